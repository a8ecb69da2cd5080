"""The configuration reference (docs/config.md and `rollover train --help-config`; the simulator's
in rollover.sim.config), generated from the models."""

from __future__ import annotations

import typing

from pydantic import BaseModel

from rollover.config.load import _BOUNDS, _number
from rollover.config.run import Config


def _bounds(metadata: list) -> str:
    """A field's declared range for `describe`, e.g. "  (>= 1)"."""
    parts = [f"{symbol} {_number(getattr(m, name))}" for m in metadata
             for name, symbol in _BOUNDS.values() if getattr(m, name, None) is not None]
    return f"  ({', '.join(parts)})" if parts else ""


TRAINING_LEAD = ("Keys are set in a YAML file or as `section.key=value` overrides on the command line "
                 "([configuration.md](configuration.md)). `rollover simulate` reads the same keys and a `simulate` "
                 "section of its own ([simulator_config.md](simulator_config.md)).")


def markdown_reference(section: type[BaseModel] = Config, prefix: str = "", *, title: str = "Configuration reference",
                       command: str = "python -m rollover.config docs/config.md", lead: str = TRAINING_LEAD) -> str:
    """A markdown page of every key of `section` (its keys named from `prefix`) with its default,
    range and meaning, from the config models: docs/config.md for the training config
    (`python -m rollover.config docs/config.md` writes it; a test keeps it current)."""
    out = [f"# {title}", "", f"Generated from the config models by `{command}`; do not edit by hand.", lead, ""]

    def cell(text: str) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    def walk(section: type[BaseModel], prefix: str) -> None:
        rows, subs = [], []
        for name, f in section.model_fields.items():
            key = prefix + ("async" if name == "async_" else name)
            sub = _subsection(f.annotation)
            if sub is not None:
                subs.append((key if sub is f.annotation else key + "[]", sub))
            if sub is not f.annotation:
                rows.append(f"| `{key}` | `{cell(repr(f.default))}` | {cell(_bounds(f.metadata).strip(' ()'))} | "
                            f"{cell(f.description or '')} |")
        if rows:
            out.extend([f"## {prefix.rstrip('.') or 'top level'}", "", "| key | default | range | meaning |",
                        "| --- | --- | --- | --- |", *rows, ""])
        for key, ann in subs:
            walk(ann, key + ".")

    walk(section, prefix)
    return "\n".join(out)


def _subsection(annotation) -> type[BaseModel] | None:
    """The section a field holds: its own type, or the items' of a list of sections."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item
    return None


def describe(section: type[BaseModel] = Config, prefix: str = "") -> str:
    """Every field with its default and docstring (`rollover train --help-config`, and `rollover
    simulate --help-config` with rollover.sim.config's model), a section's own fields before its
    subsections'."""
    lines, subs = [], []
    for name, f in section.model_fields.items():
        key = prefix + ("async" if name == "async_" else name)
        sub = _subsection(f.annotation)
        if sub is not None:
            subs.append((key if sub is f.annotation else key + "[]", sub))
        if sub is not f.annotation:
            text = "\n      ".join((f.description or "").splitlines())  # every line of the docstring indented
            lines.append(f"  {key} = {f.default!r}{_bounds(f.metadata)}\n      {text}")
    for key, sub in subs:
        lines.append(f"\n[{key}]")
        lines.append(describe(sub, key + "."))
    return "\n".join(lines)
