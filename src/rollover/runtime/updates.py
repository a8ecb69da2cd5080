"""Weight updates of `RayEngine` (a mixin: the engine's workers, locks, transport and delivery
are its state): every live worker loads each version before `update_weights` returns, through
the Ray object store or a gloo group (`rollover.runtime.collective`), the object store serving
any worker a gloo transfer missed."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import replace

from rollover.runtime.live import WorkerSlot, first_line
from rollover.runtime.weights import ObjectStoreTransport
from rollover.types import Completion

log = logging.getLogger("rollover")


class WeightUpdates:
    def update_weights(self, named_tensors, version: int, inflight: str = "continue") -> list[Completion]:
        """Every worker loads the new weights (whole tensors from the object store, deltas
        against what it holds, or the gloo group's transfer) before this returns; tokens
        generated from then on carry `version`. Completions the update aborts are returned (and
        delivered)."""
        t0 = time.perf_counter()
        lost, out = [], []
        with self._weights_lock:
            workers = [w for w in self._workers if w.alive]
            if isinstance(self.transport, ObjectStoreTransport):
                full, deltas, report = self.transport.update(named_tensors, version)
                self._loaded(workers, [w.handle.load.remote(full, deltas, version, inflight) for w in workers],
                             version, lost, out)
            else:
                report = self.transport.update(named_tensors, version)
                missed = self._send(workers, version, inflight, lost, out)
                if missed:  # the object store carries the update to the workers the transfer missed
                    full = self.transport.current_refs()
                    self._loaded(missed, [w.handle.load.remote(full, None, version, inflight) for w in missed],
                                 version, lost, out)
                report.fallback_workers = len(missed)
            self._version = version
            report.workers, report.seconds = len(workers) - len(lost), time.perf_counter() - t0
            self.last_sync = report
        for w, e in lost:
            self._lost(w, e)
        self._dispatch.sync(self.rc.sync_timeout_s, "update_weights")
        return out

    def _send(self, workers: list[WorkerSlot], version: int, inflight: str, lost: list, out: list) -> list[WorkerSlot]:
        """The gloo transfer of an update (forming the group first when its members changed);
        the workers it did not reach. (A missed worker's `receive` ends by itself: its group is
        gone, or it times out.)"""
        t = self.transport
        if not workers:
            return []
        try:
            if t.needs_group(workers):
                t.form(workers)
        except Exception as e:  # a worker died or stalled while joining
            log.warning("ray: the weights group did not form (%s); version %d goes through the object store",
                        first_line(e), version)
            t.drop_group()
            return workers
        refs = [w.handle.receive.remote(t.generation, version, inflight, self.rc.sync_timeout_s) for w in workers]
        failed = dict(t.send())
        if failed:
            t.drop_group()
            for w, e in failed.items():
                log.warning("ray: weights version %d did not reach rollout worker %d by gloo (%s); it pulls them from "
                            "the object store", version, w.index, first_line(e))
        reached = [(w, r) for w, r in zip(workers, refs) if w not in failed]
        unloaded: list[WorkerSlot] = []  # a receive that failed on the worker's side: the object store serves it
        self._loaded([w for w, _ in reached], [r for _, r in reached], version, lost, out, unloaded)
        if unloaded:
            t.drop_group()
        return [w for w in workers if w in failed or w in unloaded]

    def _loaded(self, workers: list[WorkerSlot], refs: list, version: int, lost: list, out: list,
                unloaded: list | None = None) -> None:
        """Wait for each worker's weight load; collect the completions it aborted (into `out`) and
        the workers that died (into `lost`: their replacements start at `version`). A load that
        failed on the worker or did not answer in time stops the run, unless `unloaded` collects
        such workers (gloo receives, which the object store can serve instead; a receive that
        completes late loads nothing once a newer group has formed, and the same version
        otherwise)."""
        import ray

        for w, ref in zip(workers, refs):
            try:
                got = ray.get(ref, timeout=self.rc.sync_timeout_s)
            except ray.exceptions.RayActorError as e:  # died: its replacement starts at `version`
                lost.append((w, e))
                continue
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayTaskError) as e:
                if unloaded is not None:  # a gloo receive that failed or stalled: the object store serves it
                    log.warning("ray: rollout worker %d did not receive weights version %d by gloo (%s); it pulls "
                                "them from the object store", w.index, version, first_line(e))
                    unloaded.append(w)
                    continue
                if isinstance(e, ray.exceptions.GetTimeoutError):
                    raise TimeoutError(f"rollout worker {w.index} did not load weights version {version} within "
                                       f"ray.sync_timeout_s={self.rc.sync_timeout_s:g} s") from None
                # a bad tensor, out of memory: the run cannot go on
                raise RuntimeError(f"rollout worker {w.index} failed to load weights version {version}: "
                                   f"{first_line(e)}") from None
            with self._lock:
                out += [replace(c, id=self._wire[c.id].req.id) for c in got if c.id in self._wire]
            self._dispatch.run(functools.partial(self._deliver, w, got, {}))

