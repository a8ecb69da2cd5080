"""The blocking and asyncio conveniences every engine offers on top of `submit_many`.

An engine implements `submit_many(requests, on_done)`, `shutdown()`, and keeps
`_listeners` (request id -> per-token callback) guarded by `_listen_lock`; everything here is
built from those.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterable

from rollover.engine.cpu import openmp
from rollover.types import Completion, Request


@dataclass
class TokenEvent:
    """One streamed token; the last event of a stream also carries the completion."""

    token: int | None
    logprob: float | None
    version: int | None
    completion: Completion | None = None


def call_if_finished(on_done: Callable[[Completion], None], fut: Future) -> None:
    """A future's done-callback for an engine's `on_done`: a future that failed (the engine shut
    down under it) or was cancelled has no completion to report; its error reaches whoever
    awaits the future, not the scheduler's callback."""
    if not fut.cancelled() and fut.exception() is None:
        on_done(fut.result())


class EngineAPI:
    _listeners: dict[str, Callable]
    _listen_lock: object

    def submit_many(self, requests: Iterable[Request], on_done: Callable[[Completion], None] | None = None) -> list[Future]:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    @property
    def oldest_version(self) -> int:
        """The oldest weights version a token sampled from now on may carry: `version`, except on
        an engine whose workers load updates on their own time (RayEngine, ray.weight_sync=lazy)."""
        return self.version

    def settle(self) -> None:
        """Return once every token sampled from now on carries `version`: at once, except where
        workers load updates on their own time (RayEngine, ray.weight_sync=lazy)."""

    def on_oldest_version(self, callback: Callable[[], None]) -> None:
        """Call `callback()` whenever `oldest_version` moves on by itself (a worker loaded an
        update lazily); an engine whose versions move only in `update_weights` never calls it."""

    def release_memory(self) -> None:
        """Free what can be rebuilt on demand; engines with nothing to free do nothing."""

    def submit(self, request: Request, on_done: Callable[[Completion], None] | None = None) -> Future:
        """Queue one request; returns a Future of its Completion. Bad input raises ValueError
        here, in the caller's thread, and leaves every other request untouched."""
        return self.submit_many([request], on_done)[0]

    def generate(self, requests: Iterable[Request]) -> list[Completion]:
        """Blocking: submit and wait for all."""
        futures = self.submit_many(requests)
        openmp.release()  # this thread waits while the engine's computes
        return [f.result() for f in futures]

    async def agenerate(self, request: Request) -> Completion:
        return await asyncio.wrap_future(self.submit(request))

    async def stream(self, request: Request) -> AsyncIterator[TokenEvent]:
        """Yield each new token as it is generated; the last event carries the completion. A
        request that fails raises its error here; a consumer that stops early (breaks, is
        cancelled, or its loop closes) aborts its request, and the engine's other requests go on."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:  # from the engine's thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the consumer's loop closed under an abandoned stream: nobody reads it
                pass

        def on_token(tok, lp, ver):
            put(TokenEvent(tok, lp, ver))

        with self._listen_lock:
            if request.id in self._listeners:
                raise ValueError(f"request {request.id!r} is already being streamed: give each request its own id")
            self._listeners[request.id] = on_token
        try:
            fut = self.submit(request)
        except BaseException:
            self._stop_listening(request.id, on_token)
            raise
        fut.add_done_callback(put)  # the future itself, after the request's last token
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Future):
                    yield TokenEvent(None, None, None, item.result())  # (raises the request's error)
                    return
                yield item
        finally:
            self._stop_listening(request.id, on_token)
            if not fut.done():  # (now: the id is free again when the stream is gone)
                self._abort_left(request.id)

    def _abort_left(self, request_id: str) -> None:
        """Abort a request whose stream was left; an engine shut down meanwhile holds none to abort."""
        try:
            self.abort([request_id])
        except (RuntimeError, TimeoutError) as e:
            logging.getLogger("rollover").debug("request %r, left by its stream, not aborted: %r", request_id, e)

    def _stop_listening(self, request_id: str, on_token: Callable) -> None:
        with self._listen_lock:
            if self._listeners.get(request_id) is on_token:  # (not another stream's of the same id)
                del self._listeners[request_id]

    def abort(self, ids: Iterable[str] | None = None) -> list[Completion]:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
