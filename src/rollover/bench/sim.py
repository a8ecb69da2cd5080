"""`rollover bench sim`: the simulator's own speed and the fast path's agreement with the
schedulers' path, on 1,024 simulated workers (examples/sim_1024.yaml).

- speed: `rollover simulate CONFIG steps=N simulate.fast=true` in a fresh process, wall time
  from start to exit (imports included), in sync, async (eta = 2) and APRIL mode (both carry
  modes), once per `--routers` entry (`simulate.router`: the compiled or the plain router);
- agreement: the same cluster for a few steps on both paths, the fast path with the
  schedulers' own per-sample draws (the schedule must be the same: samples/s, simulated time,
  trainer utilization side by side) and with its vectorised draws (the same distribution, other
  samples), and the schedulers' path's wall time per step.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

MODES = {"sync": [], "async": ["mode=async", "async.max_staleness=2"],
         "april": ["partial_rollout.enabled=true", "partial_rollout.carry=resubmit"],
         "april_keep_kv": ["partial_rollout.enabled=true", "partial_rollout.carry=keep_kv"]}


def _speed(config: str, steps: int, mode: str, router: str) -> dict:
    cmd = [sys.executable, "-m", "rollover.cli", "simulate", config, f"steps={steps}", "simulate.fast=true",
           f"simulate.router={router}", "logging.progress=false", *MODES[mode]]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr[-2000:]}")
    ran = re.search(r"\[fast path, (\w+) router\]", out.stdout)  # the report's mode names the router that ran
    return {"command": "rollover simulate " + " ".join(cmd[4:]), "wall_s": wall, "steps": steps,
            "router": ran.group(1) if ran else router}


def _agreement(config: str, steps: int, mode: str) -> dict:
    from rollover.commands import _load_config
    from rollover.sim.config import SimRunConfig
    from rollover.sim.fast import simulate_fast
    from rollover.sim.run import _with_rows, profile_of, simulate

    cfg = _load_config("rollover bench sim", config, [f"steps={steps}", "logging.progress=false", *MODES[mode]],
                       schema=SimRunConfig)

    def figures(r: dict, wall: float) -> dict:
        return {"samples_per_s": r["samples_per_s"], "simulated_s": r["simulated_s"],
                "trainer_utilization": r["trainer"]["utilization"], "generated_tokens": r["generated_tokens"],
                "wall_s": wall}

    out = {"mode": mode, "steps": steps}
    for name, run in (("schedulers", lambda: simulate(cfg)),
                      ("fast_exact_draws", lambda: simulate_fast(_with_rows(cfg), profile_of(cfg), draws="exact")),
                      ("fast", lambda: simulate_fast(_with_rows(cfg), profile_of(cfg)))):
        t0 = time.perf_counter()
        r = run()
        out[name] = figures(r, time.perf_counter() - t0)
    ref = out["schedulers"]["samples_per_s"]
    out["fast_exact_draws_error"] = out["fast_exact_draws"]["samples_per_s"] / ref - 1
    out["fast_error"] = out["fast"]["samples_per_s"] / ref - 1
    return out


def main(args) -> dict:
    result: dict = {"config": args.config, "speed": [], "agreement": []}
    for mode in args.modes:
        for router in args.routers:  # side by side, mode by mode
            result["speed"].append({"mode": mode, **_speed(args.config, args.steps, mode, router)})
    if args.agreement_steps:
        for mode in MODES:
            result["agreement"].append(_agreement(args.config, args.agreement_steps, mode))
    print(f"\nrollover bench sim — {args.config}")
    for s in result["speed"]:
        print(f"  fast path, {s['mode']}, {s['router']} router: {s['steps']} steps in {s['wall_s']:.1f} s wall "
              f"({s['command']})")
    for a in result["agreement"]:
        sch, fe, f = a["schedulers"], a["fast_exact_draws"], a["fast"]
        print(f"  {a['mode']}, {a['steps']} steps: samples/s schedulers {sch['samples_per_s']:.3f} "
              f"({sch['wall_s']:.1f} s wall), fast with their draws {fe['samples_per_s']:.3f} "
              f"({a['fast_exact_draws_error']:+.2%}, {fe['wall_s']:.1f} s), fast {f['samples_per_s']:.3f} "
              f"({a['fast_error']:+.2%}, {f['wall_s']:.1f} s)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return result


def add_arguments(p) -> None:
    from rollover.bench import at_least

    p.add_argument("--config", default="examples/sim_1024.yaml", help="the simulated cluster")
    p.add_argument("--steps", type=at_least(1), default=1000, help="steps of the timed fast-path runs")
    p.add_argument("--agreement-steps", type=at_least(0), default=12,
                   help="steps simulated on both paths for the agreement check (0: skip it)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), help="the timed runs' modes")
    p.add_argument("--routers", nargs="+", choices=["auto", "numba", "python"], default=["auto"],
                   help="simulate.router for the timed runs (several: each mode once per router, side by side)")
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
