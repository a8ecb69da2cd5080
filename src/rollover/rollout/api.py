"""What the synchronous loop calls on a collector: `SyncCollector` (every group waits for its
longest sample) or `AprilCollector` (APRIL partial rollouts)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from rollover.types import Group


@runtime_checkable
class CollectorAPI(Protocol):
    inflight_mode: str  # what a weight update does to requests still generating ('continue' or 'keep')

    def collect(self, step: int) -> tuple[list[Group], dict]:
        """The scored, filtered groups step `step + 1` trains on, and the collector's metrics."""

    def set_aside(self) -> None:
        """Take the requests carried between steps out of the engine before it runs other work
        (an evaluation); they go on next step."""

    def state_dict(self) -> dict:
        """What exact resume needs (carried partial rollouts, counters)."""

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...
