"""A rollout worker: one engine in its own process (a Ray actor), driven by `RayEngine`.

The worker is thin on purpose: it owns an engine and reports what the engine does, nothing
more. Each request it is given streams its tokens into a per-request buffer; `poll` hands the
driver every finished completion and every token generated since the last poll, so the driver,
not the worker, holds each request's tokens so far and can resume it elsewhere if this process
dies. Weights arrive as object references (pulled here, so the driver puts each tensor once
however many workers there are), as deltas against the weights this worker holds, or through a
gloo group the driver sends them in (`ray.weight_transport: gloo`).
"""

from __future__ import annotations

import collections
import os
import threading
from types import SimpleNamespace

import torch

from rollover.types import Completion, Request


class RolloutWorker:
    """Built by `RayEngine` through `ray.remote(RolloutWorker).options(...)`; every method is a
    remote call. `max_concurrency` > 1: `poll` blocks while `submit` and `abort` come in."""

    def __init__(self, index: int, cfg, arch_config, generation_config, weight_refs: dict, version: int,
                 device: str, max_len: int, eos_token_ids: tuple[int, ...], threads: int | None, delta: bool,
                 paused: bool = False, tokenizer=None):
        import ray

        from rollover.engine import make_engine

        if threads is not None and device == "cpu":
            torch.set_num_threads(threads)
        if cfg.train.deterministic:  # process-wide: the driver's engine runs under it (prefill's attention kernel)
            from rollover.train.seeding import use_deterministic_kernels

            use_deterministic_kernels()
        self.index = index
        names = list(weight_refs)
        tensors = ray.get([weight_refs[n] for n in names])
        architecture = SimpleNamespace(config=arch_config, generation_config=generation_config)
        # a replacement starts at the current version (VLLMEngine refuses an update without every weight)
        self.engine = make_engine(cfg, architecture, weights=list(zip(names, tensors)), device=torch.device(device),
                                  max_len=max_len, eos_token_ids=eos_token_ids, version=version, tokenizer=tokenizer)
        self.weights = {n: t for n, t in zip(names, tensors)} if delta else None  # what deltas apply to
        self.receiver = None  # ray.weight_transport=gloo: this worker's side of the weights group
        self._load_lock = threading.Lock()  # a gloo transfer's check and load, against a newer group's
        self._cv = threading.Condition()
        self._out: list[Completion] = []
        self._tokens: dict[str, list[tuple[int, float, int]]] = {}
        self._cancelled: collections.OrderedDict = collections.OrderedDict()  # aborted before they arrived
        if paused:
            self.engine.pause()

    def ready(self) -> dict:
        return {"pid": os.getpid(), "version": self.engine.version, "node": _node_id()}

    # ------------------------------------------------------------ requests
    def submit(self, requests: list[Request]) -> None:
        """Queue requests on the engine; their tokens and completions come back through `poll`."""
        with self._cv:
            gone = [r for r in requests if self._cancelled.pop(r.id, 0) is None]
        for r in gone:
            self._done(r.completion("abort"))
        requests = [r for r in requests if all(r is not g for g in gone)]
        with self.engine._listen_lock:
            for r in requests:
                self.engine._listeners[r.id] = _Listener(self, r.id)
        with self._cv:
            for r in requests:
                self._tokens.setdefault(r.id, [])
        try:
            self.engine.submit_many(requests, on_done=self._done)
        except BaseException:
            with self.engine._listen_lock:
                for r in requests:
                    self.engine._listeners.pop(r.id, None)
            with self._cv:
                for r in requests:
                    self._tokens.pop(r.id, None)
            raise

    def _token(self, rid: str, tok: int, lp: float, ver: int) -> None:
        with self._cv:
            buf = self._tokens.get(rid)
            if buf is not None:
                buf.append((tok, lp, ver))

    def _done(self, c: Completion) -> None:
        with self._cv:
            self._out.append(c)
            self._cv.notify_all()

    def poll(self, timeout_s: float) -> tuple[list[Completion], dict[str, list]]:
        """Completions finished since the last poll (waiting up to `timeout_s` for one) and the
        tokens each unfinished request generated since then, as (token, logprob, version)."""
        with self._cv:
            self._cv.wait_for(lambda: self._out, timeout=timeout_s)
            out, self._out = self._out, []
            for c in out:
                self._tokens.pop(c.id, None)
            fresh = {rid: buf for rid, buf in self._tokens.items() if buf}
            for rid in fresh:
                self._tokens[rid] = []
            return out, fresh

    def abort(self, ids: list[str] | None) -> list[Completion]:
        """Abort requests; their partial completions (which `poll` reports too: the driver
        keeps the first). An id the engine does not hold may still be on its way (a submit
        the abort overtook): it is answered as aborted the moment it arrives."""
        got = self.engine.abort(ids)
        if ids is not None:
            found = {c.id for c in got}
            with self._cv:
                for rid in ids:
                    if rid not in found:
                        self._cancelled[rid] = None
                while len(self._cancelled) > 10_000:  # ids of requests that had finished, mostly
                    self._cancelled.popitem(last=False)
        return got

    # ------------------------------------------------------------ weights
    def load(self, full: dict, deltas: dict | None, version: int, inflight: str) -> list[Completion]:
        """New weights from `version` on: `full` maps names to object references of whole
        tensors, `deltas` names to (flat indices, values) against this worker's copy."""
        import ray

        names = list(full)
        items = list(zip(names, ray.get([full[n] for n in names])))
        if deltas:
            if self.weights is None:
                raise RuntimeError(f"rollout worker {self.index} keeps no weights to apply a delta to")
            for name, (idx, values) in deltas.items():
                t = self.weights[name].clone()
                t.view(-1)[idx.long()] = values
                items.append((name, t))
        if self.weights is not None:
            self.weights.update(items)
        with self._load_lock:
            return self.engine.update_weights(items, version=version, inflight=inflight)

    def join(self, host: str, port: int, generation: int, rank: int, world: int, slots: list, size: int,
             timeout_s: float) -> None:
        """Join the driver's weights group (`ray.weight_transport: gloo`); returns once every
        member has."""
        from rollover.runtime.collective import GlooReceiver

        if self.receiver is None:
            self.receiver = GlooReceiver()
        self.receiver.join(host, port, generation, rank, world, slots, size, timeout_s)

    def receive(self, generation: int, version: int, inflight: str, timeout_s: float) -> list[Completion]:
        """New weights from `version` on, sent by the driver in the weights group."""
        if self.receiver is None:
            raise RuntimeError(f"rollout worker {self.index} is in no weights group")
        items = self.receiver.receive(generation, timeout_s)
        with self._load_lock:  # a transfer the driver gave up on (a newer group formed since) loads nothing
            if self.receiver.generation != generation:
                raise RuntimeError(f"rollout worker {self.index}: weights group {generation} was replaced by "
                                   f"{self.receiver.generation} during the transfer")
            return self.engine.update_weights(items, version=version, inflight=inflight)

    # ------------------------------------------------------------ the rest of the engine contract
    def stats(self):
        return self.engine.stats()

    def reset_stats(self) -> None:
        self.engine.reset_stats()

    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def lengths(self) -> dict[str, int]:
        return self.engine.lengths()

    def release_memory(self) -> None:
        self.engine.release_memory()

    def shutdown(self) -> None:
        self.engine.shutdown()


class _Listener:
    """The engine's per-token callback for one request (picklable, unlike a lambda)."""

    __slots__ = ("worker", "rid")

    def __init__(self, worker: RolloutWorker, rid: str):
        self.worker, self.rid = worker, rid

    def __call__(self, tok, lp, ver) -> None:
        self.worker._token(self.rid, tok, lp, ver)


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()
