"""Synchronous rollout collection: submit every group, wait for the last sample.

This is the baseline APRIL is measured against: each round waits for its longest response
(or, with an environment, its longest episode). With DAPO dynamic sampling, groups whose
rewards are all equal are filtered and the step is topped up with fresh prompts, for at most
`algorithm.max_resample_rounds` rounds. Samples go through the rollout core (`core.py`),
single-turn and multi-turn alike.
"""

from __future__ import annotations

import time
from collections import Counter

from rollover.rollout.core import env_step_metrics, run_groups
from rollover.rollout.groups import keep_group, observe_groups, sampling_from, scored_groups
from rollover.types import Group


class SyncCollector:
    inflight_mode = "continue"  # nothing is in flight at a weight update

    def __init__(self, run):
        self.run = run

    def collect(self, step: int) -> tuple[list[Group], dict]:
        run, cfg = self.run, self.run.cfg
        target = cfg.rollout.prompts_per_step
        sp = sampling_from(cfg)
        kept: list[Group] = []
        m = Counter({"generate_s": 0.0, "reward_s": 0.0, "filtered_groups": 0, "skipped_groups": 0, "rounds": 0,
                     "generated_tokens": 0, "reward_errors": 0})
        trajectories, busy = [], Counter()
        t_start, stats0 = time.perf_counter(), run.engine.stats()
        rounds = cfg.algorithm.max_resample_rounds if cfg.algorithm.dynamic_sampling else 1
        while len(kept) < target and m["rounds"] < rounds:
            pending = run.next_groups(target - len(kept), version=run.engine.version)
            t0 = time.perf_counter()
            m["generated_tokens"] += run_groups(run, pending, sp, cfg.seed, "sync collector", busy)
            m["generate_s"] += time.perf_counter() - t0
            if run.env_builder is not None:
                trajectories += [pg.done[j] for pg in pending for j in range(pg.n)]
            groups = scored_groups(pending, run, m)
            observe_groups(run, pending, groups)
            kept += [g for g in groups if keep_group(g, cfg, m)]
            m["rounds"] += 1
        stats1 = run.engine.stats()
        total = stats1.total_row_steps - stats0.total_row_steps
        m["occupancy"] = (stats1.busy_row_steps - stats0.busy_row_steps) / total if total else 0.0
        if trajectories:
            m["reward_s"] = sum(t.env_s for t in trajectories)  # environment time, overlapped with generation
            m.update(env_step_metrics(run, trajectories, busy["env_s"], time.perf_counter() - t_start))
        return kept, dict(m)

    def close(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
