"""How far `rollover simulate plan`'s closed form is from the simulation when a K/V cache binds:
tests/test_sim.py's small plan cluster with 600- and 900-token caches, at points where rollout,
latency and the trainer bind. The closed form counts the rows the cache holds at average context
and leaves out the preemptions' recompute, so it reads high.

    python benchmarks/plan_kv_error.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_sim import PLAN  # noqa: E402

from rollover.sim.config import load_sim_config  # noqa: E402
from rollover.sim.plan import capacity, scaled, steady_utilization, warmup  # noqa: E402
from rollover.sim.run import profile_of  # noqa: E402
from rollover.sim.run import simulate as sim  # noqa: E402

print("kv_tokens  row_limit  workers  eta  bound     closed form  simulated  preempted  error")
for kv in (600, 900):
    cfg = load_sim_config(None, PLAN + ["simulate.train={step_s: 2.0}",
                                        f"simulate.pools=[{{workers: 1, max_rows: 16, kv_tokens: {kv}}}]"])
    cap = capacity(cfg, profile_of(cfg))
    for workers, eta in [(1, 2), (2, 2), (3, 1), (4, 2)]:
        report = sim(scaled(cfg, 1, workers, eta))
        u = steady_utilization(report, warmup(cfg, eta))
        c = cap.utilization(workers, eta)
        print(f"{kv:9d}  {cap.row_limit:9.2f}  {workers:7d}  {eta:3d}  {cap.bound(workers, eta)[1]:8s}  "
              f"{c:11.3f}  {u:9.3f}  {report['preempted']:9d}  {c / u - 1:+.1%}")
