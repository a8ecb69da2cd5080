"""`rollover bench train`: seconds per synchronous training step, with the phase breakdown.

Config: SmolLM2-135M-Instruct, 8 prompts x 4 samples, at most 48 new tokens, one update per
step (the demo task; no evaluation or checkpoints inside the measured steps). The first step
is excluded (allocator and thread-pool warm-up).
"""

from __future__ import annotations

import json
import statistics
import tempfile


# the measured workload (also `rollover bench ray`'s): the demo task, one update per step, no
# evaluation or checkpoint inside the measured steps
WORKLOAD = (
    "resume=never", "data.train=gen:arithmetic?digits=1&n=2000", "data.eval_size=0", "data.max_prompt_tokens=64",
    "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=48",
    "reward.functions=[numeric]", "eval.every=0", "eval.at_start=false", f"checkpoint.every={10**6}",
    "logging.progress=false", "logging.tensorboard=false",
)


def main(args) -> dict:
    from rollover.config import load_config
    from rollover.loops.sync import train_sync
    from rollover.metrics import read_metrics

    run_dir = tempfile.mkdtemp(prefix="rollover-bench-train-")
    overrides = [f"model={args.model}", f"run_dir={run_dir}", f"steps={args.steps + 1}", *WORKLOAD,
                 f"rollout.engine={args.engine}", *args.overrides]
    cfg = load_config(None, overrides)
    train_sync(cfg)
    rows = [r for r in read_metrics(run_dir, kind="train") if r["step"] > 1]
    phases = sorted({k for r in rows for k in r if k.startswith("timing_s/") and k != "timing_s/step"})
    result = {
        "model": args.model, "engine": args.engine, "steps_measured": len(rows),
        "seconds_per_step": statistics.fmean(r["timing_s/step"] for r in rows),
        **{f"{p.removeprefix('timing_s/')}_s": statistics.fmean(r[p] for r in rows) for p in phases},
        "tokens_per_s_generate": statistics.fmean(r["perf/tokens_per_s"] for r in rows),
        "padding_fraction": statistics.fmean(r["actor/padding_fraction"] for r in rows),
        "response_length_mean": statistics.fmean(r["response_length/mean"] for r in rows),
    }
    print(f"\nrollover bench train — {args.model}, 8 prompts x 4 samples, max 48 new tokens, {len(rows)} steps measured")
    print(f"  seconds per step: {result['seconds_per_step']:.1f}")
    for p in phases:
        name = p.removeprefix("timing_s/")
        print(f"    {name:12s} {result[name + '_s']:7.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def add_arguments(p) -> None:
    from rollover.bench import at_least

    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--engine", choices=["torch", "vllm"], default="torch")
    p.add_argument("--steps", type=at_least(1), default=5, help="measured steps (one more runs first, unmeasured)")
    p.add_argument("--json", default=None)
    p.add_argument("overrides", nargs="*", help="extra key.path=value config overrides")
