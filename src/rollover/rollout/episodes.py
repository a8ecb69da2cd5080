"""Multi-turn collection for the synchronous loop: each group is n episodes of one task.

A step draws `prompts_per_step` tasks, makes each task's n environments (`env.name`), and runs
every episode of the step concurrently on the engine (`rollover.envs.episode.run_group`): each
episode advances on its own, with no barrier across the batch between turns. A trajectory
becomes a `Rollout` whose response holds the sampled turns and the tokens the environment
inserted between them (loss mask 0, so only sampled tokens train); its reward is the
environment's (the sum of its step rewards), recorded as the score `env`.

An episode whose environment raised or timed out has no reward: it is counted
(`env/failed`, `env/timed_out`, logged with the episode and the exception) and its group is
left out of training, as a group with an unscored sample is in single-turn mode — never a
silent 0. DAPO dynamic sampling drops groups whose rewards are all equal and tops up, as in
`sync_collect.py`.

Not here yet (the rollout core will share them with single-turn work): APRIL partial rollouts
inside episodes, async episodes, an environment pool with a concurrency limit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

from rollover.envs.base import Trajectory, episode_metrics
from rollover.envs.episode import run_group
from rollover.envs.render import ChatRenderer
from rollover.loops.guard import Stalled, Watchdog, engine_progress
from rollover.rollout.groups import has_variance, sample_seed, sampling_from
from rollover.types import Group, Rollout

log = logging.getLogger("rollover")


class EpisodeCollector:
    def __init__(self, run):
        self.run = run
        self.renderer = ChatRenderer(run.tokenizer)

    def collect(self, step: int) -> tuple[list[Group], dict]:
        run, cfg = self.run, self.run.cfg
        target = cfg.rollout.prompts_per_step
        kept: list[Group] = []
        trajectories: list[Trajectory] = []
        m = {"generate_s": 0.0, "reward_s": 0.0, "dropped_groups": 0, "skipped_groups": 0, "rounds": 0,
             "generated_tokens": 0, "reward_errors": 0}
        rounds = cfg.algorithm.max_resample_rounds if cfg.algorithm.dynamic_sampling else 1
        while len(kept) < target and m["rounds"] < rounds:
            pending = run.next_groups(target - len(kept), version=run.engine.version)
            t0 = time.perf_counter()
            results = asyncio.run(self._watched(self._episodes(pending, sampling_from(cfg), cfg.rollout.samples_per_prompt),
                                                "episode collector"))
            m["generate_s"] += time.perf_counter() - t0
            for pg, trajs in zip(pending, results):
                trajectories += trajs
                group = to_group(pg, trajs, run.tokenizer)
                if group is None:
                    m["skipped_groups"] += 1
                    m["reward_errors"] += sum(not t.ok for t in trajs)
                elif cfg.algorithm.dynamic_sampling and not has_variance(group):
                    m["dropped_groups"] += 1
                else:
                    kept.append(group)
            m["rounds"] += 1
        m["generated_tokens"] = sum(sum(t.loss_mask_T) for t in trajectories)
        m["reward_s"] = sum(t.env_s for t in trajectories)  # environment time, overlapped with generation
        m.update(episode_metrics(trajectories))
        return kept, m

    async def _episodes(self, pending, sampling, n: int) -> list[list[Trajectory]]:
        cfg = self.run.cfg
        e = cfg.env
        groups = [
            run_group(self.run.engine, self.run.env_builder.make_group(pg.prompt, n), self.renderer,
                      replace(sampling, seed=sample_seed(cfg.seed, pg.serial, 0)), group_id=pg.id,
                      max_turns=e.max_turns, max_total_tokens=e.max_total_tokens, step_timeout_s=e.step_timeout_s)
            for pg in pending
        ]
        return list(await asyncio.gather(*groups))

    async def _watched(self, episodes, who: str):
        """`episodes`, ended with `Stalled` (its episodes cancelled, their requests aborted)
        when the engine makes no progress for rollout.stall_timeout_s; an environment step is
        bounded by env.step_timeout_s, which the config keeps below it."""
        task = asyncio.ensure_future(episodes)
        dog = Watchdog(who, "episodes from the engine", lambda: engine_progress(self.run.engine),
                       self.run.cfg.rollout.stall_timeout_s)
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done():
                try:
                    dog.check()
                except Stalled:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    raise
        return task.result()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def to_group(pg, trajectories: list[Trajectory], tokenizer) -> Group | None:
    """The group's rollouts, or None when an episode failed (reported here, never scored 0)."""
    failed = [t for t in trajectories if not t.ok]
    for t in failed:
        log.warning("env: episode %s failed: %s", t.request_id, t.error.describe())
    if failed:
        return None
    rollouts: list[Rollout] = []
    for t in trajectories:
        r = t.to_rollout(pg.id)
        r.scores = {"env": t.reward}
        r.text = " || ".join(turn.text for turn in t.turns)
        rollouts.append(r)
    return Group(id=pg.id, prompt=pg.prompt, prompt_ids=trajectories[0].tokens_T[: trajectories[0].prompt_len],
                 rollouts=rollouts, start_version=pg.start_version)


def evaluate_episodes(run, step: int) -> dict:
    """Held-out episodes with the current weights: mean reward, success rate, turns."""
    cfg = run.cfg
    if not run.eval_prompts:
        return {}
    from rollover.rollout.groups import PendingGroup

    sampling = replace(sampling_from(cfg), temperature=cfg.eval.temperature)
    pending = [PendingGroup(id=f"eval-{step}-{i}", prompt=p, prompt_ids=[], serial=10**9 + i,
                            n=cfg.eval.samples_per_prompt, start_version=run.engine.version)
               for i, p in enumerate(run.eval_prompts)]
    collector = EpisodeCollector(run)
    results = asyncio.run(collector._watched(collector._episodes(pending, sampling, cfg.eval.samples_per_prompt),
                                            "evaluation"))
    trajs = [t for group in results for t in group]
    ok = [t for t in trajs if t.ok]
    rewards = [t.reward for t in ok]
    metrics = {
        "eval/accuracy": sum(r >= cfg.reward.correct_threshold for r in rewards) / max(len(trajs), 1),
        "eval/reward_mean": sum(rewards) / max(len(rewards), 1),
        "eval/response_length": sum(len(t.tokens_T) - t.prompt_len for t in ok) / max(len(ok), 1),
        "eval/samples": len(trajs),
        "eval/failed": len(trajs) - len(ok),
        "eval/turns_mean": sum(len(t.turns) for t in trajs) / max(len(trajs), 1),
    }
    run.logger.log(step, metrics, kind="eval")
    return metrics
