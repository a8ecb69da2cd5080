"""Weights from the trainer to Ray rollout workers through the Ray object store.

The driver puts each tensor that changed once; every worker pulls what it needs (on another
machine, Ray moves the bytes). With `ray.weight_delta` the driver keeps the last weights it sent
(in the engine's dtype) and compares bit patterns: a tensor with no changed bit is not sent, a
tensor with few changed elements goes as (flat indices, values), any other goes whole. In bf16
most elements of a weight keep their bits from one step to the next, which is where this pays.
Each update reports what it moved (`SyncReport`).
"""

from __future__ import annotations

import torch

from rollover.train.weight_sync import SyncReport  # noqa: F401 (the transports' report)

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SPARSE_MAX_FRACTION = 0.25  # past this share of changed elements a tensor goes whole


def engine_dtype(cfg, device: str) -> torch.dtype:
    """The dtype the rollout engine holds its weights in (as `make_engine` decides it)."""
    d = cfg.rollout.dtype
    if d == "auto":  # float32 on every device, as make_engine: the real model learned more in it on a GPU
        d = "float32"
    return getattr(torch, d)


def changed_mask(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Flat mask of the elements whose bits differ (so -0.0 vs 0.0 and NaN payloads count)."""
    bits = _BITS[new.element_size()]
    a = new.reshape(-1).view(bits) if new.is_floating_point() else new.reshape(-1)
    b = old.reshape(-1).view(bits) if old.is_floating_point() else old.reshape(-1)
    return a != b


class ObjectStoreTransport:
    """Turns named tensors into what workers load: object references of whole tensors and
    (indices, values) deltas. Holds what a restarted worker needs to start at the current
    weights (`current_refs`)."""

    def __init__(self, dtype: torch.dtype, delta: bool):
        self.dtype, self.delta = dtype, delta
        self._last: dict[str, torch.Tensor] = {}  # delta: the weights workers hold now
        self._refs: dict[str, object] = {}  # whole-tensor references of the current weights

    def initial(self, named_tensors) -> dict:
        """References to the whole weights (version 0 or a resumed version)."""
        import ray

        self._last, self._refs = {}, {}
        for name, t in named_tensors:
            t = self._cast(t)
            if self.delta:
                self._last[name] = t
            self._refs[name] = ray.put(t)
        return dict(self._refs)

    def deliver(self, engine, workers: list, named_tensors, version: int, inflight: str, lost: list,
                out: list) -> SyncReport:
        """An update to `version` for `workers`: put once, each worker pulls it (whole tensors and
        deltas) and loads it; `engine.await_loads` collects the deaths into `lost` and the
        completions the update aborted into `out`."""
        full, deltas, report = self.update(named_tensors, version)
        engine.await_loads(workers, [w.handle.load.remote(full, deltas, version, inflight) for w in workers],
                           version, lost, out)
        return report

    def update(self, named_tensors, version: int) -> tuple[dict, dict, SyncReport]:
        """(whole-tensor refs, deltas, report) for an update to `version`."""
        import ray

        report = SyncReport(version=version)
        if not self.delta and hasattr(named_tensors, "refs"):  # a trainer actor's weights, put by the actor
            full = {}
            for name, ref, size in named_tensors.refs(self.dtype):
                full[name] = ref
                report.dense_bytes += size
                report.bytes_per_worker += size
                report.full_tensors += 1
            self._refs = dict(full)
            return full, None, report
        full, deltas = {}, {}
        # built aside and kept only once every tensor is through: an update that fails halfway
        # (a bad tensor, the object store full) leaves what a restarted worker loads at the
        # version the workers hold, not a mix of two
        last, refs = dict(self._last), dict(self._refs)
        for name, t in named_tensors:
            t = self._cast(t)
            size = t.numel() * t.element_size()
            report.dense_bytes += size
            old = last.get(name) if self.delta else None
            if old is not None and old.shape == t.shape and old.dtype == t.dtype:
                mask = changed_mask(t, old)
                n = int(mask.sum())
                if n == 0:
                    report.unchanged_tensors += 1
                    continue
                wide = t.numel() >= 2**31
                sparse = n * ((8 if wide else 4) + t.element_size())
                if n <= SPARSE_MAX_FRACTION * t.numel() and sparse < size:  # indices only for the few
                    idx = mask.nonzero().squeeze(1)
                    deltas[name] = (idx if wide else idx.to(torch.int32), t.reshape(-1)[idx])
                    report.sparse_tensors += 1
                    report.bytes_per_worker += sparse
                    last[name] = t
                    refs.pop(name, None)  # put whole only if a worker restarts
                    continue
            full[name] = ray.put(t)
            refs[name] = full[name]
            report.full_tensors += 1
            report.bytes_per_worker += size
            if self.delta:
                last[name] = t
        delta_ref = ray.put(deltas) if deltas else None
        self._last, self._refs = last, refs
        return full, delta_ref, report

    def current_refs(self) -> dict:
        """Whole-tensor references of the weights workers hold now (put on demand for tensors
        that last travelled as deltas)."""
        import ray

        for name, t in self._last.items():
            if name not in self._refs:
                self._refs[name] = ray.put(t)
        return dict(self._refs)

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.is_floating_point() and t.dtype != self.dtype:
            return t.to(device="cpu", dtype=self.dtype).contiguous()
        if t.device.type != "cpu" or not t.is_contiguous():
            return t.to("cpu").contiguous()
        # kept for the next comparison: a copy, since the trainer updates its tensors in place
        # (ray.put copies by itself)
        return t.clone() if self.delta else t
