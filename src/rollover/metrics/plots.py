"""PNG curves from a run's metrics.jsonl.

`plot_run` writes one PNG per panel below into `RUN_DIR/plots/<panel>.png`, for the panels that
have at least one matching column; the rest are skipped. A column belongs to a panel when its
name matches one of the panel's regular expressions, so both rollover's names and the verl /
TRL names users bring from other libraries land in the right place:

    reward           train: reward/mean (± its standard error), reward, critic/score/mean,
                     rewards/<fn>/mean, accuracy;
                     eval rows: *acc*, *reward, *reward/mean, *reward_mean, *pass@*
    response_length  response_length/{mean,max}, completions/{mean,max}_length;
                     eval rows: *response_length, *response_length/mean
    truncation       the share of responses cut off at the token budget and ending in a loop:
                     response_length/clip_ratio, rollout/repetition_frac (TRL's clipped_ratio,
                     slime's truncated_ratio)
    entropy          anything containing "entropy"
    kl               names with "kl" as a word: kl, approx_kl, actor/ppo_kl, kl_loss (not distill/*)
    distill          on-policy distillation's distance to the teacher: distill/reverse_kl,
                     distill/divergence
    clip_fraction    *clip_frac*, *clipfrac*, clip_ratio/*
    grad_norm        *grad_norm*
    timing           timing_s/* stacked; timing_s/step drawn as a line on top (it is the total)
    throughput       *throughput*, *per_s — one subplot each, as their scales differ
    staleness        *stale*

Non-finite values (NaN, inf) leave a gap in their line and a red cross on the bottom edge.

A series equal at every step to one already in its panel is not drawn again; the first one's
legend entry names it (`reward/mean (= rewards/math/mean = accuracy)`; past two it counts the
rest). With a single 0/1 reward function those three are one series, and three lines on top of
each other would show one colour and a legend promising three. A legend of more than 8 entries
goes below the plot.

The band around reward/mean is ± its standard error, `reward/std / sqrt(samples)`: how far the
step's mean could move by chance, the thing to judge a rising curve by. It never leaves the
step's [min, max] (with the population std, `std <= sqrt(n) * (mean - min)`). A ± std band is
the spread of single samples: for a 0/1 reward at mean 0.1 it reads 0.1 ± 0.3, below 0 and
above anything the run reached. Samples of one prompt are correlated, so across prompts the
mean is less certain than the band says.

Figures are drawn with `matplotlib.figure.Figure` directly, never through pyplot, so plotting
changes no global backend state and needs no display.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollover.metrics.logger import read_metrics

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class _Panel:
    name: str  # file stem
    title: str
    ylabel: str
    train: tuple[str, ...]  # regexes searched in train column names
    eval: tuple[str, ...] = ()  # regexes searched in eval column names
    stacked: bool = False  # draw as a stacked area (timing)
    separate: bool = False  # one subplot per series


_PANELS = (
    _Panel(
        "reward",
        "Reward",
        "reward",
        train=(r"^reward/mean$", r"^reward$", r"^critic/score/mean$", r"^rewards/[^/]+/mean$", r"(^|/)accuracy$"),
        eval=(r"(^|/)acc[^/]*$", r"reward([/_]mean)?$", r"pass@", r"(^|/)(pass|maj)_at_k$"),  # (not eval/rewards/<fn>/errors)
    ),
    _Panel(
        "response_length",
        "Response length",
        "tokens",
        train=(r"^response_length/(mean|max)$", r"^completions/(mean|max)_length$"),
        eval=(r"response_length(/mean)?$",),
    ),
    _Panel("truncation", "Responses cut off or looping", "fraction of responses",
           train=(r"^response_length/clip_ratio$", r"clipped_ratio$", r"truncated_ratio$", r"repetition_frac$")),
    _Panel("entropy", "Entropy", "nats / token", train=(r"entropy",)),
    _Panel("kl", "KL", "KL", train=(r"^(?!distill/).*(^|[/_])kl($|[/_])",)),
    _Panel("distill", "Distance to the teacher", "nats / token", train=(r"^distill/",)),
    _Panel("clip_fraction", "Clip fractions", "fraction of tokens", train=(r"clip_?frac", r"^clip_ratio/")),
    _Panel("grad_norm", "Gradient norm", "norm", train=(r"grad_norm",)),
    # (weight_transfer is timed within weight_sync: a layer of its own would count it twice)
    _Panel("timing", "Time per step by phase", "seconds", train=(r"^timing_s/(?!weight_transfer$)",), stacked=True),
    _Panel("throughput", "Throughput", "per second", train=(r"throughput", r"per_s$"), separate=True),
    _Panel("staleness", "Staleness", "staleness", train=(r"stale(?!ness/hist/)",)),  # (hist/<lag>: group counts)
)
_STEP_TOTALS = ("timing_s/step", "timing_s/total")  # whole-step time: a line, not a stack layer


def plot_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[Path]:
    """Write the PNGs for one run (`run_dir`: its directory or its metrics.jsonl; default output
    `RUN_DIR/plots`); returns their paths."""
    rows = read_metrics(run_dir)
    where = Path(run_dir).parent if Path(run_dir).is_file() else Path(run_dir)
    out = Path(out_dir) if out_dir is not None else where / "plots"
    out.mkdir(parents=True, exist_ok=True)
    train = [row for row in rows if row["kind"] == "train"]
    evals = [row for row in rows if row["kind"] == "eval"]
    paths = []
    for panel in _PANELS:
        train_cols = _matching(train, panel.train)
        eval_cols = _matching(evals, panel.eval)
        if not train_cols and not eval_cols:
            continue
        fig = _draw(panel, train, train_cols, evals, eval_cols)
        path = out / f"{panel.name}.png"
        fig.savefig(path, dpi=100)
        paths.append(path)
    return paths


def plot_compare(
    run_dirs: Mapping[str, str | os.PathLike],
    metric: str,
    x: str = "step",
    *,
    out: str | os.PathLike,
    kind: str = "train",
    smooth: int = 1,
) -> Path:
    """Draw `metric` against column `x` for several runs (label -> run dir) on one axes.

    `smooth > 1` adds a trailing mean over that many points and draws the raw curve faintly.
    Every run must have logged `metric` and `x`: a silently missing curve would mislead."""
    from matplotlib.figure import Figure  # imported when drawn: the package imports this module

    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.add_subplot()
    for label, run_dir in run_dirs.items():
        xs, ys = _series(read_metrics(run_dir, kind=kind), metric, x=x)
        if not xs:
            raise ValueError(f"run {label!r} ({run_dir}) has no {kind} rows with both {x!r} and {metric!r}")
        if smooth > 1:
            (line,) = ax.plot(xs, ys, alpha=0.25)
            ax.plot(xs, _trailing_mean(ys, smooth), color=line.get_color(), label=label)
        else:
            ax.plot(xs, ys, label=label)
    ax.set(xlabel=x, ylabel=metric, title=metric if smooth <= 1 else f"{metric} (mean of last {smooth})")
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def _matching(rows: list[dict[str, Any]], patterns: tuple[str, ...]) -> list[str]:
    """Column names matching any pattern, in first-seen order, that hold at least one number."""
    columns = dict.fromkeys(key for row in rows for key in row if key not in ("step", "kind", "time"))
    return [
        name
        for name in columns
        if any(re.search(p, name) for p in patterns) and any(_finite(row.get(name)) for row in rows)
    ]


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _series(rows: list[dict[str, Any]], column: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(x, y) points of the rows holding both columns, sorted by x; non-finite y as gaps."""
    points = sorted((row[x], row[column]) for row in rows if row.get(column) is not None and row.get(x) is not None)
    return [p[0] for p in points], [p[1] if math.isfinite(p[1]) else math.nan for p in points]


