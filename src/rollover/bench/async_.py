"""`rollover bench async`: samples trained per second for sync, APRIL and async (several eta).

Every mode trains the demo configuration (SmolLM2-135M-Instruct, 1-digit addition, 8 prompts
x 4 samples, at most 48 new tokens, one update per step) for `warmup + steps` steps; the rate
is measured over the last `steps` (samples trained / wall time between their metric rows).
Busy fractions: for sync and APRIL the share of step time spent generating (rollout) and
training + weight sync (trainer); for async, the engine's busy time, the data manager's
processing time and the trainer's train + sync time, each over the run's wall time.

On one 2-core CPU the engine and the trainer share the same cores, so async overlap can only
hide the idle gaps of each (waiting on the long tail, Python overhead), not double the
throughput; on separate devices the same schedule overlaps generation and training fully.
"""

from __future__ import annotations

import json
import statistics

from rollover.bench import scratch_run_dir


def _lengths(run_dir: str) -> list[int]:
    """Every trained sample's response length, in step order (what a simulation replays)."""
    from pathlib import Path

    from rollover.metrics.logger import GROUPS_FILE

    out = []
    for line in (Path(run_dir) / GROUPS_FILE).read_text().splitlines():
        for g in json.loads(line)["groups"]:
            out += g["lengths"]
    return out


def _run(args, mode: str, eta: int | None = None) -> dict:
    with scratch_run_dir(f"rollover-bench-{mode}-") as run_dir:
        return _measure(args, mode, eta, run_dir)


def _measure(args, mode: str, eta: int | None, run_dir: str) -> dict:
    from rollover.config import load_config
    from rollover.loops.async_ import train_async
    from rollover.loops.sync import train_sync
    from rollover.metrics import read_metrics

    over = [
        f"model={args.model}", f"run_dir={run_dir}", "resume=never", f"steps={args.warmup + args.steps}",
        "data.train=gen:arithmetic?digits=1&n=4000", "data.eval_size=0", "data.max_prompt_tokens=64",
        "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4", f"rollout.max_new_tokens={args.max_new_tokens}",
        "reward.functions=[numeric]", "eval.every=0", "eval.at_start=false", f"checkpoint.every={10**6}",
        "logging.progress=false", "logging.tensorboard=false", f"seed={args.seed}",
    ]
    if mode == "april":
        # resubmit, as measured in docs/benchmarks.md (the default, auto, keeps K/V on TorchEngine)
        over += ["partial_rollout.enabled=true", f"partial_rollout.oversample={args.oversample}",
                 "partial_rollout.carry=resubmit"]
    if mode == "async":
        over += ["mode=async", f"async.max_staleness={eta}"]
    cfg = load_config(None, over)
    (train_async if mode == "async" else train_sync)(cfg)
    rows = read_metrics(run_dir, kind="train")
    measured = [r for r in rows if r["step"] > args.warmup]
    first = next(r for r in rows if r["step"] == args.warmup)
    wall = measured[-1]["time"] - first["time"]
    samples = measured[-1]["samples_consumed_total"] - first["samples_consumed_total"]
    out = {"samples_per_s": samples / wall, "samples": samples, "seconds": wall,
           "reward_mean": statistics.fmean(r["reward/mean"] for r in measured),
           "response_lengths": _lengths(run_dir)}
    if mode == "async":
        last = measured[-1]
        out["busy_fraction"] = {k: last[f"busy/{k}"] for k in ("rollout", "data_manager", "trainer")}
        out["staleness_mean"] = statistics.fmean(r["staleness/mean"] for r in measured)
    else:
        step_s = sum(r["timing_s/step"] for r in measured)
        out["busy_fraction"] = {
            "rollout": sum(r["timing_s/generate"] for r in measured) / step_s,
            "trainer": sum(r["timing_s/train"] + r["timing_s/weight_sync"] for r in measured) / step_s,
        }
    return out


def main(args) -> dict:
    result = {"model": args.model, "steps": args.steps, "warmup": args.warmup, "max_new_tokens": args.max_new_tokens}
    result["sync"] = _run(args, "sync")
    result["april"] = _run(args, "april")
    result["async"] = {str(eta): _run(args, "async", eta) for eta in args.etas}
    result["sync_samples_per_s"] = result["sync"]["samples_per_s"]
    result["april_samples_per_s"] = result["april"]["samples_per_s"]
    result["async_samples_per_s"] = {eta: r["samples_per_s"] for eta, r in result["async"].items()}
    result["async_over_sync"] = {eta: r["samples_per_s"] / result["sync"]["samples_per_s"]
                                 for eta, r in result["async"].items()}
    result["busy_fraction"] = {"sync": result["sync"]["busy_fraction"], "april": result["april"]["busy_fraction"],
                               **{f"async_eta{eta}": r["busy_fraction"] for eta, r in result["async"].items()}}
    print(f"\nrollover bench async — {args.model}, 8 prompts x 4 samples, max {args.max_new_tokens} new tokens, "
          f"{args.steps} measured steps")
    print(f"  {'mode':12s} {'samples/s':>10s}  busy fractions")
    rows = [("sync", result["sync"]), ("april", result["april"])] + [(f"async eta={e}", r) for e, r in result["async"].items()]
    for name, r in rows:
        busy = " ".join(f"{k}={v:.2f}" for k, v in r["busy_fraction"].items())
        print(f"  {name:12s} {r['samples_per_s']:10.3f}  {busy}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def add_arguments(p) -> None:
    from rollover.bench import at_least

    p.add_argument("--model", default="smollm2-135m-instruct", help="model: a local path, hub id or alias (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--steps", type=at_least(1), default=6, help="measured steps per mode")
    p.add_argument("--warmup", type=at_least(1), default=1, help="unmeasured steps first")
    p.add_argument("--max-new-tokens", type=at_least(1), default=48, help="length budget of a response")
    p.add_argument("--oversample", type=float, default=2.0, help="APRIL's over-provisioning (requests started per group wanted)")
    p.add_argument("--etas", type=at_least(0), nargs="+", default=[1, 2, 4], help="staleness bounds (eta) to measure in async mode")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
