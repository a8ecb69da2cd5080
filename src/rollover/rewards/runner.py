"""Score a batch of completions with several reward functions, concurrently, with timeouts.

Combination. Each function gives a sample a float, a dict, or None:

- a float (bool and other real numbers too) is its score;
- a dict must hold "score" (its score); every other key must be a number and is reported as
  the extra `<function>/<key>` (verl's convention), not added to the total;
- None means the function abstains for this sample (TRL's convention: a math checker on a
  code sample, or a gold answer it cannot parse).

The sample's total is the weighted sum over the functions that did not abstain. A sample on
which every function abstains is skipped.

Errors. A call that raises, returns something else, or runs past `timeout_s` is a failure.
Every failure is logged (function, sample id, exception text), counted per function, and kept
in `BatchRewards.failures`. Then `on_error` decides:

- "raise": `RewardFailed` naming the function and sample, at the first failure;
- "zero": the function scores 0 for that sample; the sample stays in training but lists the
  function in `SampleReward.failed`, and the failure shows in the metrics;
- "skip": the sample is marked skipped (status "skipped", total None); the caller must leave it
  out of training.

Threads and timeouts. Every call runs in its own daemon thread, at most `max_workers` at once;
nothing here uses signals, so the runner works from any thread. Python cannot kill a thread: a
call past its timeout is abandoned, not stopped. It keeps running in the background until it
returns (its result is thrown away), its slot goes to the next call at once, so neither the
rest of the batch nor the next batch waits for it, and the interpreter can exit without it. It
still holds whatever CPU and memory it uses, so the number of abandoned calls still alive is
reported (`stuck_threads`), and `score` refuses to start once more than `max_stuck_threads` are.

Threads overlap I/O (a remote judge, a sandbox) but not pure-Python CPU work, which the GIL
serialises; the timeout and the isolation are the point. An `async def` reward is run to
completion with `asyncio.run` inside its worker thread.

From asyncio, `await runner.ascore(...)` runs the blocking `score` in a worker thread
(`asyncio.to_thread`), so the event loop keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import math
import numbers
import statistics
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Callable, Iterator, Literal, Sequence

from rollover.rewards.registry import Reward
from rollover.types import Prompt

logger = logging.getLogger("rollover.rewards")

OnError = Literal["raise", "zero", "skip"]
SampleStatus = Literal["ok", "skipped"]


class RewardFailed(RuntimeError):
    """A reward function failed and `on_error="raise"`."""

    def __init__(self, fn: str, sample_id: str, error: str):
        super().__init__(f"reward {fn!r} failed on sample {sample_id}: {error}")
        self.fn = fn
        self.sample_id = sample_id
        self.error = error


@dataclass(frozen=True)
class RewardFailure:
    """One function failing on one sample (a failed batched call gives one per sample)."""

    fn: str
    sample_id: str
    error: str  # "ValueError: boom", "TimeoutError: timed out after 5.0 s"
    timed_out: bool = False


@dataclass
class SampleReward:
    """The reward of one completion. Train on it only if `status == "ok"`."""

    sample_id: str
    status: SampleStatus
    total: float | None  # weighted sum; None when skipped
    scores: dict[str, float | None]  # per function; None: abstained, or failed under "skip"
    extras: dict[str, float] = field(default_factory=dict)  # "<function>/<key>" from dicts
    failed: list[str] = field(default_factory=list)  # functions that failed on this sample
    skip_reason: str | None = None


@dataclass
class BatchRewards:
    """What `RewardRunner.score` returns: `samples[i]` is the i-th completion's reward."""

    samples: list[SampleReward]
    failures: list[RewardFailure]
    error_counts: dict[str, int]  # per function, failures of any kind (timeouts included)
    timeout_counts: dict[str, int]  # per function
    stuck_threads: int  # abandoned calls still running after this batch

    @property
    def totals(self) -> list[float | None]:
        return [s.total for s in self.samples]

    @property
    def num_skipped(self) -> int:
        return sum(s.status == "skipped" for s in self.samples)

    def metrics(self) -> dict[str, float]:
        """Flat, loggable numbers: reward/*, rewards/<function>/*."""
        totals = [s.total for s in self.samples if s.status == "ok"]
        out: dict[str, float] = {
            "reward/skipped": float(self.num_skipped),
            "reward/stuck_threads": float(self.stuck_threads),
        }
        if totals:
            out["reward/mean"] = statistics.fmean(totals)
            out["reward/std"] = statistics.pstdev(totals)
            out["reward/min"] = min(totals)
            out["reward/max"] = max(totals)
        for name in self.error_counts:
            values = [s.scores[name] for s in self.samples if s.scores.get(name) is not None]
            if values:
                out[f"rewards/{name}/mean"] = statistics.fmean(values)
            out[f"rewards/{name}/errors"] = float(self.error_counts[name])
            out[f"rewards/{name}/timeouts"] = float(self.timeout_counts[name])
        extra_keys = dict.fromkeys(key for s in self.samples for key in s.extras)
        for key in extra_keys:
            values = [s.extras[key] for s in self.samples if key in s.extras]
            out[f"rewards/{key}/mean"] = statistics.fmean(values)
        return out


