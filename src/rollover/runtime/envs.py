"""Environment workers as Ray actors (`ray.env_workers: N`): the environments of a multi-turn
run live on N actors, anywhere in the cluster, instead of in the driver (DART's environment
cluster).

`RayEnvBuilder` is the run's `EnvGroupBuilder`: `make_group(prompt, n)` returns n proxies at
once, without a round trip. The group is made on an actor (the least loaded: the fewest live
groups) by its first call; each proxy's `initial_observation` and `step` are that actor's
methods on the real environment, awaited by the driver's environment loop, so the episode
runner's timeouts, pool slots and failure rules apply unchanged:

- an environment that raises fails its episode, with the environment's own exception (type,
  message, the actor's traceback as a note), as on the driver;
- an actor that dies fails the episodes whose environments it held (`EnvWorkerDied`, counted
  with the failed episodes); the slot starts a fresh actor, and a group not yet made on the dead
  actor is made on the fresh one, so nothing else is lost;
- a group is dropped from its actor when the driver lets go of it (the episodes are trained or
  discarded), so actors do not grow with the run.

The actors rebuild the environment from `env.name` and `env.options` (a built-in, `module:Name`
or `path/to/file.py:Name`, which must be importable on every node). `start()` makes every actor
and waits until each has built it, so a setup error stops the run before the first step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
import threading
import traceback
import weakref

from rollover.envs.base import Action, Env, StepResult
from rollover.types import Prompt

STARTUP_TIMEOUT_S = 120.0
log = logging.getLogger("rollover")


class EnvWorkerDied(RuntimeError):
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

        from rollover.envs.builders import make_env_builder

        for path in reversed(self.sys_path):
            if path not in sys.path:
                sys.path.insert(0, path)
        try:
            self.builder = make_env_builder(self.name, self.options)
        except BaseException:
            return "failed", traceback.format_exc()
        return "ready", (ray.util.get_node_ip_address(), os.getpid())

    async def make_group(self, key: int, prompt: Prompt, n: int) -> int:
        envs = list(self.builder.make_group(prompt, n))
        if len(envs) != n:
            raise ValueError(f"make_group(prompt, {n}) returned {len(envs)} environments")
        self.groups[key] = envs
        return n

    async def initial_observation(self, key: int, j: int):
        return await _portable_call(self.groups[key][j].initial_observation())

    async def step(self, key: int, j: int, action: Action):
        return await _portable_call(self.groups[key][j].step(action))

    async def drop(self, key: int) -> None:
        self.groups.pop(key, None)

    async def live_groups(self) -> int:
        return len(self.groups)


async def _portable_call(call) -> tuple[str, object]:
    """("ok", value) or ("error", what the environment raised, able to travel back)."""
    from rollover.rewards.worker import _portable

    try:
        return "ok", await call
    except Exception as exc:
        return "error", _portable(exc)


class _Slot:
    """One actor of the pool: its handle, where it runs, and its live groups."""

    def __init__(self, handle, where):
        self.handle, self.where, self.groups = handle, where, 0
        self.dead = self.replacing = False

    def describe(self) -> str:
        return f"environment worker actor (node {self.where[0]}, pid {self.where[1]})"


class RayEnvBuilder:
    """`EnvGroupBuilder` whose environments live on Ray actors (see the module docstring).
    `prompts` (a run that draws its tasks from the environment) is answered by `local`, the
    builder made on the driver from the same config."""

    def __init__(self, local, name: str, options: dict, *, workers: int, cpus: float = 1.0):
        if workers < 1:
            raise ValueError(f"ray.env_workers: need at least one worker, got {workers}")
        self.local, self.name, self.options = local, name, options
        self.workers, self.cpus = workers, cpus
        self._slots: list[_Slot] = []
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self.started = 0  # actors started, replacements included
        self.deaths = 0

    def __getattr__(self, attr):  # `prompts` and anything else a builder offers
        if attr == "local":  # not set yet (a copy in the making): no recursion
            raise AttributeError(attr)
        return getattr(self.local, attr)

    def start(self) -> None:
        """Start every actor and wait until each has built the environment."""
        self._slots = [self._start() for _ in range(self.workers)]

    def make_group(self, prompt: Prompt, n: int) -> list[Env]:
        group = _RemoteGroup(self, next(self._keys), prompt, n)
        return [RemoteEnv(group, j) for j in range(n)]

    def close(self) -> None:
        import ray

        with self._lock:
            slots, self._slots = self._slots, []
        if ray.is_initialized():
            for slot in slots:
                try:
                    ray.kill(slot.handle, no_restart=True)
                except Exception:
                    pass

    @property
    def pids(self) -> list[int]:
        with self._lock:
            return [s.where[1] for s in self._slots if not s.dead]

    # ------------------------------------------------------------ actors
    def _start(self) -> _Slot:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        remote = ray.remote(EnvActor).options(num_cpus=self.cpus, max_restarts=0)
        handle = remote.remote(self.name, self.options, list(sys.path))
        self.started += 1
        try:
            kind, detail = ray.get(handle.ready.remote(), timeout=STARTUP_TIMEOUT_S)
        except (GetTimeoutError, RayActorError) as exc:
            ray.kill(handle, no_restart=True)
            raise EnvWorkerStartError(
                f"an environment worker actor did not start within {STARTUP_TIMEOUT_S:g} s ({self.cpus:g} CPU with "
                f"ray.cpus_per_env_worker, then building env {self.name!r}): {type(exc).__name__}") from None
        if kind != "ready":
            ray.kill(handle, no_restart=True)
            raise EnvWorkerStartError(f"an environment worker actor could not build env {self.name!r}:\n{detail}")
        return _Slot(handle, detail)

    def _place(self) -> _Slot:
        """The live actor with the fewest live groups, after starting a fresh actor in place of a
        dead one (one thread per dead slot; the others place on the live actors meanwhile)."""
        with self._lock:
            if not self._slots:
                raise RuntimeError("the environment workers are closed")
            dead = next((s for s in self._slots if s.dead and not s.replacing), None)
            if dead is not None:
                dead.replacing = True
        if dead is not None:
            try:
                fresh = self._start()  # outside the lock: a start waits for the actor
            except BaseException:
                with self._lock:
                    dead.replacing = False
                raise
            with self._lock:
                if dead in self._slots:
                    self._slots[self._slots.index(dead)] = fresh
        with self._lock:
            live = [s for s in self._slots if not s.dead]
            if not live:
                raise EnvWorkerDied("every environment worker actor is dead, and the one starting is not ready")
            slot = min(live, key=lambda s: s.groups)
            slot.groups += 1
            return slot

    def _died(self, slot: _Slot) -> None:
        with self._lock:
            if slot.dead:
                return
            slot.dead = True
            self.deaths += 1
        log.warning("%s died; the episodes it held fail, and a fresh actor takes its place", slot.describe())

    def _release(self, slot: _Slot, key: int) -> None:
        with self._lock:
            slot.groups -= 1
            dead = slot.dead
        if not dead:
            import ray

            if ray.is_initialized():
                try:
                    slot.handle.drop.remote(key)
                except Exception:
                    pass


class _RemoteGroup:
    """The n environments of one task on one actor, made by the first call of any of them."""

    def __init__(self, builder: RayEnvBuilder, key: int, prompt: Prompt, n: int):
        self.builder, self.key, self.prompt, self.n = builder, key, prompt, n
        self.slot: _Slot | None = None
        self._made: asyncio.Future | None = None

    async def call(self, method: str, *args):
        from ray.exceptions import RayActorError

        slot = await self._ensure()
        try:
            kind, value = await getattr(slot.handle, method).remote(self.key, *args)
        except RayActorError as exc:
            self.builder._died(slot)
            raise EnvWorkerDied(f"{slot.describe()} died, and this episode's environment with it: "
                                f"{_first_line(exc)}") from None
        if kind == "error":
            raise value
        return value

    async def _ensure(self) -> _Slot:
        if self._made is None:
            self._made = asyncio.ensure_future(self._make())
        return await asyncio.shield(self._made)

    async def _make(self) -> _Slot:
        from ray.exceptions import RayActorError

        from ray.exceptions import RayTaskError

        for attempt in range(2):  # an actor found dead before the group exists costs no episode
            slot = await asyncio.to_thread(self.builder._place)
            try:
                await slot.handle.make_group.remote(self.key, self.prompt, self.n)
            except BaseException as exc:
                with self.builder._lock:
                    slot.groups -= 1
                if isinstance(exc, RayTaskError):  # make_group raised: the task's episodes fail with its error
                    raise (exc.cause if isinstance(exc.cause, Exception) else RuntimeError(str(exc))) from None
                if not isinstance(exc, RayActorError):
                    raise
                self.builder._died(slot)
                if attempt:
                    raise EnvWorkerDied(f"{slot.describe()} died while making this task's environments: "
                                        f"{_first_line(exc)}") from None
                continue
            self.slot = slot
            weakref.finalize(self, self.builder._release, slot, self.key)
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
