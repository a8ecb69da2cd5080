"""Wall-clock time per phase of a training step, as `timing_s/<phase>` metrics.

    timer = Timer()
    with timer("generate"):
        ...
    with timer("update_actor"):
        ...
    logger.log(step, {**metrics, **timer.pop()})

A phase entered twice in one step accumulates. Phases may nest (`with timer("step"):` around
the others); each is timed on its own, so nested phases are not subtracted from the outer one.

CUDA kernels run asynchronously: without a synchronize, a GPU phase measures the kernel
launches, and its real cost lands in whichever later phase first waits on the GPU.
`Timer(cuda_sync=True)` synchronizes before reading the clock at both ends of every phase.
That costs a pipeline drain per phase, which is why it is off by default.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class Timer:
    """Accumulates seconds per phase into `timings` (`{"timing_s/<phase>": seconds}`)."""

    def __init__(self, *, cuda_sync: bool = False):
        self._sync = None
        if cuda_sync:  # torch imported only here: the simulator times its runs without it
            import torch

            if torch.cuda.is_available():
                self._sync = torch.cuda.synchronize
        self.timings: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = self._now()
        try:
            yield
        finally:
            key = f"timing_s/{phase}"
            self.timings[key] = self.timings.get(key, 0.0) + self._now() - start

    def pop(self) -> dict[str, float]:
        """The timings so far, and a fresh start for the next step."""
        timings, self.timings = self.timings, {}
        return timings

    def _now(self) -> float:
        if self._sync is not None:
            self._sync()
        return time.perf_counter()
