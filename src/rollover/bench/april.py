"""`rollover bench april`: synchronous rollouts vs APRIL on the same engine and settings.

Each mode runs `warmup + steps` rollout steps; only the last `steps` are measured (steady
state: APRIL's carry buffer is primed). Between steps the engine receives a weight update
(the same weights, version + 1) as in training, so carried prefixes age as they would; no
training happens, so the figures isolate rollout throughput.

Workloads:
- `longtail`: per-sample response lengths drawn from a long-tailed mix and enforced with EOS
  ignored: with probability `cap_mass` the sample runs to the cap (real RL logs show 10-45% of
  samples truncated); otherwise its length is log-normal, `exp(mu_prompt + sigma * z)` with a
  per-prompt difficulty `mu_prompt = log(cap / 5) + 0.5 * z'` (z, z' standard normal), rounded
  and clipped to [1, cap].
- `natural`: the demo task (1-digit addition) with its own lengths at temperature 1, EOS honoured.

With `--repeats N` the whole comparison (sync, then each APRIL mode) runs N times in turn;
the JSON gives the median repeat in full and every repeat's ratios (`speedup_default_runs`,
`speedup_default_spread`), since one run on a shared machine settles nothing.

Useful tokens are the response tokens of samples that enter a training batch in a measured
step (tokens generated for carried samples count when the sample trains). Occupancy is busy
row-steps / all row-steps of the engine's decode steps. Discarded tokens are tokens the engine
generated that ended up in no sample (APRIL must report 0).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import shutil
import tempfile
import time

_RUNS = itertools.count()
DEFAULTS = dict(prompts_per_step=8, samples_per_prompt=4, max_rows=64, oversample=2.0)


def longtail_budgets(run, seed: int, cap: int, cap_mass: float = 0.2, sigma: float = 0.6) -> None:
    """Make every group the run draws carry per-sample budgets from the long-tail mix."""
    rng = random.Random(seed)
    draw = run.next_groups

    def next_groups(k, version):
        groups = draw(k, version)
        for g in groups:
            mu = math.log(cap / 5) + 0.5 * rng.gauss(0, 1)
            g.budgets = [
                cap if rng.random() < cap_mass else max(1, min(cap, round(math.exp(mu + sigma * rng.gauss(0, 1)))))
                for _ in range(g.n)
            ]
        return groups

    run.next_groups = next_groups


def bench_config(args, workload: str, april: bool, carry: str = "auto", run_dir: str | None = None):
    """The measured config; `run_dir` unset: a path under the temp dir that nothing creates (the
    collectors run without recording) and `run_mode` deletes if anything did."""
    from rollover.config import load_config

    cap = args.max_new_tokens if workload == "longtail" else args.natural_max_new_tokens
    run_dir = run_dir or os.path.join(tempfile.gettempdir(), f"rollover-bench-{os.getpid()}-{next(_RUNS)}")
    return load_config(None, [], **{
        "model": args.model, "run_dir": run_dir, "resume": "never",
        "seed": args.seed, "data.train": "gen:arithmetic?digits=1&n=4000", "data.eval_size": 0,
        "data.max_prompt_tokens": 64, "rollout.prompts_per_step": args.prompts_per_step,
        "rollout.samples_per_prompt": args.samples_per_prompt, "rollout.max_new_tokens": cap,
        "rollout.max_rows": args.max_rows, "rollout.ignore_eos": workload == "longtail",
        "rollout.engine": args.engine, "partial_rollout.enabled": april, "partial_rollout.carry": carry,
        "partial_rollout.oversample": args.oversample, "partial_rollout.max_carry_steps": 1000,
        "logging.progress": False, "logging.tensorboard": False, "reward.functions": ["numeric"],
    })


def run_mode(args, workload: str, april: bool, carry: str = "resubmit") -> dict:
    from rollover.loops.build import build_run
    from rollover.loops.sync import make_collector

    cap = args.max_new_tokens if workload == "longtail" else args.natural_max_new_tokens
    cfg = bench_config(args, workload, april, carry)
    run = build_run(cfg)
    if workload == "longtail":
        longtail_budgets(run, args.seed, cap)
    collector = make_collector(run)
    totals = dict(useful_tokens=0, samples=0, seconds=0.0, busy=0, slots=0, discarded=0, generated=0,
                  prefill_tokens=0, recomputed_tokens=0, prefill_s=0.0, decode_s=0.0, decode_steps=0, admission_steps=0)
    per_step = []
    try:
        for step in range(args.warmup + args.steps):
            s0 = run.engine.stats()
            t0 = time.perf_counter()
            groups, m = collector.collect(step)
            dt = time.perf_counter() - t0
            s1 = run.engine.stats()
            useful = sum(len(r.response_ids) for g in groups for r in g.rollouts)
            if step >= args.warmup:
                totals["useful_tokens"] += useful
                totals["samples"] += sum(len(g.rollouts) for g in groups)
                totals["seconds"] += dt
                totals["busy"] += s1.busy_row_steps - s0.busy_row_steps
                totals["slots"] += s1.total_row_steps - s0.total_row_steps
                totals["generated"] += s1.generated_tokens - s0.generated_tokens
                totals["discarded"] += m.get("discarded_tokens", 0)
                totals["prefill_tokens"] += s1.prefill_tokens - s0.prefill_tokens
                totals["recomputed_tokens"] += s1.recomputed_tokens - s0.recomputed_tokens
                totals["prefill_s"] += s1.prefill_s - s0.prefill_s
                totals["decode_s"] += s1.decode_s - s0.decode_s
                totals["decode_steps"] += s1.decode_steps - s0.decode_steps
                totals["admission_steps"] += s1.admission_steps - s0.admission_steps
                per_step.append({"seconds": dt, "useful_tokens": useful,
                                 "occupancy": (s1.busy_row_steps - s0.busy_row_steps) / max(1, s1.total_row_steps - s0.total_row_steps),
                                 **({"off_policy_token_ratio": m["off_policy_token_ratio"],
                                     "partial_fraction": m["partial_fraction"]} if april else {})})
            run.engine.update_weights(run.trainer.named_weights(), version=run.engine.version + 1,
                                      inflight=collector.inflight_mode)
    finally:
        run.close()
        shutil.rmtree(cfg.run_dir, ignore_errors=True)
    return {
        "useful_tokens_per_s": totals["useful_tokens"] / totals["seconds"],
        "samples_per_s": totals["samples"] / totals["seconds"],
        "occupancy": totals["busy"] / max(1, totals["slots"]),
        "discarded_tokens": totals["discarded"],
        "generated_tokens": totals["generated"],
        "useful_tokens": totals["useful_tokens"],
        "seconds": totals["seconds"],
        "prefill_tokens": totals["prefill_tokens"],  # prompts + resumed prefixes computed
        "prefill_s": totals["prefill_s"],
        "decode_s": totals["decode_s"],
        "decode_steps": totals["decode_steps"],
        "admission_steps": totals["admission_steps"],  # decode steps that also admitted (eager prefill with graphs)
        "steps": per_step,
    }


def measure(args, w: str) -> dict:
    """One repeat on workload `w`: sync, then APRIL in each carry mode asked for and the default."""
    sync = run_mode(args, w, april=False)
    res = {"sync_useful_tokens_per_s": sync["useful_tokens_per_s"], "sync_samples_per_s": sync["samples_per_s"],
           "sync_occupancy": sync["occupancy"], "sync": sync}
    # what enabling APRIL alone runs (partial_rollout.carry: auto, the loss left unset)
    default, why = bench_config(args, w, april=True).april_carry
    res.update({"default_carry": default, "default_carry_reason": why})
    for carry in dict.fromkeys([*args.carry, default]):
        key = "april" if carry == "resubmit" else f"april_{carry}"
        a = run_mode(args, w, april=True, carry=carry)
        res.update({
            f"{key}_useful_tokens_per_s": a["useful_tokens_per_s"],
            f"{key}_samples_per_s": a["samples_per_s"],
            f"{'speedup' if key == 'april' else 'speedup_' + carry}": a["useful_tokens_per_s"] / sync["useful_tokens_per_s"],
            f"{key}_occupancy": a["occupancy"],
            f"{key}_discarded_tokens": a["discarded_tokens"],
            key: a,
        })
    res["speedup_default"] = res["speedup" if default == "resubmit" else f"speedup_{default}"]
    return res


def main(args) -> dict:
    workloads = ["longtail", "natural"] if args.workload == "both" else [args.workload]
    result = {"model": args.model, "engine": args.engine, "steps": args.steps, "warmup": args.warmup,
              "repeats": args.repeats,
              "settings": {k: getattr(args, k) for k in ("prompts_per_step", "samples_per_prompt", "max_rows",
                                                          "oversample", "max_new_tokens", "natural_max_new_tokens")}}
    for w in workloads:
        reps = [measure(args, w) for _ in range(args.repeats)]  # sync and APRIL alternate, repeat by repeat
        reps_by_default = sorted(reps, key=lambda r: r["speedup_default"])
        res = dict(reps_by_default[len(reps) // 2])  # the median repeat (by speedup_default) in full
        for k in ("speedup", "speedup_keep_kv", "speedup_default", "sync_useful_tokens_per_s"):
            if k in res:
                res[f"{k}_runs"] = [r[k] for r in reps]
        res["speedup_default_spread"] = [reps_by_default[0]["speedup_default"], reps_by_default[-1]["speedup_default"]]
        result[w] = res
        print_table(w, res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def print_table(workload: str, r: dict) -> None:
    print(f"\nrollover bench april — workload {workload}")
    print(f"  {'mode':16s} {'useful tok/s':>13s} {'samples/s':>10s} {'occupancy':>10s} {'discarded':>10s} "
          f"{'generated':>10s} {'prefilled':>10s} {'prefill s':>10s} {'decode s':>10s}")
    for mode in [k for k in ("sync", "april", "april_keep_kv") if k in r]:
        m = r[mode]
        print(f"  {mode:16s} {m['useful_tokens_per_s']:13.1f} {m['samples_per_s']:10.2f} {m['occupancy']:10.2f} "
              f"{m['discarded_tokens']:10d} {m['generated_tokens']:10d} {m['prefill_tokens']:10d} "
              f"{m['prefill_s']:10.1f} {m['decode_s']:10.1f}")
    for k in ("speedup", "speedup_keep_kv"):
        if k in r:
            print(f"  {k} (useful tokens/s vs sync): {r[k]:.2f}x")
    print(f"  speedup_default: {r['speedup_default']:.2f}x (carry: auto -> {r['default_carry']}: "
          f"{r['default_carry_reason']})")
    if len(r["speedup_default_runs"]) > 1:
        print(f"  over {len(r['speedup_default_runs'])} repeats: speedup_default median {r['speedup_default']:.2f}x, "
              f"runs {', '.join(f'{x:.2f}' for x in r['speedup_default_runs'])} (the table is the median repeat)")


def add_arguments(p) -> None:
    from rollover.bench import at_least

    p.add_argument("--model", default="smollm2-135m-instruct", help="model: a local path, hub id or alias (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--engine", choices=["torch", "vllm"], default="torch", help="rollout engine: torch (TorchEngine) or vllm")
    p.add_argument("--workload", choices=["longtail", "natural", "both"], default="both", help="response lengths: longtail (a few very long ones), natural (the model's own), or both")
    p.add_argument("--steps", type=at_least(1), default=10, help="measured steps per mode")
    p.add_argument("--warmup", type=at_least(0), default=2, help="unmeasured steps first")
    p.add_argument("--max-new-tokens", type=at_least(1), default=128, help="longtail cap")
    p.add_argument("--natural-max-new-tokens", type=at_least(1), default=128, help="length budget of the natural workload")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--carry", nargs="+", choices=["resubmit", "keep_kv"], default=["resubmit", "keep_kv"],
                   help="APRIL carry modes to measure (partial_rollout.carry)")
    for k, v in DEFAULTS.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=at_least(1) if isinstance(v, int) else float, default=v,
                       help=f"the run's {k.replace('_', ' ')} (default {v})")
    p.add_argument("--repeats", type=at_least(1), default=1,
                   help="repeat sync and APRIL this many times; the median repeat is reported, with every run's ratio")
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
