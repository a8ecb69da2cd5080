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

Where calls run, and how the timeout is enforced.

- Isolated rewards (`Reward.isolated`: the built-in `math`, and any function marked
  `isolate`) run in a pool of `workers` processes (`rollover.rewards.pool`). At `timeout_s`
  the worker is killed (SIGKILL) and the slot gets a fresh one, so a runaway call costs one
  timeout and nothing after it. A worker that dies on its own (segfault, OOM kill) fails its
  call the same way. Nothing is left running.
- Every other reward runs in a daemon thread, at most `max_threads` at once. Python cannot
  kill a thread: a call past its timeout is abandoned, not stopped. Its slot goes to the next
  call at once and its result is thrown away, but it keeps its CPU and memory until it
  returns; `stuck_threads` reports how many are still alive. Worse, a call that holds the
  interpreter lock in C code (a sympy power, a catastrophic regex) stops every thread,
  including the one that would time it out: mark such a function `isolate`.

Threads overlap I/O (a remote judge, a sandbox) but not pure-Python CPU work, which the GIL
serialises; processes run CPU-bound rewards in parallel. Timeouts and failures of both kinds
go through `on_error` alike. An `async def` reward is run to completion with `asyncio.run`
in its thread or worker. Nothing here uses signals, so the runner works from any thread.
`close()` stops the workers.

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
from collections import Counter, deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Callable, Iterator, Literal, Sequence

from rollover.rewards.builtins import numpy_bool
from rollover.rewards.pool import RewardTimeout, WorkerPool, WorkerStartError
from rollover.rewards.registry import Reward, TrainerState
from rollover.types import Prompt

logger = logging.getLogger("rollover.rewards")

OnError = Literal["raise", "zero", "skip"]
SampleStatus = Literal["ok", "skipped"]
LANES = (False, True)  # in a thread, in a worker process
# About 11 days. A worker's pipe (`Connection.poll`) and `select` overflow past ~24 days
# (2**31 ms), which would fail every isolated call; nothing real waits that long.
MAX_TIMEOUT_S = 1e6


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
    error: str  # "ValueError: boom", "RewardTimeout: timed out after 5.0 s; ..."
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
    stuck_threads: int  # abandoned in-thread calls still running after this batch

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
    run: Callable[[], object]  # the call itself, or its round trip to a worker process


class _Tally:
    """Scores and failures collected while a batch's calls come back."""

    LOGGED = 3  # failures of one function logged one by one in a batch; the rest are summed up

    def __init__(self, sample_ids: Sequence[str], names: list[str], on_error: OnError,
                 prompt_ids: Sequence[str] | None = None):
        n = len(sample_ids)
        self.sample_ids = sample_ids
        # how a failure names its sample: with the prompt (the data row) it answers
        self.where = [s if p is None or p in s else f"{s} (prompt {p})"
                      for s, p in zip(sample_ids, prompt_ids or [None] * n)]
        self.logged: dict[str, int] = {}
        self.unlogged: dict[str, int] = {}
        self.on_error = on_error
        self.scores: list[dict[str, float | None]] = [dict.fromkeys(names) for _ in range(n)]
        self.extras: list[dict[str, float]] = [{} for _ in range(n)]
        self.failed: list[list[str]] = [[] for _ in range(n)]
        self.failures: list[RewardFailure] = []

    def add(self, call: _Call, outcome: object) -> None:
        name = call.reward.name
        timed_out = isinstance(outcome, RewardTimeout)
        results = _per_sample(outcome, call)
        # One log line per distinct error: a failed batched call fails all its samples at once.
        by_error: dict[int, tuple[BaseException, list[str]]] = {}
        for i, result in results:
            if isinstance(result, BaseException):
                by_error.setdefault(id(result), (result, []))[1].append(self.where[i])
        for error, ids in by_error.values():
            if self.logged.get(name, 0) < self.LOGGED:
                self.logged[name] = self.logged.get(name, 0) + 1
                _log_failure(name, ids, error)
            else:
                self.unlogged[name] = self.unlogged.get(name, 0) + len(ids)

        for i, result in results:
            if not isinstance(result, BaseException):
                self.scores[i][name], extra = result
                self.extras[i].update({f"{name}/{key}": v for key, v in extra.items()})
                continue
            failure = RewardFailure(name, self.sample_ids[i], _describe(result), timed_out)
            if self.on_error == "raise":
                raise RewardFailed(name, self.where[i], failure.error) from result
            self.failures.append(failure)
            self.failed[i].append(name)


