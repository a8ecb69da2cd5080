"""Simulated multi-turn environments: episodes whose environment calls take virtual time.

The rollout core runs simulated episodes exactly as it runs real ones (`LiveEpisode`, the
renderer, turn budgets, the APRIL and async schedules); what is simulated is the environment
and where its calls run:

- `SimEnv` answers each turn with an observation of `obs_tokens` words until its episode's
  drawn number of turns is reached (geometric, mean `turns`, or one of `turn_values`), then ends it with a reward of 1
  with the prompt's solve probability, else 0. Every call reports how long it would take: the
  opening `open_s`, each step log-normal around `step_s` (spread `sigma`), clipped to
  [`min_s`, `max_s`].
- `SimEnvRunner` replaces the core's `EnvRunner`: a call's answer is delivered on the engine
  thread at the virtual time it would land. Calls take one of `env.max_concurrent` slots (the
  environment cluster) in arrival order, so a full cluster queues them; a call longer than
  `env.step_timeout_s` fails its episode at the timeout, as a real one would.

Departures, on purpose: every turn prefills its whole context (no prefix cache across turns, as
in TorchEngine; vLLM's prefix caching would make later turns cheaper), and environment answers
that land while the engine is paused (APRIL keep_kv between steps) are taken in when it
resumes (a real answer lands at once; the sample waits for the next step either way).
"""

from __future__ import annotations

import asyncio
import heapq
import math
import threading

from rollover.envs.base import EpisodeError, StepResult
from rollover.sim.workload import _rng


class SimEnvRunner:
    """Environment calls on the simulated clock (the `EnvRunner` contract: `call(fn, done)`)."""

    inline = True
    pool = None  # the core's EnvPool is the real runner's; this one keeps its own counters

    def __init__(self, engine, max_concurrent: int, timeout_s: float):
        self.engine, self.timeout_s = engine, timeout_s
        self.max_concurrent = max_concurrent
        self.free_at = [0.0] * max_concurrent  # when each slot is free (a heap)
        self.timed_out = 0
        self.spans: list[tuple[float, float, float]] = []  # (asked, start, end) of every call
        self._local = threading.local()  # each calling thread's event loop and the call's cost
        self._loops: list = []

    def spend(self, seconds: float, turn: int) -> None:
        """From a simulated environment, inside a call: the call takes `seconds` of virtual time."""
        self._local.cost = (seconds, turn)

    def call(self, fn, done) -> None:
        """Run `fn` now (a simulated environment answers at once) and hand its result to `done`
        on the engine thread at the virtual time the call would end."""
        loop = getattr(self._local, "loop", None)
        if loop is None:
            loop = self._local.loop = asyncio.new_event_loop()
            self._loops.append(loop)
        self._local.cost = (0.0, 0)
        try:
            result = loop.run_until_complete(fn(None))
        except BaseException as e:  # even a CancelledError: the caller counts this call as landed
            result = (e,)
        seconds, turn = self._local.cost
        if len(result) == 3 and seconds > self.timeout_s:
            seconds = self.timeout_s
            result = (None, EpisodeError(turn, "TimeoutError", f"no answer within step_timeout_s={seconds:g}",
                                         "", timed_out=True), seconds)
            self.timed_out += 1
        elif len(result) == 3:
            result = (result[0], result[1], seconds)
        self.engine.call_at(lambda now: self.take_slot(now, seconds), lambda: done(*result))

    def take_slot(self, now: float, seconds: float) -> float:
        """A call arriving at `now` that works `seconds`: when it ends (engine thread)."""
        start = max(now, heapq.heappop(self.free_at))
        heapq.heappush(self.free_at, start + seconds)
        self.spans.append((now, start, start + seconds))
        return start + seconds

    def report(self, end_s: float) -> dict:
        """The calls asked for by `end_s` and the slot time spent by then (a carried episode's
        call may run past the last step)."""
        asked = [(a, s, e) for a, s, e in self.spans if a <= end_s]
        busy = sum(max(0.0, min(e, end_s) - min(s, end_s)) for _, s, e in asked)
        wait = sum(min(s, end_s) - a for a, s, _ in asked)
        return {"slots": self.max_concurrent, "calls": len(asked), "busy_s": busy, "wait_s": wait,
                "mean_wait_s": wait / len(asked) if asked else 0.0, "timed_out": self.timed_out,
                "utilization": busy / (self.max_concurrent * end_s) if end_s > 0 else 0.0}

    def close(self) -> None:
        for loop in self._loops:
            loop.close()


class SimEnvBuilder:
    """Makes the simulated environments of each group (`EnvGroupBuilder`)."""

    def __init__(self, model, runner: SimEnvRunner, seed: int, prompt_words: int):
        self.model, self.runner, self.seed, self.prompt_words = model, runner, seed, prompt_words
        self.groups = 0  # groups made so far: seeds each group's draws (the core makes them in a fixed order)

    def make_group(self, prompt, n: int) -> list["SimEnv"]:
        self.groups += 1
        return [SimEnv(self.model, self.runner, prompt, _rng(self.seed, self.groups, j, 37), self.prompt_words)
                for j in range(n)]


class SimEnv:
    def __init__(self, model, runner: SimEnvRunner, prompt, rng, prompt_words: int):
        self.model, self.runner, self.prompt, self.rng = model, runner, prompt, rng
        self.prompt_words = prompt_words
        # the turn after which this episode is done
        self.turns = rng.choice(model.turn_values) if model.turn_values else _geometric(rng, model.turns)
        self.solved = rng.random() < float(prompt.answer)
        self.t = 0  # turns answered

    async def initial_observation(self) -> list[dict]:
        self.runner.spend(self.model.open_s, 0)
        index = self.prompt.id.removeprefix("sim")  # the opening is prompt_words tokens, the template's 6 included
        return [{"role": "user", "content": f"p{index} " + "w " * max(self.prompt_words - 6, 0)}]

    async def step(self, action) -> StepResult:
        self.t += 1
        m = self.model
        seconds = max(m.min_s, m.step_s * math.exp(self.rng.gauss(0.0, m.sigma)) if m.sigma else m.step_s)
        self.runner.spend(seconds if m.max_s is None else min(m.max_s, seconds), self.t)
        if self.t >= self.turns:
            return StepResult(messages=[], reward=1.0 if self.solved else 0.0, done=True)
        # inserted: the turn's closing, the message's words and the next turn's opening (5 of the template's)
        return StepResult(messages=[{"role": "user", "content": "w " * (m.obs_tokens - 5)}], reward=0.0, done=False)


def _geometric(rng, mean: float) -> int:
    """Turns >= 1 with the given mean (1: always one)."""
    if mean <= 1:
        return 1
    u = 1.0 - rng.random()  # (0, 1]
    return 1 + int(math.log(u) / math.log(1.0 - 1.0 / mean))
