"""Environment workers as Ray actors (`ray.env_workers: N`): the environments of a multi-turn
run live on N actors, anywhere in the cluster, instead of in the driver (DART's environment
cluster).

`RayEnvBuilder` is the run's `EnvGroupBuilder`. `make_group(prompt, n)` picks the live actor
with the fewest live groups, asks it to make the group (without waiting for the answer) and
returns n proxies; each proxy's `initial_observation` and `step` are that actor's methods on
the real environment, awaited by the driver's environment loop, so the episode runner's
timeouts, pool slots and failure rules apply unchanged:

- an environment that raises fails its episode with its own exception (type, message, the
  actor's traceback as a note), as on the driver; a call past `env.step_timeout_s` fails its
  episode, and is cancelled on the actor too;
- an actor whose event loop stops answering (an environment that blocks it instead of
  awaiting) is found by a ping after an episode's step or first observation times out; one that
  does not answer within `HANG_PING_S` is killed and counts as dead (`ray/env_workers_hung_total` as
  well). (Not after a wait for the group's making: a slow builder blocks the loop legitimately);
- an actor that dies fails the episodes whose environments it held (`EnvWorkerDied`, counted
  with the failed episodes, during a resumed run's replay as well); a fresh actor is started
  in its place at once, and a group whose actor turns out dead before its environments exist
  is made on another, so nothing else is lost. While no actor is alive, `make_group` waits for
  the replacement (up to `STARTUP_TIMEOUT_S`);
- `make_group` raising on an actor fails that group's episodes and stops the run at the next
  `make_group` (a builder bug, as on the driver, where it stops the run at once);
- a group is dropped from its actor when the driver lets go of it (its episodes are trained or
  discarded), so actors do not grow with the run.

The actors rebuild the environment from `env.name` and `env.options` (a built-in, `module:Name`
or `path/to/file.py:Name`, made absolute; it must be importable on every node). `start()`
makes every actor and waits until each has built it, so a setup error stops the run before
its first step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import sys
import threading
import traceback
import weakref

from rollover.envs.base import Action, Env, EnvLost, StepResult, make_group, make_one
from rollover.rewards.pool import STARTUP_TIMEOUT_S  # the reward workers' bound on a start, too
from rollover.runtime.live import first_line, kill_actor
from rollover.types import Prompt

log = logging.getLogger("rollover")

HANG_PING_S = 30.0  # an actor must answer a ping this fast after a call on it timed out, or it is replaced


class EnvWorkerDied(EnvLost):
    """The environment worker actor holding an episode's environment died."""


class EnvWorkerStartError(RuntimeError):
    """An environment worker actor could not start or could not build the environment."""


class EnvActor:
    """One environment worker (wrapped by `ray.remote` on use). Its methods are coroutines, so
    one actor runs the calls of many episodes at once, as the driver's environment loop does."""

    def __init__(self, name: str, options: dict, sys_path: list[str]):
        self.name, self.options, self.sys_path = name, options, sys_path
        self.builder = None
        self.groups: dict[int, list] = {}

    async def ready(self) -> tuple[str, object]:
        """Build the environment: ("ready", (node ip, pid)) or ("failed", traceback)."""
        import ray

        from rollover.envs.base import ThreadPerCall
        from rollover.envs.builders import make_env_builder

        asyncio.get_running_loop().set_default_executor(ThreadPerCall())  # a hung call holds no other up
        for path in reversed(self.sys_path):
            if path not in sys.path:
                sys.path.insert(0, path)
        try:
            self.builder = make_env_builder(self.name, self.options)
        except BaseException:
            return "failed", traceback.format_exc()
        return "ready", (ray.util.get_node_ip_address(), os.getpid())

    async def make_group(self, key: int, prompt: Prompt, n: int, only: int | None = None) -> tuple[str, object]:
        """The group's n environments, or (`only` = j) the one at place j, held as a group of one."""
        try:
            if only is not None:
                envs = [make_one(self.builder, prompt, n, only)]
            else:
                envs = make_group(self.builder, prompt, n)
        except Exception as exc:
            return "error", _portable(exc)
        self.groups[key] = envs
        return "ok", len(envs)

    async def initial_observation(self, key: int, j: int):
        return await _portable_call(self.groups[key][j].initial_observation())

    async def step(self, key: int, j: int, action: Action):
        return await _portable_call(self.groups[key][j].step(action))

    async def ping(self) -> str:
        """Answered at once by an actor whose event loop runs (the hang check)."""
        return "pong"

    async def drop(self, keys: list[int]) -> None:
        for key in keys:
            self.groups.pop(key, None)


