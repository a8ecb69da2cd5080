"""The rollout core: samples driven through the engine and the environments, for every schedule.

A sample is an episode. Single-turn work is an episode of one turn with no environment: its
completion is the sample, scored by the reward functions when its group completes. A
multi-turn sample is a `LiveEpisode` (rollover.envs.episode) alternating engine turns and
environment calls. `SampleDriver` moves samples along; the schedules (sync, APRIL, async)
decide only what to start and when to stop, and hear back through two callbacks:

- `on_finished(group, j)`: sample j is done (`group.done[j]` holds its `Completion` or
  `Trajectory`);
- `on_aborted(group, j)`: sample j's engine request came back aborted; its tokens are kept
  (in `group.partial[j]`, or inside the episode), and `advance(group, j)` resumes it at its
  next token.

Request identity is typed: the driver keeps a route from each live request to its
`SampleRef`; no schedule parses request ids.

Environment calls run on an `EnvRunner`: by default a thread with its own event loop and an
`EnvPool` (the environment cluster: `env.max_concurrent` calls at once, each bounded by
`env.step_timeout_s`), so decoding never waits for an environment; with `env.inline` they run
on the thread that finished the turn (the engine's, between decode steps), which makes the
schedule a function of the seeds alone (exact resume) at the price of stalling decoding while
an environment works — for fast environments such as games.

While `hold` is set (a step has stopped, the async service is paused) nothing new is sent to
the engine or the environments: a sample whose environment call lands meanwhile stays in its
next phase, and `idle` says when no request and no environment call is in flight.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Callable

from rollover.engine.cpu import openmp
from rollover.envs.base import EnvLost, env_loop, make_group, make_one
from rollover.envs.episode import EnvPool, LiveEpisode, env_open, env_step
from rollover.envs.render import episode_renderer
from rollover.types import Completion, Request
from rollover.rollout.inputs import RolloutInputs

log = logging.getLogger("rollover")


@dataclass(frozen=True, eq=False)
class SampleRef:
    """Sample j of a pending group: what a live request belongs to."""

    group: object  # rollover.rollout.groups.PendingGroup
    j: int


class EnvRunner:
    """Runs environment calls (coroutine functions returning (value, error, seconds)) and hands
    each result to a callback: on a background event loop (`inline=False`) or at once on the
    calling thread (`inline=True`)."""

    def __init__(self, max_concurrent: int, inline: bool = False):
        self.inline = inline
        self.max_concurrent = max_concurrent
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inline_lock = threading.Lock()  # held while the run's inline loop runs a call
        self._thread: threading.Thread | None = None
        self.pool: EnvPool | None = None
        if not inline:
            ready = threading.Event()
            self._thread = threading.Thread(target=self._serve, args=(ready,), name="rollover-envs", daemon=True)
            self._thread.start()
            ready.wait()

    def _serve(self, ready: threading.Event) -> None:
        self._loop = env_loop()
        asyncio.set_event_loop(self._loop)
        self.pool = EnvPool(self.max_concurrent)
        ready.set()
        self._loop.run_forever()

    def call(self, fn: Callable, done: Callable) -> None:
        """`done(*await fn(pool))`; an exception escaping `fn` (not the environment's: those are
        results; here even a CancelledError) goes to `done` as the only argument."""
        if self.inline:
            try:
                out = self._run_inline(fn(None))
            except BaseException as e:  # even a CancelledError: the caller counts this call as landed
                return done(e)
            return done(*out)

        async def run():
            try:
                out = await fn(self.pool)
            except asyncio.CancelledError as e:
                if self._closing:  # the run is ending: a call still out is dropped, not an error
                    return
                return done(e)
            except BaseException as e:
                return done(e)
            done(*out)

        asyncio.run_coroutine_threadsafe(run(), self._loop)

    def _run_inline(self, coro):
        """`coro` run to its end on this thread, on one event loop kept from call to call (an
        environment may hold a subprocess, a lock or a session of it from episode to episode).
        A call another thread makes while that loop runs one (an evaluation beside async's
        training episodes) gets a loop of its own for the call."""
        if self._inline_lock.acquire(blocking=False):
            try:
                if self._loop is None:
                    self._loop = env_loop()
                return self._loop.run_until_complete(coro)
            finally:
                self._inline_lock.release()
        loop = env_loop()
        try:
            return loop.run_until_complete(coro)
        finally:
            loop.close()

    def close(self) -> None:
        """Cancel the calls still out (an APRIL step does not wait for them) and stop the loop."""
        self._closing = True
        if self.inline:
            if not self._inline_lock.acquire(timeout=5):  # a call still running: its loop is left to it
                log.warning("env: an inline environment call still runs 5 s after the run asked to close; its event "
                            "loop is left open for it")
                return
            try:
                loop, self._loop = self._loop, None
                if loop is None:
                    return
                tasks = asyncio.all_tasks(loop)  # what an environment left running between calls
                for task in tasks:
                    task.cancel()
                if tasks:
                    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()
            finally:
                self._inline_lock.release()
            return
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            def stop() -> None:
                for task in asyncio.all_tasks(self._loop):
                    task.cancel()
                self._loop.call_soon(self._loop.stop)  # after the cancelled calls have unwound

            self._loop.call_soon_threadsafe(stop)
            self._thread.join(timeout=5)


class SampleDriver:
    """Moves the samples of pending groups through the engine (and environments). Every method
    runs under `lock`, which the owning schedule shares; engine completions reach the driver
    through the schedule's own callback (`completed`)."""

    def __init__(self, inputs: RolloutInputs, lock, on_finished: Callable, on_aborted: Callable, on_error: Callable,
                 on_done_callback: Callable[[Completion], None], on_settled: Callable[[], None] = lambda: None):
        self.inputs, self.cfg, self.lock = inputs, inputs.cfg, lock
        self.on_finished, self.on_aborted, self.on_error = on_finished, on_aborted, on_error
        self.on_settled = on_settled  # after every environment answer (the schedule may be done now)
        self.engine_callback = on_done_callback  # the schedule's engine done-callback
        self.routes: dict[str, SampleRef] = {}  # live engine request id -> its sample
        self.seen: dict[str, int] = {}  # tokens of each live request already accounted for
        self.new_tokens = 0  # tokens the engine produced for this driver's requests, all time
        self._calling: set[tuple[int, int]] = set()  # (id(group), j) of samples with an environment call in flight
        self._replay_envs: dict[int, list] = {}  # id(group) -> fresh environments for replayed samples
        self.events = 0  # completions and environment answers handled (a progress signal)
        self.env_busy_s = 0.0  # seconds environment calls ran (not waiting for a pool slot), all time
        self.hold = False
        self.episodes = inputs.env_builder is not None
        if self.episodes:
            self.renderer = episode_renderer(inputs.tokenizer, inputs.processor, **inputs.cfg.data.chat_template_kwargs)
            self.envs: EnvRunner = inputs.env_runner
        self._outbox: list[Request] | None = None
        # a simulated engine: its clock waits for this lock (the latest driver's: the simulator
        # runs one schedule at a time)
        bind = getattr(inputs.engine, "bind_schedule", None)
        if bind is not None:
            bind(lock)

    @property
    def env_calls(self) -> int:
        """Environment calls in flight."""
        return len(self._calling)

    @property
    def idle(self) -> bool:
        return not self.routes and not self._calling

    # ------------------------------------------------------------ starting work
    def start(self, groups, sampling, seed: int) -> None:
        """Send every open sample of `groups` on (fresh, resumed, or at its episode's next
        phase). Engine requests go in one batch at the end, unless the work was held meanwhile
        (an environment answer inside the call completed what the schedule needed): then they
        are not sent, and their samples wait in their phase."""
        outer = self._outbox is None
        if outer:
            self._outbox = []
        try:
            for g in groups:
                if self.episodes and g.episodes is None:
                    self._make_episodes(g, sampling, seed)
                for j in range(g.n):
                    if j not in g.done:
                        self.advance(g, j, sampling, seed)
        except BaseException:
            if outer:  # nothing of a failed start reaches the engine
                self._unroute(self._outbox)
                self._outbox = None
            raise
        if outer:
            reqs, self._outbox = self._outbox, None
            if self.hold:
                self._unroute(reqs)
            else:
                self._send(reqs)

    def _unroute(self, reqs: list[Request]) -> None:
        for r in reqs:
            del self.routes[r.id], self.seen[r.id]

    def advance(self, g, j: int, sampling=None, seed: int = 0) -> None:
        """Send sample j of g to whatever it needs next; a finished episode is handed to
        `on_finished` even while held."""
        if not self.episodes:
            if not self.hold:
                self._queue(g.request(j, sampling, seed), g, j)
            return
        ep: LiveEpisode = g.episodes[j]
        if ep.finished:
            ep.env = None  # let go at once: an environment's resources (an agent, a sandbox) end with it
            if not ep.traj.ok and self._resample(g, j):
                return self.advance(g, j)
            ep.traj.resampled = getattr(ep, "replaced", 0)
            g.done[j] = ep.traj
            return self.on_finished(g, j)
        if self.hold or (id(g), j) in self._calling:
            return
        if ep.env is None:  # restored from a checkpoint: replay its actions into a fresh environment
            if id(g) not in self._replay_envs:
                fresh = make_group(self.inputs.env_builder, g.prompt, g.n)
                for k in range(g.n):  # samples that need no environment give theirs up now
                    other = g.episodes.get(k)
                    if k in g.done or (other is not None and (other.finished or other.env is not None)):
                        fresh[k] = None
                self._replay_envs[id(g)] = fresh
            fresh = self._replay_envs[id(g)]
            env, fresh[j] = fresh[j], None
            if all(e is None for e in fresh):  # every sample has its environment: the group's list is done with
                del self._replay_envs[id(g)]
            return self._env_call(g, j, lambda pool: _replay(ep, env, self.cfg.env.step_timeout_s), _nothing)
        if ep.phase == "generate":
            return self._queue(ep.request(), g, j)
        timeout = self.cfg.env.step_timeout_s
        if ep.phase == "open":
            return self._env_call(g, j, lambda pool: env_open(ep, timeout, pool=pool),
                                  lambda g, j, *r: ep.opened(*r, self.renderer))
        return self._env_call(g, j, lambda pool: env_step(ep, timeout, pool=pool),
                              lambda g, j, *r: ep.stepped(*r, self.renderer))

    def _make_episodes(self, g, sampling, seed: int) -> None:
        from dataclasses import replace

        from rollover.envs.episode import episode_seed
        from rollover.rollout.groups import sample_seed

        envs = make_group(self.inputs.env_builder, g.prompt, g.n)
        base = sample_seed(seed, g.serial, 0)
        e = self.cfg.env
        greedy = g.greedy_first  # ReMax: episode 0 answers greedily in every turn
        g.episodes = {j: LiveEpisode(f"{g.id}/{j}", replace(sampling, seed=episode_seed(base, j),
                                                            **({"temperature": 0.0} if greedy and j == 0 else {})),
                                     env=env, max_turns=g.max_turns or e.max_turns, max_total_tokens=e.max_total_tokens)
                      for j, env in enumerate(envs)}

    def _resample(self, g, j: int) -> bool:
        """Put a fresh episode of the same task in place of sample j's failed one, while the group
        has `env.resample_failed` left: the environment the builder makes for place j (as a replay
        after a checkpoint would), another sampling seed, its own request id. False: the failure
        stands."""
        from dataclasses import replace

        from rollover.envs.episode import episode_seed

        limit, used = self.cfg.env.resample_failed, getattr(g, "resampled", 0)  # a checkpoint from before: none
        if used >= limit:
            return False
        old: LiveEpisode = g.episodes[j]
        try:  # what a replay would build for place j
            env = make_one(self.inputs.env_builder, g.prompt, g.n, j)
        except ValueError as e:
            raise ValueError(f"env {self.cfg.env.name!r}: {e}") from None
        g.resampled = used + 1
        log.warning("env: episode %s failed: %s; running it again in a fresh environment (%d of "
                    "env.resample_failed=%d for its group)", old.request_id, old.traj.error.describe(), used + 1, limit)
        fresh = LiveEpisode(f"{g.request_id(j)}~{used + 1}", replace(old.sampling, seed=episode_seed(old.sampling.seed, used + 1)),
                            env=env, max_turns=old.max_turns, max_total_tokens=old.max_total_tokens)
        fresh.replaced = getattr(old, "replaced", 0) + 1
        g.episodes[j] = fresh
        return True

    # ------------------------------------------------------------ the engine
    def _queue(self, req: Request, g, j: int) -> None:
        self.routes[req.id] = SampleRef(g, j)
        self.seen[req.id] = len(req.response_ids)
        if self._outbox is not None:
            self._outbox.append(req)
        else:
            self._send([req])

    def _send(self, reqs: list[Request]) -> None:
        if reqs:
            self.inputs.engine.submit_many(reqs, on_done=self.engine_callback)

    def completed(self, c: Completion) -> SampleRef:
        """Route a completion from the engine to its sample and move the sample on."""
        ref = self.routes.pop(c.id)
        self.events += 1
        self.new_tokens += len(c.response_ids) - self.seen.pop(c.id)
        g, j = ref.group, ref.j
        if not self.episodes:
            if c.finish == "abort":
                if c.response_ids:
                    g.partial[j] = c
                self.on_aborted(g, j)
            else:
                g.partial.pop(j, None)
                g.done[j] = c
                self.on_finished(g, j)
            return ref
        ep = g.episodes[j]
        ep.sampled(c, self.renderer)
        if c.finish == "abort":
            self.on_aborted(g, j)
        else:
            self.advance(g, j)
        return ref

    def abort_all(self) -> None:
        """Abort every live request (outside the lock: the engine runs their callbacks)."""
        with self.lock:
            ids = sorted(self.routes)
        if ids:
            self.inputs.engine.abort(ids)

    def live_ids(self, groups) -> list[str]:
        keep = {id(g) for g in groups}
        return sorted(rid for rid, ref in self.routes.items() if id(ref.group) in keep)

    # ------------------------------------------------------------ the environments
    def _env_call(self, g, j: int, fn: Callable, apply: Callable) -> None:
        self._calling.add((id(g), j))

        def done(*result):
            with self.lock:
                self._calling.discard((id(g), j))
                self.events += 1
                try:
                    if len(result) == 1 and isinstance(result[0], BaseException):
                        raise result[0]
                    if len(result) == 3:  # (value, error, seconds)
                        self.env_busy_s += result[2]
                    apply(g, j, *result)
                    self.advance(g, j)
                    self.on_settled()
                except BaseException as e:  # a bug or an impossible episode: the schedule stops loudly
                    self.on_error(e)

        self.envs.call(fn, done)


