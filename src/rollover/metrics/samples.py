"""What a step trained on, sample by sample: `RUN_DIR/samples/step_000012.jsonl`.

With `logging.samples: N`, every N-th training step writes the samples it trained on (the
rows are built from the step's groups and batch by `rollover.loops.samples`), so a
reward function or an environment can be debugged from what it actually saw (TRL logs
completions, verl dumps generations; this is the same idea). `rollover show RUN_DIR` prints
them. Off by default; when on, a written step costs one detokenisation per sample.

A file is JSON lines. The first is the step's header:

    {"kind": "step", "step": 12, "samples": 8, "trained_samples": 8,
     "groups": [{"group": "g40", "prompt_id": "arith-7", "samples": 4, "failed_samples": 0}, ...],
     "dropped": {"filtered_groups": 1, "skipped_groups": 0, ...}}

`groups` are the step's trained groups; `failed_samples` counts a group's samples that got no
reward (a reward error, a failed episode) and left it. `dropped` (sync and APRIL only) holds the
collector's counts of what it produced this step and did not train: groups filtered by dynamic
sampling or skipped, failed samples, regenerated tokens, collections that had nothing to train
before this step. The async loop drops groups as they
finish, not per step, so its headers have no `dropped`; its metrics carry the running totals.

Then one line per sample of those groups, in group order:

    {"kind": "sample", "step": 12, "group": "g40", "prompt_id": "arith-7", "sample": 0,
     "trained": true, "dropped": null, "reward": 1.0, "scores": {"numeric": 1.0},
     "advantage": 0.87, "finish": "stop", "logprob_mean": -0.41, "logprob_min": -3.2,
     "version_min": 11, "version_max": 11, "loss_mask": [[0, 17]],
     "prompt": "...", "response": "...", "prompt_ids": [...], "response_ids": [...]}

- `prompt` and `response` are the token ids decoded with the run's tokenizer, special tokens
  kept (exactly what the model saw and wrote; the reward functions saw the response without
  them). Undecodable bytes become U+FFFD; the file is always valid UTF-8.
- `loss_mask` is the runs of trained response tokens as `[start, end)` pairs: the mask the
  trainer used (after D3S token down-sampling, APRIL stale masking, async top-entropy masking).
- `trained` is false, with `dropped: "downsample"`, for a sample D3S sample-level
  down-sampling left out of the batch; its advantage is the one it would have trained with.
- Under `algorithm.advantage: remax` each group ends with its greedy answer, `"sample":
  "greedy"`, `trained` false, `dropped: "greedy"`: the baseline its samples' rewards are
  compared with.
- `logprob_*` (behaviour logprobs) and `version_*` (policy versions) are over the tokens the
  policy sampled: an episode's tokens inserted by its environment are left out.
- `extras`, where reward functions returned more than a score: those numbers, as
  `"<function>/<key>"` (in metrics.jsonl as `rewards/<function>/<key>/mean`).
- Multi-turn episodes add `turns`: per sampled turn its chat messages (the assistant's text,
  then the environment's reply), reward, finish and `span` (its tokens in the response).
- Non-finite numbers are written as the strings "NaN", "Infinity", "-Infinity", as in
  metrics.jsonl; any other value JSON cannot hold (a datetime in an environment's message, say)
  as its `str()`.

A file is written whole under a temporary name and renamed, so a killed run never leaves a
torn one; resuming from a checkpoint at step s removes the files of steps after s.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from rollover.metrics.logger import _encode

SAMPLES_DIR = "samples"
_FILE = {"step": re.compile(r"step_(\d+)\.jsonl"), "eval": re.compile(r"eval_step_(\d+)\.jsonl")}


class NoSamples(FileNotFoundError):
    """A run directory without the samples asked for."""


def samples_path(run_dir: str | os.PathLike, step: int, kind: str = "step") -> Path:
    """The samples file of step `step`: what it trained on (kind "step"), or the held-out samples
    of the evaluation after it (kind "eval", `logging.eval_samples`)."""
    return Path(run_dir) / SAMPLES_DIR / f"{'eval_' if kind == 'eval' else ''}step_{step:06d}.jsonl"


def mask_spans(mask: list[int]) -> list[list[int]]:
    """The runs of 1s of a 0/1 mask as `[start, end)` pairs: [0, 1, 1, 0, 1] -> [[1, 3], [4, 5]]."""
    spans: list[list[int]] = []
    for t, m in enumerate(mask):
        if not m:
            continue
        if spans and spans[-1][1] == t:
            spans[-1][1] = t + 1
        else:
            spans.append([t, t + 1])
    return spans


def _number(x):
    return None if x is None else _encode(float(x))


def umask() -> int:
    """The process's umask (which new files' modes leave out)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_samples(run_dir: str | os.PathLike, step: int, rows: list[dict], kind: str = "step") -> Path:
    """Write the rows of step `step` (whole, then renamed into place)."""
    path = samples_path(run_dir, step, kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    os.fchmod(fd, 0o666 & ~umask())  # (mkstemp's 0600 would keep it from a teammate reading the run)
    # a decoded string may still hold a lone surrogate: errors="replace" keeps the file UTF-8
    with open(fd, "w", encoding="utf-8", errors="replace") as f:
        f.writelines(json.dumps(row, ensure_ascii=False, allow_nan=False, default=str) + "\n" for row in rows)
    os.replace(tmp, path)
    return path


def written_steps(run_dir: str | os.PathLike, kind: str = "step") -> list[int]:
    """The steps whose samples (of `kind`) `run_dir` holds, in order."""
    root = Path(run_dir) / SAMPLES_DIR
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _FILE[kind].fullmatch(p.name)))