class RewardRunner:
    """Scores batches with weighted reward functions (see the module docstring).

    `timeout_s` bounds each call: one completion for a per-sample function, the whole batch
    for a TRL-style one. `workers` is the number of processes for isolated rewards, started
    on first use; `max_threads` bounds the other calls in flight. `pool`, an object with the
    process pool's `call`/`close`/`size` (`rollover.runtime.rewards.RayRewardPool`), takes every
    call, isolated or not, and `workers` is then unused. Safe to share between threads. Call
    `close()` (or use it as a context manager) to stop the workers.
    """

    def __init__(
        self,
        rewards: Sequence[Reward],
        *,
        timeout_s: float = 10.0,
        on_error: OnError = "raise",
        workers: int = 4,
        max_threads: int = 8,
        pool: object | None = None,
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
        if not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {timeout_s}")
        for r in rewards:  # a built-in whose own time limit must end before the call's (code's sandbox)
            base, bound = _base(r), (r.fn.keywords if isinstance(r.fn, functools.partial) else {})
            check = getattr(base, "_rollover_check_timeout", None)
            if check is not None:
                try:
                    check(timeout_s, **bound)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"reward {r.name!r}: {e}") from None
        if workers < 1 or max_threads < 1:
            raise ValueError(f"workers and max_threads must be >= 1, got {workers}, {max_threads}")
        self.rewards = list(rewards)
        self.timeout_s = timeout_s
        self.on_error = on_error
        self.max_threads = max_threads
        # `pool` given (Ray reward workers): every reward is called there, isolated or not
        self._all_in_pool = pool is not None
        isolated = [r for r in rewards if r.isolated]
        if pool is None and isolated:
            pool = WorkerPool(isolated, size=workers, timeout_s=timeout_s)
        self.pool = pool
        # what a TRL-style function reads as `trainer_state`: the loops move it on after each step
        self.trainer_state = TrainerState()
        self._stuck: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """Kill the worker processes and let go of what the rewards loaded here (reward_model's
        models); `score` raises afterwards. Abandoned threads are left."""
        self._closed = True
        if self.pool is not None:
            self.pool.close()
        for reward in self.rewards:
            base = reward.fn.func if isinstance(reward.fn, functools.partial) else reward.fn
            release = getattr(base, "_rollover_close", None)
            if release is not None:
                release()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
        opened_reasoning: Sequence[bool] | None = None,
    ) -> BatchRewards:
        """Score `completions[i]` against `prompts[i]` (repeat a prompt once per completion).

        Sample ids default to "<prompt id>#<index in batch>". `completion_ids` is only handed
        to TRL-style functions that ask for it (whole, reasoning included, also for a reward that
        drops the reasoning). `opened_reasoning[i]`: the i-th prompt ended in an open `<think>`
        (what a reward with `reasoning="drop"` sees, `Reward.sees`).
        """
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"{len(prompts)} prompts for {n} completions")
        if sample_ids is None:
            sample_ids = [f"{p.id}#{i}" for i, p in enumerate(prompts)]
        if any(given is not None and len(given) != n for given in (sample_ids, completion_ids, opened_reasoning)):
            raise ValueError("sample_ids, completion_ids and opened_reasoning need one entry per completion")
        if self._closed:
            raise RuntimeError("this RewardRunner is closed")

        names = [r.name for r in self.rewards]
        tally = _Tally(sample_ids, names, self.on_error, [p.id for p in prompts])
        calls = self._calls(prompts, completions, completion_ids, opened_reasoning or [False] * n)
        with contextlib.closing(self._run(calls)) as outcomes:
            for call, outcome in outcomes:
                if isinstance(outcome, WorkerStartError):
                    raise outcome  # no worker: every isolated call would fail, not one sample
                tally.add(call, outcome)
        for name, count in tally.unlogged.items():
            logger.warning("reward %r failed on %d more sample(s) of this batch (on_error=%s)", name, count,
                           self.on_error)

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
            stuck_threads=self.stuck_threads(),
        )

    def _calls(self, prompts, completions, completion_ids, opened) -> list[_Call]:
        n = len(completions)
        calls = []
        for reward in self.rewards:
            if reward.batched:
                args = (
                    [p.text if p.text is not None else p.messages for p in prompts],
                    [reward.sees(c, o) for c, o in zip(completions, opened)],
                    [p.answer for p in prompts],
                    [p.fields for p in prompts],
                    None if completion_ids is None else list(completion_ids),
                    self.timeout_s,
                    self.trainer_state,
                )
                calls.append(_Call(reward, list(range(n)), self._bind(reward, "call_batch", args)))
            else:
                for i, (p, c, o) in enumerate(zip(prompts, completions, opened)):
                    run = self._bind(reward, "call_one", (reward.sees(c, o), p.answer, p.fields))
                    calls.append(_Call(reward, [i], run))
        return calls

    def _bind(self, reward: Reward, method: str, args: tuple) -> Callable[[], object]:
        if self._in_pool(reward):
            return functools.partial(self.pool.call, reward.name, method, args)
        return functools.partial(getattr(reward, method), *args)

    def _in_pool(self, reward: Reward) -> bool:
        return self._all_in_pool or reward.isolated

    def _run(self, calls: list[_Call]) -> Iterator[tuple[_Call, object]]:
        """Yield (call, result or exception) as calls finish or time out.

        Each call gets a thread: it runs an in-thread reward, or waits on a worker process
        for an isolated one. In-thread calls are timed out here (abandoned); isolated ones by
        the pool (killed), so they have no deadline here and always come back.
        """
        # Two lanes, keyed by `isolated`, each with its own limit on calls in flight; a reward
        # with its own limit (`code`: one sandbox per CPU) waits here, before its timeout starts.
        pending = {lane: deque(c for c in calls if self._in_pool(c.reward) == lane) for lane in LANES}
        limit = {False: self.max_threads, True: self.pool.size if self.pool else 0}
        own = {r.name: getattr(_base(r), "_rollover_max_concurrency", None) for r in self.rewards}
        running: dict[Future, tuple[_Call, float | None, threading.Thread]] = {}
        try:
            while any(pending.values()) or running:
                for lane in LANES:
                    busy = sum(self._in_pool(c.reward) == lane for c, _, _ in running.values())
                    per_reward = Counter(c.reward.name for c, _, _ in running.values())
                    waiting = deque()
                    while pending[lane] and busy < limit[lane]:
                        call = pending[lane].popleft()
                        cap = own[call.reward.name]
                        if cap is not None and per_reward[call.reward.name] >= cap:
                            waiting.append(call)
                            continue
                        future, thread = _start(call)
                        deadline = None if lane else time.monotonic() + self.timeout_s
                        running[future] = (call, deadline, thread)
                        busy += 1
                        per_reward[call.reward.name] += 1
                    pending[lane] = waiting + pending[lane]  # in their order
                deadlines = [d for _, d, _ in running.values() if d is not None]
                timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
                done, _ = wait(running, timeout=timeout, return_when=FIRST_COMPLETED)
                for future in done:
                    call, _, _ = running.pop(future)
                    error = future.exception()
                    yield call, (error if error is not None else future.result())
                now = time.monotonic()
                for future, (call, deadline, thread) in list(running.items()):
                    if deadline is not None and deadline <= now and not future.done():
                        del running[future]
                        self._abandon(thread)
                        yield call, RewardTimeout(
                            f"timed out after {self.timeout_s} s; its thread cannot be killed "
                            "and runs on"
                        )
        finally:
            # Left early (on_error="raise"): in-thread calls still running are abandoned too;
            # isolated ones end by their timeout at the latest and free their worker.
            for _, deadline, thread in running.values():
                if deadline is not None:
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

    def stuck_threads(self) -> int:
        """In-thread calls abandoned at their timeout that still run (threads cannot be killed)."""
        with self._lock:
            self._stuck = [t for t in self._stuck if t.is_alive()]
            return len(self._stuck)


