"""Checkpoints for exact resume.

`RUN_DIR/checkpoints/step_000012/` holds:
- `model/` — the policy, `save_pretrained` safetensors (loadable with `from_pretrained`); with
  LoRA, the peft adapter (`adapter/`) instead;
- `state.pt` — optimizer, scheduler, RNG states (python, numpy, torch), the data iterator's
  position, the prompt serial counter, the rollout scheduler's buffers (APRIL partial groups)
  and anything else the loop puts in `extra`;
- `config.yaml` — the config that trained it (what `resume` compares a new config with);
- `eval.json` — the evaluation of its step, when there was one (its metrics);
- `DONE` — written last: a directory without it was interrupted mid-save and is ignored.

A checkpoint is written to a temporary directory and renamed into place, so a kill during a
save never leaves a half checkpoint that `latest` would pick. `keep` removes the oldest
checkpoints but never the one just written, nor the best by `checkpoint.best` (`best`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from rollover.metrics.samples import umask

log = logging.getLogger("rollover")


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest(run_dir: str | Path) -> Path | None:
    root = checkpoint_dir(run_dir)
    if not root.exists():
        return None
    done = sorted(p for p in root.glob("step_*") if (p / "DONE").exists())
    return done[-1] if done else None


def exists(run_dir: str | Path, step: int) -> bool:
    """Whether the run has a complete checkpoint of `step`."""
    return (checkpoint_dir(run_dir) / f"step_{step:06d}" / "DONE").exists()


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


EVAL_FILE = "eval.json"


def save(run_dir: str | Path, step: int, *, model, tokenizer, trainer_state: dict, extra: dict, keep: int,
         config: str | None = None, evaluation: dict | None = None, best: tuple[str, str] | None = None,
         rng: dict | None = None) -> Path:
    """Write `RUN_DIR/checkpoints/step_{step:06d}`, then remove the oldest complete checkpoints
    other than it until `keep` remain, sparing the best by `best` (metric, "max" or "min").
    `config`: the run's config as YAML text; `evaluation`: the metrics of the step's evaluation;
    `rng`: the random generators' state to resume with (None: this moment's, `rng_state()`)."""
    if keep < 1:
        raise ValueError(f"checkpoint keep={keep}: must be >= 1 (the checkpoint just written is always kept)")
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"  # exists() knows this name
    tmp = Path(tempfile.mkdtemp(prefix=f".step_{step:06d}-", dir=root))
    try:
        sub = "adapter" if hasattr(model, "get_base_model") else "model"
        model.save_pretrained(tmp / sub, safe_serialization=True)
        if tokenizer is not None and sub == "model":
            tokenizer.save_pretrained(tmp / sub)
        torch.save({"step": step, "trainer": trainer_state, "rng": rng or rng_state(), **extra}, tmp / "state.pt")
        if config is not None:
            (tmp / "config.yaml").write_text(config)
        if evaluation is not None:
            (tmp / EVAL_FILE).write_text(_evaluation_json(evaluation))
        (tmp / "DONE").write_text(str(step))
        readable(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException as e:
        full = _disk_full(e, root)  # asked before the partial write goes: it holds the space that ran out
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise OSError(28, f"no space left on the device of {root} while writing checkpoint step {step} "
                              f"({shutil.disk_usage(root).free / 2**20:.0f} MiB free once its partial files were "
                              "removed); nothing of it was kept, the previous checkpoint stands") from None
        raise
    for stale in root.glob(".step_*"):  # left by a process killed mid-save (one writer per run dir)
        shutil.rmtree(stale, ignore_errors=True)
    others = sorted(p for p in root.glob("step_*") if (p / "DONE").exists() and p != final)
    newest = set(others[max(0, len(others) - (keep - 1)):]) if keep > 1 else set()
    spared = {best_checkpoint(run_dir, *best)} if best is not None else set()
    if best is not None:  # one whose evaluation does not read back might be the best: kept, not guessed at
        unread = {p for p in others if p not in newest and (p / EVAL_FILE).exists() and read_evaluation(p) is None}
        for p in sorted(unread):
            _warn_once(("kept", p), "checkpoint %s is kept beside checkpoint.keep=%d: its %s does not read back, so "
                       "whether it is the best by %s is not known; remove it yourself if it is not", p.name, keep,
                       EVAL_FILE, best[0])
        spared |= unread
    for old in others:
        if old not in newest and old not in spared:  # the best is kept besides the newest, or is one of them
            shutil.rmtree(old, ignore_errors=True)
    return final


def readable(root: Path) -> None:
    """`root` (a `mkdtemp` directory, 0700) and what is under it with the modes the umask gives
    new files, so that a teammate can read a run's checkpoints as they can its metrics."""
    mask = umask()
    for p in [root, *root.rglob("*")]:
        if not p.is_symlink():
            p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


def best_of_run(run_dir: str | Path) -> tuple[Path | None, str, str]:
    """(checkpoint, metric, mode): the run's best checkpoint by its `checkpoint.best` (from
    RUN_DIR/config.yaml; unset: eval/accuracy, largest), among those it kept."""
    import yaml

    saved = Path(run_dir) / "config.yaml"
    section = (yaml.safe_load(saved.read_text()) or {}).get("checkpoint", {}) if saved.is_file() else {}
    metric, mode = section.get("best") or "eval/accuracy", section.get("best_mode") or "max"
    return best_checkpoint(run_dir, metric, mode), metric, mode


def _evaluation_json(evaluation: dict) -> str:
    return json.dumps({k: v for k, v in evaluation.items() if isinstance(v, (int, float)) and math.isfinite(v)})


