"""The trainer -> engine seam: new weights as named tensors and an integer version.

Loops push weights through a `WeightSync` and never call the engine's `update_weights`
themselves, so how weights travel is one swappable piece: in one process it is a direct copy
into the engine (`InProcessWeightSync`); the Ray runtime adds transports (object store,
torch.distributed broadcast, disk) behind the same `push`.
"""

from __future__ import annotations

from typing import Iterable, Protocol

import torch


class WeightSync(Protocol):
    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, inflight: str = "continue") -> None:
        """Make `named_tensors` the rollout weights from `version` on. `inflight` says what
        happens to requests still generating: 'continue' (K/V recomputed under the new
        weights), 'keep' (their K/V kept) or 'abort' (they come back aborted, tokens kept)."""
        ...

    def metrics(self) -> dict:
        """What the last push moved (bytes, tensors, seconds), for the step's metrics row."""
        ...


class InProcessWeightSync:
    """Weights copied straight into an engine living in this process."""

    def __init__(self, engine):
        self.engine = engine

    def push(self, named_tensors, version: int, inflight: str = "continue") -> None:
        from rollover.train.memory import release

        self.engine.update_weights(named_tensors, version=version, inflight=inflight)
        release()  # the engine's old packed weights

    def metrics(self) -> dict:
        return {}


class RayWeightSync(InProcessWeightSync):
    """Weights to Ray rollout workers (`rollover.runtime.router.RayEngine`): put once in the
    object store, pulled by every worker, only what changed when `ray.weight_delta` is on."""

    def push(self, named_tensors, version: int, inflight: str = "continue") -> None:
        self.engine.update_weights(named_tensors, version=version, inflight=inflight)

    def metrics(self) -> dict:
        return self.engine.last_sync.metrics()