def remove_after(run_dir: str | os.PathLike, step: int) -> int:
    """Remove the samples of steps after `step` (a killed run's, past its last checkpoint) and
    temporary files left by a kill mid-write. Returns the number of step files removed."""
    root = Path(run_dir) / SAMPLES_DIR
    if not root.is_dir():
        return 0
    for tmp in [*root.glob(".step_*"), *root.glob(".eval_step_*")]:
        tmp.unlink()
    removed = 0
    for kind in _FILE:
        later = [s for s in written_steps(run_dir, kind) if s > step]
        for s in later:
            samples_path(run_dir, s, kind).unlink()
        removed += len(later)
    return removed


def read_samples(run_dir: str | os.PathLike, step: int | None = None, kind: str = "step") -> tuple[int, dict, list[dict]]:
    """(step, header, sample rows) of step `step`, or of the latest step written (kind "eval":
    of the evaluations' held-out samples)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise NoSamples(f"{run_dir}: no such run directory")
    steps = written_steps(run_dir, kind)
    if not steps and not any((run_dir / name).exists() for name in ("metrics.jsonl", "config.yaml", SAMPLES_DIR)):
        raise NoSamples(f"{run_dir}: not a run directory (no metrics.jsonl, config.yaml or {SAMPLES_DIR}/ there)")
    if not steps:
        key, what = ("eval_samples", "held-out samples of the first N prompts at every evaluation") \
            if kind == "eval" else ("samples", "trained samples of every N-th step")
        raise NoSamples(f"{run_dir / SAMPLES_DIR}: no {'held-out ' if kind == 'eval' else ''}samples written; set "
                        f"logging.{key}=N in the run's config to write the {what}")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise NoSamples(f"{run_dir / SAMPLES_DIR}: no {'held-out ' if kind == 'eval' else ''}samples of step {step}; "
                        f"written: {_listing(steps)}")
    path = samples_path(run_dir, step, kind)
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise NoSamples(f"{path} line {n}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not rows:
        raise NoSamples(f"{path}: empty")
    return step, rows[0], rows[1:]


def _listing(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[:10] if len(steps) <= 12 else steps[:5] + ["..."] + steps[-5:]))
    return f"steps {shown}"


# ---------------------------------------------------------------- `rollover show`
PROMPT_CHARS = 400  # shown of a prompt without --full (its head and tail)
RESPONSE_CHARS = 800


def render(step: int, header: dict, rows: list[dict], *, full: bool = False, source: str = "") -> str:
    """A step's samples for reading: per group its prompt once, then per sample its reward
    (and parts), advantage, finish and response (or turns). Long texts are cut in the middle
    unless `full`."""
    trim = (lambda text, limit: text) if full else _trim  # noqa: E731
    if header.get("kind") == "eval":
        correct = sum(bool(r.get("correct")) for r in rows)
        lines = [f"evaluation after step {step}: {len(header.get('groups', []))} held-out prompts, {len(rows)} "
                 f"samples, {correct} correct" + (f" ({source})" if source else "")]
    else:
        trained = header.get("trained_samples", len(rows))
        lines = [f"step {step}: {len(header.get('groups', []))} groups, {len(rows)} samples, {trained} trained"
                 + (f" ({source})" if source else "")]
    dropped = {k: v for k, v in header.get("dropped", {}).items() if v}
    if dropped:
        lines.append("not trained this step: " + ", ".join(f"{k} {v}" for k, v in dropped.items()))
    failed = {g["group"]: g["failed_samples"] for g in header.get("groups", [])}
    group = None
    for r in rows:
        if r["group"] != group:
            group = r["group"]
            note = ""
            if failed.get(group):
                note = f", {failed[group]} unscored" if header.get("kind") == "eval" else \
                    f", {failed[group]} failed samples left out"
            if r.get("source"):
                note += f" | {r['source']}"
            lines += ["", f"=== group {group} | prompt {r['prompt_id']}{note}", "prompt:",
                      _indent(trim(r["prompt"], PROMPT_CHARS), 4)]
        lines.append(f"  [{r['sample']}] " + _summary(r))
        if "turns" in r:
            for k, turn in enumerate(r["turns"], 1):
                lines.append(f"    turn {k} | reward {_fmt(turn['reward'])} | {turn['finish']}")
                for m in turn["messages"]:
                    lines.append(_indent(f"{m['role']}: " + trim(str(m.get("content", "")), RESPONSE_CHARS), 6))
                if "continuation" in turn:  # the environment's text inside the assistant's turn
                    lines.append(_indent("(continued): " + trim(turn["continuation"], RESPONSE_CHARS), 6))
        else:
            lines.append(_indent(trim(r["response"], RESPONSE_CHARS), 4))
    return "\n".join(lines)


def _summary(r: dict) -> str:
    parts = ", ".join(f"{k} {_fmt(v)}" for k, v in r["scores"].items())
    out = f"reward {_fmt(r['reward'])}" + (f" ({parts})" if parts else "")
    if r.get("dropped") == "eval":
        return out + f" | {'correct' if r['correct'] else 'wrong'} | finish {r['finish']} | {len(r['response_ids'])} tokens"
    out += f" | adv {_fmt(r['advantage'], signed=True)} | finish {r['finish']} | {len(r['response_ids'])} tokens"
    if r["version_min"] is not None:
        v0, v1 = r["version_min"], r["version_max"]
        out += f" | v{v0}" if v0 == v1 else f" | v{v0}-{v1}"
    if not r["trained"]:
        out += f" | not trained ({r['dropped']})"
    return out


def _fmt(x, signed: bool = False) -> str:
    if x is None:
        return "none"
    if isinstance(x, str):  # a non-finite number
        return x
    return f"{x:+.3f}" if signed else f"{x:.3f}"


def _trim(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head, tail = text[: limit * 2 // 3], text[-(limit // 3):]
    return f"{head} [... {len(text) - len(head) - len(tail)} chars cut; --full shows all ...] {tail}"


def _indent(text: str, n: int) -> str:
    return "\n".join(" " * n + line for line in text.splitlines() or [""])
