"""Weight updates of `RayEngine` (a mixin: the engine's workers, locks, transport and delivery
are its state). With `ray.weight_sync=eager` every live worker loads each version before
`update_weights` returns (a replacement still starting is not waited for: it pulls the newest
version from the object store once it is up, and is sent requests once it holds it), through the Ray object store or a gloo group
(`rollover.runtime.collective`), the object store serving any worker a gloo transfer missed.
With `lazy` the update is put in the object store and each worker is asked to load the newest
version whenever it has no load on the way; `update_weights` returns at once."""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import replace

from rollover.runtime.live import WorkerSlot, first_line
from rollover.types import Completion

log = logging.getLogger("rollover")


class WeightUpdates:
    def update_weights(self, named_tensors, version: int, inflight: str = "continue") -> list[Completion]:
        """Every worker loads the new weights (whole tensors from the object store, deltas
        against what it holds, or the gloo group's transfer) before this returns; tokens
        generated from then on carry `version`. Completions the update aborts are returned (and
        delivered)."""
        if self.rc.weight_sync == "lazy":
            return self._publish(named_tensors, version)
        t0 = time.perf_counter()
        lost, out = [], []
        with self._weights_lock:
            # a replacement still starting (or catching up) is not waited for: it loads this
            # version from the object store when it can, and takes requests once it holds it
            workers = [w for w in self._workers if w.alive and w.ready and not w.pulling]
            joining = [w for w in self._workers if w.alive and w not in workers]
            report = self.transport.deliver(self, workers, named_tensors, version, inflight, lost, out)
            self._version = version
            for w in workers:
                w.version = version
            for w in joining:
                self._pull(w)
            report.workers, report.seconds = len(workers) - len(lost), time.perf_counter() - t0
            report.joining_workers = len(joining)
            self.last_sync = report
        for w, e in lost:
            self._lost(w, e)
        self._dispatch.sync(self.rc.sync_timeout_s, "update_weights")
        return out

    # ------------------------------------------------------------ lazy pulls
    @property
    def oldest_version(self) -> int:
        if self.rc.weight_sync == "eager":
            return self._version  # every live worker loaded it before update_weights returned
        with self._lock:
            return min((w.version for w in self._workers if w.alive), default=self._version)

    def on_oldest_version(self, callback) -> None:
        self._version_listeners.append(callback)

    def settle(self) -> None:
        deadline = time.monotonic() + self.rc.sync_timeout_s
        while self.oldest_version < self._version:
            if self._error is not None:
                raise self._error
            if time.monotonic() > deadline:
                with self._lock:
                    behind = [f"{w.index} (at {w.version})" for w in self._workers if w.alive and w.version < self._version]
                raise TimeoutError(f"rollout workers {', '.join(behind)} did not load weights version {self._version} "
                                   f"within ray.sync_timeout_s={self.rc.sync_timeout_s:g} s")
            time.sleep(0.01)

    def _publish(self, named_tensors, version: int) -> list[Completion]:
        """ray.weight_sync=lazy: put `version` in the object store, ask every worker without a
        load on its way to load it, and return. Tokens carry each worker's own version; the
        staleness gate admits by `oldest_version`."""
        if self._error is not None:
            raise self._error
        t0 = time.perf_counter()
        with self._weights_lock:
            _, _, report = self.transport.update(named_tensors, version)
            previous, self._version = self._version, version
            workers = [w for w in self._workers if w.alive]
            # workers that had not finished loading the previous version when this one came
            report.lagging_workers = sum(w.version < previous for w in workers)
            for w in workers:
                self._pull(w)
            report.workers = len(workers)
            report.seconds = time.perf_counter() - t0
            self.last_sync = report
        return []

    def _pull(self, w: WorkerSlot) -> None:
        """Ask `w` for the newest version unless it holds it or a load is on its way (under
        `_weights_lock`); a thread waits for the load."""
        if w.pulling or not w.alive or w.version >= self._version:
            return
        version, refs = self._version, self.transport.current_refs()
        w.pulling = True
        ref = w.handle.load.remote(refs, None, version, "continue")
        threading.Thread(target=self._pulled, args=(w, ref, version), name=f"rollover-ray-pull-{w.index}",
                         daemon=True).start()

    def _pulled(self, w: WorkerSlot, ref, version: int) -> None:
        import ray

        try:
            ray.get(ref, timeout=self.rc.sync_timeout_s)
        except ray.exceptions.RayActorError as e:  # died: its replacement starts at the newest version
            with self._weights_lock:
                w.pulling = False
            if self._stopped:  # killed by the shutdown
                return
            self._lost(w, e)
            self._moved_on()
            return
        except Exception as e:  # a load that failed or did not answer: the run cannot go on
            with self._weights_lock:
                w.pulling = False
            if self._stopped:  # shut down under it: nobody waits for this load
                return
            what = ("did not load" if isinstance(e, ray.exceptions.GetTimeoutError) else "failed to load")
            self._fail(RuntimeError(f"rollout worker {w.index} {what} weights version {version} (ray.weight_sync="
                                    f"{self.rc.weight_sync}, ray.sync_timeout_s={self.rc.sync_timeout_s:g} s): {first_line(e)}"))
            return
        with self._weights_lock:
            w.pulling = False
            w.version = max(w.version, version)
            self._pull(w)  # a newer version was published meanwhile
        self._moved_on()

    def _moved_on(self) -> None:
        for callback in list(self._version_listeners):
            self._dispatch.run(callback)

    def await_loads(self, workers: list[WorkerSlot], refs: list, version: int, lost: list, out: list,
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

