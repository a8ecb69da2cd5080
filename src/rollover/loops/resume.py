"""A run directory across runs: which checkpoint a run resumes from (and whether it trained the
same thing), the lock one running process holds, and the config a run goes on under."""

from __future__ import annotations

import logging
from pathlib import Path

from rollover.config import Config, ConfigError, config_changes, dump_config, read_yaml
from rollover.config.algorithm import CLIP_DEFAULTS
from rollover.config.base import lora_settings
from rollover.train import checkpoint

log = logging.getLogger("rollover")


def lock_run_dir(run_dir: Path):
    """Hold RUN_DIR/.lock (an exclusive flock) for the life of the run: a second process on the
    same run dir would interleave checkpoints and metrics, so it is refused, naming the first."""
    import fcntl
    import os

    run_dir.mkdir(parents=True, exist_ok=True)
    f = open(run_dir / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        if holder == f"pid {os.getpid()}":  # a Run built earlier in this process and not closed
            raise ConfigError(f"run_dir {run_dir} is in use by a run built earlier in this process and not closed: "
                              "close it (run.close(), or train it: the loop closes it) first") from None
        raise ConfigError(f"run_dir {run_dir} is in use by a running rollover process ({holder}); wait for it to "
                          "finish or stop it, or give another run_dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}")
    f.flush()
    return f


def checkpoint_to_resume(cfg: Config) -> Path | None:
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        return checkpoint.latest_intact(cfg.run_dir)
    ckpt = Path(cfg.resume)
    if not ckpt.is_dir():
        raise ConfigError(f"resume={cfg.resume!r}: no such checkpoint directory (resume is auto, never or the "
                          "directory of a checkpoint)")
    if not (ckpt / "DONE").exists():
        raise ConfigError(f"resume={cfg.resume!r}: not a complete checkpoint directory (no DONE marker)")
    why = checkpoint.damage(ckpt)
    if why is not None:
        raise ConfigError(f"resume={cfg.resume!r}: the checkpoint is damaged: {why}")
    return ckpt


def set_aside_later_checkpoints(run_dir: Path, step: int) -> list[Path]:
    """Move the run dir's checkpoints past `step` (the step a run resumes at, from an earlier
    checkpoint than the newest) to RUN_DIR/checkpoints_set_aside/after_step_N/: they belong to
    the abandoned continuation whose metrics the resume drops, so neither `resume=auto`,
    `--best` nor retention may take them for this run's. Nothing is deleted. Returns the moved
    directories' new paths."""
    import re
    import shutil
    import time

    root = checkpoint.checkpoint_dir(run_dir)
    later = [p for p in sorted(root.glob("step_*")) if (m := re.fullmatch(r"step_(\d+)", p.name)) and int(m[1]) > step]
    if not later:
        return []
    dest = run_dir / "checkpoints_set_aside" / f"after_step_{step}-{time.strftime('%Y%m%d-%H%M%S')}"
    dest.mkdir(parents=True, exist_ok=True)
    moved = [Path(shutil.move(str(p), str(dest / p.name))) for p in later]
    log.warning("resume at step %d: %d later checkpoint(s) of the abandoned continuation (%s) set aside in %s",
                step, len(moved), ", ".join(p.name for p in later), dest)
    return moved


def saved_config(ckpt: Path) -> Path | None:
    """The config a checkpoint was trained under: its own config.yaml, or its run dir's for
    checkpoints written without one; None when neither is there."""
    return next((p for p in (ckpt / "config.yaml", ckpt.parent.parent / "config.yaml") if p.is_file()), None)


def check_lora_matches(cfg: Config, ckpt: Path) -> None:
    """A checkpoint resumes only as it was trained: an adapter (`train.lora`; the sharded trainer
    saves it merged, so its config says) or every weight. Anything else is refused, with the way
    to start a new run from its weights."""
    saved = saved_config(ckpt)
    saved_lora = (read_yaml(saved).get("train") or {}).get("lora") if saved is not None else None
    adapter = (ckpt / "adapter").exists() or saved_lora is not None
    if adapter and cfg.train.lora is None:
        raise ConfigError(f"{ckpt} holds a LoRA adapter but train.lora is unset; set train.lora as the run that wrote "
                          "it did, or start a new run from its merged weights (rollover export RUN_DIR OUT, then "
                          "model=OUT)")
    if not adapter and cfg.train.lora is not None:
        raise ConfigError(f"{ckpt} was trained without LoRA (every weight) but train.lora is set; unset it to resume, "
                          f"or start a new run with an adapter over its weights (model={ckpt / 'model'}, a new run_dir)")
    if (ckpt / "adapter").exists() and saved_lora is not None and lora_settings(saved_lora) != lora_settings(cfg.train.lora):
        raise ConfigError(f"{ckpt} holds an adapter of train.lora={lora_settings(saved_lora)}, and this config's is "
                          f"{lora_settings(cfg.train.lora)}: an adapter goes on with its own shape and scale, even with "
                          "--allow-config-change; set train.lora as the run that wrote it did, or start a new run "
                          "from its merged weights (rollover export RUN_DIR OUT, then model=OUT)")


def config_changes_since(cfg: Config, ckpt: Path, allow: bool) -> list[str]:
    """The differences in what is trained between `cfg` and the config that trained `ckpt`
    (its own config.yaml, or its run dir's for checkpoints written without one); an error
    listing them unless `allow`."""
    saved = saved_config(ckpt)
    if saved is None:
        log.warning("resume: no config.yaml in or beside %s; cannot check that it was trained under this config", ckpt)
        return []
    changes = config_changes(read_yaml(saved), cfg)
    if changes and not allow:
        clip = [c for c in changes if c.startswith(("algorithm.eps_low:", "algorithm.eps_high:"))]
        if clip and cfg.algorithm.loss in CLIP_DEFAULTS:  # a run begun when every loss defaulted to 0.2 / 0.28
            changes = [*changes, f"(algorithm.loss={cfg.algorithm.loss} now defaults to its own clip range; write "
                                 "out the saved eps_low and eps_high to go on as the run began)"]
        raise ConfigError(f"resume from {ckpt} refused: this config changes what is trained (vs {saved}):\n"
                          + "\n".join(f"  {c}" for c in changes)
                          + "\nhint: pass --allow-config-change (build_run(cfg, allow_config_change=True) in Python) to continue "
                            "under the new config, "
                            "or give another run_dir to start a new run")
    return changes


def restart_without_checkpoint(cfg: Config, run_dir: Path, allow: bool) -> None:
    """A run dir with a run's metrics but no checkpoint (stopped before its first): `resume: auto`
    starts it over, replacing its metrics, under the config it had (else refused, naming the
    differences, unless `allow`), with a warning."""
    lock_run_dir(run_dir).close()  # a live run that has not saved yet is "in use", not a run to start over
    saved = run_dir / "config.yaml"
    changes = config_changes(read_yaml(saved), cfg) if saved.is_file() else []
    if changes and not allow:
        raise ConfigError(f"run_dir {run_dir} holds a run with no checkpoint under another config (vs {saved}); "
                          "starting it over would replace its metrics:\n" + "\n".join(f"  {c}" for c in changes)
                          + "\nhint: give another run_dir, or pass --allow-config-change (allow_config_change=True "
                            "in Python) to start it over under this config")
    log.warning("run_dir %s holds a run's metrics but no checkpoint: the run starts over, replacing them", run_dir)


def run_dir_state(run_dir: Path) -> tuple:
    """What a run decides its start by (the newest complete checkpoint, the metrics written so
    far): compared again once the run holds the lock, since another process may have finished
    in between."""
    from rollover.metrics.logger import METRICS_FILE

    metrics = run_dir / METRICS_FILE
    return checkpoint.latest(run_dir), metrics.stat().st_size if metrics.exists() else None


def has_metrics(run_dir: Path) -> bool:
    from rollover.metrics.logger import METRICS_FILE

    path = run_dir / METRICS_FILE
    return path.exists() and path.stat().st_size > 0


def record_config(cfg: Config, run_dir: Path, ckpt: Path | None, changes: list[str]) -> None:
    """RUN_DIR/config.yaml is the config the run goes on under; allowed changes are logged
    and appended to RUN_DIR/config_changes.log."""
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    if changes:
        log.warning("resume from %s under a changed config (allowed):\n%s", ckpt, "\n".join(f"  {c}" for c in changes))
        with open(run_dir / "config_changes.log", "a", encoding="utf-8") as f:
            f.write(f"resumed from {ckpt}:\n" + "".join(f"  {c}\n" for c in changes))
