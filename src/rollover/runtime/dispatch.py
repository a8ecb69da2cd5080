"""The one thread that hands `RayEngine`'s completions to the schedule.

It plays the part of TorchEngine's engine thread: deliveries run on it in the order they were
queued, so a command issued from a callback (on this thread) runs inline, and a command from
another thread can wait until what it caused has been delivered.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

log = logging.getLogger("rollover")


class Dispatcher:
    def __init__(self, name: str = "rollover-ray-dispatch"):
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            fn = self._events.get()
            if fn is None:
                return
            try:
                fn()
            except BaseException as e:  # a bug here must not stop every later delivery
                log.error("ray: delivering to the schedule failed: %r", e, exc_info=e)

    @property
    def here(self) -> bool:
        """True on the dispatcher thread (inside a callback)."""
        return threading.current_thread() is self._thread

    def put(self, fn: Callable[[], None]) -> None:
        """Queue fn behind what is there."""
        self._events.put(fn)

    def run(self, fn: Callable[[], None]) -> None:
        """fn on the dispatcher: now if this is it, else queued."""
        if self.here:
            fn()
        else:
            self._events.put(fn)

    def sync(self, timeout_s: float, what: str) -> None:
        """Wait until everything queued before this call has been delivered; past `timeout_s`
        raise TimeoutError naming `what` waited (a callback that never returns)."""
        if self.here or not self._thread.is_alive():
            return
        done = threading.Event()
        self._events.put(done.set)
        if not done.wait(timeout=timeout_s):
            raise TimeoutError(f"ray: {what} waited {timeout_s:g} s for earlier completions to be delivered "
                               "(a schedule callback has not returned; ray.sync_timeout_s)")

    def close(self) -> None:
        self._events.put(None)
        if not self.here:
            self._thread.join(timeout=5)
