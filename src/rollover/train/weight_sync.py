"""The trainer -> engine seam: new weights as named tensors and an integer version.

Loops push weights through a `WeightSync` and never call the engine's `update_weights`
themselves, so how weights travel is one swappable piece: in one process it is a direct copy
into the engine (`InProcessWeightSync`); the Ray runtime adds transports (object store,
torch.distributed broadcast, disk) behind the same `push`.
"""

from __future__ import annotations

import logging
from typing import Iterable, Protocol

import torch

log = logging.getLogger("rollover")


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


def share_engine_weights(cfg, engine, trainer) -> None:
    """One copy of the weights for trainer and engine where that is safe: the synchronous loop
    (APRIL included) never generates while the trainer steps, so the trainer's parameters can
    be views of an in-process TorchEngine's weights of the same dtype and device (fp32 on CPU):
    the optimizer's in-place update is the weight push, and the push copies nothing. Not with
    LoRA (the engine holds merged weights), async mode (the engine generates during the step),
    Ray or vLLM (the weights live elsewhere)."""
    from rollover.engine.torch_engine import TorchEngine

    if cfg.mode != "sync" or trainer.is_peft or trainer.sharded or not isinstance(engine, TorchEngine):
        return
    runner = engine.core.runner
    param, held = next(trainer.model.parameters()), runner.views["model.norm.weight"]
    if held.dtype != param.dtype or held.device != param.device:
        return
    try:
        saved = engine.lend_weights(trainer.model)
    except ValueError as e:  # a layout the engine does not mirror (nothing was rebound): keep two copies
        log.warning("trainer and engine keep their own weights: %s", e)
        return
    # the engine's packed weights are snapshots: an optimizer step makes them stale at once,
    # even before the push (which drops them too)
    trainer.optimizer.register_step_post_hook(lambda *_: runner.drop_packs())
    log.info("trainer and engine share one copy of the weights (%.2f GB)", saved / 1e9)