def _trailing_mean(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        tail = [v for v in values[max(0, i + 1 - window) : i + 1] if not math.isnan(v)]
        out.append(sum(tail) / len(tail) if tail else math.nan)
    return out


def _draw(panel: _Panel, train: list[dict], train_cols: list[str], evals: list[dict], eval_cols: list[str]) -> Figure:
    if panel.separate:
        return _draw_separate(panel, train, train_cols)
    from matplotlib.figure import Figure  # imported when drawn: the package imports this module

    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.add_subplot()
    if panel.stacked:
        _draw_stacked(ax, train, train_cols)
    else:
        for col, same in _distinct(train, train_cols):
            xs, ys = _series(train, col)
            (line,) = ax.plot(xs, ys, label=_label(col, same), marker="." if len(xs) < 30 else None)
            _mark_nonfinite(ax, xs, ys, col)
            if panel.name == "reward" and col == "reward/mean":
                _sem_band(ax, train, line.get_color())
    for col, same in _distinct(evals, eval_cols):
        xs, ys = _series(evals, col)
        ax.plot(xs, ys, label="eval: " + _label(col, same), marker="o", linestyle="--")
    ax.set(xlabel="step", ylabel=panel.ylabel, title=panel.title)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if panel.stacked:  # list the layers top to bottom, as they are drawn
        handles, labels = handles[::-1], labels[::-1]
    _legend(ax, handles, labels)
    return fig


def _legend(ax, handles: list, labels: list[str]) -> None:
    """A legend inside the plot, or, past 8 entries, below it (over the lines it would hide
    them), in as many columns as the figure's width holds (about 110 characters at x-small)."""
    if len(labels) <= 8:
        ax.legend(handles, labels, fontsize="small")
    else:
        columns = max(1, min(3, 110 // (max(map(len, labels)) + 6)))
        fig = ax.get_figure()
        fig.set_size_inches(8, 5 + 0.15 * -(-len(labels) // columns))  # the plot keeps its height
        fig.legend(handles, labels, fontsize="x-small", loc="outside lower center", ncols=columns)


def _mark_nonfinite(ax, xs: list[float], ys: list[float], col: str) -> bool:
    """Red crosses along the bottom edge at the steps where `col` was NaN or inf: a gap in a
    line is too easy to miss when it is a diverging loss or grad norm."""
    bad = [x for x, y in zip(xs, ys) if math.isnan(y)]
    if bad:
        ax.plot(bad, [0.0] * len(bad), "rx", transform=ax.get_xaxis_transform(), clip_on=False, label=f"{col}: NaN/inf")
    return bool(bad)


def _distinct(rows: list[dict], cols: list[str]) -> list[tuple[str, list[str]]]:
    """(column, later columns with the same series) for each distinct series, in order."""
    kept: list[tuple[str, list[str], tuple[list[float], list[float]]]] = []
    for col in cols:
        series = _series(rows, col)
        for _, same, first in kept:
            if _same_series(first, series):
                same.append(col)
                break
        else:
            kept.append((col, [], series))
    return [(col, same) for col, same, _ in kept]


def _same_series(a: tuple[list[float], list[float]], b: tuple[list[float], list[float]]) -> bool:
    """Same steps and, at each, values equal to float32 rounding (one series may be a float32
    mean, the other a Python fraction of the same samples), or both NaN."""
    (xa, ya), (xb, yb) = a, b
    return xa == xb and all(
        (math.isnan(u) and math.isnan(v)) or math.isclose(u, v, rel_tol=1e-6, abs_tol=1e-9) for u, v in zip(ya, yb)
    )


LABEL_SAME = 2  # equal series named in a legend entry; more are counted (a legend wider than its plot hides it)


def _label(col: str, same: list[str]) -> str:
    if not same:
        return col
    named = " = ".join(same[:LABEL_SAME])
    more = len(same) - LABEL_SAME
    return f"{col} (= {named}{f' and {more} more' if more > 0 else ''})"


def _sem_band(ax, rows: list[dict], color: str) -> None:
    """Shade reward/mean ± reward/std / sqrt(samples) over the rows that logged all three (see
    the module docstring for why not ± std)."""
    def scored(row):  # the samples the reward's statistics cover (D3S down-sampling trains fewer)
        return row.get("downsample/samples_generated", row.get("samples"))

    points = sorted(
        (row["step"], row["reward/mean"], row["reward/std"] / math.sqrt(scored(row)))
        for row in rows
        if _finite(row.get("reward/mean")) and _finite(row.get("reward/std")) and _finite(scored(row))
        and scored(row) > 0
    )
    if points:
        xs = [p[0] for p in points]
        lo = [p[1] - p[2] for p in points]
        hi = [p[1] + p[2] for p in points]
        ax.fill_between(xs, lo, hi, color=color, alpha=0.2, label="reward/mean ± standard error (std / √samples)")


def _draw_stacked(ax, rows: list[dict], cols: list[str]) -> None:
    """Phases as a stacked area over the steps that logged any phase (a missing phase is 0)."""
    phases = [c for c in cols if c not in _STEP_TOTALS]
    totals = [c for c in cols if c in _STEP_TOTALS]
    timed = sorted((row for row in rows if any(_finite(row.get(c)) for c in phases)), key=lambda r: r["step"])
    if phases and len(timed) == 1:  # one step: an area has no width, so stacked bars
        row, bottom = timed[0], 0.0
        for c in phases:
            height = row[c] if _finite(row.get(c)) else 0.0
            ax.bar([row["step"]], [height], bottom=[bottom], width=0.5, label=c.removeprefix("timing_s/"), alpha=0.8)
            bottom += height
    elif phases and timed:
        xs = [row["step"] for row in timed]
        layers = [[row[c] if _finite(row.get(c)) else 0.0 for row in timed] for c in phases]
        ax.stackplot(xs, layers, labels=[c.removeprefix("timing_s/") for c in phases], alpha=0.8)
    for col in totals:
        xs, ys = _series(rows, col)
        ax.plot(xs, ys, color="black", linewidth=1.2, label=col.removeprefix("timing_s/") + " (total)",
                marker="." if len(xs) < 30 else None)


def _draw_separate(panel: _Panel, rows: list[dict], cols: list[str]) -> Figure:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 2.5 * len(cols) + 0.5), layout="constrained")
    axes = fig.subplots(len(cols), 1, sharex=True, squeeze=False)[:, 0]
    for ax, col in zip(axes, cols):
        xs, ys = _series(rows, col)
        ax.plot(xs, ys, marker="." if len(xs) < 30 else None)
        if _mark_nonfinite(ax, xs, ys, col):
            ax.legend(fontsize="small")
        ax.set(ylabel=col)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.suptitle(panel.title)
    return fig