async def _replay(ep: LiveEpisode, env, timeout_s: float):
    try:
        await ep.replay(env, timeout_s)
    except EnvLost as e:  # the environment worker died: this episode fails, the run goes on
        ep.fail(e)
    return (None,)


def _nothing(*_) -> None:
    """After a replay the episode holds its fresh environment; `advance` goes on from its phase."""


def run_groups(run, groups, sampling, seed: int, who: str, busy=None) -> int:
    """Drive every sample of `groups` to its end (the synchronous schedule and evaluation);
    returns the tokens the engine generated for them (and adds the seconds environment calls
    ran to `busy["env_s"]` when given). A wait that sees neither the engine nor
    an environment make progress for `rollout.stall_timeout_s` ends with `Stalled` (live
    requests aborted); an aborted request (nothing here aborts one) is an error."""
    from rollover.rollout.stops import Watchdog, engine_progress

    lock, done, errors = threading.RLock(), threading.Event(), []
    left = {g.id for g in groups if not g.complete}

    def finished(g, j):
        if g.complete:
            left.discard(g.id)
            if not left:
                done.set()

    def fail(e: BaseException):
        errors.append(e)
        done.set()

    def aborted(g, j):
        fail(RuntimeError(f"{who}: the engine aborted sample {j} of group {g.id}"))

    def on_done(c: Completion):
        try:
            with lock:
                driver.completed(c)
        except BaseException as e:
            fail(e)

    driver = SampleDriver(run, lock, finished, aborted, fail, on_done)
    if not left:
        return 0
    with lock:
        driver.start(groups, sampling, seed)
    dog = Watchdog(who, f"{len(left)} groups from the engine and environments",
                   lambda: (engine_progress(run.engine), driver.events), run.cfg.rollout.stall_timeout_s,
                   describe=lambda: f"{len(left)} groups unfinished, {len(driver.routes)} requests in the engine, "
                                    f"{driver.env_calls} environment calls")
    openmp.release()  # this thread waits while the engine's computes
    try:
        while not done.wait(timeout=0.5):
            dog.check()
    except BaseException:
        driver.hold = True
        driver.abort_all()
        raise
    if errors:
        driver.hold = True
        driver.abort_all()
        raise errors[0]
    if busy is not None:
        busy["env_s"] += driver.env_busy_s
    return driver.new_tokens


def env_step_metrics(run, trajectories, busy_s: float, wall_s: float) -> dict:
    """Episode metrics of a step: turns, failures, finishes and the environment's time share
    (`episode_metrics`), and environment utilization: the seconds environment calls ran over the
    step's wall time times `env.max_concurrent` (the cluster's size)."""
    from rollover.envs.base import episode_metrics

    if run.env_builder is None:
        return {}
    # a step whose groups all finished in earlier steps (carried) completed no episode: 0, not absent
    out = episode_metrics(trajectories) or {"env/episodes": 0.0}
    out["env/utilization"] = busy_s / (run.cfg.env.max_concurrent * wall_s) if wall_s > 0 else 0.0
    return out