@dataclass
class _Call:
    reward: Reward
    samples: list[int]  # indices into the batch this call scores
    run: Callable[[], object]


class _Tally:
    """Scores and failures collected while a batch's calls come back."""

    def __init__(self, sample_ids: Sequence[str], names: list[str], on_error: OnError):
        n = len(sample_ids)
        self.sample_ids = sample_ids
        self.on_error = on_error
        self.scores: list[dict[str, float | None]] = [dict.fromkeys(names) for _ in range(n)]
        self.extras: list[dict[str, float]] = [{} for _ in range(n)]
        self.failed: list[list[str]] = [[] for _ in range(n)]
        self.failures: list[RewardFailure] = []

    def add(self, call: _Call, outcome: object, timed_out: bool) -> None:
        name = call.reward.name
        results = _per_sample(outcome, call)
        # One log line per distinct error: a failed batched call fails all its samples at once.
        by_error: dict[int, tuple[BaseException, list[str]]] = {}
        for i, result in results:
            if isinstance(result, BaseException):
                by_error.setdefault(id(result), (result, []))[1].append(self.sample_ids[i])
        for error, ids in by_error.values():
            _log_failure(name, ids, error)

        for i, result in results:
            if not isinstance(result, BaseException):
                self.scores[i][name], extra = result
                self.extras[i].update({f"{name}/{key}": v for key, v in extra.items()})
                continue
            failure = RewardFailure(name, self.sample_ids[i], _describe(result), timed_out)
            if self.on_error == "raise":
                raise RewardFailed(name, self.sample_ids[i], failure.error) from result
            self.failures.append(failure)
            self.failed[i].append(name)


class RewardRunner:
    """Scores batches with weighted reward functions (see the module docstring).

    `timeout_s` bounds each call: one completion for a per-sample function, the whole batch
    for a TRL-style one. Safe to share between threads.
    """

    def __init__(
        self,
        rewards: Sequence[Reward],
        *,
        timeout_s: float = 10.0,
        on_error: OnError = "raise",
        max_workers: int = 8,
        max_stuck_threads: int = 32,
    ):
        if not rewards:
            raise ValueError("RewardRunner needs at least one reward")
        names = [r.name for r in rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"reward names must be unique, got {names}")
        for r in rewards:
            if not math.isfinite(r.weight):
                raise ValueError(f"reward {r.name!r}: weight must be finite, got {r.weight}")
        if on_error not in ("raise", "zero", "skip"):
            raise ValueError(f"on_error must be 'raise', 'zero' or 'skip', got {on_error!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.rewards = list(rewards)
        self.timeout_s = timeout_s
        self.on_error = on_error
        self.max_workers = max_workers
        self.max_stuck_threads = max_stuck_threads
        self._stuck: list[threading.Thread] = []
        self._lock = threading.Lock()

    async def ascore(self, prompts, completions, **kwargs) -> BatchRewards:
        """`score` in a worker thread, for callers inside an event loop."""
        return await asyncio.to_thread(self.score, prompts, completions, **kwargs)

    def score(
        self,
        prompts: Sequence[Prompt],
        completions: Sequence[str],
        *,
        sample_ids: Sequence[str] | None = None,
        completion_ids: Sequence[list[int]] | None = None,
    ) -> BatchRewards:
        """Score `completions[i]` against `prompts[i]` (repeat a prompt once per completion).

        Sample ids default to "<prompt id>#<index in batch>". `completion_ids` is only handed
        to TRL-style functions that ask for it.
        """
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"{len(prompts)} prompts for {n} completions")
        if sample_ids is None:
            sample_ids = [f"{p.id}#{i}" for i, p in enumerate(prompts)]
        if len(sample_ids) != n or (completion_ids is not None and len(completion_ids) != n):
            raise ValueError("sample_ids and completion_ids need one entry per completion")
        stuck = self._live_stuck()
        if stuck > self.max_stuck_threads:
            raise RuntimeError(
                f"{stuck} reward calls abandoned after their timeout are still running "
                f"(max_stuck_threads={self.max_stuck_threads}): a reward function hangs"
            )

        names = [r.name for r in self.rewards]
        tally = _Tally(sample_ids, names, self.on_error)
        calls = self._calls(prompts, completions, completion_ids)
        with contextlib.closing(self._run(calls)) as outcomes:
            for call, outcome, timed_out in outcomes:
                tally.add(call, outcome, timed_out)

        failures = tally.failures
        return BatchRewards(
            samples=[
                self._combine(sample_ids[i], tally.scores[i], tally.extras[i], tally.failed[i])
                for i in range(n)
            ],
            failures=failures,
            error_counts={name: sum(f.fn == name for f in failures) for name in names},
            timeout_counts={
                name: sum(f.fn == name and f.timed_out for f in failures) for name in names
            },
            stuck_threads=self._live_stuck(),
        )

    def _calls(self, prompts, completions, completion_ids) -> list[_Call]:
        n = len(completions)
        calls = []
        for reward in self.rewards:
            if reward.batched:
                run = functools.partial(
                    reward.call_batch,
                    [p.text if p.text is not None else p.messages for p in prompts],
                    list(completions),
                    [p.answer for p in prompts],
                    [p.fields for p in prompts],
                    None if completion_ids is None else list(completion_ids),
                )
                calls.append(_Call(reward, list(range(n)), run))
            else:
                for i, (p, c) in enumerate(zip(prompts, completions)):
                    run = functools.partial(reward.call_one, c, p.answer, p.fields)
                    calls.append(_Call(reward, [i], run))
        return calls

    def _run(self, calls: list[_Call]) -> Iterator[tuple[_Call, object, bool]]:
        """Yield (call, result or exception, timed_out) as calls finish or time out."""
        pending = deque(calls)
        running: dict[Future, tuple[_Call, float, threading.Thread]] = {}
        try:
            while pending or running:
                while pending and len(running) < self.max_workers:
                    call = pending.popleft()
                    future, thread = _start(call)
                    running[future] = (call, time.monotonic() + self.timeout_s, thread)
                earliest = min(deadline for _, deadline, _ in running.values())
                timeout = max(0.0, earliest - time.monotonic())
                done, _ = wait(running, timeout=timeout, return_when=FIRST_COMPLETED)
                for future in done:
                    call, _, _ = running.pop(future)
                    error = future.exception()
                    yield call, (error if error is not None else future.result()), False
                now = time.monotonic()
                for future, (call, deadline, thread) in list(running.items()):
                    if deadline <= now and not future.done():
                        del running[future]
                        self._abandon(thread)
                        timeout = TimeoutError(f"timed out after {self.timeout_s} s")
                        yield call, timeout, True
        finally:
            # Left early (on_error="raise"): calls still running are abandoned too.
            for _, _, thread in running.values():
                self._abandon(thread)

    def _combine(
        self, sample_id: str, scores: dict, extras: dict, failed: list[str]
    ) -> SampleReward:
        if failed and self.on_error == "skip":
            reason = f"reward failed: {', '.join(failed)}"
            return SampleReward(sample_id, "skipped", None, scores, extras, failed, reason)
        for name in failed:  # on_error == "zero"
            scores[name] = 0.0
        present = [(r.weight, scores[r.name]) for r in self.rewards if scores[r.name] is not None]
        if not present:
            reason = "every reward function returned None"
            return SampleReward(sample_id, "skipped", None, scores, extras, failed, reason)
        total = sum(weight * score for weight, score in present)
        return SampleReward(sample_id, "ok", total, scores, extras, failed)

    def _abandon(self, thread: threading.Thread) -> None:
        with self._lock:
            self._stuck.append(thread)

    def _live_stuck(self) -> int:
        with self._lock:
            self._stuck = [t for t in self._stuck if t.is_alive()]
            return len(self._stuck)


