"""Turn rows from jsonl, parquet or HF `datasets` into `Prompt`s.

A source is one string:

- `path/to/file.jsonl` or `path/to/file.parquet`;
- a directory written by `datasets.Dataset.save_to_disk` (or `DatasetDict.save_to_disk`, then
  `split` picks the split, or the source names it: `path/to/dir?split=test`);
- `hf:owner/name` or `hf:owner/name?name=config&split=test`: `datasets.load_dataset` (needs a reachable
  hub; `split` picks the split);
- `gen:NAME?n=...&opt=...`: a procedural generator (see `rollover.data.generators`).

Row conventions (both TRL-style and verl-style rows work without options):

- the prompt is in column `prompt_key` (default "prompt"): a non-empty string, or a non-empty
  list of {"role": str, "content": str} messages;
- the answer is in column `answer_key`; the default `None` looks, in order, for "answer",
  "solution" (TRL) and "reward_model.ground_truth" (verl). A dotted key reads into a nested
  dict or parquet struct;
- images (vision-language models) are in column `images` or `image`, and a message's content may
  be a list of `{"type": "text"|"image"}` parts (`rollover.data.media`);
- every other column goes to `Prompt.fields`, except the top-level column the answer came from
  (verl's `reward_model` would otherwise hand the answer to rewards a second time).

A malformed row raises `DataError` naming the source and row; with `on_bad_row="skip"` it is
left out and recorded in `PromptSet.skipped` instead. A source in which every row is bad is an
error either way.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal

from rollover.data.media import IMAGE_COLUMNS, row_images
from rollover.types import Prompt

OnBadRow = Literal["raise", "skip"]
DEFAULT_ANSWER_KEYS = ("answer", "solution", "reward_model.ground_truth")
_MISSING = object()


class DataError(ValueError):
    """A dataset that cannot be read as prompts: names the source and, for a bad row, the row."""


@dataclass(frozen=True)
class BadRow:
    where: str  # "data.jsonl line 3" or "data.parquet row 2"
    reason: str


@dataclass
class PromptSet:
    """The prompts read from one source, and the rows that were skipped (`on_bad_row="skip"`)."""

    source: str
    prompts: list[Prompt]
    skipped: list[BadRow] = field(default_factory=list)

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def __len__(self) -> int:
        return len(self.prompts)


def load_prompts(
    source: str | Path,
    *,
    prompt_key: str = "prompt",
    answer_key: str | None = None,
    require_answer: bool = True,
    split: str | None = "train",
    on_bad_row: OnBadRow = "raise",
) -> PromptSet:
    """Read every row of `source` (see the module docstring) as a `Prompt`. `split` None: a source
    of several splits (a `DatasetDict`, a hub dataset) must name its own (`?split=`); one of a
    single split gives that one."""
    if on_bad_row not in ("raise", "skip"):
        raise ValueError(f"on_bad_row must be 'raise' or 'skip', got {on_bad_row!r}")
    source = str(source)
    if source.startswith("gen:"):
        from rollover.data.generators import generate_from_spec

        return PromptSet(source, generate_from_spec(source))

    rows, label, where = _open_rows(source, split)
    base = Path(source).expanduser().parent if Path(source).expanduser().is_file() else None  # of relative image paths
    prompts: list[Prompt] = []
    skipped: list[BadRow] = []
    for index, row in rows:
        try:
            if isinstance(row, Exception):  # a jsonl line that is not valid JSON
                raise BadRowError(str(row))
            prompts.append(
                row_to_prompt(
                    row,
                    id=f"{label}:{index}",
                    prompt_key=prompt_key,
                    answer_key=answer_key,
                    require_answer=require_answer,
                    base=base,
                )
            )
        except BadRowError as exc:
            if on_bad_row == "raise":
                raise DataError(f"{where(index)}: {exc}") from None
            skipped.append(BadRow(where(index), str(exc)))
    if not prompts:
        detail = f" (all {len(skipped)} rows bad; first: {skipped[0].reason})" if skipped else ""
        raise DataError(f"{source}: no usable rows{detail}")
    return PromptSet(source, prompts, skipped)


class BadRowError(ValueError):
    """Raised by `row_to_prompt`; the loader adds the file and row."""


def row_to_prompt(
    row: dict,
    *,
    id: str,
    prompt_key: str = "prompt",
    answer_key: str | None = None,
    require_answer: bool = True,
    base: Path | None = None,
) -> Prompt:
    """One row as a `Prompt`; raises BadRowError saying what is wrong with it. `base`: the
    directory relative image paths start from."""
    if not isinstance(row, dict):
        raise BadRowError(f"expected an object with columns, got {type(row).__name__}")
    prompt = _get(row, prompt_key)
    if prompt is _MISSING:
        raise BadRowError(f"missing prompt column {prompt_key!r} (columns: {sorted(row)})")
    if prompt is None:
        raise BadRowError(f"prompt column {prompt_key!r} is null")
    text, messages = _check_prompt(prompt, prompt_key)

    answer, used_key = _find_answer(row, answer_key)
    if isinstance(answer, float) and math.isnan(answer):  # a missing value (JSON's NaN, pandas' None in a number column)
        answer = None
    if require_answer and (answer is None or answer == ""):
        looked = [answer_key] if answer_key else list(DEFAULT_ANSWER_KEYS)
        raise BadRowError(f"missing answer (looked for {looked}; columns: {sorted(row)}); rows without one are kept "
                          "with require_answer=False (data.require_answer: false in a run)")

    try:
        images = row_images(row, base)
    except ValueError as e:
        raise BadRowError(str(e)) from None
    if messages is not None and not images:  # parts without images: the text as it reads, or a missing image
        if any(isinstance(m["content"], list) and any(q["type"] == "image" for q in m["content"]) for m in messages):
            raise BadRowError(f"the prompt has image parts but the row no images (columns: {sorted(row)})")
        messages = [{**m, "content": "".join(q["text"] for q in m["content"])} if isinstance(m["content"], list) else m
                    for m in messages]
    excluded = {prompt_key.split(".")[0], *(IMAGE_COLUMNS if images else ())}
    if used_key is not None:
        excluded.add(used_key.split(".")[0])
    fields = {k: v for k, v in row.items() if k not in excluded}
    return Prompt(id=id, messages=messages, text=text, answer=answer, fields=fields, images=images)


def _check_text(text: str, what: str) -> None:
    """Text a tokenizer can take: JSON admits lone surrogates (\\ud800), which no encoder does."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRowError(f"{what} holds {text[exc.start:exc.end].encode('unicode_escape').decode()} at character "
                          f"{exc.start + 1}, a lone surrogate that is not text") from None