def _portable(exc: BaseException) -> BaseException:
    from rollover.rewards.worker import _portable as portable

    return portable(exc, "the environment worker actor")


async def _portable_call(call) -> tuple[str, object]:
    """("ok", value) or ("error", what the environment raised, able to travel back)."""
    try:
        return "ok", await call
    except (Exception, SystemExit) as exc:  # a sys.exit in an environment fails its episode, not the actor
        return "error", _portable(exc)


class _Slot:
    """One actor of the pool: its handle, where it runs, and its live groups."""

    def __init__(self, handle, where):
        self.handle, self.where, self.groups = handle, where, 0
        self.dead = False

    def describe(self) -> str:
        return f"environment worker actor (node {self.where[0]}, pid {self.where[1]})"


class RayEnvBuilder:
    """`EnvGroupBuilder` whose environments live on Ray actors (see the module docstring).
    `prompts` (a run that draws its tasks from the environment) is answered by `local`, the
    builder made on the driver from the same config."""

    def __init__(self, local, name: str, options: dict, *, workers: int, cpus: float = 1.0, concurrency: int = 1000):
        if workers < 1:
            raise ValueError(f"ray.env_workers: need at least one worker, got {workers}")
        self.local, self.name, self.options = local, name, options
        self.workers, self.cpus, self.concurrency = workers, cpus, concurrency
        self._slots: list[_Slot] = []
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a replacement came (or failed)
        self._released: queue.SimpleQueue = queue.SimpleQueue()  # (slot, key) of groups the driver let go
        self._closed = False
        self._replacing = 0  # replacements being started
        self.error: BaseException | None = None  # make_group failed on an actor: the run stops
        self.started = 0  # actors started, replacements included
        self.deaths = 0  # hung actors included
        self.hung = 0
        self._pinging: set[_Slot] = set()
        self.groups_made = 0  # groups placed on actors, all time

    def __getattr__(self, attr):  # `prompts` and anything else a builder offers
        if attr == "local":  # not set yet (a copy in the making): no recursion
            raise AttributeError(attr)
        return getattr(self.local, attr)

    def start(self) -> None:
        """Start every actor and wait until each has built the environment."""
        for _ in range(self.workers):
            slot = self._start()
            with self._lock:
                self._slots.append(slot)  # kept at once: if a later one fails, close() kills this one

    def make_group(self, prompt: Prompt, n: int) -> list[Env]:
        if self.error is not None:
            raise RuntimeError(f"env {self.name!r}: make_group failed on an environment worker: "
                               f"{type(self.error).__name__}: {self.error}") from self.error
        self._drop_released()
        group = self._group(prompt, n, None)
        return [RemoteEnv(group, j) for j in range(n)]

    def make_one(self, prompt: Prompt, n: int, j: int) -> Env:
        """The environment at place j of a group of n, made alone on an actor (a resample)."""
        if self.error is not None:
            raise RuntimeError(f"env {self.name!r}: make_group failed on an environment worker: "
                               f"{type(self.error).__name__}: {self.error}") from self.error
        self._drop_released()
        return RemoteEnv(self._group(prompt, n, j), 0)

    def _group(self, prompt: Prompt, n: int, only: int | None) -> _RemoteGroup:
        group = _RemoteGroup(self, next(self._keys), prompt, n, only)
        slot = self._place(wait=False)  # none alive: the group's first call waits for a replacement
        if slot is not None:
            group.place(slot)
        self.groups_made += 1
        return group

    def metrics(self) -> dict:
        """All-time counts for the step's metrics row."""
        return {"ray/env_workers_started_total": self.started, "ray/env_worker_deaths_total": self.deaths,
                "ray/env_workers_hung_total": self.hung}

    def close(self) -> None:
        import ray

        with self._lock:
            self._closed = True
            slots, self._slots = self._slots, []
            for slot in slots:  # a ping in flight finds them dead, and counts nothing
                slot.dead = True
            self._changed.notify_all()
        if ray.is_initialized():
            for slot in slots:
                kill_actor(slot.handle)

    @property
    def pids(self) -> list[int]:
        with self._lock:
            return [s.where[1] for s in self._slots if not s.dead]

    # ------------------------------------------------------------ actors
    def _start(self) -> _Slot:
        import ray
        from ray.exceptions import GetTimeoutError

        with self._lock:  # closed, or Ray shut down under the run (`.remote()` would start a new local Ray)
            if self._closed or not ray.is_initialized():
                raise EnvWorkerStartError("the environment workers are closed")
            remote = ray.remote(EnvActor).options(num_cpus=self.cpus, max_restarts=0,
                                                  max_concurrency=self.concurrency)
            handle = remote.remote(self.name, self.options, list(sys.path))
            self.started += 1
        try:
            kind, detail = ray.get(handle.ready.remote(), timeout=STARTUP_TIMEOUT_S)
        except GetTimeoutError:
            kill_actor(handle)
            raise EnvWorkerStartError(
                f"an environment worker actor did not start within {STARTUP_TIMEOUT_S:g} s ({self.cpus:g} CPU with "
                f"ray.cpus_per_env_worker, then building env {self.name!r})") from None
        except Exception as exc:
            kill_actor(handle)
            raise EnvWorkerStartError(f"an environment worker actor died while starting: {first_line(exc)}") from None
        if kind != "ready":
            kill_actor(handle)
            raise EnvWorkerStartError(f"an environment worker actor could not build env {self.name!r}:\n{detail}")
        return _Slot(handle, detail)

    def _place(self, wait: bool = True) -> _Slot | None:
        """The live actor with the fewest live groups. With none alive: None if not `wait`, else
        wait for a replacement (starting one again if the last start failed)."""
        with self._lock:
            live = self._live()
            if not live and not self._closed and wait:
                if not self._replacing:  # every replacement failed to start: try again
                    dead = next((s for s in self._slots if s.dead), None)
                    if dead is not None:
                        self._replacing += 1
                        threading.Thread(target=self._replace, args=(dead,), name="rollover-env-worker-start",
                                         daemon=True).start()
                self._changed.wait_for(lambda: self._live() or self._closed, timeout=STARTUP_TIMEOUT_S)
                live = self._live()
            if self._closed:
                raise RuntimeError("the environment workers are closed")
            if not live:
                if not wait:
                    return None
                raise EnvWorkerDied(f"every environment worker actor is dead, and no replacement was ready within "
                                    f"{STARTUP_TIMEOUT_S:g} s")
            slot = min(live, key=lambda s: s.groups)
            slot.groups += 1
            return slot

    def _live(self) -> list[_Slot]:
        return [s for s in self._slots if not s.dead]

    def _check_alive(self, slot: _Slot) -> None:
        """A call on `slot` timed out (or was cancelled): ping its actor, off the caller's thread."""
        with self._lock:
            if slot.dead or self._closed or slot in self._pinging:
                return
            self._pinging.add(slot)
        threading.Thread(target=self._ping, args=(slot,), name="rollover-env-worker-ping", daemon=True).start()

    def _ping(self, slot: _Slot) -> None:
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            ray.get(slot.handle.ping.remote(), timeout=HANG_PING_S)
        except GetTimeoutError:
            if self._died(slot, hung=True):
                log.warning("%s did not answer a ping within %g s after a call on it timed out (an environment blocks "
                            "its event loop); it is killed, the episodes it held fail, and a fresh actor takes its place",
                            slot.describe(), HANG_PING_S)
        except Exception:  # dead already: replaced now rather than at the next call on it
            self._died(slot)
        finally:
            with self._lock:
                self._pinging.discard(slot)

    def _died(self, slot: _Slot, hung: bool = False) -> bool:
        """`slot`'s actor is dead, or hung (it is killed to make sure): replace it now. False if
        it was counted dead already."""
        with self._lock:
            if slot.dead:
                return False
            slot.dead = True
            self.deaths += 1
            self.hung += hung
            closed = self._closed
        kill_actor(slot.handle)
        if closed:
            return True
        if not hung:
            log.warning("%s died; the episodes it held fail, and a fresh actor takes its place", slot.describe())
        with self._lock:
            self._replacing += 1
        threading.Thread(target=self._replace, args=(slot,), name="rollover-env-worker-start", daemon=True).start()
        return True

    def _replace(self, dead: _Slot) -> None:
        """Start an actor in `dead`'s place (`_replacing` counted up by the caller)."""
        try:
            fresh = self._start()
        except Exception as e:
            log.error("could not start an environment worker actor in place of a dead one: %s", e)
            with self._lock:
                self._replacing -= 1
                self._changed.notify_all()
            return
        with self._lock:
            self._replacing -= 1
            if self._closed:
                kill_actor(fresh.handle)
            elif dead in self._slots:
                self._slots[self._slots.index(dead)] = fresh
            else:  # another replacement took that place first
                kill_actor(fresh.handle)
            self._changed.notify_all()

    def _release(self, where: list, key: int) -> None:
        """A group's finalizer (may run inside the garbage collector, on any thread, with any
        lock held): only queues the drop, done by the next `make_group`. `where[0]` is the slot
        the group was last placed on."""
        if where[0] is not None:
            self._released.put((where[0], key))

    def _drop_released(self) -> None:
        drops: dict[_Slot, list[int]] = {}
        while True:
            try:
                slot, key = self._released.get_nowait()
            except queue.Empty:
                break
            drops.setdefault(slot, []).append(key)
        for slot, keys in drops.items():
            with self._lock:
                slot.groups -= len(keys)
                dead = slot.dead
            if not dead:
                try:
                    slot.handle.drop.remote(keys)
                except Exception:  # the actor just died: its groups went with it
                    pass


