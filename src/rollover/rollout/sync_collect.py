"""Synchronous rollout collection: submit every group, wait for the last sample.

This is the baseline APRIL is measured against: each round waits for its longest response
(or, with an environment, its longest episode). With DAPO dynamic sampling, groups whose
rewards are all equal are filtered and the step is topped up with fresh prompts, for at most
`algorithm.max_resample_rounds` rounds. With `selection.dars`, prompts solved by fewer than
half their samples get DARS's second-stage extra samples before the step trains. Samples go
through the rollout core (`core.py`), single-turn and multi-turn alike.
"""

from __future__ import annotations

import time
from collections import Counter

from rollover.rollout.core import env_step_metrics, run_groups
from rollover.rollout.groups import keep_group, observe_groups, sampling_from, scored_groups
from rollover.types import Group
from rollover.rollout.inputs import RolloutInputs


class SyncCollector:
    inflight_mode = "continue"  # nothing is in flight at a weight update

    def __init__(self, inputs: RolloutInputs):
        self.inputs = inputs

    def collect(self, step: int) -> tuple[list[Group], dict]:
        run, cfg = self.inputs, self.inputs.cfg
        target = cfg.rollout.prompts_per_step
        sp = sampling_from(cfg)
        kept: list[Group] = []
        m = Counter({"generate_s": 0.0, "reward_s": 0.0, "filtered_groups": 0, "skipped_groups": 0, "rounds": 0,
                     "generated_tokens": 0, "reward_errors": 0, "dropped_samples": 0,
                     **({"dars_extra_samples": 0, "dars_groups": 0} if cfg.selection.dars != "off" else {})})
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
            if cfg.selection.dars != "off":
                groups = self._dars_second_stage(pending, groups, sp, m, busy)
            observe_groups(run, pending, groups)
            kept += [g for g in groups if keep_group(g, cfg, m, primary=run.primary_reward)]
            m["rounds"] += 1
        stats1 = run.engine.stats()
        total = stats1.total_row_steps - stats0.total_row_steps
        m["occupancy"] = (stats1.busy_row_steps - stats0.busy_row_steps) / total if total else 0.0
        if trajectories:
            m["reward_s"] = sum(t.env_s for t in trajectories)  # environment time, overlapped with generation
            m.update(env_step_metrics(run, trajectories, busy["env_s"], time.perf_counter() - t_start))
        return kept, dict(m)

    def _dars_second_stage(self, pending, groups: list[Group], sp, m: Counter, busy: Counter) -> list[Group]:
        """DARS: extra samples for the prompts solved by fewer than half of theirs, generated
        with the same weights and merged into their groups. Sample j of a group keeps its seed
        whichever stage made it (the extras continue the group's numbering)."""
        from dataclasses import replace

        from rollover.rollout.allocation import dars_extra_samples

        run, sel = self.inputs, self.inputs.cfg.selection
        correct = run.cfg.reward.correct_threshold
        grow = []  # (pending group, its scored group, first-stage size)
        for pg, g in zip(pending, groups):
            scored = [r for r in g.rollouts if r.reward is not None]
            if not scored:
                continue
            acc = sum((r.scores.get(run.primary_reward) or 0.0) >= correct for r in scored) / len(scored)
            extra = dars_extra_samples(acc, pg.n, sel.dars, sel.dars_max_samples)
            if extra:
                grow.append((pg, g, pg.n))
                pg.n += extra
        if not grow:
            return groups
        t0 = time.perf_counter()
        m["generated_tokens"] += run_groups(run, [pg for pg, _, _ in grow], sp, run.cfg.seed, "DARS second stage", busy)
        m["generate_s"] += time.perf_counter() - t0
        extras = [replace(pg, n=pg.n - n0, done={j - n0: pg.done[j] for j in range(n0, pg.n)}, partial={})
                  for pg, _, n0 in grow]
        for (_, g, _), more in zip(grow, scored_groups(extras, run, m)):
            g.rollouts += more.rollouts
        m["dars_extra_samples"] += sum(pg.n - n0 for pg, _, n0 in grow)
        m["dars_groups"] += len(grow)
        return groups

    def set_aside(self) -> None:
        pass  # nothing is in flight between steps

    def close(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
