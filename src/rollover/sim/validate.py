"""`rollover simulate validate`: the simulator against published and measured results.

The rows are data (`validation.yaml` beside this file, or any file given with `--rows`):
adding a published result needs no code. A row names its source, the published (or
measured) figure, the settings of the runs it compares (config overrides on top of the row's
`base`), and how a figure is made from the simulated runs (`metric`):

- `time_ratio`: simulated seconds of run `a` over run `b` for the same steps (e.g. hours of a
  synchronous system over hours of an asynchronous one);
- `rollout_tokens_ratio`: engine tokens generated per rollout second, run `b` over run `a` (the
  APRIL paper's throughput: every token generated, aborted segments included, over rollout
  time);
- `useful_tokens_ratio`: response tokens of trained samples per rollout second, `b` over `a`;
- `useful_tokens_per_s`: the same of run `a` alone (an absolute figure: for this machine);
- `samples_per_s`: samples trained per simulated second of run `a` (training in the loop);
- `samples_ratio`: the same, run `b` over run `a`;
- `trained_tokens_ratio`: response tokens of trained samples per simulated second, `b` over `a`
  (AReaL's effective training throughput: generated tokens consumed by updates per second).

Rollout time is the collect phase of each step (sync and APRIL schedules). The first `warmup`
steps are left out of every metric (a pipeline filling, a carry buffer priming). A row with `measured: {file, key}` reads its reference figure from a
benchmark JSON (a row whose file is missing is reported as skipped, never as passed).
`workload: longtail` gives the runs `rollover bench april`'s per-sample budgets (its seed and
cap), so a simulated row and a measured one see the same lengths; `lengths: {file, a: key, b:
key}` replays a measured run's response lengths (a benchmark JSON's list) as run a's or b's
length distribution.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

ROWS = Path(__file__).with_name("validation.yaml")
TOLERANCE = 0.15


def _rollout(report: dict, warmup: int, key: str) -> float:
    rows = report["step_rows"][warmup:]
    seconds = sum(r["t_train"] - r["t_start"] for r in rows)
    return sum(r[key] for r in rows) / seconds


def _seconds(report: dict, warmup: int) -> float:
    """Simulated seconds of the steps after the first `warmup`."""
    rows = report["step_rows"]
    return rows[-1]["t_end"] - (rows[warmup - 1]["t_end"] if warmup else 0.0)


def _per_s(report: dict, warmup: int, key: str = "samples") -> float:
    """Samples trained (or their response tokens) per simulated second after the first `warmup` steps."""
    return sum(r[key] for r in report["step_rows"][warmup:]) / _seconds(report, warmup)


METRICS = {
    "time_ratio": lambda a, b, w: _seconds(a, w) / _seconds(b, w),
    "rollout_tokens_ratio": lambda a, b, w: _rollout(b, w, "engine_tokens") / _rollout(a, w, "engine_tokens"),
    "useful_tokens_ratio": lambda a, b, w: _rollout(b, w, "response_tokens") / _rollout(a, w, "response_tokens"),
    "useful_tokens_per_s": lambda a, b, w: _rollout(a, w, "response_tokens"),
    "samples_per_s": lambda a, b, w: _per_s(a, w),
    "samples_ratio": lambda a, b, w: _per_s(b, w) / _per_s(a, w),
    "trained_tokens_ratio": lambda a, b, w: _per_s(b, w, "response_tokens") / _per_s(a, w, "response_tokens"),
}


def _lookup(data: dict, dotted: str):
    for part in dotted.split("."):
        data = data[part]
    return data


def _run(overrides: list[str], workload: str | None, root: Path) -> dict:
    from rollover.sim.config import load_sim_config
    from rollover.sim.run import simulate

    cfg = load_sim_config(None, [*overrides, "logging.progress=false"])
    if cfg.simulate.profile and not Path(cfg.simulate.profile).is_absolute():
        cfg = cfg.model_copy(update={"simulate": cfg.simulate.model_copy(update={"profile": str(root / cfg.simulate.profile)})})
    if workload not in (None, "longtail"):
        raise ValueError(f"unknown workload {workload!r} (known: longtail)")

    def prepare(run):
        if workload == "longtail":
            from rollover.bench.april import longtail_budgets

            longtail_budgets(run, cfg.seed, cfg.rollout.max_new_tokens)

    return simulate(cfg, prepare=prepare)


def validate(rows_file: str | Path = ROWS, root: str | Path = ".", only: str | None = None) -> list[dict]:
    """Every row of `rows_file` (relative paths in it are taken from `root`): source,
    published, simulated, relative_error, within (|error| <= 15%)."""
    root = Path(root)
    spec = yaml.safe_load(Path(rows_file).read_text())
    out = []
    cache: dict[tuple, dict] = {}
    for row in spec["rows"]:
        if only and only not in row["name"]:
            continue
        base = list(row.get("base", []))
        result = {"name": row["name"], "source": row["source"], "metric": row["metric"],
                  "assumed": row.get("assumed", "")}
        if "measured" in row:
            path = root / row["measured"]["file"]
            if not path.is_file():
                out.append({**result, "published": None, "simulated": None, "relative_error": None,
                            "within": None, "skipped": f"{path} not found"})
                continue
            result["published"] = float(_lookup(json.loads(path.read_text()), row["measured"]["key"]))
        else:
            result["published"] = float(row["published"])
        runs = []
        for which in ("a", "b"):
            if which not in row:
                runs.append(None)
                continue
            overrides = base + row[which]
            if which in row.get("lengths", {}):  # the measured run's own response lengths, replayed
                values = _lookup(json.loads((root / row["lengths"]["file"]).read_text()), row["lengths"][which])
                overrides.append("simulate.lengths=" + json.dumps({"kind": "empirical", "values": values}))
            key = (tuple(overrides), row.get("workload"))
            if key not in cache:
                cache[key] = _run(overrides, row.get("workload"), root)
            runs.append(cache[key])
        sim = METRICS[row["metric"]](runs[0], runs[1], row.get("warmup", 0))
        err = (sim - result["published"]) / result["published"]
        out.append({**result, "simulated": sim, "relative_error": err, "within": abs(err) <= TOLERANCE})
    return out


def text(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        if r.get("skipped"):
            lines.append(f"  SKIPPED  {r['name']}: {r['skipped']}")
            continue
        mark = "ok  " if r["within"] else "MISS"
        lines.append(f"  {mark} {r['name']}: published {r['published']:.3g}, simulated {r['simulated']:.3g} "
                     f"({r['relative_error']:+.1%})")
    return "\n".join(lines)
