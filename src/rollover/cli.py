"""The `rollover` command: train, eval, plot, bench."""

from __future__ import annotations

import argparse
import sys


def _bench(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollover bench", description="benchmarks (see docs/benchmarks.md)")
    sub = p.add_subparsers(dest="which", required=True)
    from rollover.bench import engine as bench_engine

    bench_engine.add_arguments(sub.add_parser("engine", help="TorchEngine vs HF generate vs FLOP limit"))
    args = p.parse_args(argv)
    if args.which == "engine":
        bench_engine.main(args)
    return 0


COMMANDS = {"bench": _bench}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: rollover {" + ",".join(COMMANDS) + "} ...", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
