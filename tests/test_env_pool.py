"""The environment pool (a concurrency limit and a busy-time meter shared by every episode of a
run) and the turn barrier `rollover bench envs` uses for its batch-synchronous baseline."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest

from rollover.bench.envs import TurnBarrier
from rollover.envs.base import StepResult
from rollover.envs.episode import EnvPool, run_episode, run_group
from rollover.envs.render import ChatRenderer
from rollover.testing import char_tokenizer
from rollover.types import Completion, SamplingParams

TOK = char_tokenizer()
EOT = TOK.convert_tokens_to_ids("<|im_end|>")
LIMITS = dict(max_turns=8, max_total_tokens=400, step_timeout_s=5.0)


def completion(request) -> Completion:
    out = TOK.encode("7", add_special_tokens=False) + [EOT]
    return Completion(request.id, list(request.prompt_ids), out, logprobs=[-0.5] * len(out), versions=[0] * len(out),
                      finish="stop", sampling=request.sampling)


class InstantEngine:
    """Answers every request at once; `batches` records what each submit_many call carried."""

    eos_token_ids = (EOT,)

    def __init__(self):
        self.batches: list[list[str]] = []

    async def agenerate(self, request):
        self.batches.append([request.id])
        return completion(request)

    def submit_many(self, requests):
        self.batches.append([r.id for r in requests])
        futures = [Future() for _ in requests]
        for r, f in zip(requests, futures):
            f.set_result(completion(r))
        return futures

    def abort(self, ids):
        return []


class TimedEnv:
    """Steps take `step_s[k - 1]` seconds of `clock` (a fake clock advanced by the env, or a real
    sleep when `sleep`); done after len(step_s) steps."""

    def __init__(self, step_s: list[float], clock=None, sleep: bool = False):
        self.step_s, self.clock, self.sleep, self.k = step_s, clock, sleep, 0

    async def initial_observation(self):
        return [{"role": "user", "content": "Go."}]

    async def step(self, action):
        self.k += 1
        if self.sleep:
            await asyncio.sleep(self.step_s[self.k - 1])
        else:
            self.clock.now += self.step_s[self.k - 1]
        return StepResult([{"role": "user", "content": "More."}], 0.0, done=self.k == len(self.step_s))


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_pool_sums_busy_time_and_defines_utilization_over_its_slots():
    clock = FakeClock()
    pool = EnvPool(4, clock=clock)
    envs = [TimedEnv([1.0, 2.0], clock), TimedEnv([0.5], clock), TimedEnv([3.0, 1.0, 1.0], clock)]
    trajs = asyncio.run(run_group(InstantEngine(), envs, ChatRenderer(TOK), SamplingParams(max_new_tokens=4),
                                  group_id="g", clock=clock, pool=pool, **LIMITS))
    assert all(t.finish == "done" for t in trajs)
    assert pool.busy_s == pytest.approx(8.5) and pool.calls == 3 + 6  # initial observations count
    assert [t.env_s for t in trajs] == pytest.approx([3.0, 0.5, 5.0])  # the episodes' own view agrees
    assert pool.utilization(10.0) == pytest.approx(8.5 / (4 * 10.0))
    pool.reset()
    assert (pool.busy_s, pool.calls, pool.wait_s) == (0.0, 0, 0.0)
    with pytest.raises(ValueError, match="max_concurrent must be >= 1"):
        EnvPool(0)


def test_pool_limits_concurrent_calls_and_the_wait_is_not_the_step_timeout():
    async def main():
        pool = EnvPool(2)
        envs = [TimedEnv([0.15, 0.15], sleep=True) for _ in range(5)]
        # 5 episodes, 2 slots: a step waits up to ~0.3 s for a slot and takes 0.15 s; the
        # 0.25 s timeout counts only the step, so nobody times out
        trajs = await asyncio.gather(*[
            run_episode(InstantEngine(), env, ChatRenderer(TOK), SamplingParams(max_new_tokens=4), request_id=f"e{i}",
                        pool=pool, **{**LIMITS, "step_timeout_s": 0.25})
            for i, env in enumerate(envs)])
        return pool, trajs

    pool, trajs = asyncio.run(main())
    assert [t.finish for t in trajs] == ["done"] * 5
    assert pool.peak == 2 and pool.active == 0
    assert pool.wait_s > 0.3  # calls queued for a slot
    assert pool.busy_s == pytest.approx(sum(t.env_s for t in trajs), rel=0.01)  # timed around the call
    assert all(turn.env_s < 0.25 for t in trajs for turn in t.turns)


def test_turn_barrier_generates_each_turn_of_the_live_episodes_as_one_batch():
    engine = InstantEngine()

    async def main():
        barrier = TurnBarrier(engine, live=3)
        # turns per episode 3, 1, 2; latencies so that the episodes would drift apart alone
        envs = [TimedEnv([0.05, 0.0, 0.03], sleep=True), TimedEnv([0.0], sleep=True), TimedEnv([0.0, 0.06], sleep=True)]

        async def one(i, env):
            try:
                return await run_episode(barrier, env, ChatRenderer(TOK), SamplingParams(max_new_tokens=4),
                                         request_id=f"e{i}", **LIMITS)
            finally:
                barrier.leave()

        trajs = await asyncio.gather(*[one(i, env) for i, env in enumerate(envs)])
        await asyncio.gather(*barrier.batches)
        return trajs

    trajs = asyncio.run(main())
    assert [len(t.turns) for t in trajs] == [3, 1, 2] and all(t.finish == "done" for t in trajs)
    assert [sorted(b) for b in engine.batches] == [
        ["e0/turn1", "e1/turn1", "e2/turn1"], ["e0/turn2", "e2/turn2"], ["e0/turn3"]]
