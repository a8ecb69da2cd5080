"""`rollover bench memory`: peak resident memory per phase of a synchronous training run.

For each model (SmolLM2-135M-Instruct with the demo's config, and a ~0.5B model of the same
architecture built from random weights with SmolLM2's tokenizer), a fresh process builds the
run as `rollover train` does and goes through `steps` steps of generate -> train -> push
weights, then one evaluation (135M only unless `--eval-all`), recording after each phase the
process's resident high-water mark since the previous phase (the kernel's VmHWM, restarted
between phases) and its resident size at the end of the phase. `peak_gb` is the highest of
them: what a machine must have free for this run. Overrides (`--set key=value`, as on the
`rollover train` command line) apply to every model, e.g. `--set train.micro_batch_tokens=4096
train.logit_chunk_tokens=0` for the settings before the memory work.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEMO = "examples/arith.yaml"
HALF_B = dict(hidden_size=1280, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=20,
              num_key_value_heads=5)  # SmolLM2's Llama architecture and vocabulary, ~0.49B parameters


def make_half_b(path: Path, seed: int = 0) -> Path:
    """A ~0.5B Llama model with random weights and SmolLM2's tokenizer, saved at `path`."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    from rollover.models import load_tokenizer, resolve_model

    if (path / "config.json").is_file():
        return path
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    src = AutoConfig.from_pretrained(resolve_model("smollm2-135m-instruct"))
    cfg = src.__class__(**{**src.to_dict(), **HALF_B})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))  # a killed save leaves no model
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(path)
    return path


def child(model: str, config: str, overrides: list[str], steps: int, evaluate: bool, out: str) -> None:
    """One model's phases, in this (fresh) process; writes the JSON to `out`."""
    t_start = time.perf_counter()
    from rollover.config import load_config
    from rollover.loops.batch import train_batch_from
    from rollover.loops.build import build_run
    from rollover.loops.sync import make_collector
    from rollover.train import memory

    phases = []

    def mark(name: str, t0: float, **extra) -> None:
        end = memory.rss_gb()  # before the high-water mark: the engine's thread may still be allocating
        phases.append({"phase": name, "peak_gb": memory.peak_rss_gb(), "end_gb": end,
                       "seconds": time.perf_counter() - t0, **extra})
        memory.reset_peak()

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        cfg = load_config(config, overrides, **{"model": model, "run_dir": tmp, "steps": steps,
                                                "logging.progress": False, "logging.tensorboard": False,
                                                "eval.at_start": False})
        run = build_run(cfg, record=False)
        mark("build", t0)
        collector = make_collector(run)
        try:
            for step in range(steps):
                t0 = time.perf_counter()
                groups, gen = collector.collect(step)
                mark(f"generate {step + 1}", t0, tokens=gen["generated_tokens"])
                t0 = time.perf_counter()
                batch, _ = train_batch_from(groups, cfg)
                run.engine.release_memory()
                m = run.trainer.train_step(batch)
                mark(f"train {step + 1}", t0, micro_batches=m.get("actor/micro_batches", 0), loss_tokens=m.get("actor/loss_tokens", 0))
                t0 = time.perf_counter()
                run.weights.push(run.trainer.named_weights(), version=step + 1, inflight=collector.inflight_mode)
                mark(f"push {step + 1}", t0)
            if evaluate:
                t0 = time.perf_counter()
                run.evaluate(steps)
                mark("eval", t0)
            micro = run.trainer.micro_batch_tokens
        finally:
            collector.close()
            run.close()
    params = sum(p.numel() for p in run.trainer.model.parameters())
    result = {"model": model, "parameters": params, "micro_batch_tokens": micro, "phases": phases,
              "peak_gb": max(p["peak_gb"] for p in phases), "seconds": time.perf_counter() - t_start}
    Path(out).write_text(json.dumps(result, indent=2))


def measure(model: str, args, evaluate: bool) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "rollover.bench.memory", "--child", model, args.config, str(args.steps),
           str(int(evaluate)), out, *args.set]
    try:
        done = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if done.returncode != 0:
            raise SystemExit(f"rollover bench memory: measuring {model} failed (exit {done.returncode}; its error is "
                             "above)")
        return json.loads(Path(out).read_text())
    finally:
        Path(out).unlink(missing_ok=True)


def main(args) -> dict:
    from rollover.train.memory import peak_rss_gb, reset_peak

    if peak_rss_gb() is None or not reset_peak():
        raise SystemExit("rollover bench memory: needs Linux's /proc/self/status and /proc/self/clear_refs "
                         "(the resident high-water mark, restarted between phases)")
    if not Path(args.config).is_file():
        raise SystemExit(f"rollover bench memory: config {args.config!r} not found "
                         "(the default is the demo's: run from the repository root, or give --config)")
    result = {"config": args.config, "steps": args.steps, "overrides": args.set, "models": {}}
    models = {"135m": args.model}
    if not args.skip_half_b:
        models["0_5b"] = str(make_half_b(Path(args.half_b_dir)))
    for key, model in models.items():
        r = measure(model, args, evaluate=key == "135m" or args.eval_all)
        result["models"][key] = r
        result[f"peak_gb_{key}"] = r["peak_gb"]
        print_table(key, r)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def print_table(key: str, r: dict) -> None:
    print(f"\nrollover bench memory — {key} ({r['parameters'] / 1e6:.0f}M parameters, micro-batches of "
          f"{r['micro_batch_tokens']} tokens): peak {r['peak_gb']:.2f} GB")
    print(f"  {'phase':12s} {'peak GB':>8s} {'end GB':>8s} {'seconds':>8s}")
    for p in r["phases"]:
        print(f"  {p['phase']:12s} {p['peak_gb']:8.2f} {p['end_gb']:8.2f} {p['seconds']:8.1f}")


def add_arguments(p) -> None:
    from rollover.bench import at_least

    p.add_argument("--config", default=DEMO, help="the run's config (default: the demo's)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="the first model (reported as 135m)")
    p.add_argument("--steps", type=at_least(1), default=2, help="generate -> train -> push steps")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every model")
    p.add_argument("--skip-half-b", action="store_true", help="only the 135M model")
    p.add_argument("--half-b-dir", default=str(Path(tempfile.gettempdir()) / "rollover-llama-0.5b"),
                   help="where the random ~0.5B model is saved (reused when present)")
    p.add_argument("--eval-all", action="store_true", help="evaluate the ~0.5B model too (slow on a CPU)")
    p.add_argument("--json", default=None, help="write the results as JSON to this file")


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        from rollover.config import ConfigError

        model, config, steps, evaluate, out, *overrides = sys.argv[2:]
        try:
            child(model, config, overrides, int(steps), bool(int(evaluate)), out)
        except ConfigError as e:
            sys.exit(f"rollover bench memory: config error: {e}")
