"""Why a wait or a run stops short: the stall watchdog every wait between components polls,
and the errors that end a run after too many bad steps in a row. Below the collectors and
loops, which both use them.

Watchdog. Every wait between components (the trainer waiting for a batch, a collector waiting
for the engine, the rollout service waiting for aborted requests to come back) polls a
`Watchdog` with a progress signature (tokens generated, groups resolved, ...). The wait may
last as long as work moves; when the signature has not changed for `timeout_s` the wait ends
with `Stalled`, whose message names the component that waited, what it waited for, and the
state of the parts that should have delivered it. A deadlock thus costs `timeout_s`, not the
rest of the rental.
"""

from __future__ import annotations

import time
from typing import Callable


class Stalled(RuntimeError):
    """A wait between components saw no progress for the stall timeout."""


class Watchdog:
    """Raises `Stalled` from `check()` once `progress()` has not changed for `timeout_s`."""

    def __init__(self, component: str, waiting_for: str, progress: Callable[[], object], timeout_s: float,
                 describe: Callable[[], str] | None = None, clock: Callable[[], float] = time.monotonic):
        self.component, self.waiting_for = component, waiting_for
        self.progress, self.timeout_s, self.describe, self.clock = progress, timeout_s, describe, clock
        self.last = progress()
        self.since = clock()

    def check(self) -> None:
        now, sig = self.clock(), self.progress()
        if sig != self.last:
            self.last, self.since = sig, now
            return
        if now - self.since >= self.timeout_s:
            state = f" ({self.describe()})" if self.describe else ""
            raise Stalled(f"{self.component} waited {now - self.since:.0f} s for {self.waiting_for} and nothing "
                          f"moved{state}; stopped by the stall timeout of {self.timeout_s:g} s")


def engine_progress(engine) -> tuple:
    """A signature that changes whenever the engine prefills, decodes or finishes a request
    (also raises if the engine thread has died)."""
    s = engine.stats()
    return s.generated_tokens, s.prefill_tokens, sum(s.finished.values())


class TooManyBadSteps(RuntimeError):
    """`train.max_bad_steps` steps in a row whose loss or gradient was not finite."""


class TooManyEmptyCollections(TooManyBadSteps):
    """`train.max_bad_steps` collections in a row with nothing to train on (a kind of bad step)."""