def record_evaluation(path: str | Path, evaluation: dict) -> None:
    """Add the evaluation of a complete checkpoint's step to it (`eval.json`, written whole by a
    rename), for an evaluation run after the checkpoint was saved."""
    path = Path(path)
    tmp = path / f".{EVAL_FILE}.tmp"
    tmp.write_text(_evaluation_json(evaluation))
    os.replace(tmp, path / EVAL_FILE)


def read_evaluation(path: str | Path) -> dict | None:
    """The evaluation recorded in a checkpoint (`eval.json`), or None when it has none or the
    file cannot be read as one (a write cut short: warned about, naming the file)."""
    f = Path(path) / EVAL_FILE
    if not f.is_file():
        return None
    try:
        evaluation = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        _warn_once(f, "%s is damaged (%s): that checkpoint's evaluation is passed over", f, e)
        return None
    if not isinstance(evaluation, dict):
        _warn_once(f, "%s holds no evaluation (a JSON %s): passed over", f, type(evaluation).__name__)
        return None
    return evaluation


_warned: set = set()  # (what, path) warned about in this process: each save reads every checkpoint again


def _warn_once(key, message: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def best_checkpoint(run_dir: str | Path, metric: str, mode: str = "max") -> Path | None:
    """The complete checkpoint whose evaluation (eval.json) has the best value of `metric`
    (largest for "max", smallest for "min"; on a tie the earliest); None when none has it."""
    found, best = None, None
    for path in sorted(checkpoint_dir(run_dir).glob("step_*")):
        evaluation = read_evaluation(path) if (path / "DONE").exists() else None
        if evaluation is None:
            continue
        value = evaluation.get(metric)
        if not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
            continue  # no value (every held-out episode failed: NaN) is never the best
        if best is None or (value > best if mode == "max" else value < best):
            found, best = path, value
    return found


def _disk_full(e: BaseException, root: Path) -> bool:
    """Whether a failed write ran out of space (torch's zip writer says only "unexpected pos")."""
    import errno

    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return True
    text = str(e)
    if "No space left" in text:
        return True
    try:
        return "unexpected pos" in text and shutil.disk_usage(root).free < 64 * 2**20
    except OSError:
        return False


def load_state(path: str | Path) -> dict:
    path = Path(path)
    if not (path / "DONE").exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no DONE marker)")
    try:
        return torch.load(path / "state.pt", weights_only=False)
    except (RuntimeError, OSError, EOFError) as e:
        raise RuntimeError(f"{path / 'state.pt'} cannot be read: {' '.join(str(e).split())}") from None


def damage(path: str | Path) -> str | None:
    """What is wrong with a complete checkpoint's files (a file cut short or unreadable, named),
    or None. Cheap: state.pt is opened memory-mapped, each safetensors file by its header (which
    is checked against the file's length)."""
    from rollover.models import unreadable_safetensors

    path = Path(path)
    try:
        state = torch.load(path / "state.pt", weights_only=False, mmap=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any failure to read it is damage
        return f"{path / 'state.pt'}: {' '.join(str(e).split())[:200]}"
    trainer = state.get("trainer") if isinstance(state, dict) else None
    if isinstance(trainer, dict) and trainer.get("sharded") and not (path / "sharded").is_dir():
        return f"{path / 'sharded'}: missing (the sharded trainer's weights and optimizer state were saved there)"
    for f in sorted(path.glob("*/*.safetensors")):
        if (why := unreadable_safetensors(f)) is not None:
            return f"{f}: {why[:200]}"
    for f in sorted(path.glob("*/*.json")):  # the model's and adapter's configs, the tokenizer's files
        try:
            json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            return f"{f}: not readable as JSON ({e})"
    if (path / "config.yaml").is_file():
        import yaml

        try:
            recorded = yaml.safe_load((path / "config.yaml").read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            return f"{path / 'config.yaml'}: {' '.join(str(e).split())[:200]}"
        if not isinstance(recorded, dict):
            return f"{path / 'config.yaml'}: holds no config (cut short?)"
    if (path / "sharded").is_dir():
        return _sharded_damage(path / "sharded")
    return None


def _sharded_damage(sharded: Path) -> str | None:
    """What is wrong with a `torch.distributed.checkpoint` directory (the sharded trainer's), or
    None: its `.metadata` must read back and every shard file hold the bytes it lists there."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        stored = FileSystemReader(str(sharded)).read_metadata().storage_data
    except Exception as e:  # noqa: BLE001 - any failure to read it is damage
        return f"{sharded / '.metadata'}: {' '.join(str(e).split())[:200]}"
    needed: dict[str, int] = {}
    for info in stored.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        f = sharded / name
        have = f.stat().st_size if f.is_file() else None
        if have is None or have < size:
            return f"{f}: {'missing' if have is None else f'{have} bytes'}, its metadata lists {size}"
    return None


def latest_intact(run_dir: str | Path, doing: str = "resuming from",
                  hint: str = "resume=never starts over") -> Path | None:
    """The newest complete checkpoint whose files read back; a damaged newer one is passed over
    with a warning naming its damaged file (and saying what is `doing` the one before). When
    every one is damaged, an error ending with `hint` (never a silent start from scratch)."""
    from rollover.config import ConfigError

    root = checkpoint_dir(run_dir)
    done = sorted((p for p in root.glob("step_*") if (p / "DONE").exists()), reverse=True) if root.exists() else []
    first = None
    for ckpt in done:
        why = damage(ckpt)
        if why is None:
            return ckpt
        if not (ckpt / "DONE").exists():  # removed meanwhile (a live run's checkpoint.keep), not damaged
            continue
        log.warning("checkpoint %s is damaged (%s); %s the one before it", ckpt.name, why, doing)
        first = first or why
    if done:
        raise ConfigError(f"every checkpoint in {root} is damaged (the newest: {first}); {hint}")
    return None
