"""Fewer threads while other processes hold cores: a busy machine slows decoding, not stalls it.

On a CPU the engine's thread runs its parallel regions on a team of OpenMP threads, one per
core, and waits at the end of every region for the slowest. When another process keeps a core
busy, the OS shares that core between it and one of the team's threads, so every one of a
decode step's hundreds of small regions waits for a thread that is not running: on a 2-core
host TorchEngine decoded 53 tokens/s beside one busy process bound to a core against 525 alone,
and 307 once it ran one thread (docs/benchmarks.md, "Decode on a busy machine"). With one
thread per core that is free, a region never waits for a descheduled
teammate, and the engine decodes at the speed of the cores it actually has.

`CpuShare` measures, every half second, how many of this process's allowed cores other
processes kept busy (the kernel's per-CPU busy time in /proc/stat, less this process's own CPU
time from /proc/self/stat) and sets torch's thread count to the cores left (at least one, at
most the count torch had when the process first asked). It lowers the count at once and raises
it only after two readings agree, so a short burst elsewhere does not make it oscillate.
torch's count is one setting for the whole process, so there is one `CpuShare` per process
(`shared()`): the engine's thread consults it before each decode step and the trainer before
each step. Linux only (elsewhere it never changes anything); ROLLOVER_CPU_SHARE=0 turns it off.
"""

from __future__ import annotations

import os
import threading
import time

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_ticks(cpus: set[int]) -> int | None:
    """Busy clock ticks (all but idle and iowait) of `cpus` since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            lines = f.readlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *fields = line.split()
        if int(name[3:]) not in cpus:
            continue
        v = [int(x) for x in fields[:8]]
        total += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]  # user nice system irq softirq steal
    return total


def _own_ticks() -> int | None:
    """This process's user + system clock ticks (every thread) since it started."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of the whole line)


class CpuShare:
    """The calling thread's torch thread count, kept to the cores other processes leave free."""

    EVERY_S = 0.5
    BUSY = 0.5  # a core counts as taken once others keep it this busy

    def __init__(self, threads: int):
        self._lock = threading.Lock()  # the engine's and the trainer's threads both consult it
        self.max_threads = threads
        self.threads = threads
        try:
            self.cpus = os.sched_getaffinity(0)
        except (AttributeError, OSError):
            self.cpus = set()
        self.enabled = (threads > 1 and len(self.cpus) > 1 and os.environ.get("ROLLOVER_CPU_SHARE", "1") != "0"
                        and _busy_ticks(self.cpus) is not None)
        self._last = None
        self._next = 0.0
        self._raise_votes = 0
        self.others = 0.0  # cores other processes kept busy at the last reading
        self.changes = 0

    def wanted(self, others: float) -> int:
        """Threads for `others` cores kept busy elsewhere."""
        taken = int(others + (1 - self.BUSY))  # a core others keep at least BUSY busy is theirs
        return max(1, min(self.max_threads, len(self.cpus) - taken))

    def check(self) -> int | None:
        """A new thread count when the share changed (at most every EVERY_S), else None."""
        if not self.enabled:
            return None
        with self._lock:
            return self._check()

    def _check(self) -> int | None:
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + self.EVERY_S
        busy, own = _busy_ticks(self.cpus), _own_ticks()
        if busy is None or own is None:
            return None
        last, self._last = self._last, (now, busy, own)
        if last is None:
            return None
        wall = now - last[0]
        self.others = max(0.0, ((busy - last[1]) - (own - last[2])) / _TICKS / wall)
        want = self.wanted(self.others)
        if want > self.threads:
            self._raise_votes += 1
            if self._raise_votes < 2:
                return None
        self._raise_votes = 0
        if want == self.threads:
            return None
        self.threads = want
        self.changes += 1
        return want

    def apply(self) -> None:
        """`check`, and set torch's thread count when it says so."""
        n = self.check()
        if n is not None:
            import torch

            torch.set_num_threads(n)


_shared: CpuShare | None = None
_shared_lock = threading.Lock()


def shared() -> CpuShare:
    """This process's `CpuShare`, made at the first call with torch's thread count then."""
    global _shared
    with _shared_lock:
        if _shared is None:
            import torch

            _shared = CpuShare(torch.get_num_threads())
        return _shared


def restore() -> None:
    """torch's thread count back to what it was before any adapting (benchmarks comparing
    conditions; the next reading adapts again)."""
    if _shared is not None:
        import torch

        with _shared._lock:
            torch.set_num_threads(_shared.max_threads)
            _shared.threads, _shared._last, _shared._raise_votes = _shared.max_threads, None, 0