def _start(call: _Call) -> tuple[Future, threading.Thread]:
    future: Future = Future()

    def target():
        try:
            result = call.run()
            if inspect.iscoroutine(result):
                result = asyncio.run(result)
        except BaseException as exc:  # handed to the runner, which reports it
            future.set_exception(exc)
        else:
            future.set_result(result)

    thread = threading.Thread(target=target, name=f"reward:{call.reward.name}", daemon=True)
    thread.start()
    return future, thread


def _per_sample(outcome: object, call: _Call) -> list[tuple[int, object]]:
    """(sample index, (score, extras) or the exception) for every sample the call covers."""
    if isinstance(outcome, BaseException):
        return [(i, outcome) for i in call.samples]
    if not call.reward.batched:
        return [(call.samples[0], _checked(outcome))]
    if not isinstance(outcome, (list, tuple)) or len(outcome) != len(call.samples):
        got = f"{len(outcome)} values" if isinstance(outcome, (list, tuple)) else repr(outcome)
        error = ValueError(f"expected a list of {len(call.samples)} scores, got {got}")
        return [(i, error) for i in call.samples]
    return [(i, _checked(value)) for i, value in zip(call.samples, outcome)]


def _checked(value: object) -> tuple[float | None, dict[str, float]] | Exception:
    """A returned value as (score, extras), or the exception saying why it is not one."""
    try:
        if isinstance(value, dict):
            if "score" not in value:
                raise ValueError(f"returned a dict without a 'score' key: {sorted(value)}")
            extras = {k: _number(v, k) for k, v in value.items() if k != "score"}
            score = value["score"]
            return (None if score is None else _number(score, "score")), extras
        return (None if value is None else _number(value, "score")), {}
    except (TypeError, ValueError) as exc:
        return exc


def _number(value: object, what: str) -> float:
    if not isinstance(value, numbers.Real):
        raise TypeError(
            f"{what} must be a real number (or the reward may return None or a dict with "
            f"'score'), got {type(value).__name__}: {value!r}"
        )
    if not math.isfinite(value):
        raise ValueError(f"{what} is {value}")
    return float(value)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _log_failure(name: str, sample_ids: list[str], error: BaseException) -> None:
    where = sample_ids[0] + (f" and {len(sample_ids) - 1} more" if len(sample_ids) > 1 else "")
    logger.warning("reward %r failed on sample %s: %s", name, where, _describe(error))
