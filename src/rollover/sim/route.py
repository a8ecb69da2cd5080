"""The Ray router's rule on the fast path's arrays of worker loads (`rollover.sim.fleet`).

A request goes to the worker with the least outstanding tokens (ties to the lowest index),
except that a never-started sample goes to its prompt's home worker while home's load is
within `slack` of the least-loaded (prefix affinity; `rollover.runtime.routing`). Fresh groups
are routed in closed form per group (`groups`), resumed samples request by request
(`requests`): at 1,024 workers an APRIL `resubmit` step hands back about 16,000 of them
(compiling that loop took 1,000 such steps from 78.8 to 70.5 s, docs/simulator.md).

Each rule has two implementations with the same picks: plain Python over `heapq` (always
there) and a numba-compiled one over an indexed heap (numba comes with the `sim` extra and with
vLLM); `simulate.router` chooses, and tests/test_sim_fast.py checks that the two agree pick for
pick. Both update `loads` and `home_of` in place.
"""

from __future__ import annotations

import heapq

import numpy as np

from rollover.config import ConfigError


# ---------------------------------------------------------------------------- plain Python
def groups_py(loads: np.ndarray, home_of: np.ndarray, prompts: np.ndarray, n: int, b: int, slack: int):
    """Per group of n fresh samples of prompt p: sample j goes to p's home while home's load +
    j x b is within `slack` of the least-loaded worker, the rest (and a prompt's first group)
    to the least-loaded, which becomes its home. Returns per group (home, how many go there,
    the least-loaded)."""
    W = len(loads)
    if len(prompts) > 64:  # many groups: a heap of load x W + worker (ties to the lowest index)
        ld = loads.tolist()
        heap = [x * W + w for w, x in enumerate(ld)]
        heapq.heapify(heap)
    else:  # a few: argmin over the loads in place
        ld, heap = loads, None
    out_h, out_m, out_b = [], [], []
    for p in prompts.tolist():
        if heap is None:
            best = int(ld.argmin())
        else:
            while heap[0] != ld[heap[0] % W] * W + heap[0] % W:  # an entry from before a load changed
                heapq.heappop(heap)
            best = heap[0] % W
        home = int(home_of[p])
        if home < 0 or home == best:
            m, home = n, best
        else:
            m = min(n, max(0, (int(ld[best]) + slack - int(ld[home])) // b + 1))
        out_h.append(home)
        out_m.append(m)
        out_b.append(best)
        home_of[p] = best if m < n else home
        for w, c in ((home, m), (best, n - m)):
            if c:
                ld[w] += c * b
                if heap is not None:
                    heapq.heappush(heap, int(ld[w]) * W + w)
    if heap is not None:
        loads[:] = ld
    return (np.array(out_h, dtype=np.int64), np.array(out_m, dtype=np.int64), np.array(out_b, dtype=np.int64))


def requests_py(loads: np.ndarray, home_of: np.ndarray, carried: np.ndarray, prompts: np.ndarray, b: int,
                slack: int) -> np.ndarray:
    """Per request in order: a resumed one (`carried` tokens > 0) to the least-loaded worker,
    a never-started one to its prompt's home within `slack`, else the least-loaded (its new
    home); the worker's load grows by b - carried. The workers picked."""
    W, ld, home = len(loads), loads.tolist(), home_of.tolist()
    heap = [x * W + w for w, x in enumerate(ld)]
    heapq.heapify(heap)
    pop, replace, push = heapq.heappop, heapq.heapreplace, heapq.heappush
    dest = []
    for c, p in zip(carried.tolist(), prompts.tolist()):
        top = heap[0]
        best = top % W
        while top != ld[best] * W + best:  # an entry from before the worker's load changed
            pop(heap)
            top = heap[0]
            best = top % W
        pick = best
        if not c:
            h = home[p]
            if h >= 0 and ld[h] <= ld[best] + slack:
                pick = h
            home[p] = pick
        dest.append(pick)
        x = ld[pick] = ld[pick] + b - c
        if pick == best:  # the heap's top: replaced in one operation
            replace(heap, x * W + pick)
        else:
            push(heap, x * W + pick)
    loads[:] = ld
    home_of[:] = home
    return np.array(dest, dtype=np.int64)


# ---------------------------------------------------------------------------- numba
try:
    from numba import njit
except ImportError:  # only the plain versions (simulate.router=auto runs them; =numba is refused)
    njit = None


def _jit(fn):
    return njit(cache=True)(fn) if njit is not None else None


@_jit
def _down(heap, pos, key, i, size):
    """Move the worker at slot i down the indexed min-heap to where its key belongs."""
    w = heap[i]
    k = key[w]
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and key[heap[c + 1]] < key[heap[c]]:
            c += 1
        if key[heap[c]] >= k:
            break
        heap[i] = heap[c]
        pos[heap[i]] = i
        i = c
    heap[i] = w
    pos[w] = i


@_jit
def _sift(heap, pos, key, i, size):
    """Restore a valid heap after the key of the worker at slot i moved either way."""
    w = heap[i]
    k = key[w]
    while i > 0:
        up = (i - 1) // 2
        if key[heap[up]] <= k:
            break
        heap[i] = heap[up]
        pos[heap[i]] = i
        i = up
    heap[i] = w
    pos[w] = i
    _down(heap, pos, key, i, size)


@_jit
def _build(loads):
    """Keys load x W + worker (ties to the lowest index), the heap of workers, their slots."""
    W = loads.shape[0]
    key = loads * W + np.arange(W)
    heap = np.arange(W)
    pos = np.arange(W)
    for i in range(W // 2 - 1, -1, -1):  # heapify: sift down only (the slots above are not a heap yet)
        _down(heap, pos, key, i, W)
    return key, heap, pos


@_jit
def _groups_nb(loads, home_of, prompts, n, b, slack):
    W = loads.shape[0]
    key, heap, pos = _build(loads)
    k = prompts.shape[0]
    out_h = np.empty(k, np.int64)
    out_m = np.empty(k, np.int64)
    out_b = np.empty(k, np.int64)
    for i in range(k):
        p = prompts[i]
        best = heap[0]
        home = home_of[p]
        if home < 0 or home == best:
            m = n
            home = best
        else:
            m = min(n, max(0, (loads[best] + slack - loads[home]) // b + 1))
        out_h[i] = home
        out_m[i] = m
        out_b[i] = best
        home_of[p] = best if m < n else home
        if m:
            loads[home] += m * b
            key[home] = loads[home] * W + home
            _sift(heap, pos, key, pos[home], W)
        if n - m:
            loads[best] += (n - m) * b
            key[best] = loads[best] * W + best
            _sift(heap, pos, key, pos[best], W)
    return out_h, out_m, out_b


@_jit
def _requests_nb(loads, home_of, carried, prompts, b, slack):
    W = loads.shape[0]
    key, heap, pos = _build(loads)
    dest = np.empty(carried.shape[0], np.int64)
    for i in range(carried.shape[0]):
        best = heap[0]
        pick = best
        if carried[i] == 0:
            p = prompts[i]
            h = home_of[p]
            if h >= 0 and loads[h] <= loads[best] + slack:
                pick = h
            home_of[p] = pick
        dest[i] = pick
        loads[pick] += b - carried[i]
        key[pick] = loads[pick] * W + pick
        _sift(heap, pos, key, pos[pick], W)
    return dest


NUMBA = njit is not None  # whether the compiled router can run


def compiled(router: str) -> bool:
    """Whether `simulate.router` (auto, numba, python) runs the compiled router."""
    if router == "numba" and not NUMBA:
        raise ConfigError("simulate.router=numba needs numba (pip install numba, or rollover[sim]); "
                          "simulate.router=auto runs the plain router without it")
    return NUMBA and router != "python"


def groups(loads, home_of, prompts, n: int, b: int, slack: int, fast: bool):
    """`groups_py`'s picks, compiled with `fast`."""
    prompts = np.asarray(prompts, dtype=np.int64)
    if not fast:
        return groups_py(loads, home_of, prompts, n, b, slack)
    return _groups_nb(loads, home_of, prompts, np.int64(n), np.int64(b), np.int64(slack))


def requests(loads, home_of, carried, prompts, b: int, slack: int, fast: bool) -> np.ndarray:
    """`requests_py`'s picks, compiled with `fast`."""
    if not fast:
        return requests_py(loads, home_of, carried, prompts, b, slack)
    return _requests_nb(loads, home_of, np.ascontiguousarray(carried, dtype=np.int64),
                        np.ascontiguousarray(prompts, dtype=np.int64), np.int64(b), np.int64(slack))
