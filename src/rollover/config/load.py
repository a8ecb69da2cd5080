"""Reading a config (YAML, a dict, `key.path=value` overrides) with one-line errors, writing it
back, and what a resumed run may change."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rollover.config.base import ConfigError, lora_settings
from rollover.config.run import Config


def _set_path(d: dict, dotted: str, value: Any, schema: type | None = None) -> None:
    """Set `dotted` in the raw config `d`. A mapping given for a whole section (`data={...}`,
    `"data={eval_size: 16}"`) sets those keys of it, keeping the section's others; a mapping
    given for a key whose value is a mapping (`rollout.engine_options`) replaces it."""
    keys = dotted.split(".")
    for k in keys[:-1]:
        if not isinstance(d.get(k, {}), dict):
            raise ConfigError(f"override {dotted}: {k!r} is not a section")
        d = d.setdefault(k, {})
    last = keys[-1]
    if isinstance(value, dict) and isinstance(d.get(last), dict) and _names_section(schema, keys):
        d[last] = {**d[last], **value}
    else:
        d[last] = value


def _annotation(schema: type | None, keys: list[str]):
    """The type `keys` lead to through `schema`'s fields (by name or alias), or None."""
    model = schema
    for k in keys:
        fields = getattr(model, "model_fields", None) or {}
        field = fields.get(k) or fields.get(k + "_") or next((f for f in fields.values() if f.alias == k), None)
        if field is None:
            return None
        model = field.annotation
    return model


def _names_section(schema: type | None, keys: list[str]) -> bool:
    """Whether `keys` lead, through `schema`'s fields (by name or alias), to a section of its own."""
    from pydantic import BaseModel

    model = _annotation(schema, keys)
    return isinstance(model, type) and issubclass(model, BaseModel)


