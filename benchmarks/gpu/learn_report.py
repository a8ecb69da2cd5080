"""Table and curves of benchmarks/gpu/learn.sh's runs.

    python benchmarks/gpu/learn_report.py RESULTS_DIR [--plot PREFIX] [--json OUT]

RESULTS_DIR holds runs/NAME/{metrics.jsonl,train.log} (learn.sh's tarball, unpacked), NAME being
ARM_sSEED. Per run: held-out accuracy at the first and last evaluation and its best, the mean
rollout-vs-trainer gap (`actor/rollout_kl`, the KL of the engine's sampling distribution from
the trainer's at the sampled tokens) over the steps, the run's wall time and exit code. Per arm:
the mean and spread over seeds. --plot PREFIX writes PREFIX_accuracy.png (held-out accuracy by
step, one line a seed, a colour an arm) and PREFIX_rollout_kl.png.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path


def _rows(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a run cut off mid-write
    return out


def load(results: Path) -> list[dict]:
    runs = []
    for d in sorted((results / "runs").iterdir()):
        m = re.fullmatch(r"(.+)_s(\d+)", d.name)
        if not m or not (d / "metrics.jsonl").exists():
            continue
        rows = _rows(d / "metrics.jsonl")
        evals = [(r["step"], r["eval/accuracy"]) for r in rows if r.get("kind") == "eval" and "eval/accuracy" in r]
        train = [r for r in rows if r.get("kind") == "train"]
        log = (d / "train.log").read_text(errors="replace") if (d / "train.log").exists() else ""
        tail = re.search(r"rc=(-?\d+) wall_ms=(\d+)", log)
        runs.append({
            "arm": m.group(1), "seed": int(m.group(2)), "evals": evals,
            "rollout_kl": [(r["step"], r["actor/rollout_kl"]) for r in train if "actor/rollout_kl" in r],
            "steps": max((r["step"] for r in train), default=-1) + 1,
            "rc": int(tail.group(1)) if tail else None, "wall_s": int(tail.group(2)) / 1000 if tail else None,
        })
    return runs


def _ms(xs: list[float], digits: int = 3) -> str:
    if not xs:
        return "—"
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}"
    return f"{statistics.fmean(xs):.{digits}f} ± {statistics.stdev(xs):.{digits}f}"


def table(runs: list[dict]) -> str:
    lines = ["| run | steps | accuracy first -> last (best) | mean rollout_kl | wall s | rc |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        ev = r["evals"]
        acc = f"{ev[0][1]:.3f} -> {ev[-1][1]:.3f} ({max(a for _, a in ev):.3f})" if ev else "—"
        kl = _ms([k for _, k in r["rollout_kl"]], 5) if r["rollout_kl"] else "—"
        lines.append(f"| {r['arm']} seed {r['seed']} | {r['steps']} | {acc} | {kl} | {r['wall_s']} | {r['rc']} |")
    lines += ["", "| arm | seeds | first accuracy | last accuracy | best | mean rollout_kl |", "| --- | --- | --- | --- | --- | --- |"]
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm and r["evals"]]
        lines.append(f"| {arm} | {len(mine)} | {_ms([r['evals'][0][1] for r in mine])} | "
                     f"{_ms([r['evals'][-1][1] for r in mine])} | {_ms([max(a for _, a in r['evals']) for r in mine])} | "
                     f"{_ms([statistics.fmean(k for _, k in r['rollout_kl']) for r in mine if r['rollout_kl']], 5)} |")
    return "\n".join(lines)


def plot(runs: list[dict], prefix: str, title: str) -> list[str]:
    from matplotlib.figure import Figure

    arms = list(dict.fromkeys(r["arm"] for r in runs))
    colours = {a: f"C{i}" for i, a in enumerate(arms)}
    written = []
    for key, ylabel, name in (("evals", "held-out accuracy", "accuracy"), ("rollout_kl", "rollout-vs-trainer KL (actor/rollout_kl)", "rollout_kl")):
        fig = Figure(figsize=(7.5, 4.2), layout="constrained")
        ax = fig.subplots()
        seen = set()
        for r in runs:
            if not r[key]:
                continue
            xs, ys = zip(*r[key])
            ax.plot(xs, ys, color=colours[r["arm"]], marker="o" if key == "evals" else None, ms=3, lw=1.2,
                    label=r["arm"] if r["arm"] not in seen else None)
            seen.add(r["arm"])
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        if key == "rollout_kl":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        out = f"{prefix}_{name}.png"
        fig.savefig(out, dpi=100)
        written.append(out)
    return written


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="learn.sh's results folder (runs/NAME/...)")
    p.add_argument("--arms", nargs="*", help="only these arms (default: all)")
    p.add_argument("--plot", help="PNG prefix for the curves")
    p.add_argument("--title", default="SmolLM2-135M-Instruct on one GPU", help="the plots' title")
    p.add_argument("--json", help="write the per-run figures here")
    args = p.parse_args(argv)
    runs = load(args.results)
    if args.arms:
        runs = [r for r in runs if r["arm"] in args.arms]
    print(table(runs))
    if args.plot:
        print("\n".join(plot(runs, args.plot, args.title)))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
