"""Reward workers as Ray actors (`ray.reward_workers: N`): every reward call of the run is
scored on one of N actors, anywhere in the cluster, instead of on the driver.

`RayRewardPool` keeps the contract of the process pool in `rollover.rewards.pool` (the runner
cannot tell them apart):

- `call(name, method, args)` returns the reward's value or raises what the reward raised (with
  the actor's traceback as a note), `RewardTimeout` when no answer came within the timeout (the
  actor is killed: a call spinning in C code cannot be interrupted any other way), and
  `WorkerDied` when the actor's process ended mid-call. Either way the runner counts the failure
  against that call's samples only, and the slot starts a fresh actor on its next call.
- `WorkerStartError` when an actor cannot start or cannot rebuild the rewards (a setup error,
  which stops the run rather than failing every sample one by one).
- Actors start on demand, at most `size` of them, and are kept between calls. Each rebuilds the
  rewards from their references (built-in name, `module:function`, `file.py:function`) with the
  driver's `sys.path`, so `rollover` and the reward's module must be importable on every node.

Ray must be running when the first call comes (the Ray engine starts it while the run is built).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import queue
import sys
import threading
import traceback
from typing import Sequence

from rollover.rewards.pool import STARTUP_TIMEOUT_S, RewardTimeout, WorkerDied, WorkerStartError
from rollover.rewards.registry import Reward
from rollover.runtime.live import first_line, kill_actor


class RewardActor:
    """One reward worker (wrapped by `ray.remote` on first use)."""

    def __init__(self, setup: dict):
        self.setup = setup
        self.rewards: dict = {}

    def ready(self) -> tuple[str, object]:
        """Rebuild the rewards: ("ready", (node ip, pid)) or ("failed", traceback)."""
        import ray

        from rollover.rewards.worker import _rebuild

        for path in reversed(self.setup["sys_path"]):
            if path not in sys.path:
                sys.path.insert(0, path)
        if not ray.get_gpu_ids():  # Ray hides no GPU from an actor that asked for none: a reward model
            os.environ["CUDA_VISIBLE_DEVICES"] = ""  # on `device: auto` would land on one uncounted
        try:
            self.rewards = _rebuild(self.setup["rewards"])
        except BaseException:
            return "failed", traceback.format_exc()
        return "ready", (ray.util.get_node_ip_address(), os.getpid())

    def call(self, name: str, method: str, args: tuple) -> tuple[str, object]:
        """("ok", value) or ("error", what the reward raised, able to travel)."""
        from rollover.rewards.worker import _dumps, _portable

        try:
            result = getattr(self.rewards[name], method)(*args)
            if inspect.iscoroutine(result):
                result = asyncio.run(result)
            if isinstance(result, list):  # a batched reward's failed samples: exceptions that must travel
                result = [_portable(x, "the reward worker actor") if isinstance(x, Exception) else x for x in result]
            reply = ("ok", result)
        except BaseException as exc:
            reply = ("error", _portable(exc, "the reward worker actor"))
        try:
            return pickle.loads(_dumps(reply))  # a value that cannot travel becomes a clear error
        except Exception as exc:  # pickles, but does not unpickle
            return "error", TypeError(f"returned {type(reply[1]).__name__}, which cannot be sent back from the "
                                      f"reward worker actor: {exc}")


class _Actor:
    def __init__(self, handle, where: tuple[str, int] | None = None):
        self.handle, self.where = handle, where

    def describe(self) -> str:
        if self.where is None:
            return "reward worker actor"
        return f"reward worker actor (node {self.where[0]}, pid {self.where[1]})"


class RayRewardPool:
    """`WorkerPool`'s contract on Ray actors (see the module docstring)."""

    def __init__(self, rewards: Sequence[Reward], *, size: int, timeout_s: float, cpus: float = 1.0,
                 gpus: float = 0.0):
        if size < 1:
            raise ValueError(f"a reward worker pool needs at least one worker, got size={size}")
        references = {}
        for reward in rewards:
            references[reward.name] = reward.reference  # raises, naming the reward, if no actor could rebuild it
            try:
                pickle.dumps(reward.reference)
            except Exception as exc:
                raise TypeError(f"reward {reward.name!r}: its kwargs cannot be sent to a reward worker: {exc}") from exc
        self.size, self.timeout_s, self.cpus, self.gpus = size, timeout_s, cpus, gpus
        self._setup = {"rewards": references}
        self._slots: queue.LifoQueue[_Actor | None] = queue.LifoQueue()
        for _ in range(size):
            self._slots.put(None)
        self._live: set[_Actor] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.started = 0  # actors started, replacements included
        self.calls = 0  # calls answered by an actor (the reward's value or its error)

    def call(self, name: str, method: str, args: tuple) -> object:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        while True:
            actor, fresh = self._acquire()
            try:
                kind, value = ray.get(actor.handle.call.remote(name, method, args), timeout=self.timeout_s)
            except GetTimeoutError:
                self._discard(actor)
                raise RewardTimeout(f"timed out after {self.timeout_s} s; {actor.describe()} was killed") from None
            except RayActorError as exc:
                self._discard(actor)
                if not fresh:
                    # A kept actor may have died while idle, through no fault of this call: it gets
                    # one fresh actor. One that just answered `ready` dying on it is the call's doing.
                    continue
                raise WorkerDied(f"{actor.describe()} died mid-call: {first_line(exc)}") from None
            except BaseException as exc:  # Ray failed the call some other way: this sample's failure, a fresh actor next
                self._discard(actor)
                raise WorkerDied(f"{actor.describe()}: the call failed in Ray: {first_line(exc)}") from None
            break
        self._slots.put(actor)
        with self._lock:
            self.calls += 1
        if kind == "error":
            raise value
        return value

    def metrics(self) -> dict:
        """All-time counts for the step's metrics row: actors started (replacements included)."""
        return {"ray/reward_workers_started_total": self.started}

    def close(self) -> None:
        """Kill every actor; later calls raise."""
        with self._lock:
            self._closed = True
            live, self._live = list(self._live), set()
        for actor in live:
            kill_actor(actor.handle)

    @property
    def pids(self) -> list[int]:
        """Process ids of the actors started and not yet killed (on whichever node)."""
        with self._lock:
            return [a.where[1] for a in self._live if a.where is not None]

    def _acquire(self) -> tuple[_Actor, bool]:
        """(an actor, whether it was started for this call)."""
        import ray
        from ray.exceptions import GetTimeoutError

        actor = self._slots.get()
        if actor is not None and self._closed:
            self._discard(actor)
            actor = self._slots.get()
        if actor is not None:
            return actor, False
        with self._lock:
            # closed, or Ray shut down under the run (`.remote()` would start a new local Ray)
            if self._closed or not ray.is_initialized():
                self._slots.put(None)
                raise RuntimeError("the reward worker pool is closed" if self._closed else
                                   "Ray is shut down: no reward worker actor can score this call")
            try:
                remote = ray.remote(RewardActor).options(num_cpus=self.cpus, num_gpus=self.gpus, max_restarts=0,
                                                         max_concurrency=1)
                actor = _Actor(remote.remote({**self._setup, "sys_path": list(sys.path)}))
            except BaseException:
                self._slots.put(None)
                raise
            self._live.add(actor)
            self.started += 1
        try:
            kind, detail = ray.get(actor.handle.ready.remote(), timeout=STARTUP_TIMEOUT_S)
        except GetTimeoutError:
            self._discard(actor)
            raise WorkerStartError(
                f"a reward worker actor did not start within {STARTUP_TIMEOUT_S} s (waiting for {self.cpus:g} CPU "
                f"with ray.cpus_per_reward_worker, then importing {sorted(self._setup['rewards'])})") from None
        except BaseException as exc:
            self._discard(actor)
            raise WorkerStartError(f"a reward worker actor died while starting: {first_line(exc)}") from None
        if kind != "ready":
            self._discard(actor)
            raise WorkerStartError(f"a reward worker actor could not rebuild the rewards:\n{detail}")
        actor.where = detail
        return actor, True

    def _discard(self, actor: _Actor) -> None:
        """Kill `actor` and give its slot to a fresh one, started by the slot's next call."""
        kill_actor(actor.handle)
        with self._lock:
            self._live.discard(actor)
        self._slots.put(None)
