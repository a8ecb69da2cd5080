"""Worker processes for reward calls that may never return, killed at their timeout.

Why processes. A call that runs away inside C code (sympy raising 9 to the power 9^9 holds
the interpreter lock throughout) stops every thread of its process, the one meant to enforce
its timeout included. So such rewards run in separate Python processes: the parent waits on a
pipe, which releases the lock, and at the timeout kills the worker (SIGKILL). The slot's next
call starts a fresh worker.

- A worker is `python -m rollover.rewards.worker`, a new interpreter rather than a
  multiprocessing child: nothing is forked from a process that holds torch and threads, and
  the caller's main module is never re-imported.
- It rebuilds each reward from its reference (built-in name, `module:function` or
  `file.py:function`) and bound kwargs, with the parent's `sys.path`. Only the call's
  arguments and the returned value cross the pipe, pickled.
- At most `size` workers, started on demand and kept between calls, so starting one
  (importing math-verify and sympy, about half a second) is paid once per worker, and never
  counted against a call's timeout.
- No orphans: a worker exits when its pipe closes (the pool closed, or the parent died), and
  around every call it arms faulthandler's watchdog, a C thread that needs no interpreter lock,
  which ends it at `timeout + WATCHDOG_GRACE_S` even if the parent is gone or frozen.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import weakref
from typing import Sequence

from rollover.rewards.registry import Reward

STARTUP_TIMEOUT_S = 120.0  # a worker imports math-verify and the user's reward modules
WATCHDOG_GRACE_S = 10.0


class RewardTimeout(TimeoutError):
    """A reward call ran past the runner's `timeout_s`."""


class WorkerDied(RuntimeError):
    """The worker process scoring a call ended without answering (crash, OOM kill, os._exit)."""


class WorkerStartError(RuntimeError):
    """A worker process could not start or rebuild a reward: a setup error, not a sample's."""


class WorkerPool:
    """Runs `Reward.call_one` / `Reward.call_batch` of the given rewards in worker processes.

    `call` blocks its thread (not the interpreter) until the worker answers, the worker dies,
    or `timeout_s` passes. Safe to share between threads: a call waits for a free worker.
    """

    def __init__(self, rewards: Sequence[Reward], *, size: int, timeout_s: float):
        if size < 1:
            raise ValueError(f"a worker pool needs at least one worker, got size={size}")
        references = {}
        for reward in rewards:
            references[reward.name] = reward.reference
            try:
                pickle.dumps(reward.reference)
            except Exception as exc:
                raise TypeError(
                    f"reward {reward.name!r}: its kwargs cannot be sent to a worker process: {exc}"
                ) from exc
        self.size = size
        self.timeout_s = timeout_s
        self._setup = {"rewards": references, "watchdog_s": timeout_s + WATCHDOG_GRACE_S}
        # One entry per slot: an idle worker, or None where the next call starts one. Last in,
        # first out, so a worker just used is used again, and more start only under load.
        self._slots: queue.LifoQueue[_Worker | None] = queue.LifoQueue()
        for _ in range(size):
            self._slots.put(None)
        self._live: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer = weakref.finalize(self, _kill_all, self._live)

    def call(self, name: str, method: str, args: tuple) -> object:
        """`getattr(reward, method)(*args)` in a worker: its return value, or what it raised.

        Raises `RewardTimeout` (the worker was killed) or `WorkerDied` for a failed call, and
        `WorkerStartError` if no worker could be started.
        """
        try:
            request = pickle.dumps((name, method, args))
        except Exception as exc:
            raise TypeError(f"the sample cannot be sent to a worker process: {exc}") from exc
        worker = self._acquire()
        try:
            result = worker.call(request, self.timeout_s)
        except (RewardTimeout, WorkerDied):
            self._discard(worker)
            raise
        except BaseException:  # the reward raised; its worker is fine
            self._slots.put(worker)
            raise
        self._slots.put(worker)
        return result

    def close(self) -> None:
        """Kill every worker (idle or busy); later calls raise."""
        with self._lock:
            self._closed = True
        self._finalizer()

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers started and not yet killed."""
        with self._lock:
            return [w.process.pid for w in self._live]

    def _acquire(self) -> _Worker:
        worker = self._slots.get()
        if worker is not None and worker.process.poll() is None:
            return worker
        if worker is not None:  # it died while idle; its slot is this call's now
            self._drop(worker)
        with self._lock:
            if self._closed:
                self._slots.put(None)
                raise RuntimeError("the reward worker pool is closed")
            worker = _Worker()
            self._live.add(worker)
        try:
            worker.handshake({**self._setup, "sys_path": list(sys.path)})
        except BaseException:
            self._discard(worker)
            raise
        return worker

    def _discard(self, worker: _Worker) -> None:
        """Kill `worker` and give its slot to a fresh one, started by the slot's next call."""
        self._drop(worker)
        self._slots.put(None)

    def _drop(self, worker: _Worker) -> None:
        worker.kill()
        worker.conn.close()
        with self._lock:
            self._live.discard(worker)


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self):
        self.conn, child = multiprocessing.Pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rollover.rewards.worker", str(child.fileno())],
            pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: a kill takes what it started too
        )
        child.close()

    def handshake(self, setup: dict) -> None:
        """Send the rewards to rebuild; wait until the worker has imported them."""
        self.conn.send(setup)
        if not self.conn.poll(STARTUP_TIMEOUT_S):
            raise WorkerStartError(
                f"reward worker process {self.process.pid} did not start within "
                f"{STARTUP_TIMEOUT_S} s (importing {sorted(setup['rewards'])})"
            )
        try:
            kind, detail = self.conn.recv()
        except (EOFError, OSError):
            raise WorkerStartError(
                f"reward worker process {self.process.pid} {self._ended()} while starting "
                "(its traceback, if any, is on stderr)"
            ) from None
        if kind != "ready":
            raise WorkerStartError(
                f"a reward worker process could not rebuild the rewards:\n{detail}"
            )

    def call(self, request: bytes, timeout_s: float) -> object:
        try:
            self.conn.send_bytes(request)
        except OSError:  # it died while idle, just before this call
            raise WorkerDied(f"reward worker process {self._ended()}") from None
        if not self.conn.poll(timeout_s):
            self.kill()
            raise RewardTimeout(
                f"timed out after {timeout_s} s; worker process {self.process.pid} was killed"
            )
        try:
            kind, value = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            raise WorkerDied(f"reward worker process {self.process.pid} {self._ended()}") from None
        if kind == "error":
            raise value
        return value

    def kill(self) -> None:
        # SIGKILL to the worker's process group: works while the worker holds its interpreter
        # lock, and takes down processes the reward started (a subprocess, a pool), unless they
        # left the group themselves (setsid)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the group is already gone
        self.process.wait()

    def _ended(self) -> str:
        code = self.process.wait()
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"


def _kill_all(workers: set[_Worker]) -> None:
    for worker in list(workers):
        worker.kill()
    workers.clear()
