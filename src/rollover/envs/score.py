"""How an environment scores the model's final text: a reward by name, reference or function,
called per sample; isolated rewards (math-verify's) in worker processes killed at a timeout."""

from __future__ import annotations

import dataclasses
import inspect
import threading
from typing import Callable

from rollover.envs.base import in_thread

SCORES = ("exact", "em", "numeric", "math")  # the built-in rewards that score one completion against its answer alone
SCORE_TIMEOUT_S = 60.0  # an isolated score (math-verify's sympy) is killed after this long
_POOLS: dict = {}  # reference -> the worker processes that run an isolated score
_POOLS_LOCK = threading.Lock()


class Score:
    """An environment's score of the model's final text: a reward's name (one of `SCORES`), a
    `module:function` reference, or a function, called per sample as `f(completion, answer)` (a
    dict's "score" counts). A reward marked `isolate` (`math`) runs in a worker process that is
    killed after `SCORE_TIMEOUT_S`, as the reward runner runs it, so a runaway answer cannot keep
    a thread for ever. `reasoning="drop"`: it scores what follows a thinking model's `</think>`
    (as a reward spec's `reasoning`, `rollover.rewards.registry`)."""

    def __init__(self, score, what: str, reasoning: str = "keep"):
        from rollover.rewards.registry import Reward, resolve_reward_fn

        if reasoning not in ("keep", "drop"):
            raise ValueError(f"{what}: reasoning={reasoning!r}: must be keep (the whole reply is scored) or drop "
                             "(what follows the model's </think>)")
        if isinstance(score, Score):  # (a spec rebuilt, dataclasses.replace): the same function, this reasoning
            self.reward, self.what = dataclasses.replace(score.reward, reasoning=reasoning), score.what
            return
        self.what = what
        ref = None
        if not callable(score):
            if ":" not in str(score) and score not in SCORES:
                raise ValueError(f"{what}: score={score!r}: one of {list(SCORES)} (the built-in rewards that need "
                                 "only the completion and the answer), 'module:function' or a function")
            try:
                ref, score = str(score), resolve_reward_fn(score)
            except (AttributeError, FileNotFoundError, ImportError, ValueError) as e:
                raise ValueError(f"{what}: score: {e}") from None
        try:
            self.reward = Reward("score", score, ref=ref, reasoning=reasoning)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{what}: score: {e}") from None
        if self.reward.batched:
            raise ValueError(f"{what}: score {score!r} takes a batch (`completions`): an environment scores one "
                             "completion at a time, f(completion, answer)")
        try:
            signature = inspect.signature(score)
        except (TypeError, ValueError):  # a builtin or an object without one: its first call will tell
            signature = None
        if signature is not None:
            try:
                signature.bind("completion", "answer")
            except TypeError as e:
                raise ValueError(f"{what}: score {getattr(score, '__name__', score)!r} cannot be called as "
                                 f"f(completion, answer), as an environment calls it: {e}") from None

    async def __call__(self, completion: str, answer, opened: bool = False) -> float:
        """`opened`: the reply began inside an open `<think>` (`Action.opened_reasoning`)."""
        completion = self.reward.sees(completion, opened)
        if self.reward.isolated:
            value = await in_thread(self._pool().call, "score", "call_one", (completion, answer, {}))
        else:
            value = await call(self.reward.call_one, completion, answer, {})
        if isinstance(value, dict):
            value = value.get("score")
        if value is None:
            raise ValueError(f"{self.what}: the score gave no number for the answer {answer!r:.80}")
        return float(value)

    def _pool(self):
        from rollover.rewards.pool import WorkerPool

        key = self.reward.reference[0]
        with _POOLS_LOCK:
            if key not in _POOLS:
                _POOLS[key] = WorkerPool([self.reward], size=2, timeout_s=SCORE_TIMEOUT_S)
            return _POOLS[key]


async def call(fn: Callable, *args):
    """`fn(*args)`: awaited if it is a coroutine function (or returns an awaitable), else in a
    worker thread."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    out = await in_thread(fn, *args)
    return await out if inspect.isawaitable(out) else out
