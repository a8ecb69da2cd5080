"""SimEngine: the engine contract on a virtual clock (a `ThreadedEngine` over a `SimCore`).

Schedulers see an engine like any other: `submit_many` with done-callbacks run between steps,
`abort`, `update_weights`, `pause`/`resume`, `lengths`, `stats`, `version`. What differs is
time: the engine thread processes events in virtual-time order as fast as it can, up to a
*horizon* the simulation driver sets, so a driver can let rollouts run while its simulated
trainer trains (`run(until=...)`) and apply a weight update at the exact virtual time the
trainer finishes.
"""

from __future__ import annotations

import math

from rollover.engine.threaded import ThreadedEngine
from rollover.sim.core import SimCore
from rollover.types import Completion


class SimEngine(ThreadedEngine):
    stuck_s = 120.0  # `run` raises if the virtual clock and the requests stand still this long (wall seconds)

    def __init__(self, core: SimCore):
        core.horizon = 0.0  # nothing runs before the driver says
        self.max_len = core.max_len
        self.max_rows = sum(w.max_rows for w in core.workers)
        self._start(core, name="rollover-sim")

    @property
    def now(self) -> float:
        """Virtual seconds since the simulation started (the last event processed, or the time a
        driver advanced it to)."""
        return self.core.now

    def release(self) -> None:
        """Let the engine run freely (a scheduler waiting on it drives the clock)."""
        self._run_or_queue(lambda: setattr(self.core, "horizon", math.inf), wait=True)

    def run(self, until: float = math.inf) -> None:
        """Process every event before `until` (or until `halt`, or until nothing is left), then
        set the clock to `until` when it is finite. Blocks; not for the engine thread."""
        self._run_or_queue(lambda: setattr(self.core, "horizon", until), wait=True)
        self.wait_idle(stuck_s=self.stuck_s)
        if until != math.inf:
            self._run_or_queue(lambda: setattr(self.core, "now", max(self.core.now, until)), wait=True)

    def _progress(self):
        return (self.core.now, self.core.stats.decode_steps, len(self.core.where))

    def _describe_stuck(self) -> str:
        live = sorted(list(self.core.where))  # one C-level copy under the GIL: the engine thread may run on
        return (f"virtual time {self.core.now:.3f} s, horizon {self.core.horizon:g}, {len(live)} live "
                f"requests (e.g. {live[:3]}), {len(self.core.heap)} events queued")

    def halt(self) -> None:
        """From a callback (the engine thread): stop at the current time; `run` returns."""
        self.core.horizon = self.core.now

    def update_weights(self, named_tensors, version: int, inflight: str = "continue",
                       stall_s: float = 0.0) -> list[Completion]:
        """New version from now; every worker stalls `stall_s` (the weights' dissemination)."""
        items = list(named_tensors)
        return self._run_or_queue(
            lambda: self._resolve(self.core.update_weights(items, version, inflight, stall_s)), wait=True)

    def bind_schedule(self, lock) -> None:
        """Step only while `lock` (the schedule's) is free: a schedule's locked section takes no
        virtual time, so work it starts from its own thread (requests, environment calls) all
        starts at one instant, whatever the threads' timing (the rollout core binds its lock)."""
        self._step_lock = lock

    def gate(self, predicate) -> None:
        """Process events only while `predicate()` holds (checked between events, and every few
        milliseconds while waiting, since nothing notifies the engine when it turns true)."""
        self._run_or_queue(lambda: setattr(self.core, "gate", predicate), wait=True)
        self._poll_s = 0.002

    def call_at(self, when, fn) -> None:
        """At the next step boundary (on the engine thread), schedule `fn()` for the virtual time
        `when(now)`; returns at once. The simulated environments' answers land this way."""
        self._run_or_queue(lambda: self.core.timer(when(self.core.now), fn), wait=False)

    def pause(self) -> None:
        def go():
            self.core.pause()
            self._paused = True

        self._run_or_queue(go, wait=True)

    def resume(self) -> None:
        """Continue from now; returns at once (the command runs before the next step), so a
        caller holding a lock a callback wants cannot deadlock, as with TorchEngine."""
        def go():
            self.core.resume()
            self._paused = False

        self._run_or_queue(go, wait=False)

    def slow_down(self, factor: float) -> None:
        self._run_or_queue(lambda: self.core.slow_down(factor), wait=True)

    def busy(self) -> bool:
        return self._run_or_queue(self.core.busy, wait=True)

    def workers(self):
        return self.core.workers
