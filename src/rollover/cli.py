"""The `rollover` command: train, eval, plot, bench."""

from __future__ import annotations

import argparse
import sys


def _bench(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollover bench", description="benchmarks (see docs/benchmarks.md)")
    sub = p.add_subparsers(dest="which", required=True)
    from rollover.bench import april as bench_april
    from rollover.bench import async_ as bench_async
    from rollover.bench import engine as bench_engine
    from rollover.bench import train as bench_train

    benches = {"engine": bench_engine, "april": bench_april, "train": bench_train, "async": bench_async}
    bench_engine.add_arguments(sub.add_parser("engine", help="TorchEngine vs HF generate vs FLOP limit"))
    bench_april.add_arguments(sub.add_parser("april", help="synchronous rollouts vs APRIL (longtail, natural)"))
    bench_train.add_arguments(sub.add_parser("train", help="seconds per synchronous training step, by phase"))
    bench_async.add_arguments(sub.add_parser("async", help="samples trained/s: sync vs APRIL vs async (eta 1, 2, 4)"))
    args = p.parse_args(argv)
    benches[args.which].main(args)
    return 0


def _train(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollover train", description="RL-train a model from a YAML config")
    p.add_argument("config", nargs="?", help="YAML config (optional: defaults + overrides work too)")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. rollout.temperature=0.7")
    p.add_argument("--help-config", action="store_true", help="list every config key with its default and meaning")
    args = p.parse_args(argv)
    from rollover.config import ConfigError, describe, load_config

    if args.help_config:
        print(describe())
        return 0
    path, overrides = args.config, list(args.overrides)
    if path is not None and "=" in path and not path.endswith((".yaml", ".yml")):
        path, overrides = None, [path, *overrides]
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        print(f"rollover train: config error: {e}", file=sys.stderr)
        return 2
    _setup_logging()
    if cfg.mode == "async":
        from rollover.loops.async_ import train_async

        result = train_async(cfg)
    else:
        from rollover.loops.sync import train_sync

        result = train_sync(cfg)
    from rollover.metrics import plot_run

    plots = plot_run(cfg.run_dir)
    print(f"done: step {result['step']}" + (f", held-out accuracy {result['eval/accuracy']:.3f}" if "eval/accuracy" in result else ""))
    print(f"metrics: {cfg.run_dir}/metrics.jsonl; plots: {', '.join(str(x) for x in plots)}")
    return 0


def _eval(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollover eval", description="held-out reward and accuracy of a model or checkpoint")
    p.add_argument("config", nargs="?")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--checkpoint", default=None, help="a checkpoint directory (default: the config's model)")
    args = p.parse_args(argv)
    from rollover.config import ConfigError, load_config
    from rollover.loops.common import build_run

    path, overrides = args.config, list(args.overrides)
    if path is not None and "=" in path and not path.endswith((".yaml", ".yml")):
        path, overrides = None, [path, *overrides]
    try:
        cfg = load_config(path, [*overrides, f"resume={args.checkpoint or 'never'}",
                                 f"run_dir={_eval_dir(path, args.checkpoint)}"])
    except ConfigError as e:
        print(f"rollover eval: config error: {e}", file=sys.stderr)
        return 2
    _setup_logging()
    run = build_run(cfg)
    try:
        metrics = run.evaluate(run.start_step)
    finally:
        run.close()
    for k, v in metrics.items():
        print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    return 0


def _eval_dir(config: str | None, ckpt: str | None) -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="rollover-eval-")


def _plot(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollover plot", description="PNG curves from a run's metrics.jsonl")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from rollover.metrics import plot_run

    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


def _setup_logging() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


COMMANDS = {"train": _train, "eval": _eval, "plot": _plot, "bench": _bench}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: rollover {" + ",".join(COMMANDS) + "} ...", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
