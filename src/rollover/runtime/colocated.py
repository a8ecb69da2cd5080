"""Rollout on every trainer rank's device (`train.colocate`, verl's "hybrid engine").

With `train.parallel: fsdp` and N ranks on N GPUs, one engine on the driver would generate on
one GPU while N-1 wait. Colocated, each rank process also holds a TorchEngine on its own device
(`rollover.train.rank_server.RankServer.engine_*`), and `ColocatedEngines` is the engine contract the
loops see over those N engines: it validates and routes each request (least outstanding
tokens, prompt-prefix affinity: `rollover.runtime.routing.Router`), keeps every live request and
its future, and hands completions to the schedule as the ranks send them. The driver's APRIL
bookkeeping and sync schedule run unchanged on top.

The engines and the ranks' training take turns on the devices, which is why only the
synchronous schedule (APRIL included) runs colocated: before a step the loop calls
`release_memory` (each engine frees its K/V cache, packed weights and, with
`train.colocate_free_weights` (the default), the weights themselves, as verl's vLLM sleeps),
and after it `ColocatedWeightSync` has every rank load the new weights into its own engine
from its own gather, a bucket at a time, so no weights cross a pipe and no rank holds a second
full copy while it trains. A model must then fit sharded plus one bucket while training, and
whole plus its K/V cache while generating. Sequences paused across the step (APRIL's
`carry: keep_kv`) keep their K/V, not their weights. A rank that dies ends the run (`RankLost`,
naming it), as with the trainer alone; so does a rank whose engine gives no answer to a call
within `train.collective_timeout_s` (twice that for a weight load, which gathers inside): it is
taken for hung rather than waited on for ever.
"""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from typing import Callable, Iterable

from rollover.engine.api import EngineAPI, call_if_finished
from rollover.engine.core import EngineStats
from rollover.engine.validation import validate_request
from rollover.models import is_vision_language
from rollover.runtime.routing import Router
from rollover.train.ranks import RankLost
from rollover.train.weight_sync import SyncReport
from rollover.types import Completion, Request

log = logging.getLogger("rollover")


@dataclass(eq=False)
class _Rank:
    """One rank's engine as the router sees it."""

    index: int
    load: int = 0  # tokens still owed by its live requests


@dataclass(eq=False)
class _Live:
    req: Request
    future: Future
    rank: _Rank
    wire: str  # the id this placement goes by on its rank (an id resubmitted after an abort gets a new one)

    @property
    def owed(self) -> int:
        return self.req.remaining_tokens


