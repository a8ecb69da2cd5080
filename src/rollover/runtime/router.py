"""RayEngine: the engine contract over N rollout workers (Ray actors), with a router.

The loops see one engine; behind it each worker (`rollover.runtime.worker.RolloutWorker`) owns
a TorchEngine or vLLM engine in its own process, on this machine or another. What the driver
keeps, the worker does not:

- every live request and its tokens so far (the workers stream them back with each `poll`), so
  a worker's death loses nothing: its requests resume on the others (or on its replacement)
  from their last reported token (sampling seeded by position draws the regenerated tail with
  the same noise; bit-identical wherever the recomputed prefix gives the same logits);
- the weights version, the staleness gate's clock: a replacement worker starts at the current
  version, and an update returns once every worker holds it.

Weight updates: `rollover.runtime.updates.WeightUpdates`. Routing: `rollover.runtime.routing.Router` (least outstanding tokens, prompt-prefix
affinity). Delivery: one dispatcher thread (`rollover.runtime.dispatch`) hands completions to
futures and `on_done` callbacks, as TorchEngine's engine thread does; each completion is
delivered exactly once, by the wire id of its placement.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import wait as wait_futures
from dataclasses import replace
from typing import Callable, Iterable

from rollover.engine import portable_architecture
from rollover.engine.api import EngineAPI, call_if_finished
from rollover.engine.core import EngineStats
from rollover.engine.validation import validate_request
from rollover.models import is_vision_language, text_config
from rollover.runtime.dispatch import Dispatcher
from rollover.runtime.live import LiveRequest, WorkerSlot, already_finished, first_line
from rollover.runtime.routing import Router
from rollover.runtime.updates import WeightUpdates
from rollover.runtime.weights import ObjectStoreTransport, SyncReport, engine_dtype
from rollover.types import Completion, Request

log = logging.getLogger("rollover")

POLL_S = 0.5  # a worker's poll returns at the first completion or after this long


class WorkerLost(RuntimeError):
    """A rollout worker died with no restart left, and no worker remains."""


class RayEngine(WeightUpdates, EngineAPI):
    """The engine contract (`rollover.engine.Engine`) served by `cfg.ray.rollout_workers` Ray
    actors. Build it with the arguments of `make_engine`."""

    def __init__(self, cfg, architecture, *, weights, device, max_len: int, eos_token_ids):
        import ray

        from rollover.runtime import check_resources, start_ray

        self.cfg, self.rc = cfg, cfg.ray
        self._owns_ray = start_ray(cfg)
        self.worker_device = "cuda" if self.rc.gpus_per_worker > 0 else "cpu"
        check_resources(cfg)
        self.max_len, self.vocab_size = max_len, text_config(architecture.config).vocab_size
        # the workers' TorchEngines prefill images with a vision-language model
        self.takes_media = is_vision_language(architecture.config) and cfg.rollout.engine == "torch"
        # rollout.stop: the workers find the strings with the driver's tokenizer (their nodes need no copy)
        self._tokenizer = self._stops = None
        if cfg.finds_stop_strings:
            from rollover.engine.stop import StopStrings
            from rollover.models import load_tokenizer

            self._tokenizer = load_tokenizer(cfg.model)
            self._stops = StopStrings.of(self._tokenizer)  # a resubmitted request that already holds one ends here
        self._eos = tuple(eos_token_ids)
        self._arch = portable_architecture(architecture, cfg, max_len)  # a worker starts without transformers
        self._version = 0
        self.poll_s = POLL_S  # tokens reach the driver at least this often (tests lower it)
        self._paused = False
        self._stopped = False
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # _live, _wire, worker loads and liveness, the router
        self._weights_lock = threading.Lock()  # a weight update and a worker's replacement
        self._live: dict[str, LiveRequest] = {}  # request id -> live request
        self._wire: dict[str, LiveRequest] = {}  # wire id (request id @ placement) -> live request
        self._placements = 0
        self._parked: list[LiveRequest] = []  # requests waiting for a replacement worker (none alive)
        self._restarting = 0  # replacements being started
        self._retired = EngineStats()  # counters of workers that died
        slack = self.rc.affinity_slack_tokens
        self.router = Router(slack if slack is not None else cfg.rollout.max_new_tokens * cfg.rollout.samples_per_prompt)
        dtype = engine_dtype(cfg, self.worker_device)
        self.delta = self.rc.weight_delta
        if self.delta is None:
            self.delta = (self.rc.weight_transport == "object_store" and self.rc.weight_sync == "eager"
                          and (dtype.itemsize == 2 or cfg.train.lora is not None))
        if self.rc.weight_transport == "gloo":
            from rollover.runtime.collective import GlooTransport

            self.transport = GlooTransport(dtype, self.rc.sync_timeout_s)
        else:
            self.transport = ObjectStoreTransport(dtype, self.delta)
        self.last_sync = SyncReport()
        self.restarts = 0  # worker replacements, all time
        self.resubmitted = 0  # requests resumed on another worker after a death
        self._listeners: dict = {}  # streaming: driver-side per-token callbacks
        self._version_listeners: list = []  # called when a lazy load moves oldest_version on
        self._listen_lock = threading.Lock()
        self._remote = ray.remote(_worker_class()).options
        self._dispatch = Dispatcher()  # delivers completions, runs the schedule's callbacks
        refs = self.transport.initial(weights)
        self._workers = [self._spawn(i, refs, 0) for i in range(self.rc.rollout_workers)]
        try:
            self._wait_ready(self._workers)
        except BaseException:
            self.shutdown()
            raise
        for w in self._workers:
            self._start_poller(w)
        how = {"gloo": "a gloo group"}.get(self.rc.weight_transport, "the object store" + (" as deltas" if self.delta else ""))
        log.info("ray: %d rollout worker(s) on %d node(s) (pids %s), weights through %s", len(self._workers),
                 len({w.node for w in self._workers}), ", ".join(str(w.pid) for w in self._workers), how)

    # ------------------------------------------------------------ workers
    def _spawn(self, index: int, refs: dict, restarts: int) -> WorkerSlot:
        rc = self.rc
        threads = max(1, int(rc.cpus_per_worker))
        handle = self._remote(num_cpus=rc.cpus_per_worker, num_gpus=rc.gpus_per_worker, max_concurrency=8,
                              name=None).remote(index, self.cfg, *self._arch, refs, self._version, self.worker_device,
                                                self.max_len, self._eos, threads, self.delta, self._paused,
                                                self._tokenizer)
        return WorkerSlot(index=index, handle=handle, restarts=restarts, version=self._version)

    def _wait_ready(self, workers: list[WorkerSlot]) -> None:
        import ray

        refs = [w.handle.ready.remote() for w in workers]
        for w, ref in zip(workers, refs):
            try:
                info = ray.get(ref, timeout=self.rc.sync_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"rollout worker {w.index} did not start within ray.sync_timeout_s="
                                   f"{self.rc.sync_timeout_s:g} s (are its resources free? ray status shows them)") from None
            except ray.exceptions.RayError as e:
                raise RuntimeError(f"rollout worker {w.index} failed to start: {first_line(e)}") from None
            w.pid, w.node, w.ready = info["pid"], info["node"], True

    def _start_poller(self, w: WorkerSlot) -> None:
        w.thread = threading.Thread(target=self._poll_loop, args=(w,), name=f"rollover-ray-poll-{w.index}", daemon=True)
        w.thread.start()

    def _poll_loop(self, w: WorkerSlot) -> None:
        import ray

        started = time.monotonic()
        while not self._stopped and w.alive:
            try:
                if w.pid is None:  # a replacement: who and where, once it is up
                    info = ray.get(w.handle.ready.remote(), timeout=self.rc.sync_timeout_s)
                    w.pid, w.node = info["pid"], info["node"]
                    log.info("ray: rollout worker %d replaced: pid %s on node %s, up in %.1f s (restart %d of "
                             "ray.max_restarts=%d)", w.index, w.pid, w.node, time.monotonic() - started, w.restarts,
                             self.rc.max_restarts)
                done, tokens = ray.get(w.handle.poll.remote(self.poll_s), timeout=self.poll_s + self.rc.sync_timeout_s)
            except BaseException as e:  # dead (RayActorError), hung (GetTimeoutError), or a bug
                if not self._stopped:
                    self._lost(w, e)
                return
            w.ready = True
            self._check_submits(w)
            self._dispatch.put(functools.partial(self._deliver, w, done, tokens))

    # ------------------------------------------------------------ delivery (on the dispatcher)
    def _resolve(self, pairs: list) -> None:
        """Hand each (live, completion or error) to its future (and so to `on_done`)."""
        for live, outcome in pairs:
            with self._listen_lock:
                listener = self._listeners.pop(live.req.id, None)
            if listener is not None and isinstance(outcome, Completion):  # the tail no poll reported
                seen = len(live.req.response_ids) + len(live.ids)
                for tok, lp, ver in zip(outcome.response_ids[seen:], outcome.logprobs[seen:], outcome.versions[seen:]):
                    listener(tok, lp, ver)
            try:
                if isinstance(outcome, BaseException):
                    live.future.set_exception(outcome)
                else:
                    live.future.set_result(outcome)
            except InvalidStateError:  # cancelled by its caller meanwhile
                pass

    def _deliver(self, w: WorkerSlot, done: list[Completion], tokens: dict) -> None:
        """Apply streamed tokens and hand out completions, by wire id: each placement of a
        request has its own, so a completion from an earlier placement (an abort answered twice,
        a request resumed under the same id) is dropped, and each is delivered exactly once.
        Only the poller drains a worker's tokens, so they arrive in order."""
        finished, streamed = [], []
        with self._lock:
            for wire, toks in tokens.items():
                live = self._wire.get(wire)
                if live is not None and live.worker is w:
                    n = min(len(toks), live.owed)
                    for tok, lp, ver in toks[:n]:
                        live.ids.append(tok), live.lps.append(lp), live.vers.append(ver)
                    w.load -= n
                    streamed.append((live.req.id, toks[:n]))
            for c in done:
                live = self._wire.pop(c.id, None)
                if live is None:
                    continue
                del self._live[live.req.id]
                w.load -= live.owed
                finished.append((live, replace(c, id=live.req.id)))
        if self._listeners:
            for rid, toks in streamed:
                with self._listen_lock:
                    listener = self._listeners.get(rid)
                if listener is not None:
                    for tok, lp, ver in toks:
                        listener(tok, lp, ver)
        self._resolve(finished)

    def _lost(self, w: WorkerSlot, err: BaseException) -> None:
        """A worker died (or stopped answering): replace it and resume its requests (those
        an abort was asked for end as aborted, from the driver's tokens). Until the
        replacement is there, requests that find no live worker wait for it."""
        import ray

        # (a Ray shut down meanwhile, by whoever started it, is not restarted: a new actor would start another)
        can_restart = w.restarts < self.rc.max_restarts and not self._stopped and ray.is_initialized()
        with self._lock:
            if not w.alive:
                return
            w.alive = False
            if w.last_stats is not None:
                self._retired.add(w.last_stats)
            orphans = [live for live in self._live.values() if live.worker is w]
            for live in orphans:
                live.worker = None
                self._wire.pop(live.wire, None)
            w.load = 0
            if can_restart:
                self._restarting += 1
            no_one = not can_restart and not any(x.alive for x in self._workers) and not self._restarting
        try:
            ray.kill(w.handle, no_restart=True)
        except Exception:  # already gone
            pass
        log.warning("ray: rollout worker %d (pid %s) lost: %s; %d requests resume %s", w.index, w.pid,
                    first_line(err), len(orphans),
                    "on the others or its replacement" if can_restart else "on the others (no restart left)")
        if no_one:
            self._fail(WorkerLost(f"rollout worker {w.index} died after {w.restarts} restarts (ray.max_restarts="
                                  f"{self.rc.max_restarts}) and no worker is left: {first_line(err)}"))
            return
        ending = [live for live in orphans if live.aborting]
        if ending:
            self._dispatch.run(functools.partial(self._abort_rest, ending))
        moving = [live for live in orphans if not live.aborting]
        self.resubmitted += len(moving)
        if can_restart:
            with self._weights_lock:  # the replacement starts at the version every worker holds
                new = self._spawn(w.index, self.transport.current_refs(), w.restarts + 1)
                with self._lock:
                    self._workers[self._workers.index(w)] = new
                    self.restarts += 1
                    self._restarting -= 1
                    moving += self._parked
                    self._parked = []
            if self._stopped:  # shut down meanwhile: nothing else would end it
                ray.kill(new.handle, no_restart=True)
                return
            self._start_poller(new)
        self._place(moving)

    def _fail(self, err: BaseException) -> None:
        with self._lock:
            self._error = err
            lives, self._live, self._wire, self._parked = list(self._live.values()), {}, {}, []
        self._resolve([(live, err) for live in lives])

    # ------------------------------------------------------------ requests
    @property
    def version(self) -> int:
        return self._version

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    def submit_many(self, requests: Iterable[Request], on_done: Callable[[Completion], None] | None = None) -> list[Future]:
        """Validate here (ValueError naming the request, nothing queued), then route and send
        without waiting for the workers."""
        requests = list(requests)
        self._check_alive()
        lives = []
        for r in requests:
            f = Future()
            if on_done is not None:
                f.add_done_callback(functools.partial(call_if_finished, on_done))
            f.add_done_callback(functools.partial(self._abort_if_cancelled, r.id))
            lives.append(LiveRequest(req=r, future=f))
        with self._lock:  # checked and entered in one hold: two submits of one id cannot both pass
            seen = set()
            for r in requests:
                if r.id in self._live or r.id in seen:
                    raise ValueError(f"request {r.id!r}: an unfinished request has this id")
                seen.add(r.id)
                validate_request(r, max_len=self.max_len, vocab_size=self.vocab_size, media=self.takes_media,
                                 stop_strings=self._tokenizer is not None)
            for live in lives:
                self._live[live.req.id] = live
        self._place(lives)
        return [live.future for live in lives]

    def _place(self, lives: list[LiveRequest]) -> None:
        """Route lives to workers (one batch per worker, in order) and send them, each under a
        fresh wire id. With no worker alive they wait for a replacement being started; with
        none coming they fail."""
        batches: dict[int, tuple[WorkerSlot, list[Request]]] = {}
        done = []
        with self._lock:
            alive = [w for w in self._workers if w.alive]
            ready = [w for w in alive if w.ready] or alive  # a starting replacement only if nothing else
            if self.rc.weight_sync == "eager":  # a replacement catching up on the weights only if nothing else
                ready = [w for w in ready if w.version >= self._version] or ready
            for live in lives:
                if self._live.get(live.req.id) is not live:
                    continue  # finished meanwhile (aborted before it was placed)
                end = already_finished(live.resumed(), self._eos, self.max_len, self._stops)
                if end is not None:
                    del self._live[live.req.id]
                    done.append((live, live.resumed().completion(end)))
                    continue
                if not ready:
                    if self._restarting:
                        self._parked.append(live)
                    else:
                        del self._live[live.req.id]
                        done.append((live, WorkerLost("no rollout worker is alive")))
                    continue
                self._placements += 1
                live.wire = f"{live.req.id}@{self._placements}"
                req = live.resumed(live.wire)
                w = self.router.pick(req, ready)
                live.worker = w
                w.load += live.owed
                self._wire[live.wire] = live
                batches.setdefault(id(w), (w, []))[1].append(req)
        if done:
            self._dispatch.run(functools.partial(self._resolve, done))
        for w, reqs in batches.values():
            w.submits.append((w.handle.submit.remote(reqs), [r.id for r in reqs]))

    def _check_submits(self, w: WorkerSlot) -> None:
        """Fail the requests of a batch the worker refused (its engine's own checks; the
        driver's validation makes this rare). A dead worker's batches move with its poller."""
        import ray

        while w.submits:
            ref, wires = w.submits[0]
            if not ray.wait([ref], timeout=0)[0]:
                return
            w.submits.popleft()
            try:
                ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                err = RuntimeError(f"rollout worker {w.index} refused a batch of {len(wires)} requests: {first_line(e)}")
                with self._lock:
                    lives = [self._wire.pop(wire) for wire in wires if wire in self._wire]
                    for live in lives:
                        del self._live[live.req.id]
                        w.load -= live.owed
                self._dispatch.put(functools.partial(self._resolve, [(live, err) for live in lives]))
            except ray.exceptions.RayError:
                return  # died: the next poll says so

    def abort(self, ids: Iterable[str] | None = None) -> list[Completion]:
        """Abort requests (all when ids is None); returns their completions (partial, finish
        'abort', or finished just before the abort reached them). From another thread it
        returns once their futures and `on_done` callbacks have them; from a callback (the
        dispatcher thread) it returns those delivered so far, the rest following as the
        workers report them."""
        import ray

        with self._lock:
            wanted = set(self._live) if ids is None else set(ids) & set(self._live)
            targets = [self._live[rid] for rid in sorted(wanted)]
            by_worker: dict[int, tuple[WorkerSlot, list[str]]] = {}
            unplaced = []
            for live in targets:
                live.aborting = True
                if live.worker is None:
                    unplaced.append(live)
                else:
                    by_worker.setdefault(id(live.worker), (live.worker, []))[1].append(live.wire)
        for w, wires in by_worker.values():
            try:
                got = ray.get(w.handle.abort.remote(sorted(wires)), timeout=self.rc.sync_timeout_s)
            except ray.exceptions.RayError as e:  # died: its poller ends these from the driver's tokens
                log.warning("ray: abort on rollout worker %d failed (%s)", w.index, first_line(e))
                continue
            self._dispatch.run(functools.partial(self._deliver, w, got, {}))
        if unplaced:  # between workers (their worker lost) or waiting for a replacement
            self._dispatch.run(functools.partial(self._abort_rest, unplaced))
        if not self._dispatch.here:
            _, pending = wait_futures([live.future for live in targets], timeout=self.rc.sync_timeout_s)
            if pending:
                raise TimeoutError(f"{len(pending)} aborted requests got no answer within ray.sync_timeout_s="
                                   f"{self.rc.sync_timeout_s:g} s")
        return [live.future.result() for live in targets if live.future.done() and not live.future.cancelled()
                and live.future.exception() is None]

    def _abort_rest(self, lives: list[LiveRequest]) -> None:
        """End aborted requests no worker holds: their partial completion is the driver's tokens."""
        with self._lock:
            rest = [live for live in lives if self._live.get(live.req.id) is live and live.worker is None]
            for live in rest:
                del self._live[live.req.id]
        self._resolve([(live, live.resumed().completion("abort")) for live in rest])

    def _abort_if_cancelled(self, rid: str, fut: Future) -> None:
        if fut.cancelled() and not self._stopped:
            threading.Thread(target=self.abort, args=([rid],), daemon=True).start()

    # ------------------------------------------------------------ the rest of the contract
    def _each(self, method: str, *args) -> list[tuple[WorkerSlot, object]]:
        """Call `method` on every ready worker and return (worker, answer) pairs; a worker
        still starting gets the call without being waited for (commands such as pause), and
        the answers of workers that died meanwhile are left out (their pollers replace them)."""
        import ray

        workers = [w for w in self._workers if w.alive]
        refs = [getattr(w.handle, method).remote(*args) for w in workers]
        out = []
        for w, ref in zip(workers, refs):
            if not w.ready:
                continue
            try:
                out.append((w, ray.get(ref, timeout=self.rc.sync_timeout_s)))
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"rollout worker {w.index} did not answer {method} within ray.sync_timeout_s="
                                   f"{self.rc.sync_timeout_s:g} s") from None
            except ray.exceptions.RayActorError:
                pass
        return out

    def stats(self) -> EngineStats:
        """Counters summed over the workers (those that died included, as last seen), once what
        they reported so far is delivered."""
        self._check_alive()
        self._dispatch.sync(self.rc.sync_timeout_s, "stats")
        answers = self._each("stats")
        with self._lock:
            total = EngineStats()
            total.add(self._retired)
            for w, st in answers:
                w.last_stats = st
                total.add(st)
        return total

    def reset_stats(self) -> None:
        with self._lock:
            self._retired = EngineStats()
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
        self._dispatch.sync(self.rc.sync_timeout_s, "lengths")
        out = {}
        for _, part in self._each("lengths"):
            out.update(part)
        with self._lock:
            return {self._wire[wire].req.id: n for wire, n in out.items() if wire in self._wire}

    def release_memory(self) -> None:
        self._each("release_memory")

    def workers(self) -> list[dict]:
        """Each worker's index, pid, node, restarts, outstanding tokens, whether it has answered, and
        the weights version it holds (for tests and logs)."""
        with self._lock:
            return [{"index": w.index, "pid": w.pid, "node": w.node, "restarts": w.restarts, "load": w.load,
                     "alive": w.alive, "ready": w.ready, "version": w.version} for w in self._workers]

    def kill_worker(self, index: int) -> None:
        """SIGKILL a worker's process (fault tests and benchmarks): what a crash does."""
        import os
        import signal

        import ray

        w = next(w for w in self._workers if w.index == index and w.alive)
        pid = w.pid or ray.get(w.handle.ready.remote(), timeout=self.rc.sync_timeout_s)["pid"]
        os.kill(pid, signal.SIGKILL)

    def shutdown(self) -> None:
        import ray

        if self._stopped:
            return
        self._stopped = True
        for w in self._workers:
            w.alive = False
            try:
                ray.kill(w.handle, no_restart=True)
            except Exception:
                pass
        for w in self._workers:
            if w.thread is not None and w.thread is not threading.current_thread():
                w.thread.join(timeout=5)
        self._dispatch.close()
        if hasattr(self.transport, "close"):  # gloo: the group's sockets and the store
            self.transport.close()
        with self._lock:
            lives, self._live, self._wire = list(self._live.values()), {}, {}
        for live in lives:
            if not live.future.done():
                live.future.set_exception(RuntimeError("engine is shut down"))
        if self._owns_ray:
            ray.shutdown()

    def _check_alive(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"ray engine stopped: {self._error}") from self._error
        if self._stopped:
            raise RuntimeError("engine is shut down")


@functools.lru_cache(maxsize=1)
def _worker_class():
    from rollover.runtime.worker import RolloutWorker

    return RolloutWorker
