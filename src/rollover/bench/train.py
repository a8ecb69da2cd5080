"""`rollover bench train`: seconds per synchronous training step, with the phase breakdown.

Config: SmolLM2-135M-Instruct, 8 prompts x 4 samples, at most 48 new tokens, one update per
step (the demo task; no evaluation or checkpoints inside the measured steps). The first step
is excluded (allocator and thread-pool warm-up).

`--compare plain` runs the same workload first with the plain packing (every sample with its
own copy of the prompt, `train.shared_prefix=false`), then with the defaults, in one process
after the other on the same host, and reports both and their ratios. `--compare trl` runs the
workload through TRL's GRPOTrainer as well (rollover.bench.trl_side says what is matched).
"""

from __future__ import annotations

import json
import statistics

from rollover.bench import scratch_run_dir


# the measured workload (also `rollover bench ray`'s): the demo task, one update per step, no
# evaluation or checkpoint inside the measured steps
WORKLOAD = (
    "resume=never", "data.train=gen:arithmetic?digits=1&n=2000", "data.eval_size=0", "data.max_prompt_tokens=64",
    "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=48",
    "reward.functions=[numeric]", "eval.every=0", "eval.at_start=false", f"checkpoint.every={10**6}",
    "logging.progress=false", "logging.tensorboard=false",
)


def measure(args, extra: tuple[str, ...] = ()) -> dict:
    """One training run of the workload; per-phase means over the measured steps."""
    from rollover.config import load_config
    from rollover.loops.sync import train_sync
    from rollover.metrics import read_metrics

    with scratch_run_dir("rollover-bench-train-") as run_dir:
        overrides = [f"model={args.model}", f"run_dir={run_dir}", f"steps={args.steps + 1}", *WORKLOAD,
                     f"rollout.engine={args.engine}", *args.overrides, *extra]
        train_sync(load_config(None, overrides))
        # the steps that trained the policy (critic.warmup_steps trains the critic alone first)
        rows = [r for r in read_metrics(run_dir, kind="train") if r["step"] > 1 and "actor/micro_batches" in r]
        if not rows:
            raise SystemExit("bench train: no measured step trained the policy (critic.warmup_steps covers them all): "
                             "give more --steps")
    phases = sorted({k for r in rows for k in r if k.startswith("timing_s/") and k != "timing_s/step"})
    return {
        "model": args.model, "engine": args.engine, "steps_measured": len(rows), "overrides": [*args.overrides, *extra],
        "seconds_per_step": statistics.fmean(r["timing_s/step"] for r in rows),
        **{f"{p.removeprefix('timing_s/')}_s": statistics.fmean(r[p] for r in rows) for p in phases},
        "tokens_per_s_generate": statistics.fmean(r["perf/tokens_per_s"] for r in rows),
        "padding_fraction": statistics.fmean(r["actor/padding_fraction"] for r in rows),
        "micro_batches": statistics.fmean(r["actor/micro_batches"] for r in rows),
        "rollout_kl": statistics.fmean(r["actor/rollout_kl"] for r in rows),
        "response_length_mean": statistics.fmean(r["response_length/mean"] for r in rows),
    }


def _print(title: str, result: dict) -> None:
    print(f"\n{title}")
    print(f"  seconds per step: {result['seconds_per_step']:.1f}")
    for name in ("generate", "reward", "advantage", "train", "weight_sync"):
        if f"{name}_s" in result:
            print(f"    {name:12s} {result[name + '_s']:7.2f} s")
    print(f"  micro-batches {result['micro_batches']:.1f}, padding fraction {result['padding_fraction']:.2f}")


def main(args) -> dict:
    head = (f"rollover bench train — {args.model}, 8 prompts x 4 samples, max 48 new tokens, {args.steps} steps measured"
            + (f"; overrides: {' '.join(args.overrides)}" if args.overrides else ""))
    compare = set(args.compare or ())
    if "plain" in compare:
        plain = measure(args, ("train.shared_prefix=false",))
        _print(head + " — plain packing (train.shared_prefix=false)", plain)
    result = measure(args)
    _print(head + (" — defaults" if compare else ""), result)
    if "plain" in compare:
        result.update(plain=plain, speedup_step=plain["seconds_per_step"] / result["seconds_per_step"],
                      speedup_train=plain["train_s"] / result["train_s"])
        print(f"\n  defaults vs plain packing: step {result['speedup_step']:.2f}x, train phase {result['speedup_train']:.2f}x")
    if "trl" in compare:
        from rollover.bench.trl_side import measure_trl

        result["trl"] = measure_trl(args, WORKLOAD)
        result["speedup_vs_trl"] = result["trl"]["seconds_per_step"] / result["seconds_per_step"]
        print(f"\n  TRL {result['trl']['trl_version']} GRPOTrainer: {result['trl']['seconds_per_step']:.1f} s per step; "
              f"rollover {result['speedup_vs_trl']:.2f}x faster")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _compare_list(text: str) -> list[str]:
    import argparse

    items = [t for t in text.split(",") if t]
    bad = [t for t in items if t not in ("plain", "trl")]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of plain, trl")
    return items


def add_arguments(p) -> None:
    from rollover.bench import at_least

    p.add_argument("--model", default="smollm2-135m-instruct", help="model: a local path, hub id or alias (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--engine", choices=["torch", "vllm"], default="torch", help="rollout engine: torch (TorchEngine) or vllm")
    p.add_argument("--steps", type=at_least(1), default=5, help="measured steps (one more runs first, unmeasured)")
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
    p.add_argument("--compare", type=_compare_list, default=None, metavar="plain,trl",
                   help="also measure, in the same invocation (comma-separated): plain = the plain packing "
                        "(train.shared_prefix=false), trl = TRL's GRPOTrainer on the same workload (needs trl)")
    p.add_argument("overrides", nargs="*", help="extra key.path=value config overrides")
