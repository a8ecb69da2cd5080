"""The thread every core-driven engine runs: commands between steps, futures, callbacks.

A core (`EngineCore` for TorchEngine, the simulator's `SimCore`) is single-threaded; this layer
drives it from one background thread and is what callers use. Every public method is
thread-safe. Commands (submit, abort, update_weights) are applied between steps in the order
they were issued; a step in progress is never interrupted, so `abort` returns within one
step. Completions resolve `concurrent.futures.Future`s from the engine thread, so a
done-callback that calls `abort` or `submit` runs before the next step, which makes schedulers
built on it deterministic.

A core offers: `version`, `eos_token_ids`, `stats` (an `EngineStats`), `validate(request)`,
`add(request) -> Completion | None`, `abort(ids) -> completions`, `update_weights(named,
version, inflight) -> completions`, `has_work()`, `step() -> (finished, touched sequences)` and
`lengths()`.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable, Iterable

from rollover.engine.cpu import openmp
from rollover.engine.api import EngineAPI, call_if_finished
from rollover.engine.core import EngineStats
from rollover.types import Completion, Request


class ThreadedEngine(EngineAPI):
    def _start(self, core, name: str = "rollover-engine") -> None:
        self.core = core
        self._cond = threading.Condition()
        self._listen_lock = self._cond
        self._commands: list[tuple[Callable, Future]] = []
        self._futures: dict[str, Future] = {}
        self._listeners: dict[str, Callable] = {}
        self._error: BaseException | None = None
        self._stopped = False
        self._paused = False
        self._idle = False
        self._step_lock = None  # a simulated engine's: steps only while it is free (see SimEngine.bind_schedule)
        self._poll_s = None  # a simulated engine's: look for work this often while waiting (see SimEngine.gate)
        self._share = None  # TorchEngine on a CPU: its threads kept to the free cores (rollover.engine.cpu.share)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API
    @property
    def version(self) -> int:
        return self.core.version

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.core.eos_token_ids)

    def submit_many(
        self, requests: Iterable[Request], on_done: Callable[[Completion], None] | None = None
    ) -> list[Future]:
        """Queue requests atomically (they are admitted in this order, none before the rest).

        `on_done(completion)` is called from the engine thread between steps as each request
        finishes (or is aborted); calls it makes to `submit`/`abort` take effect before the next
        step, which makes schedulers built on it deterministic.
        """
        requests = list(requests)
        with self._cond:
            self._check_alive()
            seen = set()
            for r in requests:
                if r.id in self._futures or r.id in seen:
                    raise ValueError(f"request {r.id!r}: an unfinished request has this id")
                seen.add(r.id)
                self.core.validate(r)
            futures = [Future() for _ in requests]
            for r, f in zip(requests, futures):
                if on_done is not None:
                    f.add_done_callback(functools.partial(call_if_finished, on_done))
                f.add_done_callback(functools.partial(self._abort_if_cancelled, r.id))
                self._futures[r.id] = f

            def add() -> None:
                for r in requests:
                    done = self.core.add(r)
                    if done is not None:
                        self._resolve([done])

            self._run_or_queue(add, wait=False)
        return futures

    def abort(self, ids: Iterable[str] | None = None) -> list[Completion]:
        """Abort requests (all when ids is None). Returns their partial completions (tokens,
        logprobs and versions so far, finish 'abort'); their futures resolve with the same."""
        idset = None if ids is None else set(ids)
        return self._run_or_queue(lambda: self._resolve(self.core.abort(idset)), wait=True)

    def update_weights(
        self, named_tensors: Iterable[tuple], version: int, inflight: str = "continue"
    ) -> list[Completion]:
        """Load new weights between decode steps, without a restart.

        inflight='continue': running sequences keep going; their K/V is recomputed under the new
        weights and their later tokens carry `version`. inflight='keep': they keep going on the
        K/V the older weights computed (no recompute). inflight='abort': they are aborted and
        returned. Tensors are copied before this returns, so the caller may modify them after
        (weights lent to a trainer, `TorchEngine.lend_weights`, are already in place and not copied).
        """
        items = [(k, v.detach() if hasattr(v, "detach") else v) for k, v in named_tensors]
        return self._run_or_queue(
            lambda: self._resolve(self.core.update_weights(items, version, inflight)), wait=True
        )

    def pause(self) -> None:
        """Stop stepping at the next step boundary; running sequences keep their rows and K/V.
        Commands (submit, abort, update_weights) are still applied while paused."""
        self._run_or_queue(lambda: setattr(self, "_paused", True), wait=True)

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def lengths(self) -> dict[str, int]:
        """Response tokens generated so far by each unfinished request."""
        return self._run_or_queue(self.core.lengths, wait=True)

    def stats(self) -> EngineStats:
        return self._run_or_queue(lambda: EngineStats(**{
            **self.core.stats.__dict__, "finished": dict(self.core.stats.finished)
        }), wait=True)

    def reset_stats(self) -> None:
        self._run_or_queue(lambda: setattr(self.core, "stats", EngineStats()), wait=True)

    def wait_idle(self, stuck_s: float | None = None) -> None:
        """Block until the engine thread has nothing it can do (no command queued; no request, or
        paused), every callback of what it did having run. With `stuck_s`: raise TimeoutError if
        the engine makes no progress (`_progress()` unchanged) for that many seconds."""
        with self._cond:
            seen, since = self._progress(), time.monotonic()
            while not (self._idle and not self._commands):
                self._cond.wait(timeout=None if stuck_s is None else min(stuck_s, 5.0))
                if stuck_s is None:
                    continue
                now, mark = time.monotonic(), self._progress()
                if mark != seen:
                    seen, since = mark, now
                elif now - since > stuck_s:
                    raise TimeoutError(f"engine made no progress for {stuck_s:g} s: {self._describe_stuck()}")

    def _progress(self):
        """What changes whenever the engine does something (a watchdog's mark)."""
        return (self.core.stats.decode_steps, self.core.stats.prefill_tokens, len(self._futures))

    def _describe_stuck(self) -> str:
        return f"{len(self._futures)} requests unfinished, {len(self._commands)} commands queued"

    def on_engine_thread(self) -> bool:
        """Whether the caller is the engine's thread (a done-callback, or a simulated
        environment's answer): commands from it run at once instead of queueing."""
        return threading.current_thread() is self._thread

    def num_unfinished(self) -> int:
        with self._cond:
            return len(self._futures)

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)


    # ------------------------------------------------------------ internals
    def _abort_if_cancelled(self, rid: str, fut: Future) -> None:
        """A caller cancelled its future (asyncio.wait_for, task.cancel): free the row at the next
        step boundary instead of generating for nobody; the other requests are undisturbed."""
        if fut.cancelled():
            with self._cond:
                if self._stopped:
                    return
                self._commands.append((lambda: self._resolve(self.core.abort({rid})), Future()))
                self._cond.notify_all()

    def _check_alive(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"engine stopped after an error: {self._error!r}") from self._error
        if self._stopped:
            raise RuntimeError("engine is shut down")

    def _run_or_queue(self, fn: Callable, wait: bool):
        """Run fn in the engine thread at the next step boundary (now, if we are that thread)."""
        if threading.current_thread() is self._thread:
            return fn()
        box: Future = Future()
        with self._cond:
            self._check_alive()
            self._commands.append((fn, box))
            self._cond.notify_all()
        return box.result() if wait else None

    def _resolve(self, completions: list[Completion]) -> list[Completion]:
        for c in completions:
            with self._cond:
                fut = self._futures.pop(c.id, None)
                self._listeners.pop(c.id, None)
            if fut is not None and not fut.cancelled():  # a caller may cancel (asyncio.wait_for, ...)
                fut.set_result(c)
        return completions

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopped and not self._commands and (self._paused or not self.core.has_work()):
                        if not self._idle:
                            self._idle = True
                            self._cond.notify_all()
                            openmp.release()  # the caller's thread computes while this one waits
                        self._cond.wait(self._poll_s)
                    self._idle = False
                    if self._stopped:
                        break
                    commands, self._commands = self._commands, []
                for fn, box in commands:
                    try:
                        box.set_result(fn())
                    except Exception as e:  # reported to the caller; the engine keeps running
                        box.set_exception(e)
                lock = self._step_lock
                if lock is not None:
                    if not lock.acquire(timeout=0.001):  # its holder may wait on a command: serve those meanwhile
                        continue
                    with self._cond:
                        late = bool(self._commands)  # queued by the section that held it: they come first
                    if late:
                        lock.release()
                        continue
                try:
                    if self.core.has_work() and not self._paused:
                        if self._share is not None:
                            self._share.apply()
                        finished, touched = self.core.step()
                        if self._listeners:
                            for s in touched:
                                cb = self._listeners.get(s.id)
                                if cb is not None:
                                    cb(s.response_ids[-1], s.logprobs[-1], s.versions[-1])
                        self._resolve(finished)
                finally:
                    if lock is not None:
                        lock.release()
        except BaseException as e:  # a broken step fails every pending request loudly
            with self._cond:
                self._error = e
            logging.getLogger("rollover").error("engine step failed: %r", e, exc_info=e)
        finally:
            with self._cond:
                self._stopped = self._idle = True
                self._cond.notify_all()
                commands, self._commands = self._commands, []
                pending, self._futures = self._futures, {}
            why = f"engine step failed: {self._error!r}" if self._error else "engine shut down"
            for _, box in commands:
                box.set_exception(RuntimeError(why))
            for f in pending.values():
                if not f.done():
                    f.set_exception(RuntimeError(f"{why} before the request finished"))