class ColocatedEngines(EngineAPI):
    """The engine contract over the engines of a `ShardedTrainer`'s ranks (see the module
    docstring)."""

    def __init__(self, trainer, cfg, *, max_len: int, eos_token_ids, vocab_size: int):
        self.trainer, self.cfg = trainer, cfg
        self.max_len, self.vocab_size, self._eos = max_len, vocab_size, tuple(eos_token_ids)
        self._bucket_bytes = int(cfg.train.weight_bucket_mb * 2**20)
        self._timeout_s = cfg.train.collective_timeout_s
        self._free_weights = cfg.train.colocate_free_weights
        tokenizer = None
        if cfg.finds_stop_strings:  # the ranks' engines find stop strings with the driver's tokenizer
            from rollover.models import load_tokenizer

            tokenizer = load_tokenizer(cfg.model)
        trainer._all("engine_start", max_len, self._eos, self._bucket_bytes, tokenizer)
        # the ranks' TorchEngines prefill images with a vision-language model
        self.takes_media = cfg.rollout.engine == "torch" and is_vision_language(trainer.architecture.config)
        self._ranks = [_Rank(r) for r in range(trainer.world)]
        self.router = Router(cfg.rollout.max_new_tokens * cfg.rollout.samples_per_prompt)
        self._lock = threading.Lock()  # _live, _wire, the ranks' loads, the router
        self._live: dict[str, _Live] = {}
        self._wire: dict[str, _Live] = {}
        self._placements = 0
        self._version = 0
        self._paused = False
        self._stopped = False
        self._error: BaseException | None = None
        self._listeners: dict = {}  # per-token streams are not forwarded from the ranks
        self._listen_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="rollover-colocated", daemon=True)
        self._reader.start()
        log.info("rollout: an engine on each of the %d trainer ranks' devices (train.colocate)", trainer.world)

    # ------------------------------------------------------------ completions from the ranks
    def _read(self) -> None:
        """Deliver the ranks' completions as they come (this thread runs the schedule's
        callbacks, as TorchEngine's engine thread does); a rank that dies fails every live request."""
        conns = list(self.trainer.events)
        watched = self.trainer._watched()  # what becomes ready when a rank's process ends
        while not self._stopped:
            try:
                ready = wait(conns + list(watched), timeout=0.5)
            except (OSError, ValueError):  # the pipes were closed under us: shutting down, or the ranks failed
                if self.trainer.failure is not None and not self._stopped:
                    self._fail(self.trainer.failure)
                return
            for x in ready:
                if x in conns:
                    try:
                        c = x.recv()
                    except (EOFError, OSError):
                        rank = conns.index(x)
                    else:
                        self._deliver([c])
                        continue
                else:
                    rank = watched[x]
                if self._stopped:
                    return
                if self.trainer.failure is not None:  # the trainer stopped the ranks and said why
                    self._fail(self.trainer.failure)
                    return
                self._fail(RankLost(f"trainer rank {rank} of {self.trainer.world} died ({self.trainer.how_ended(rank)}) "
                                    "while its engine generated; the run stops at its last checkpoint"))
                return

    def _deliver(self, completions: list[Completion]) -> None:
        """Hand completions to their futures by wire id: each is delivered once, and one from an
        earlier placement of a resubmitted id is dropped."""
        finished = []
        with self._lock:
            for c in completions:
                live = self._wire.pop(c.id, None)
                if live is None:
                    continue
                del self._live[live.req.id]
                live.rank.load -= live.owed
                finished.append((live, replace(c, id=live.req.id)))
        for live, c in finished:
            try:
                live.future.set_result(c)
            except InvalidStateError:  # cancelled by its caller meanwhile
                pass

    def _fail(self, err: BaseException, stays: bool = True) -> None:
        with self._lock:
            if stays:
                self._error = err
            lives, self._live, self._wire = list(self._live.values()), {}, {}
        for live in lives:
            if not live.future.done():
                live.future.set_exception(err)

    # ------------------------------------------------------------ requests
    @property
    def version(self) -> int:
        return self._version

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    def submit_many(self, requests: Iterable[Request], on_done: Callable[[Completion], None] | None = None) -> list[Future]:
        """Validate here (ValueError naming the request, nothing queued), then route: one batch
        per rank."""
        requests = list(requests)
        self._check_alive()
        batches: dict[int, list[Request]] = {}
        lives = []
        with self._lock:
            seen = set()
            for r in requests:
                if r.id in self._live or r.id in seen:
                    raise ValueError(f"request {r.id!r}: an unfinished request has this id")
                seen.add(r.id)
                validate_request(r, max_len=self.max_len, vocab_size=self.vocab_size, media=self.takes_media,
                                 stop_strings=self.cfg.finds_stop_strings)  # the ranks' engines get the tokenizer
            for r in requests:
                f = Future()
                if on_done is not None:
                    f.add_done_callback(functools.partial(call_if_finished, on_done))
                self._placements += 1
                wire = f"{r.id}@{self._placements}"
                rank = self.router.pick(r, self._ranks)
                live = _Live(req=r, future=f, rank=rank, wire=wire)
                rank.load += live.owed
                self._live[r.id] = self._wire[wire] = live
                lives.append(live)
                batches.setdefault(rank.index, []).append(replace(r, id=wire))
        for index, reqs in batches.items():
            self.trainer.call(index, "engine_submit", reqs, timeout=self._timeout_s)
        return [live.future for live in lives]

    def abort(self, ids: Iterable[str] | None = None) -> list[Completion]:
        """Abort requests (all when ids is None); returns their completions (partial, finish
        'abort', or finished just before the abort reached them). Off the delivering thread it
        returns once their futures have them."""
        with self._lock:
            wanted = set(self._live) if ids is None else set(ids) & set(self._live)
            targets = [self._live[rid] for rid in sorted(wanted)]
            by_rank: dict[int, list[str]] = {}
            for live in targets:
                by_rank.setdefault(live.rank.index, []).append(live.wire)
        for index, wires in by_rank.items():
            self._deliver(self.trainer.call(index, "engine_call", "abort", wires, timeout=self._timeout_s))
        if threading.current_thread() is not self._reader:
            _, pending = wait_futures([live.future for live in targets], timeout=self._timeout_s)
            if pending:
                raise TimeoutError(f"{len(pending)} aborted requests got no answer from the ranks within "
                                   f"train.collective_timeout_s={self._timeout_s:g} s")
        return [live.future.result() for live in targets if live.future.done() and not live.future.cancelled()
                and live.future.exception() is None]

    # ------------------------------------------------------------ weights
    def load_from_ranks(self, version: int, inflight: str = "continue") -> None:
        """Every rank loads the trainer's current weights into its engine as `version`."""
        self._check_alive()
        # the ranks gather inside (collectives that give up after the timeout themselves): twice it here
        got = self.trainer._all("engine_load", self._bucket_bytes, version, inflight, timeout=2 * self._timeout_s)
        aborted = [c for part in got for c in part]
        self._version = version
        self._deliver(aborted)

    def update_weights(self, named_tensors, version: int, inflight: str = "continue") -> list[Completion]:
        raise RuntimeError("train.colocate: the ranks' engines load the trainer's weights themselves "
                           "(ColocatedWeightSync), not tensors from the driver")

    # ------------------------------------------------------------ the rest of the contract
    def _each(self, method: str, *args) -> list:
        self._check_alive()
        return [self.trainer.call(r.index, "engine_call", method, *args, timeout=self._timeout_s) for r in self._ranks]

    def stats(self) -> EngineStats:
        total = EngineStats()
        for st in self._each("stats"):
            total.add(st)
        return total

    def reset_stats(self) -> None:
        self._each("reset_stats")

    def pause(self) -> None:
        self._paused = True
        self._each("pause")

    def resume(self) -> None:
        self._paused = False
        self._each("resume")

    @property
    def paused(self) -> bool:
        return self._paused

    def lengths(self) -> dict[str, int]:
        """Response tokens so far of every unfinished request, by request id."""
        out = {}
        for part in self._each("lengths"):
            out.update(part)
        with self._lock:
            return {self._wire[wire].req.id: n for wire, n in out.items() if wire in self._wire}

    def release_memory(self) -> None:
        """Before the ranks train: each engine frees its packed weights and idle K/V cache, and
        with `train.colocate_free_weights` its weights too, which the push after the step loads
        again (`ColocatedWeightSync`); a model then needs to fit whole on a device only while it
        generates."""
        self._each("release_memory")
        if self._free_weights:
            self._each("release_weights")

    def shutdown(self) -> None:
        """Stop delivering; the engines themselves stop with their ranks (the trainer's close)."""
        if self._stopped:
            return
        self._stopped = True
        if self._reader is not threading.current_thread():
            self._reader.join(timeout=5)
        self._fail(RuntimeError("engine is shut down"), stays=False)

    def _check_alive(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"colocated engines stopped: {self._error}") from self._error
        if self._stopped:
            raise RuntimeError("engine is shut down")


class ColocatedWeightSync:
    """The trainer -> engine seam when the engines live in the ranks: each rank loads its own
    gather of the weights (`ColocatedEngines.load_from_ranks`); the driver-side stream of named
    tensors it is handed is never drawn, so nothing is gathered to the driver."""

    def __init__(self, engine: ColocatedEngines):
        self.engine = engine
        self.last_sync = SyncReport()

    def push(self, named_tensors, version: int, inflight: str = "continue") -> None:
        import time

        close = getattr(named_tensors, "close", None)
        if close is not None:  # a generator of the ranks' buckets, not started: nothing to gather
            close()
        t0 = time.perf_counter()
        self.engine.load_from_ranks(version, inflight)
        # nothing crosses to the driver: the ranks' own gathers are what moved
        self.last_sync = SyncReport(version=version, workers=self.engine.trainer.world,
                                    seconds=time.perf_counter() - t0)

    def metrics(self) -> dict:
        return self.last_sync.metrics()
