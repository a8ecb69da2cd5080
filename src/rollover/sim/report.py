"""A simulation's report as text, JSON and a Gantt chart of workers over time."""

from __future__ import annotations

import json
from pathlib import Path

COLORS = {"generate": "#4c9a2a", "sync": "#e08a1e", "train": "#2a62b8"}


def text(r: dict) -> str:
    lines = [f"{r['mode']}: {r['steps']} steps on {r['workers']} rollout workers + 1 trainer "
             f"(profile {r['profile']}) in {r['simulated_s']:.1f} simulated s",
             f"  samples trained/s  {r['samples_per_s']:.3f}",
             f"  tokens generated/s {r['generated_tokens_per_s']:.1f}   row occupancy {r['row_occupancy']:.2f}"]
    for name, p in r["rollout"].items():
        lines.append(f"  rollout pool {name} ({p['workers']} workers): generating {p['utilization']:.0%}, "
                     f"loading weights {p['stalled_fraction']:.0%}, idle {p['idle_fraction']:.0%}")
    t = r["trainer"]
    total = r["simulated_s"] or 1.0
    lines.append(f"  trainer: training {t['utilization']:.0%}, sending weights {t['sync_s'] / total:.0%}, "
                 f"waiting for data {t['wait_s'] / total:.0%}")
    if "reward" in r:
        lines.append(f"  reward workers ({r['reward']['workers']}): scoring {r['reward']['utilization']:.0%}")
    if "env" in r:
        e = r["env"]
        lines.append(f"  environments ({e['slots']} slots): working {e['utilization']:.0%}, {e['calls']} calls, "
                     f"waiting {e['mean_wait_s']:.2f} s for a slot on average, {e['timed_out']} timed out")
    if "preempted" in r:
        lines.append(f"  sequences preempted for K/V capacity (recomputed when readmitted): {r['preempted']}")
    if r.get("loss_token_share") is not None and r["loss_token_share"] < 1:
        lines.append(f"  the loss used {r['loss_token_share']:.0%} of the sampled tokens trained "
                     "(the rest older than partial_rollout.max_carry_steps, masked)")
    ages = ", ".join(f"{k}: {v}" for k, v in r["staleness"].items())
    lines.append(f"  samples by age (versions behind the trained policy at their oldest token): {ages}")
    return "\n".join(lines)


def write_json(r: dict, path: str | Path, timeline: bool = False) -> None:
    """The report as JSON; the per-worker timeline only when asked (it can be large)."""
    out = {k: v for k, v in r.items() if timeline or k != "timeline"}
    Path(path).write_text(json.dumps(out, indent=1))


def gantt(r: dict, path: str | Path, max_workers: int = 32) -> Path:
    """Trainer and rollout workers over simulated time: generating, loading weights, training
    (blank: idle). With more workers than `max_workers`, evenly spaced ones are drawn."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    tl = r["timeline"]
    workers = tl["workers"]
    shown = list(range(len(workers)))
    if len(shown) > max_workers:
        step = len(shown) / max_workers
        shown = sorted({int(i * step) for i in range(max_workers)})
    rows = [("trainer", tl["trainer"])] + [(f"{tl['pools'][i]} {i}", workers[i]) for i in shown]
    fig = Figure(figsize=(11, 1.2 + 0.28 * len(rows)))
    ax = fig.add_subplot()
    for y, (label, spans) in enumerate(reversed(rows)):
        for kind in COLORS:
            bars = [(s, e - s) for s, e, k in spans if k == kind]
            if bars:
                ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=COLORS[kind], linewidth=0)
    ax.set_yticks(range(len(rows)), [label for label, _ in reversed(rows)], fontsize=7)
    ax.set_xlabel("simulated seconds")
    ax.set_xlim(0, r["simulated_s"] or 1)
    ax.set_title(f"{r['mode']}: {r['samples_per_s']:.3g} samples trained/s", fontsize=10)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="upper right", fontsize=7,
              ncol=3, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)
