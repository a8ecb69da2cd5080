"""Weights by `torch.distributed`: `ray.weight_transport: gloo`.

The driver (rank 0) and every live rollout worker form a gloo group over a TCP store the driver
serves. A weight update packs every tensor, in the engine's dtype, into one flat byte buffer at
a fixed offset (the layout travels once, when the group forms) and sends the buffer, in chunks,
from the driver to each worker point to point; each worker receives into its own buffer and
loads views of it (the engine copies them into its weights). Bytes go straight from the
driver's memory to each worker over TCP, with no object store in between. Point to point
rather than one broadcast: a member that died fails only its own transfer (a gloo broadcast
would leave every other member waiting out its timeout).

What the object store still carries: a worker's first weights and a replacement's (a group
forms only among running workers), and an update to a worker whose transfer failed (it died,
or did not receive within `ray.sync_timeout_s`: every rendezvous and every chunk has that
timeout). The group is formed again, with the current workers, before the next update.
"""

from __future__ import annotations

import datetime
import logging
import threading
from dataclasses import dataclass

import torch

from rollover.runtime.live import first_line
from rollover.runtime.weights import SyncReport

log = logging.getLogger("rollover")

CHUNK_BYTES = 64 << 20  # one send moves at most this much
ALIGN = 64  # every tensor starts at a multiple of this many bytes in the buffer


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in the flat buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def layout(named_tensors, dtype: torch.dtype) -> tuple[list[Slot], int]:
    """Slots for the tensors (floating ones in `dtype`, others in their own) and the buffer size."""
    slots, offset = [], 0
    for name, t in named_tensors:
        dt = dtype if t.is_floating_point() else t.dtype
        nbytes = t.numel() * dt.itemsize
        slots.append(Slot(name, dt, tuple(t.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return slots, offset


def view(buffer: torch.Tensor, s: Slot) -> torch.Tensor:
    return buffer[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)


def timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def make_group(store_host: str, store_port: int, generation: int, rank: int, world: int, own_host: str,
               timeout_s: float):
    """Join generation `generation` of the weights group through the driver's store, this
    process reachable at `own_host` (its node's address); returns once all `world` members have
    (or raises after `timeout_s`). Each generation gets its own store client: a rendezvous left
    waiting by a member that died holds its client's lock until it times out."""
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    store = TCPStore(store_host, store_port, is_master=False, timeout=timeout(timeout_s))
    opts = ProcessGroupGloo._Options()
    opts._timeout = timeout(timeout_s)
    opts._devices = [ProcessGroupGloo.create_device(hostname=own_host)]
    return ProcessGroupGloo(PrefixStore(f"rollover-weights/{generation}", store), rank, world, opts)


def chunks(buffer: torch.Tensor) -> list[torch.Tensor]:
    return [buffer[start:start + CHUNK_BYTES] for start in range(0, buffer.numel(), CHUNK_BYTES)]


class GlooTransport:
    """The driver's side: the store, the current group and the buffer workers hold now."""

    def __init__(self, dtype: torch.dtype, timeout_s: float):
        import ray

        self.dtype, self.timeout_s = dtype, timeout_s
        self.host = ray.util.get_node_ip_address()
        self.store = None
        self._open_store()
        self.generation = 0
        self.group = None
        self.members: tuple = ()  # the worker slots of the current group, in rank order
        self.slots: list[Slot] = []
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def _open_store(self) -> None:
        """A new store in place of the old one. Closing a store is the one way to end a
        rendezvous waiting on it: each client waiting on the old store (this process's forming
        thread, a worker's join) fails at once instead of after the timeout."""
        from torch.distributed import TCPStore

        self.store = None  # the old one closes first
        self.store = TCPStore(self.host, 0, is_master=True, timeout=timeout(self.timeout_s), wait_for_workers=False)

    def initial(self, named_tensors) -> dict:
        """Object references of the whole weights (a worker's first weights)."""
        self._pack(named_tensors)
        return self.current_refs()

    def update(self, named_tensors, version: int) -> SyncReport:
        """Pack the update (`send` sends it)."""
        self._pack(named_tensors)
        n = self.buffer.numel()
        return SyncReport(version=version, full_tensors=len(self.slots), bytes_per_worker=n, dense_bytes=n)

    def deliver(self, engine, workers: list, named_tensors, version: int, inflight: str, lost: list,
                out: list) -> SyncReport:
        """An update to `version` for `workers` over the gloo group; the workers it missed pull it
        from the object store (`fallback_workers`). `engine.await_loads` collects the deaths into
        `lost` and the completions the update aborted into `out`."""
        report = self.update(named_tensors, version)
        missed = self._transfer(engine, workers, version, inflight, lost, out)
        if missed:
            full = self.current_refs()
            engine.await_loads(missed, [w.handle.load.remote(full, None, version, inflight) for w in missed],
                               version, lost, out)
        report.fallback_workers = len(missed)
        return report

    def _transfer(self, engine, workers: list, version: int, inflight: str, lost: list, out: list) -> list:
        """The gloo transfer of an update (forming the group first when its members changed);
        the workers it did not reach. (A missed worker's `receive` ends by itself: its group is
        gone, or it times out.)"""
        if not workers:
            return []
        try:
            if self.needs_group(workers):
                self.form(workers)
        except Exception as e:  # a worker died or stalled while joining
            log.warning("ray: the weights group did not form (%s); version %d goes through the object store",
                        first_line(e), version)
            self.drop_group()
            return workers
        refs = [w.handle.receive.remote(self.generation, version, inflight, engine.rc.sync_timeout_s)
                for w in workers]
        failed = dict(self.send())
        if failed:
            self.drop_group()
            for w, e in failed.items():
                log.warning("ray: weights version %d did not reach rollout worker %d by gloo (%s); it pulls them from "
                            "the object store", version, w.index, first_line(e))
        reached = [(w, r) for w, r in zip(workers, refs) if w not in failed]
        unloaded: list = []  # a receive that failed on the worker's side: the object store serves it
        engine.await_loads([w for w, _ in reached], [r for _, r in reached], version, lost, out, unloaded)
        if unloaded:
            self.drop_group()
        return [w for w in workers if w in failed or w in unloaded]

    def current_refs(self) -> dict:
        """Object references of the weights the workers hold now (each tensor copied out of the
        buffer: a view would carry the whole buffer with it)."""
        import ray

        return {s.name: ray.put(view(self.buffer, s).clone()) for s in self.slots}

    def needs_group(self, workers: list) -> bool:
        return self.group is None or self.members != tuple(workers)

    def form(self, workers: list) -> None:
        """A new group of the driver and `workers` (ranks 1..N in this order), the layout sent
        to each. Raises, naming the worker, when one fails to join (a dead worker fails at once)
        or when the group has not formed within the timeout."""
        import ray

        self.group, self.members = None, ()
        self.generation += 1
        g, world, port = self.generation, len(workers) + 1, self.store.port
        refs = [w.handle.join.remote(self.host, port, g, rank, world, self.slots, self.buffer.numel(),
                                     self.timeout_s)
                for rank, w in enumerate(workers, start=1)]
        box: dict = {}

        def driver_side() -> None:  # blocks until every member joined (or the timeout)
            try:
                box["group"] = make_group(self.host, port, g, 0, world, self.host, self.timeout_s)
            except BaseException as e:
                box["error"] = e

        thread = threading.Thread(target=driver_side, name="rollover-weights-group", daemon=True)
        thread.start()
        try:
            while thread.is_alive():  # a join that fails (its worker died) ends the wait early
                done, _ = ray.wait(refs, num_returns=len(refs), timeout=0.1)
                for w, ref in zip(workers, refs):
                    if ref in done:
                        try:
                            ray.get(ref)
                        except Exception as e:
                            raise RuntimeError(f"weights group {g}: rollout worker {w.index} did not join: "
                                               f"{first_line(e)}") from None
        except BaseException:
            # the forming thread would otherwise wait out the timeout in native code, and one
            # that wakes while the interpreter exits aborts the process
            self._open_store()
            thread.join(timeout=10)
            raise
        if "error" in box:
            raise TimeoutError(f"weights group {g}: not every rollout worker joined within ray.sync_timeout_s="
                               f"{self.timeout_s:g} s ({first_line(box['error'])})")
        ray.get(refs, timeout=self.timeout_s)
        self.group, self.members = box["group"], tuple(workers)

    def send(self) -> list[tuple[object, BaseException]]:
        """The buffer to every member; the members it did not reach, each with its error (the
        others have it once this returns)."""
        pending, failed = [], []
        for rank, w in enumerate(self.members, start=1):
            try:  # a dead member fails here, at once
                pending.append((w, [self.group.send([c], rank, tag) for tag, c in enumerate(chunks(self.buffer))]))
            except Exception as e:
                failed.append((w, e))
        for w, works in pending:
            try:
                for work in works:
                    work.wait(timeout(self.timeout_s))
            except Exception as e:
                failed.append((w, e))
        return failed

    def drop_group(self) -> None:
        """Form a new group before the next update (a member failed)."""
        self.group, self.members = None, ()

    def close(self) -> None:
        """The group and the store (so no rendezvous is left waiting on it)."""
        self.drop_group()
        self.store = None

    def _pack(self, named_tensors) -> None:
        named = [(n, t.detach()) for n, t in named_tensors]
        same = len(named) == len(self.slots) and all(
            s.name == n and s.shape == tuple(t.shape) for s, (n, t) in zip(self.slots, named))
        if not same:  # a new layout: the members learn it when the group forms again
            self.slots, size = layout(named, self.dtype)
            self.buffer = torch.empty(size, dtype=torch.uint8)
            self.drop_group()
        with torch.no_grad():
            for s, (_, t) in zip(self.slots, named):
                view(self.buffer, s).copy_(t)


class GlooReceiver:
    """A worker's side. Each group it joins comes with its own buffer, and a transfer works on
    the group and buffer it started with: a receive left over from a group the driver gave up on
    can neither take a newer group's chunks nor write into its buffer (the worker checks the
    generation again before loading, `RolloutWorker.receive`)."""

    def __init__(self):
        self.generation = 0
        self.member: tuple | None = None  # (generation, group, buffer, slots) of the group joined last

    def join(self, host: str, port: int, generation: int, rank: int, world: int, slots: list[Slot], size: int,
             timeout_s: float) -> None:
        import ray

        self.member = None
        group = make_group(host, port, generation, rank, world, ray.util.get_node_ip_address(), timeout_s)
        self.member = (generation, group, torch.empty(size, dtype=torch.uint8), slots)
        self.generation = generation

    def receive(self, generation: int, timeout_s: float) -> list[tuple[str, torch.Tensor]]:
        """The driver's transfer in `generation`'s group, as named views of that group's buffer."""
        member = self.member
        if member is None or member[0] != generation:
            raise RuntimeError(f"asked to receive weights from group {generation}, this worker is in group "
                               f"{member[0] if member is not None else 'none'}")
        _, group, buffer, slots = member
        for tag, c in enumerate(chunks(buffer)):
            group.recv([c], 0, tag).wait(timeout(timeout_s))
        return [(s.name, view(buffer, s)) for s in slots]
