"""Synchronous rollout collection: submit every group, wait for the last sample.

This is the baseline APRIL is measured against: each round waits for its longest response.
With DAPO dynamic sampling, groups whose rewards are all equal are dropped and the step is
topped up with fresh prompts, for at most `algorithm.max_resample_rounds` rounds.
"""

from __future__ import annotations

import time

from rollover.rollout.groups import has_variance, sampling_from, score_groups, to_rollouts, trainable
from rollover.types import Group


class SyncCollector:
    def __init__(self, run):
        self.run = run

    def collect(self, step: int) -> tuple[list[Group], dict]:
        run, cfg = self.run, self.run.cfg
        target = cfg.rollout.prompts_per_step
        sp = sampling_from(cfg)
        kept: list[Group] = []
        m = {"generate_s": 0.0, "reward_s": 0.0, "dropped_groups": 0, "skipped_groups": 0, "rounds": 0,
             "generated_tokens": 0, "reward_errors": 0}
        rounds = cfg.algorithm.max_resample_rounds if cfg.algorithm.dynamic_sampling else 1
        while len(kept) < target and m["rounds"] < rounds:
            pending = run.next_groups(target - len(kept), version=run.engine.version)
            n = cfg.rollout.samples_per_prompt
            t0 = time.perf_counter()
            outs = run.generate([g.request(j, sp, cfg.seed) for g in pending for j in range(n)], "sync collector")
            m["generate_s"] += time.perf_counter() - t0
            for k, c in enumerate(outs):
                pending[k // n].done[k % n] = c
                m["generated_tokens"] += len(c.response_ids)
            groups = [to_rollouts(g, cfg, run.tokenizer) for g in pending]
            t0 = time.perf_counter()
            result = score_groups(groups, run.rewards, cfg)
            m["reward_s"] += time.perf_counter() - t0
            for fn, count in result.error_counts.items():
                m[f"rewards/{fn}/errors"] = m.get(f"rewards/{fn}/errors", 0) + count
                m["reward_errors"] += count
            ok = [g for g in groups if trainable(g)]
            m["skipped_groups"] += len(groups) - len(ok)
            if cfg.algorithm.dynamic_sampling:
                varied = [g for g in ok if has_variance(g)]
                m["dropped_groups"] += len(ok) - len(varied)
                ok = varied
            kept.extend(ok)
            m["rounds"] += 1
        return kept, m

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
