"""Comparison figures of the demo in sync, APRIL and async mode (for docs/).

    python -m rollover.bench.curves RUNS_DIR OUT_DIR

RUNS_DIR holds runs named arith, arith_april, arith_async (see benchmarks/run_all.sh).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def main(runs: str, out: str) -> list[Path]:
    from rollover.metrics import plot_compare, plot_run

    runs_p, out_p = Path(runs), Path(out)
    out_p.mkdir(parents=True, exist_ok=True)
    modes = {"sync": runs_p / "arith", "APRIL": runs_p / "arith_april", "async (eta=1)": runs_p / "arith_async"}
    modes = {k: v for k, v in modes.items() if (v / "metrics.jsonl").exists()}
    if not modes:
        raise SystemExit(f"no demo runs (arith, arith_april, arith_async) under {runs_p}")
    made = [
        plot_compare(modes, "reward/mean", x="samples_consumed_total", out=out_p / "modes_reward_per_sample.png",
                     smooth=3),
        plot_compare(modes, "eval/accuracy", x="step", out=out_p / "modes_eval_accuracy.png", kind="eval"),
    ]
    if "sync" in modes:
        for png in plot_run(modes["sync"]):
            if png.name == "reward.png":
                made.append(Path(shutil.copy(png, out_p / "demo_reward.png")))
    return made


if __name__ == "__main__":
    for p in main(*sys.argv[1:3]):
        print(p)
