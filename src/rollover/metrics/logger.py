"""Scalar metrics to `RUN_DIR/metrics.jsonl`, and optionally to TensorBoard and W&B.

The JSONL file is the record of a run; TensorBoard and W&B are views of it. One line per
`log` call: `{"step": 12, "kind": "train", "time": 1731974400.1, "reward/mean": 0.41, ...}`.

- Each line is flushed as it is written, so a killed process keeps every line it logged (the
  data sits in the OS page cache; a power cut can still lose the tail — we do not fsync).
- Non-finite floats become the strings "NaN", "Infinity" and "-Infinity". Bare `NaN` tokens
  (what `json.dumps` writes by default) are not JSON and break `jq` and most other readers;
  `null` would lose the difference between an overflow (inf) and a NaN. `read_metrics` turns
  the strings back into floats. Metric values are numbers only, so the strings are unambiguous.
- Nested dicts are flattened with "/": `{"timing_s": {"generate": 1.2}}` logs `timing_s/generate`.
- `kind` separates row types in one file ("train", "eval", ...). In TensorBoard and W&B a
  non-train metric is shown under `<kind>/<name>` (unless its name already starts with
  `<kind>/`) so that an eval `reward/mean` does not overwrite the train one.

Resume: a run restarted from a checkpoint taken after step `s` passes `resume=s`. Rows with
step > s (logged by the killed run after its last checkpoint) are removed from metrics.jsonl
before anything is appended (and from trained_groups.jsonl; the samples of later steps, under
`RUN_DIR/samples`, are removed), so an exact resume never leaves a step logged twice; TensorBoard
hides the same steps through `SummaryWriter(purge_step=s + 1)`. W&B's server-side history is
not rewound: configure W&B's own resume options in the `wandb` dict if you need that.

W&B writes through a separate service process: `close()` finishes the run, but the last records
may reach `RUN_DIR/wandb` only when the process exits or `wandb.teardown()` is called.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
GROUPS_FILE = "trained_groups.jsonl"  # which groups each step trained on (data lineage)
_RESERVED = ("step", "kind", "time")
_KINDS = ("train", "eval")  # the kinds rollover's loops write
_STR_TO_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}, "c": 2}` -> `{"a/b": 1, "c": 2}`."""
    flat: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, prefix=f"{name}/"))
        else:
            flat[name] = value
    return flat