def _base(reward: Reward):
    """The function a reward calls, its bound options aside."""
    return reward.fn.func if isinstance(reward.fn, functools.partial) else reward.fn


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
    # a batched function may put an exception in a sample's place: that sample fails with it
    return [(i, value if isinstance(value, Exception) else _checked(value)) for i, value in zip(call.samples, outcome)]


def _checked(value: object) -> tuple[float | None, dict[str, float]] | Exception:
    """A returned value as (score, extras), or the exception saying why it is not one."""
    try:
        if isinstance(value, dict):
            if "score" not in value:
                raise ValueError(f"returned a dict without a 'score' key: {sorted(value)}")
            # text (verl's `pred`, the answer it extracted) is not a metric: left out
            extras = {k: _number(v, k) for k, v in value.items() if k != "score" and not isinstance(v, (str, bytes))}
            score = value["score"]
            return (None if score is None else _number(score, "score")), extras
        return (None if value is None else _number(value, "score")), {}
    except (TypeError, ValueError) as exc:
        return exc


def _number(value: object, what: str) -> float:
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a 0-d array or tensor (TRL's torch rewards)
        value = value.item()
    if not isinstance(value, numbers.Real) and not numpy_bool(value):
        raise TypeError(
            f"{what} must be a real number (or the reward may return None or a dict with "
            f"'score'), got {type(value).__name__}: {value!r:.200}"
        )
    try:
        number = float(value)
    except OverflowError as e:  # an int or Fraction past 1.8e308; its repr may be too long to print
        raise ValueError(f"{what} does not fit in a float ({type(value).__name__}: {e})") from None
    if not math.isfinite(number):
        raise ValueError(f"{what} is {number}")
    return number


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _log_failure(name: str, sample_ids: list[str], error: BaseException) -> None:
    where = sample_ids[0] + (f" and {len(sample_ids) - 1} more" if len(sample_ids) > 1 else "")
    logger.warning("reward %r failed on sample %s: %s", name, where, _describe(error))
