"""Hand a thread's OpenMP workers back before it blocks, so the thread that computes meanwhile
runs at full speed.

rollover runs torch on two threads: the engine's and the caller's (the trainer, model loading).
GNU OpenMP gives each thread that starts a parallel region a pool of worker threads of its own,
kept for the thread's lifetime. Once the pools hold more threads than there are cores, every
idle worker spins for at most a thousand rounds before it sleeps (libgomp's throttled spin),
so each of the many small parallel regions of a decode step waits for a worker to wake: on the
2-core Intel host TorchEngine decoded 1.30x faster once the caller's pool was released, and a
GRPO step ran 1.21x faster (docs/benchmarks.md, "One OpenMP pool at a time"). A thread that is
about to wait for another one's work releases its pool (`omp_pause_resource_all`, OpenMP 5.0:
libgomp frees the calling thread's pool); the pool is made again at the thread's next parallel
region, for the cost of starting its workers.

Only libgomp (the OpenMP runtime of torch's Linux wheels) is released; elsewhere `release` does
nothing. ROLLOVER_OPENMP_RELEASE=0 turns it off.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

_OMP_PAUSE_SOFT = 1
_lock = threading.Lock()
_pauses = None  # each loaded libgomp's omp_pause_resource_all, once looked up


def _lookup() -> list:
    """omp_pause_resource_all of every libgomp in the process (torch's, and any other that a
    package bundles, sentencepiece's for one: each keeps pools of its own)."""
    if os.environ.get("ROLLOVER_OPENMP_RELEASE", "1") == "0":
        return []
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line and "/" in line}
    except OSError:
        return []
    found = []
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        found.append(fn)
    return found


def release() -> bool:
    """Free the calling thread's OpenMP worker threads (it is about to wait); whether a runtime
    was there to release them. Never call it from inside a parallel region."""
    global _pauses
    if _pauses is None:
        if "torch" not in sys.modules:  # no torch, no pool of its (the simulator's engines)
            return False
        with _lock:
            if _pauses is None:
                _pauses = _lookup()
    return bool(_pauses) and all(pause(_OMP_PAUSE_SOFT) == 0 for pause in _pauses)