def _text_types(annotation) -> list:
    """A field's types, unions flattened and Optional and Annotated constraints taken off
    (`str | None` -> [str]; `Annotated[str | dict, ...] | None` -> [str, dict])."""
    import types
    import typing

    if typing.get_origin(annotation) is typing.Annotated:
        return _text_types(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [t for a in typing.get_args(annotation) if a is not type(None) for t in _text_types(a)]
    return [annotation]


class _StrictLoader(yaml.SafeLoader):
    """`yaml.safe_load`'s loader, refusing a key given twice in one mapping (which PyYAML would
    read as its last value, silently dropping the first: a second `data:` section, say). Keys a
    merge (`<<: *defaults`) brings in may be given again: that is how a merge is overridden."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    if key in first:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"key {key!r} is given twice (first on line {first[key]})", key_node.start_mark)
                    first[key] = key_node.start_mark.line + 1
                except TypeError:  # an unhashable key: the constructor below names it
                    pass
        return super().construct_mapping(node, deep=deep)


# YAML 1.2's exponent forms that PyYAML (YAML 1.1) reads as text: 1e-6, 5E+3, 1.5e3. A value inside
# a free-form mapping (a reward's kwargs, loss_options, engine_options) has no field type to make it
# a number, and verl's configs (OmegaConf) write them so. One that overflows (a git hash such as
# 3e81452) stays text; config.yaml quotes text of this form, so it reads back as written.
_EXPONENT = "tag:rollover,2026:exponent"
_EXPONENT_FORM = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
_EXPONENT_FIRST = list("-+0123456789")  # the characters such a scalar may start with
_StrictLoader.add_implicit_resolver(_EXPONENT, _EXPONENT_FORM, _EXPONENT_FIRST)


def _exponent(loader, node):
    text = loader.construct_scalar(node)
    number = float(text.replace("_", ""))
    return number if math.isfinite(number) else text


_StrictLoader.add_constructor(_EXPONENT, _exponent)


class _Dumper(yaml.SafeDumper):
    """`yaml.safe_dump`'s dumper, quoting text that `_StrictLoader` would read as a number."""


_Dumper.add_implicit_resolver(_EXPONENT, _EXPONENT_FORM, _EXPONENT_FIRST)


def _load_yaml(text: str):
    return yaml.load(text, Loader=_StrictLoader)


NULLS = ("", "null", "Null", "NULL", "~")  # YAML's nulls


def parse_overrides(overrides: list[str], schema: type | None = None) -> list[tuple[str, Any]]:
    """`key.path=value` strings as (key, value) pairs. Each value is read as YAML, except for a
    key of `schema` that takes only text, whose value is the text given (`data.instruction=Answer:
    a number` is not a mapping, `=yes` not true, `=# 1` not a comment), unless quoted or a null;
    a text YAML reads cut at ` #` (a comment) is the whole text where the key takes text."""
    out = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like key.path=value")
        key, text = key.strip(), raw.strip()
        types = _text_types(_annotation(schema, key.split("."))) if schema is not None else []
        as_given = text[:1] not in ("'", '"')  # (quoted: YAML's reading is the user's)
        if types == [str] and text not in NULLS and as_given:
            out.append((key, text))
            continue
        try:
            value = _load_yaml(raw) if text else None
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or e
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({problem})") from None
        if isinstance(value, str) and str in types and " #" in text and as_given:
            value = text  # (a path or text holding " #": not a comment)
        out.append((key, value))
    return out


def read_yaml(path: str | Path) -> dict:
    """A YAML mapping from a file; invalid YAML is a ConfigError naming file:line:column."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} not found")
    if path.is_dir():
        raise ConfigError(f"{path} is a directory, not a YAML config file")
    try:
        raw = _load_yaml(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{where}: invalid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(raw).__name__}")
    return raw


# Sections older versions wrote into every run's config.yaml that training no longer has
# (`simulate` moved to rollover.sim.config): a recorded config drops them when read back.
RETIRED_SECTIONS = ("simulate",)


def load_config(path: str | Path | None = None, overrides: list[str] = (), *, schema: type[Config] = Config,
                recorded: bool = False, **data: Any) -> Config:
    """Read YAML (optional), apply overrides, validate as `schema` (a training config, or a
    subclass with sections of its own: rollover.sim.config). `recorded`: the YAML is a run's own
    config.yaml, whose `RETIRED_SECTIONS` are dropped. Raises ConfigError naming the key."""
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of key.path=value strings, got one string: [{overrides!r}]")
    raw: dict = read_yaml(path) if path is not None else {}
    in_file = set(_flat(raw)) if isinstance(raw, dict) else set()
    if recorded:
        raw = {k: v for k, v in raw.items() if k not in RETIRED_SECTIONS or k in schema.model_fields}
    for k, v in data.items():
        _set_path(raw, k, v, schema)
    overridden, before = set(), dict(raw) if isinstance(raw, dict) else {}
    for k, v in parse_overrides(list(overrides), schema):
        _set_path(raw, k, v, schema)
        overridden.add(k)
    _drop_switched_off(raw, before, overridden)
    sections = {"async" if n == "async_" else n for n in schema.model_fields}
    try:
        return schema.model_validate(raw, context={"recorded": recorded})
    except ValidationError as e:
        keyworded = set(_flat(data))  # a section given as a keyword: the keys in it, not the file's beside them

        def where(err: dict) -> str:  # with a file: the file, the overrides or the keywords the keys came from
            if path is None:
                return ""
            keys = _error_keys(err) + [k for k in _mentioned_keys(err)  # those given, not those a hint suggests
                                       if k.split(".")[0] in sections and (k in in_file or k in overridden or k in keyworded)]

            def among(key: str, given: set[str]) -> bool:
                return any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in given)

            origins = {"override" if among(key, overridden) else "keyword" if among(key, keyworded) else "file"
                       for key in dict.fromkeys(k for k in keys if k)}
            if origins == {"override"}:
                return "override "
            if origins == {"keyword"}:
                return "keyword argument: "
            named = [f"{path}" if "file" in origins or not origins else None,
                     "overrides" if "override" in origins else None, "keyword arguments" if "keyword" in origins else None]
            return " and ".join(n for n in named if n) + ": "

        raise ConfigError("; ".join(where(err) + _error_line(err) for err in e.errors())) from None


def _drop_switched_off(raw: dict, before: dict, overridden: set[str]) -> None:
    """An override that switches the runtime from ray to local (or the mode from async to sync)
    sets aside the YAML's ray (or async) section, which configures the other (a Ray run's
    config.yaml evaluated here, an async config compared in sync mode); such a section beside a
    local runtime (sync mode) in the file itself is refused as a mistake."""
    import logging

    for key, value, section in (("runtime", "local", "ray"), ("mode", "sync", "async")):
        ours = any(k == section or k.startswith(section + ".") for k in overridden)
        switched = key in overridden and raw.get(key) == value and before.get(key, value) != value
        if switched and raw.get(section) and not ours:
            del raw[section]
            logging.getLogger("rollover").warning("%s=%s (an override): the config's %s section is not used", key,
                                                  value, section)


def _error_keys(err: dict) -> list[str]:
    """The dotted keys a validation error is about: its location, with each key a section's own
    check names (`unknown key 'x'`, `eval_size=...: ...`)."""
    loc = ".".join("async" if p == "async_" else str(p) for p in err["loc"] if not isinstance(p, int))
    msg = err["msg"].removeprefix("Value error, ")
    named = re.findall(r"unknown key '([^']+)'", msg) + re.findall(r"(?:^|; )([A-Za-z_][\w.]*)=", msg)
    return [".".join(filter(None, [loc, n])) for n in named] or [loc]


def _mentioned_keys(err: dict) -> list[str]:
    """Dotted keys a cross-field check's message names anywhere (`train.colocate: ...`); the
    caller keeps those of the config's sections."""
    return re.findall(r"(?<![\w./])([a-z_]+(?:\.[a-z_]\w*)+)", err["msg"])


_BOUNDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"),
           "less_than_equal": ("le", "<="), "less_than": ("lt", "<")}


_TYPE_ERRORS = {"int_parsing": "must be an integer", "int_type": "must be an integer",
                "int_from_float": "must be an integer", "float_parsing": "must be a number",
                "float_type": "must be a number", "finite_number": "must be a finite number",
                "bool_parsing": "must be true or false", "bool_type": "must be true or false",
                "string_type": "must be a string", "string_too_short": "must not be empty",
                "too_short": "must not be empty", "dict_type": "must be a mapping", "list_type": "must be a list",
                "model_type": "must be a mapping of this section's keys (its key: value lines), not one value"}


def _number(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _error_line(err: dict) -> str:
    """One pydantic error as `key=value: what is allowed`."""
    loc = ".".join("async" if x == "async_" else str(x) for x in err["loc"])
    kind, value = err["type"], err.get("input")
    if kind in _BOUNDS:
        name, symbol = _BOUNDS[kind]
        msg = f"must be {symbol} {_number(err['ctx'][name])}"
    elif kind == "string_pattern_mismatch" and loc == "device":
        msg = "must be auto, cpu, cuda, cuda:N or mps"
    else:
        msg = _TYPE_ERRORS.get(kind) or err["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
    if not loc:
        return msg
    if value is None or isinstance(value, str | int | float):
        quoted = isinstance(value, str) and kind not in _BOUNDS  # a bound was checked on a number
        shown = repr(value) if quoted else value if isinstance(value, str) else json.dumps(value)
        if isinstance(value, float):  # as it was likely written: 1e-5 and 3e6, not 1e-05 and 3000000.0
            short = f"{value:g}"
            if "e" in short and float(short) == value:
                shown = re.sub(r"e\+?(-?)0*(\d)", r"e\1\2", short)
        return f"{loc}={shown}: {msg}"
    if isinstance(value, dict):  # a section's own check, whose messages name its keys: name them in full
        named = re.sub(r"(^|; )(?=[A-Za-z_]\w*=)", lambda m: f"{m.group(1)}{loc}.", msg)
        named = named.replace("unknown key '", f"unknown key '{loc}.")
        if named != msg:
            return named
    return f"{loc}: {msg}"


# Keys a resumed run may change freely: how long it runs, where and on what it runs, how it
# evaluates, checkpoints and logs, knobs that change speed but not the samples' meaning
# (packing is exact, the engine is behind one contract), and what a failing reward call does
# (a run stopped by reward.on_error=raise is meant to be resumed with zero or skip). Every other
# key — model, seed, mode, data, reward functions, algorithm, train, rollout sampling,
# partial_rollout, async — changes what is trained, and a new key is in that group until it is
# listed here.
RESUME_FREE_KEYS = (
    "run_dir", "steps", "epochs", "resume", "device", "eval", "checkpoint", "logging", "runtime", "ray",
    "rollout.engine", "rollout.max_rows", "rollout.dtype", "rollout.engine_options", "rollout.stall_timeout_s",
    "reward.timeout_s", "reward.on_error", "reward.workers",
    "train.micro_batch_tokens", "train.pack_length", "train.shared_prefix", "train.gradient_checkpointing",
    "train.activation_memory_gb", "train.logit_chunk_tokens", "train.max_bad_steps", "train.deterministic",
    "train.ranks", "train.sequence_parallel", "train.fsdp_offload", "train.weight_bucket_mb",
    "train.collective_timeout_s", "train.colocate", "train.colocate_free_weights",
)


_SECTIONS = {("async" if n == "async_" else n) for n, f in Config.model_fields.items()
             if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)}


def _flat(data: dict, prefix: str = "") -> dict[str, Any]:
    """A dumped config as {dotted key: value}, descending into sections only."""
    out = {}
    for key, value in data.items():
        key = "async" if key == "async_" else key
        if isinstance(value, dict) and prefix == "" and key in _SECTIONS:
            out.update(_flat(value, f"{key}."))
        else:
            out[prefix + key] = value
    return out


def config_changes(saved: dict, cfg: Config) -> list[str]:
    """`key: old -> new` for each key outside RESUME_FREE_KEYS where `cfg` differs from a
    saved config (a mapping read from a run's config.yaml; keys it lacks count as defaults)."""
    saved, now = _same_lora(saved), _same_lora(cfg.model_dump(mode="json"))
    old = {**_flat(Config().model_dump(mode="json")), **_flat(saved)}
    new = _flat(now)
    changes = []
    for key, value in new.items():
        if any(key == free or key.startswith(free + ".") for free in RESUME_FREE_KEYS):
            continue
        if key in old and _plain(_as_path(key, old[key])) != _plain(_as_path(key, value)):
            changes.append(f"{key}: {json.dumps(old[key])} -> {json.dumps(value)}")
    return changes


PATH_KEYS = ("model", "critic.model", "distill.teacher", "data.train", "data.eval")  # (a named source: data.train.NAME)


def _as_path(key: str, value: Any) -> Any:
    """A local path written two ways (`tiny/` and `tiny`, `./data.jsonl`) as one; a value with
    a scheme (`gen:`, `hf:`) as it is."""
    if not any(key == k or key.startswith(k + ".") for k in PATH_KEYS):
        return value
    if isinstance(value, dict):  # named sources
        return {name: _as_path(key, v) for name, v in value.items()}
    if not isinstance(value, str):
        return value
    if not value or re.match(r"^[A-Za-z][\w+.-]*:", value):
        return value
    path, sep, query = value.partition("?")  # a dataset directory's split: `dir?split=test`
    return os.path.normpath(path) + sep + query


def _same_lora(config: dict) -> dict:
    """A config mapping whose train.lora has its defaults filled in and targets in name order, so
    that two ways of writing one adapter compare equal."""
    lora = (config.get("train") or {}).get("lora")
    if not isinstance(lora, dict):
        return config
    return {**config, "train": {**config["train"], "lora": lora_settings(lora)}}


def _plain(value: Any) -> Any:
    """Tuples as lists (as a YAML round trip gives them back)."""
    return json.loads(json.dumps(value))


def dump_config(cfg: Config) -> str:
    data = cfg.model_dump(mode="json")
    data["async"] = data.pop("async_")
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)