def _number(name: str, value: Any) -> int | float:
    """A plain int or float from a Python number, a numpy scalar or a 0-dim tensor."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int | float):
        return value
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # numpy scalar, 0-dim tensor
        return _number(name, value.item())
    raise TypeError(f"metric {name!r} must be a number, got {type(value).__name__}: {value!r}")


def _encode(value: int | float) -> int | float | str:
    if not isinstance(value, float) or math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def _decode(row: dict[str, Any]) -> dict[str, Any]:
    decoded = dict(row)
    for key, value in row.items():
        if key not in _RESERVED and isinstance(value, str):
            decoded[key] = _STR_TO_NONFINITE[value]
    return decoded


def _metrics_path(run_dir_or_path: str | os.PathLike) -> Path:
    path = Path(run_dir_or_path)
    return path / METRICS_FILE if path.is_dir() else path


def _parse_lines(path: Path) -> list[dict[str, Any]]:
    """Rows of a metrics file. A last line that lacks its newline and does not parse is a write
    torn by a kill, and is dropped; a malformed line anywhere else is an error."""
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    torn = lines.pop()  # "" when the file ends with a newline
    rows = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(_row(json.loads(line, parse_constant=_bare)))
        except (json.JSONDecodeError, ValueError) as e:
            raise ValueError(f"{path}:{lineno}: not a metrics row ({e})") from None
    if torn.strip():
        try:
            rows.append(_row(json.loads(torn, parse_constant=_bare)))  # complete JSON that only lacks its newline
        except (json.JSONDecodeError, ValueError):
            pass
    return rows


def _bare(name: str):
    raise ValueError(f"a bare {name}, which JSON has not: write \"{name}\" (a string), as rollover does")


def _row(row) -> dict[str, Any]:
    """A metrics row as read: an object with a step, whose text values are only "NaN",
    "Infinity" and "-Infinity" (a hand edit may have put other text there)."""
    if not isinstance(row, dict) or not isinstance(row.get("step"), int):
        raise ValueError("an object with an integer step is needed")
    for key, value in row.items():
        if key not in _RESERVED and isinstance(value, str) and value not in _STR_TO_NONFINITE:
            raise ValueError(f"{key}={value!r} is not a number")
    return row


def read_metrics(run_dir_or_path: str | os.PathLike, kind: str | None = None) -> list[dict[str, Any]]:
    """Rows of `RUN_DIR/metrics.jsonl` (or of the file given), in file order, with non-finite
    values back as floats. `kind` keeps only rows of that kind: rollover writes "train" and
    "eval"; another kind must be one the file holds (a misspelt kind is refused, not read as
    no rows)."""
    rows = [_decode(row) for row in _parse_lines(_metrics_path(run_dir_or_path))]
    if kind is None:
        return rows
    kept = [row for row in rows if row["kind"] == kind]
    if not kept and kind not in _KINDS:
        present = sorted({row["kind"] for row in rows} | set(_KINDS))
        raise ValueError(f"no metric rows of kind {kind!r}; the kinds are {present}")
    return kept


def truncate_after(run_dir_or_path: str | os.PathLike, step: int) -> int:
    """Drop rows with step > `step` (and a torn last line) from a metrics file, atomically.
    Returns the number of rows dropped."""
    path = _metrics_path(run_dir_or_path)
    if not path.exists():
        return 0
    rows = _parse_lines(path)
    kept = [row for row in rows if row["step"] <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in kept), encoding="utf-8")
    os.replace(tmp, path)
    return len(rows) - len(kept)


class MetricsLogger:
    """Appends metric rows to `RUN_DIR/metrics.jsonl` and mirrors them to TensorBoard / W&B.

    `tensorboard`: True writes `RUN_DIR/tb`; None does so when the tensorboard package is
    installed; False never. `wandb`: keyword arguments for `wandb.init` (e.g.
    `{"project": "gsm8k", "mode": "offline"}`); W&B files go under RUN_DIR. `resume`: the step
    of the checkpoint being resumed (see the module docstring), -1 to start over in the same
    run dir; None starts a fresh run and refuses a run dir that already holds metrics.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        tensorboard: bool | None = None,
        wandb: dict[str, Any] | None = None,
        resume: int | None = None,
    ):
        if isinstance(resume, bool):
            raise TypeError("resume takes the step of the checkpoint being resumed (an int), not a bool")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if resume is None:
            if self.path.exists() and self.path.stat().st_size > 0:
                raise FileExistsError(
                    f"{self.path} already holds metrics; pass resume=<checkpoint step> to continue "
                    "that run, or log to a new run dir"
                )
        else:
            from rollover.metrics.samples import remove_after as remove_samples_after

            truncate_after(self.path, resume)
            truncate_after(self.run_dir / GROUPS_FILE, resume)
            remove_samples_after(self.run_dir, resume)
            for png in (self.run_dir / "plots").glob("*.png"):  # drawn from rows now gone: drawn again at the end
                png.unlink(missing_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._groups_file = (self.run_dir / GROUPS_FILE).open("a" if resume is not None else "w", encoding="utf-8")
        self._tb = _open_tensorboard(self.run_dir / "tb", tensorboard, resume)
        self._wandb_run = _open_wandb(self.run_dir, wandb)
        if resume is not None and self._wandb_run is not None and not {"id", "resume"} & set(wandb):
            # A resumed process is a new W&B run, and W&B's service writes its rows when the run
            # finishes: a killed run's file can hold none of them. The rows kept on record go to
            # the new run first, so it holds the whole history.
            for row in read_metrics(self.path):
                self._wandb_run.log({_tag(row["kind"], k): v for k, v in row.items() if k not in _RESERVED},
                                    step=row["step"])

    def log(self, step: int, metrics: Mapping[str, Any], *, kind: str = "train") -> None:
        """Write one row. Values: numbers, numpy scalars or 0-dim tensors; dicts are flattened."""
        flat = {name: _number(name, value) for name, value in flatten(metrics).items()}
        clash = [name for name in _RESERVED if name in flat]
        if clash:
            raise ValueError(f"metric names {clash} are reserved for the row's own fields")
        step = int(step)
        row = {"step": step, "kind": kind, "time": time.time()}
        row.update({name: _encode(value) for name, value in flat.items()})
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()
        if self._tb is None and self._wandb_run is None:
            return
        tagged = {_tag(kind, name): value for name, value in flat.items()}
        if self._tb is not None:
            for tag, value in tagged.items():
                self._tb.add_scalar(tag, value, global_step=step)
        if self._wandb_run is not None:
            self._wandb_run.log(tagged, step=step)

    def log_groups(self, step: int, groups: list[Mapping[str, Any]]) -> None:
        """One row of `RUN_DIR/trained_groups.jsonl`: the groups step `step` trained on (each a
        small mapping: serial, prompt id, samples, start version). Resume truncates it like the
        metrics, so after any number of kills and resumes it lists every trained group once."""
        self._groups_file.write(json.dumps({"step": int(step), "groups": list(groups)}) + "\n")
        self._groups_file.flush()

    def log_samples(self, step: int, rows: list[Mapping[str, Any]], kind: str = "step") -> None:
        """Write `RUN_DIR/samples/step_<step>.jsonl`: what step `step` trained on, sample by
        sample (`rollover.metrics.samples`); kind "eval": `eval_step_<step>.jsonl`, the held-out
        samples of the evaluation after step `step`. Resume removes the files of later steps."""
        from rollover.metrics.samples import write_samples

        write_samples(self.run_dir, step, rows, kind)
        if self._wandb_run is not None:  # a table to read beside the curves (verl's generations table)
            import wandb

            score = "correct" if kind == "eval" else "advantage"
            columns = ["group", "sample", "prompt", "response", "reward", score]
            table = wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows[1:]])
            self._wandb_run.log({f"samples/{'eval' if kind == 'eval' else 'train'}": table}, step=step)

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.close()
        self._groups_file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tag(kind: str, name: str) -> str:
    if kind == "train" or name.startswith(f"{kind}/"):
        return name
    return f"{kind}/{name}"


def _open_tensorboard(log_dir: Path, enabled: bool | None, resume: int | None):
    installed = importlib.util.find_spec("tensorboard") is not None
    if enabled is None:
        enabled = installed
    if not enabled:
        return None
    if not installed:
        raise ImportError("tensorboard=True needs the tensorboard package: pip install 'rollover[tensorboard]'")
    from torch.utils.tensorboard import SummaryWriter

    purge_step = None if resume is None else resume + 1
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


def _open_wandb(run_dir: Path, config: dict[str, Any] | None):
    if config is None:
        return None
    if "dir" in config:
        raise ValueError("wandb config must not set 'dir': W&B files always go under the run dir")
    if importlib.util.find_spec("wandb") is None:
        raise ImportError("the wandb config needs the wandb package: pip install 'rollover[wandb]'")
    import wandb

    return wandb.init(dir=str(run_dir), **config)
