"""A run's checkpoint as a plain Hugging Face model directory (`rollover export`).

The output holds full weights (a LoRA adapter is merged into its base model), the tokenizer
and its chat template, so `AutoModelForCausalLM.from_pretrained(OUT)` and
`AutoTokenizer.from_pretrained(OUT)` load it with no rollover and no peft (a vision-language
model: `AutoModelForImageTextToText` and `AutoProcessor`, its processor saved too). Weights are saved in
the checkpoint's dtype (float32). `data.system_prompt` and `data.instruction` are applied by
rollover when it renders prompts; they are not part of the exported chat template.

The directory is written beside OUT under a temporary name and renamed into place, so an
interrupted export leaves no half model at OUT.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from rollover.config import ConfigError, read_yaml
from rollover.train import checkpoint as ckpts


class ExportError(RuntimeError):
    """An export that cannot be made; the message says why."""


def export(run_dir: str | Path, out: str | Path, *, checkpoint: str | Path | None = None,
           force: bool = False, best: bool = False) -> Path:
    """Write the run's latest checkpoint (or `checkpoint`, or with `best` its best by
    `checkpoint.best`) to `out`; returns the checkpoint used.

    A non-empty `out` is refused unless `force`, and even then only when it is a model
    directory (holds config.json) unrelated to the checkpoint.
    """
    run_dir, out = Path(run_dir), Path(out)
    if checkpoint is None and (run_dir / "DONE").is_file() and run_dir.parent.name == "checkpoints":
        checkpoint, run_dir = run_dir, run_dir.parent.parent  # a checkpoint given as the run (as eval takes it)
    if checkpoint is None and run_dir.is_file():
        raise ExportError(f"{run_dir} is a file: give the run directory (RUN_DIR, which holds config.yaml and "
                          "checkpoints/)")
    if checkpoint is None and not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    if best:
        ckpt, metric, _ = ckpts.best_of_run(run_dir)
        if ckpt is None:
            raise ExportError(f"{run_dir}: no checkpoint holds an evaluation with {metric} (eval.json)")
    else:
        ckpt = Path(checkpoint) if checkpoint is not None else _latest(run_dir)
    if ckpt is None:
        raise ExportError(f"{run_dir} has no complete checkpoint (checkpoints/step_*/DONE); pass --checkpoint DIR")
    if not (ckpt / "DONE").exists():
        raise ExportError(f"{ckpt} is not a complete checkpoint directory (no DONE marker)")
    _check_out(out, ckpt, force)
    _check_not_base(out, ckpt, run_dir)
    for tries in range(3):
        try:
            model, tokenizer = _load(ckpt, run_dir)
            break
        except Exception:
            # a run still training removes old checkpoints (checkpoint.keep) while one is read:
            # the latest then is another; read that one
            latest = None if checkpoint is not None or best or ckpt.exists() else _latest(run_dir)
            if latest is None or latest == ckpt:
                raise
            if tries == 2:
                raise ExportError(f"{run_dir}'s checkpoints were removed while they were read, three times: the run is "
                                  "training and keeps checkpoint.keep of them; stop it, or pass --checkpoint DIR of "
                                  "one it keeps (a checkpoint.best)") from None
            ckpt = latest
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        ckpts.readable(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ckpt


def _latest(run_dir: Path) -> Path | None:
    """The run's newest checkpoint whose files read back (a damaged newer one is passed over, named)."""
    try:
        return ckpts.latest_intact(run_dir, "exporting", "pass --checkpoint DIR of a checkpoint kept elsewhere")
    except ConfigError as e:
        raise ExportError(str(e)) from None


def _check_out(out: Path, ckpt: Path, force: bool) -> None:
    o, c = out.resolve(), ckpt.resolve()
    if o == c or o in c.parents or c in o.parents:
        raise ExportError(f"{out} overlaps the checkpoint {ckpt}; export somewhere else")
    inside = next((p for p in (o, *o.parents) if p.name.startswith("step_") and (p / "DONE").is_file()), None)
    if inside is not None:
        raise ExportError(f"{out} is inside the checkpoint {inside}, which it would change; export somewhere else")
    blocked = next((p for p in o.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise ExportError(f"{out}: {blocked} is a file, not a directory")
    if not out.exists():
        return
    if not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory")
    if not any(out.iterdir()):
        return
    if not (out / "config.json").exists():
        raise ExportError(f"{out} is not empty and is not a model directory (no config.json); --force replaces only "
                          "a model directory: remove it yourself or export elsewhere")
    if not force:
        raise ExportError(f"{out} holds a model already; pass --force (force=True in Python) to replace it")


def _check_not_base(out: Path, ckpt: Path, run_dir: Path) -> None:
    """`out` is not the run's starting model (`model:` of its config.yaml), which its LoRA
    checkpoints are merged into and a resume's KL reference loads: replacing it would change
    every checkpoint of the run."""
    saved = next((p for p in (ckpt / "config.yaml", run_dir / "config.yaml") if p.is_file()), None)
    try:
        name = read_yaml(saved).get("model") if saved is not None else None
    except (ConfigError, OSError, AttributeError):
        return  # (a config that names no base model: `_load` says so where it needs one)
    if not isinstance(name, str):
        return
    # a relative path was read from where the run started: here, or (commonly) a directory above
    # RUN_DIR; a bare name (a hub id such as gpt2) is looked for here only
    above = not Path(name).is_absolute() and ("/" in name or name.startswith("."))
    candidates = [Path(name), *(a / name for a in run_dir.resolve().parents if above)]
    o = out.resolve()
    hit = next((b for b in (c.resolve() for c in candidates if c.is_dir())  # (a hub id or an alias is no directory)
                if o == b or b in o.parents or o in b.parents), None)
    if hit is not None:
        raise ExportError(f"{out} {'is' if o == hit else 'overlaps'} the run's base model {hit} (model: in {saved}): "
                          "its checkpoints stand on it (a LoRA adapter is merged into it, a resume's reference is "
                          "loaded from it); export somewhere else")


def _load(ckpt: Path, run_dir: Path):
    """(model with full weights, tokenizer) from a checkpoint: its `model/` directory, or its
    LoRA `adapter/` merged into the base model its config names."""
    import torch

    from rollover.models import load_hf_model, resolve_model, text_processor

    if (ckpt / "model").exists():
        src = str(ckpt / "model")
        model = load_hf_model(src, dtype=torch.float32)
        return model, text_processor(src, model)
    if not (ckpt / "adapter").exists():
        raise ExportError(f"{ckpt} holds neither model/ nor adapter/")
    saved = next((p for p in (ckpt / "config.yaml", run_dir / "config.yaml") if p.is_file()), None)
    if saved is None:
        raise ExportError(f"{ckpt} holds a LoRA adapter but no config.yaml names its base model "
                          f"(looked in {ckpt} and {run_dir})")
    base_name = read_yaml(saved).get("model")
    if not isinstance(base_name, str):
        raise ExportError(f"{saved} names no base model (`model:`)")
    from peft import PeftModel

    try:
        source = resolve_model(base_name)
    except ValueError as e:
        raise ExportError(f"{saved} names the base model {base_name!r}, and {e}" + (
            "; a relative path is read from the directory rollover runs in: run it where the run was started"
            if not Path(base_name).is_absolute() else "")) from None
    base = load_hf_model(source, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(ckpt / "adapter")).merge_and_unload()
    return merged, text_processor(base_name, merged)
