"""Observability for a training run: what it logged, how far along it is, and how it went.

- `MetricsLogger` writes one JSON line per `log(step, metrics, kind=...)` to
  `RUN_DIR/metrics.jsonl` (the record of the run) and mirrors it to TensorBoard and W&B.
- `read_metrics` / `truncate_after` read the file back and cut it back to a checkpoint.
- `Timer` times the phases of a step into `timing_s/<phase>`.
- `Progress` shows step, reward, throughput and ETA, as a bar on a terminal and as plain lines
  in logs.
- `plot_run` draws a run's curves to PNGs; `plot_compare` draws one metric from several runs.

Metric names follow verl where there is one, so curves line up with what users already know:
`reward/mean`, `response_length/mean`, `entropy`, `grad_norm`, `timing_s/<phase>`,
`perf/tokens_per_s`. `plot_run` also recognises the common TRL / verl variants.
"""

from rollover.metrics.logger import MetricsLogger, flatten, read_metrics, truncate_after
from rollover.metrics.plots import plot_compare, plot_run
from rollover.metrics.progress import Progress
from rollover.metrics.timer import Timer

__all__ = [
    "MetricsLogger",
    "Progress",
    "Timer",
    "flatten",
    "plot_compare",
    "plot_run",
    "read_metrics",
    "truncate_after",
]
