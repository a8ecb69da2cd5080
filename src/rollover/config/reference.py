"""The configuration reference (docs/config.md and `rollover train --help-config`), generated from
the models."""

from __future__ import annotations

from pydantic import BaseModel

from rollover.config.load import _BOUNDS, _number
from rollover.config.run import Config


def _bounds(metadata: list) -> str:
    """A field's declared range for `describe`, e.g. "  (>= 1)"."""
    parts = [f"{symbol} {_number(getattr(m, name))}" for m in metadata
             for name, symbol in _BOUNDS.values() if getattr(m, name, None) is not None]
    return f"  ({', '.join(parts)})" if parts else ""


def markdown_reference() -> str:
    """docs/config.md: every key of every section with its default, range and meaning, from the
    config models (`python -m rollover.config docs/config.md` writes it; a test keeps it current)."""
    out = ["# Configuration reference", "",
           "Generated from the config models by `python -m rollover.config docs/config.md`; do not edit by hand.",
           "Keys are set in a YAML file or as `section.key=value` overrides on the command line "
           "([configuration.md](configuration.md)).", ""]

    def cell(text: str) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    def walk(section: type[BaseModel], prefix: str) -> None:
        rows, subs = [], []
        for name, f in section.model_fields.items():
            key = prefix + ("async" if name == "async_" else name)
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                subs.append((key, ann))
            else:
                rows.append(f"| `{key}` | `{cell(repr(f.default))}` | {cell(_bounds(f.metadata).strip(' ()'))} | "
                            f"{cell(f.description or '')} |")
        if rows:
            out.extend([f"## {prefix.rstrip('.') or 'top level'}", "", "| key | default | range | meaning |",
                        "| --- | --- | --- | --- |", *rows, ""])
        for key, ann in subs:
            walk(ann, key + ".")

    walk(Config, "")
    return "\n".join(out)


def describe(section: type[BaseModel] = Config, prefix: str = "") -> str:
    """Every field with its default and docstring (for `rollover train --help-config`)."""
    lines = []
    for name, f in section.model_fields.items():
        key = prefix + ("async" if name == "async_" else name)
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            lines.append(f"\n[{key}]")
            lines.append(describe(ann, key + "."))
        else:
            lines.append(f"  {key} = {f.default!r}{_bounds(f.metadata)}\n      {f.description or ''}")
    return "\n".join(lines)