def _check_prompt(prompt: object, key: str) -> tuple[str | None, list[dict] | None]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadRowError(f"prompt column {key!r} is an empty string")
        _check_text(prompt, f"prompt column {key!r}")
        return prompt, None
    if not isinstance(prompt, list) or not prompt:
        raise BadRowError(
            f"prompt column {key!r} must be a string or a non-empty list of messages, "
            f"got {type(prompt).__name__}"
        )
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise BadRowError(f"prompt message {i} is a {type(message).__name__}, not a dict")
        if isinstance(message.get("content"), list):  # parts: text and image (a vision-language prompt)
            _check_parts(message["content"], i)
        for part in ("role", "content") if not isinstance(message.get("content"), list) else ("role",):
            if not isinstance(message.get(part), str):
                raise BadRowError(f"prompt message {i} needs a string {part!r}, got {message!r}")
            _check_text(message[part], f"prompt message {i}'s {part!r}")
    # Keep only role/content: parquet structs add null columns for keys other rows have.
    return None, [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else [
        {"type": "image"} if q["type"] == "image" else {"type": "text", "text": q["text"]} for q in m["content"]]}
        for m in prompt]


def _check_parts(parts: list, i: int) -> None:
    for k, p in enumerate(parts):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text" and isinstance(p.get("text"), str):
            _check_text(p["text"], f"prompt message {i}'s part {k}")
        elif kind != "image":
            raise BadRowError(f"prompt message {i}'s part {k} must be {{'type': 'text', 'text': ...}} or "
                              f"{{'type': 'image'}}, got {p!r}")


def _find_answer(row: dict, answer_key: str | None) -> tuple[object, str | None]:
    keys = [answer_key] if answer_key else DEFAULT_ANSWER_KEYS
    for key in keys:
        value = _get(row, key)
        if value is not _MISSING and value is not None:
            return value, key
    return None, None


def _get(row: dict, dotted: str) -> object:
    value: object = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


# --- sources -----------------------------------------------------------------------------------

Rows = Iterator[tuple[int, "dict | Exception"]]


def _open_rows(source: str, split: str | None):
    """(rows, id label, where(index) -> location text) for a file, directory or hub id."""
    if source.startswith("hf:"):
        name = source[3:].partition("?")[0]
        return _hub_rows(source[3:], split), name, lambda i: f"{source} row {i}"
    path = Path(source)
    if not path.exists() and "?" in source:  # a saved DatasetDict's split: dir?split=test
        path, label, split = _dir_split(source)
        return _disk_rows(path, split, named=True), label, lambda i: f"{source} row {i}"
    if not path.exists():
        raise FileNotFoundError(f"dataset not found: {path}")
    if path.is_dir():
        return _disk_rows(path, split), path.name, lambda i: f"{path} row {i}"
    if path.suffix == ".jsonl":
        return _jsonl_rows(path), path.stem, lambda i: f"{path} line {i + 1}"
    if path.suffix == ".parquet":
        return _parquet_rows(path), path.stem, lambda i: f"{path} row {i}"
    raise DataError(
        f"{path}: unknown dataset extension {path.suffix!r}; expected .jsonl, .parquet, a "
        "directory saved with datasets' save_to_disk, 'hf:owner/name' or 'gen:NAME?...'"
    )


