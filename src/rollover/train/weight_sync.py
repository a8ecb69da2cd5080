"""The trainer -> engine seam: new weights as named tensors and an integer version.

Loops push weights through a `WeightSync` and never call the engine's `update_weights`
themselves, so how weights travel is one swappable piece: in one process it is a direct copy
into the engine (`InProcessWeightSync`); with the FSDP ranks' own engines each rank loads its
own gather (`rollover.runtime.colocated.ColocatedWeightSync`); to Ray rollout workers the
engine's transport carries them (`rollover.runtime.weights.ObjectStoreTransport`: put once,
pulled by each worker, whole or as bit-level deltas; `rollover.runtime.collective.GlooTransport`:
a gloo group, the object store serving whom it missed), each with one `deliver` call. Every
push reports what it moved as a `SyncReport`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterable, Protocol

import torch

log = logging.getLogger("rollover")


@dataclass
class SyncReport:
    """What one weight update moved, per worker (each worker pulls the same payload)."""

    version: int = 0
    full_tensors: int = 0
    sparse_tensors: int = 0
    unchanged_tensors: int = 0
    bytes_per_worker: int = 0  # payload bytes each worker pulled
    dense_bytes: int = 0  # what sending every tensor whole would have moved
    workers: int = 0
    seconds: float = 0.0
    fallback_workers: int = 0  # gloo: workers the transfer missed, served by the object store
    lagging_workers: int = 0  # ray.weight_sync=lazy: workers still short of the previous version at this push
    joining_workers: int = 0  # eager: replacements still starting, left to pull this version when they are up

    def metrics(self) -> dict:
        return {
            "weights/bytes_per_worker": self.bytes_per_worker,
            "weights/bytes_all_workers": self.bytes_per_worker * self.workers,
            "weights/sent_fraction": self.bytes_per_worker / self.dense_bytes if self.dense_bytes else 0.0,
            "weights/full_tensors": self.full_tensors,
            "weights/sparse_tensors": self.sparse_tensors,
            "weights/unchanged_tensors": self.unchanged_tensors,
            "weights/fallback_workers": self.fallback_workers,
            "weights/lagging_workers": self.lagging_workers,
            "weights/joining_workers": self.joining_workers,
            "timing_s/weight_transfer": self.seconds,
        }


class WeightSync(Protocol):
    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, inflight: str = "continue") -> None:
        """Make `named_tensors` the rollout weights from `version` on. `inflight` says what
        happens to requests still generating: 'continue' (K/V recomputed under the new
        weights), 'keep' (their K/V kept) or 'abort' (they come back aborted, tokens kept)."""
        ...

    def metrics(self) -> dict:
        """What the last push moved (`SyncReport.metrics`: bytes, tensors, seconds), for the step's
        metrics row."""
        ...


class InProcessWeightSync:
    """Weights copied straight into an engine living in this process."""

    def __init__(self, engine):
        self.engine = engine
        self.last_sync = SyncReport()

    def push(self, named_tensors, version: int, inflight: str = "continue") -> None:
        from rollover.train.memory import release

        t0, report = time.perf_counter(), SyncReport(version=version, workers=1)

        def counted():
            for name, t in named_tensors:
                report.full_tensors += 1
                report.bytes_per_worker += t.numel() * t.element_size()
                yield name, t

        self.engine.update_weights(counted(), version=version, inflight=inflight)
        release()  # the engine's old packed weights
        report.dense_bytes, report.seconds = report.bytes_per_worker, time.perf_counter() - t0
        self.last_sync = report

    def metrics(self) -> dict:
        return self.last_sync.metrics()


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
    name, param = next(iter(trainer.model.named_parameters()))
    held = runner.views.get(name.removeprefix("_orig_mod."))
    if held is None:
        return
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
