"""What `RayEngine` keeps per worker and per request, and the small rules about them."""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from rollover.engine.core import EngineStats
from rollover.types import Request


@dataclass(eq=False)
class WorkerSlot:
    """One rollout worker as the driver sees it (a replacement gets a new slot)."""

    index: int
    handle: object
    restarts: int = 0
    alive: bool = True
    load: int = 0  # tokens still owed by its live requests
    pid: int | None = None
    node: str | None = None
    thread: threading.Thread | None = None
    submits: collections.deque = field(default_factory=collections.deque)  # (ref, wire ids) not yet checked
    ready: bool = False  # answered once (a replacement is routed to only when no ready worker is)
    last_stats: EngineStats | None = None
    version: int = 0  # the weights version it has loaded
    pulling: bool = False  # ray.weight_sync=lazy: a load is on its way to it


@dataclass(eq=False)
class LiveRequest:
    """A request the driver owns: as submitted, plus the tokens streamed since."""

    req: Request
    future: Future
    worker: WorkerSlot | None = None
    wire: str = ""  # the id its current placement goes by on its worker
    aborting: bool = False  # an abort was asked for: if its worker dies it ends, it does not move
    ids: list = field(default_factory=list)
    lps: list = field(default_factory=list)
    vers: list = field(default_factory=list)

    @property
    def owed(self) -> int:
        return max(0, self.req.remaining_tokens - len(self.ids))

    def resumed(self, wire: str | None = None) -> Request:
        r = self.req
        return Request(id=wire or r.id, prompt_ids=r.prompt_ids, sampling=r.sampling,
                       response_ids=r.response_ids + self.ids, response_logprobs=r.response_logprobs + self.lps,
                       response_versions=r.response_versions + self.vers, media=r.media)


def already_finished(req: Request, eos: tuple[int, ...], max_len: int, stop_strings=None) -> str | None:
    """The finish of a resumed request whose carried tokens already end it (its worker died
    after the last token and before reporting the completion), else None. `stop_strings`: what
    finds the request's stop strings (`rollover.engine.stop.StopStrings`)."""
    if not req.response_ids:
        return None
    stop = set(req.sampling.stop_token_ids) | (set() if req.sampling.ignore_eos else set(eos))
    if req.response_ids[-1] in stop:
        return "stop"
    if stop_strings is not None and stop_strings.ends(req.sampling.stop, req.response_ids):
        return "stop"
    if req.remaining_tokens <= 0 or len(req.prompt_ids) + len(req.response_ids) >= max_len:
        return "length"
    return None


def first_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def kill_actor(handle) -> None:
    """Kill a Ray actor for good; nothing if it is already gone or Ray is shut down (its actors
    went with it)."""
    import ray

    if not ray.is_initialized():
        return
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # already gone
        pass