def _jsonl_rows(path: Path) -> Rows:
    # Read bytes and decode line by line, so that a line with bytes that are not UTF-8 is one
    # bad row (named, or skipped) instead of a UnicodeDecodeError that names no line.
    with path.open("rb") as f:
        for index, raw in enumerate(f):
            try:
                line = raw.decode("utf-8-sig" if index == 0 else "utf-8")  # (a BOM some editors write first)
            except UnicodeDecodeError as exc:
                byte = raw[exc.start : exc.start + 1].hex()
                yield index, BadRowError(
                    f"not valid UTF-8 (byte 0x{byte} at byte column {exc.start + 1}: {exc.reason})"
                )
                continue
            if not line.strip():
                continue  # blank lines (a trailing newline, say) are not rows
            try:
                yield index, json.loads(line.rstrip("\r\n"))  # (an error past the row's end names its last column)
            except json.JSONDecodeError as exc:
                yield index, BadRowError(f"not valid JSON ({exc.msg} at column {exc.colno})")


def _parquet_rows(path: Path) -> Rows:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as exc:  # pyarrow raises OSError for some corrupt files
        raise DataError(f"{path}: cannot read as parquet: {_one_line(str(exc))}") from exc
    yield from enumerate(rows)


def _one_line(text: str) -> str:
    """`text` with control characters and runs of whitespace turned into single spaces."""
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())


def _dir_split(source: str) -> tuple[Path, str, str]:
    """(directory, id label, split) of `dir?split=NAME`: the split of a saved `DatasetDict` (its
    prompts' ids carry the split, so two splits of one directory never share an id)."""
    name, _, query = source.rpartition("?")
    path = Path(name)
    if not path.exists():
        raise FileNotFoundError(f"dataset not found: {source}")
    if not path.is_dir():
        raise DataError(f"{source}: ?{query} picks a split of a directory saved with datasets' save_to_disk; "
                        f"{path} is a file")
    options = _parse_query(query, source)
    if set(options) != {"split"}:
        raise DataError(f"{source}: a saved dataset takes one option, split (got {sorted(options)})")
    return path, f"{path.name}.{options['split']}", options["split"]


def _disk_rows(path: Path, split: str | None, named: bool = False) -> Rows:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if named and not isinstance(ds, datasets.DatasetDict):
        raise DataError(f"{path}?split={split}: {path} holds one Dataset, which has no splits; name the directory alone")
    yield from enumerate(_pick_split(ds, split, str(path)))


def _hub_rows(spec: str, split: str | None) -> Rows:
    import datasets

    name, _, query = spec.partition("?")
    options = _parse_query(query, spec)
    unknown = set(options) - {"name", "split"}
    if unknown:
        raise DataError(f"hf:{spec}: unknown options {sorted(unknown)} (known: ['name', 'split'])")
    chosen = options.get("split", split)
    if chosen is None:  # the source must say which split, unless it has one only (asked before any download)
        names = datasets.get_dataset_split_names(name, options.get("name"))
        if len(names) != 1:
            raise DataError(f"hf:{spec} holds the splits {sorted(names)}: name one, {_with_split(f'hf:{spec}')}")
        chosen = names[0]
    yield from enumerate(datasets.load_dataset(name, options.get("name"), split=chosen))


def _pick_split(ds, split: str | None, where: str):
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        if split is None and len(ds) == 1:  # one split: nothing to choose
            split = next(iter(ds))
        if split is None:
            raise DataError(f"{where} holds the splits {sorted(ds)}: name one, {_with_split(where)}")
        if split not in ds:
            raise DataError(f"{where}: no split {split!r} (splits: {sorted(ds)}; pick one with {_with_split(where)})")
        return ds[split]
    return ds


def _with_split(source: str) -> str:
    """`source` with a `split=NAME` option added, as a message shows how to name a split."""
    return f"{source}{'&' if '?' in source else '?'}split=NAME"


def _parse_query(query: str, where: str) -> dict[str, str]:
    """'a=1&b=x' -> {'a': '1', 'b': 'x'}. No URL decoding: '+' stays a plus sign."""
    options: dict[str, str] = {}
    for part in filter(None, query.split("&")):
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise DataError(f"{where}: option {part!r} is not key=value")
        if key in options:
            raise DataError(f"{where}: option {key!r} given twice")
        options[key] = value
    return options
