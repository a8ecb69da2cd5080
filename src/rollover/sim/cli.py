"""`rollover simulate` and its subcommands: calibrate, validate, plan (docs/simulator.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rollover.commands import _guarded, _load_config, _split_config


def _calibrate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="rollover simulate calibrate",
        description="Fit a simulator profile (decode, prefill, training-step and weight-update costs) from runs of "
                    "the real engine and trainer on this machine; writes it as JSON for simulate.profile.")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name or directory")
    p.add_argument("--out", required=True, help="profile JSON to write (with --refit it may be PROFILE itself)")
    p.add_argument("--name", default=None, help="the profile's name (default: model@host)")
    p.add_argument("--skip-train", action="store_true", help="do not measure training steps (keep the defaults)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (a GPU measures a larger grid: up to 256 rows)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the engine's dtype (default: float32 on the CPU, bfloat16 on a GPU)")
    p.add_argument("--refit", default=None, metavar="PROFILE",
                   help="measure nothing: fit PROFILE's stored measurements again (after a change of the fit)")
    p.add_argument("--debug", action="store_true", help="on an error, print the traceback")
    args = p.parse_args(argv)

    def body() -> int:
        from rollover.sim.calibrate import calibrate, refit
        from rollover.sim.costs import Profile

        command = "rollover simulate calibrate " + " ".join(argv)
        if args.refit:
            prof = refit(Profile.load(args.refit))
        else:
            prof = calibrate(args.model, name=args.name, train=not args.skip_train, command=command,
                             device=args.device, dtype=args.dtype)
        Path(args.out).write_text(prof.to_json())
        d = prof.decode
        print(f"decode step = {d.step_s * 1e3:.2f} ms + {d.per_row_s * 1e3:.3f} ms/row + "
              f"{d.per_context_token_s * 1e6:.3f} us/context token (rel. RMS error {prof.fit['decode_rel_rms']:.1%}); "
              f"prefill = {d.prefill_s * 1e3:.1f} ms + {d.prefill_per_token_s * 1e3:.3f} ms/token "
              f"({prof.fit['prefill_rel_rms']:.1%})")
        if "train_rel_rms" in prof.fit:
            print(f"train step = {prof.train.step_s:.2f} s + {prof.train.per_token_s * 1e3:.3f} ms/token "
                  f"({prof.fit['train_rel_rms']:.1%})")
        print(f"weight update = {prof.sync.latency_s:.3f} s")
        if "contention_points" in prof.fit:
            print(f"sharing the machine: decode steps {prof.contention.decode:.2f}x slower, training "
                  f"{prof.contention.train:.2f}x slower")
        print(f"profile: {args.out}")
        return 0

    return _guarded("rollover simulate calibrate", args.debug, body)


def _validate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="rollover simulate validate",
        description="Rerun the simulator's validation: each row simulates a published (or measured) setting and "
                    "compares the simulated figure with the reference (docs/simulator.md).")
    p.add_argument("--rows", default=None, help="a YAML of rows (default: the built-in rollover/sim/validation.yaml)")
    p.add_argument("--root", default=".", help="directory the rows' relative paths are taken from (default: .)")
    p.add_argument("--only", default=None, help="run only rows whose name contains this text")
    p.add_argument("--json", default=None, help="write {rows: [...]} with source, published, simulated, relative_error")
    p.add_argument("--debug", action="store_true", help="on an error, print the traceback")
    args = p.parse_args(argv)

    def body() -> int:
        from rollover.sim import validate

        rows = validate.validate(args.rows or validate.ROWS, root=args.root, only=args.only)
        print(validate.text(rows))
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))
            print(f"rows: {args.json}")
        return 0

    return _guarded("rollover simulate validate", args.debug, body)


def _config(p: argparse.ArgumentParser, args):
    """The config from the positional YAML and overrides (None after a one-line error)."""
    from rollover.sim.config import SimRunConfig

    if args.config is None and not args.overrides:
        p.print_usage(sys.stderr)
        print(f"{p.prog}: give a YAML config and/or key.path=value overrides", file=sys.stderr)
        return None
    cfg = _load_config(p.prog, *_split_config(args.config, args.overrides), schema=SimRunConfig)
    if cfg is not None and cfg.epochs is not None:
        print(f"{p.prog}: config error: epochs={cfg.epochs:g} counts passes over training data, which a simulation "
              "has none of: give steps", file=sys.stderr)
        return None
    return cfg


def _plan(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="rollover simulate plan",
        description="Recommend rollout workers per trainer and the staleness bound eta for a target trainer "
                    "utilization: a closed-form capacity model, checked (and corrected) by simulating the async "
                    "loop at each point of a grid of cluster sizes (docs/simulator.md).",
        epilog="The config's simulate section gives the rollout worker (the one pool's max_rows and decode cost; "
               "its workers count is what the plan decides), the trainer (train cost, trainer_gpus) and the "
               "workload. Example: rollover simulate plan examples/sim_plan.yaml --target 0.8")
    p.add_argument("config", nargs="?", help="YAML config (optional when overrides are given)")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides")
    p.add_argument("--target", type=float, default=0.8, help="trainer utilization to reach (default 0.8)")
    p.add_argument("--max-gpus", type=int, default=1024, help="largest cluster of the grid (default 1024)")
    p.add_argument("--closed-form", action="store_true", help="no simulation: the closed form's answer only")
    p.add_argument("--rounds", type=int, default=6, help="corrections at most per point when the simulation "
                                                          "falls short of the target (default 6)")
    p.add_argument("--json", default=None, help="write the points (closed form, simulated, corrected) here")
    p.add_argument("--debug", action="store_true", help="on an error, print the traceback")
    args = p.parse_args(argv)
    cfg = _config(p, args)
    if cfg is None:
        return 2

    def body() -> int:
        from rollover.sim.plan import plan, text

        def show(point: dict) -> None:
            if cfg.logging.progress:
                print(f"  {point['gpus']} GPUs simulated", file=sys.stderr, flush=True)

        result = plan(cfg, args.target, max_gpus=args.max_gpus, simulate_points=not args.closed_form,
                      rounds=args.rounds, progress=show)
        print(text(result))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
            print(f"plan: {args.json}")
        return 0

    return _guarded("rollover simulate plan", args.debug, body)


def main(argv: list[str]) -> int:
    subs = {"calibrate": _calibrate, "validate": _validate, "plan": _plan}
    if argv and argv[0] in subs:
        return subs[argv[0]](argv[1:])
    p = argparse.ArgumentParser(
        prog="rollover simulate",
        description="Simulate a training run on a cluster: rollover's own schedulers (sync, APRIL, async) drive "
                    "simulated rollout workers and a simulated trainer on a virtual clock (docs/simulator.md). "
                    "Subcommands: `rollover simulate calibrate|validate|plan --help`.",
        epilog="The config is a training config plus a `simulate` section that describes the cluster (pools of "
               "rollout workers, a cost profile, response lengths; docs/simulator_config.md). Example: rollover "
               "simulate examples/sim_cluster.yaml mode=async async.max_staleness=2 --gantt gantt.png. Add "
               "simulate.fast=true for the vectorised fast path (sync and async; thousands of workers and steps in "
               "seconds).")
    p.add_argument("config", nargs="?", help="YAML config (optional when overrides are given)")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. simulate.pools=[{workers: 8}]")
    p.add_argument("--help-config", action="store_true",
                   help="list every config key (the training keys, then the simulate section's) with its default "
                        "and meaning")
    p.add_argument("--json", default=None, help="write the report (throughput, utilization, staleness, steps) here")
    p.add_argument("--timeline", action="store_true", help="include every worker's timeline in the JSON")
    p.add_argument("--gantt", default=None, help="write a Gantt chart PNG of the trainer and workers over time")
    p.add_argument("--debug", action="store_true", help="on an error, print the traceback")
    args = p.parse_args(argv)
    if args.help_config:
        from rollover.config import describe
        from rollover.sim.config import SimRunConfig

        print(describe(SimRunConfig))
        return 0
    cfg = _config(p, args)
    if cfg is None:
        return 2

    def body() -> int:
        from rollover.metrics import Progress
        from rollover.sim import report
        from rollover.sim.run import simulate

        bar = Progress(cfg.steps, desc="simulate") if cfg.logging.progress else None
        try:
            r = simulate(cfg, progress=(lambda row: bar.update(row["step"], simulated_s=f"{row['t_end']:.1f}"))
                         if bar else None)
        finally:
            if bar:
                bar.close()
        print(report.text(r))
        if args.json:
            report.write_json(r, args.json, timeline=args.timeline)
            print(f"report: {args.json}")
        if args.gantt:
            print(f"gantt: {report.gantt(r, args.gantt)}")
        return 0

    return _guarded("rollover simulate", args.debug, body)