class _RemoteGroup:
    """The n environments of one task on one actor."""

    def __init__(self, builder: RayEnvBuilder, key: int, prompt: Prompt, n: int, only: int | None = None):
        self.builder, self.key, self.prompt, self.n, self.only = builder, key, prompt, n, only
        self._where: list = [None]  # the slot it is placed on, shared with its finalizer (which must not hold the group)
        self._made = None  # the actor's make_group, asked for at once
        self._ready: asyncio.Future | None = None
        weakref.finalize(self, builder._release, self._where, key)

    @property
    def slot(self) -> _Slot | None:
        return self._where[0]

    def place(self, slot: _Slot) -> None:
        """Ask `slot`'s actor to make the group (an object reference, awaited by the first call)."""
        self._where[0] = slot
        self._made = slot.handle.make_group.remote(self.key, self.prompt, self.n, self.only)

    async def call(self, method: str, *args):
        import ray
        from ray.exceptions import RayActorError

        slot = await self._ensure()
        if not ray.is_initialized():
            raise RuntimeError("Ray is shut down: the environment worker actors are gone")
        ref = getattr(slot.handle, method).remote(self.key, *args)
        try:
            kind, value = await ref
        except asyncio.CancelledError:  # the episode's step timeout: stop the call on the actor too
            ray.cancel(ref)
            self.builder._check_alive(slot)
            raise
        except RayActorError as exc:
            self.builder._died(slot)
            raise EnvWorkerDied(f"{slot.describe()} died, and this episode's environment with it: "
                                f"{first_line(exc)}") from None
        if kind == "error":
            raise value
        return value

    async def _ensure(self) -> _Slot:
        if self._ready is None:
            self._ready = asyncio.ensure_future(self._wait_made())
        return await asyncio.shield(self._ready)

    async def _wait_made(self) -> _Slot:
        from ray.exceptions import RayActorError

        if self._made is None:  # no actor was alive at make_group: wait for a replacement, off the loop
            self.place(await asyncio.to_thread(self.builder._place))
        for attempt in range(2):  # an actor found dead before the group exists costs no episode
            slot = self.slot
            try:
                kind, value = await self._made
            except RayActorError as exc:
                self.builder._died(slot)
                if attempt:
                    raise EnvWorkerDied(f"{slot.describe()} died while making this task's environments: "
                                        f"{first_line(exc)}") from None
                with self.builder._lock:
                    slot.groups -= 1
                self.place(await asyncio.to_thread(self.builder._place))
                continue
            if kind == "error":  # the builder's make_group failed: this group fails, the run stops at the next
                if self.builder.error is None:
                    self.builder.error = value
                raise value
            return slot
        raise AssertionError("unreachable")


class RemoteEnv:
    """One episode's environment on an environment worker actor (the `Env` protocol)."""

    def __init__(self, group: _RemoteGroup, j: int):
        self.group, self.j = group, j

    async def initial_observation(self) -> list[dict]:
        return await self.group.call("initial_observation", self.j)

    async def step(self, action: Action) -> StepResult:
        return await self.group.call("step", self.j, action)
