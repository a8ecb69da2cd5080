"""The fast path's workers (`rollover.sim.fast`): every rollout worker of the simulated cluster
as a row of numpy arrays (their length draws and step costs: `rollover.sim.vector`). `Fleet` moves all
workers in lockstep, each to its own next event, with `SimCore`'s semantics (admission at a
step boundary, one prefill per prompt within the prefill budget, closed-form segments between
finishes, a command at the first boundary at or after its time, a K/V-cache capacity with the
newest sequences preempted when it would overflow) and routes requests by the Ray router's
rule; the drivers in `rollover.sim.fast` decide what is admitted when."""

from __future__ import annotations

import math

import numpy as np

from rollover.sim import admission, route
from rollover.sim.config import SimRunConfig
from rollover.sim.costs import ADMIT_MAX_WAIT, Profile
from rollover.sim.vector import Costs, Draws

BIG = np.int64(1 << 60)


# ---------------------------------------------------------------------------- the workers
class Fleet:
    """Every rollout worker as a row of arrays (the module docstring of `rollover.sim.fast`)."""

    def __init__(self, cfg: SimRunConfig, profile: Profile, draws: Draws, timeline: bool):
        s, r = cfg.simulate, cfg.rollout
        self._from_pools(s.pools, profile)
        self.max_prefill = 8192  # SimWorker's default
        self.prompt_tokens = s.prompt_tokens
        self.budget = r.max_new_tokens
        self.slack = r.samples_per_prompt * r.max_new_tokens
        self.compiled = route.compiled(s.router)  # the router's rule and admission compiled (numba) or not
        self.seen = None  # admission.plan_nb's marks
        self.draws = draws
        self._worker_arrays()
        self._slot_arrays()
        self._sample_arrays(s.prompts)
        self.version = 0
        self.paused = False
        self.finished: list[tuple[np.ndarray, np.ndarray]] = []  # (sample ids, times) not yet taken
        self.timeline = [[] for _ in range(self.W)] if timeline else None
        self.open = np.full((self.W, 2), np.nan)  # the worker's open [start, end] timeline interval

    def _from_pools(self, pools: list, profile: Profile) -> None:
        """Each worker's pool and what it takes from it: decode cost, rows, K/V capacity,
        admission batch."""
        from dataclasses import replace

        costs, pool_of, rows, names, kv, batch = [], [], [], [], [], []
        for i, pool in enumerate(pools):
            costs.append(replace(profile.decode, **pool.decode))
            pool_of += [i] * pool.workers
            rows += [pool.max_rows] * pool.workers
            batch += [costs[-1].admit_batch(pool.max_rows, pool.admit_batch)] * pool.workers
            kv += [BIG if pool.kv_tokens is None else pool.kv_tokens] * pool.workers
            names.append(pool.name)
        self.W = len(pool_of)
        self.R = max(rows)
        self.pool_of = np.array(pool_of)
        self.pool_names = names
        self.cost = Costs(costs, self.pool_of)
        self.max_rows = np.array(rows, dtype=np.int64)
        self.kv = np.array(kv, dtype=np.int64)  # K/V capacity in tokens (BIG: the rows alone limit it)
        self.has_kv = any(p.kv_tokens is not None for p in pools)
        # admission waits for a batch (SimWorker.admit_batch, admit_max_wait)
        self.admit_batch = np.array(batch, dtype=np.int64)
        self.batching = bool((self.admit_batch > 1).any())
        self.admit_max_wait = ADMIT_MAX_WAIT
        self.preempted = np.zeros(1, dtype=np.int64)  # sequences preempted for K/V capacity

    def _worker_arrays(self) -> None:
        """Per worker: its clock, running rows and context, the planned segment, time busy and stalled."""
        W = self.W
        self.t = np.zeros(W)
        self.rows = np.zeros(W, dtype=np.int64)
        self.ctx = np.zeros(W, dtype=np.int64)
        self.load = np.zeros(W, dtype=np.int64)
        self.k = np.zeros(W, dtype=np.int64)  # steps planned (0: nothing)
        self.extra = np.zeros(W)
        self.base = np.zeros(W)
        self.slope = np.zeros(W)
        self.pre_recompute = np.zeros(W, dtype=np.int64)
        self.recompute = np.zeros(W, dtype=np.int64)
        self.deferred_from = np.full(W, -1, dtype=np.int64)  # wstep when admission began to wait (-1: it does not)
        self.busy_s = np.zeros(W)
        self.stall_s = np.zeros(W)
        self.row_steps = np.zeros(W, dtype=np.int64)  # rows x steps: tokens generated

    def _slot_arrays(self) -> None:
        """Every worker's rows (slots) and its queue of waiting requests."""
        W, R = self.W, self.R
        self.sid = np.full((W, R), -1, dtype=np.int64)
        # a slot's tokens are counted by its worker's steps: it holds wstep - born tokens (a
        # resumed sample was born before it entered, by the tokens it carried), entered at step
        # `entered` (entering: admitted at the current boundary) and finishes at step `fin`
        # (BIG: empty)
        self.wstep = np.zeros(W, dtype=np.int64)
        self.born = np.zeros((W, R), dtype=np.int64)
        self.entered = np.zeros((W, R), dtype=np.int64)
        self.seq = np.zeros((W, R), dtype=np.int64)  # admission order
        self.admitted = np.zeros(1, dtype=np.int64)
        self.fin = np.full((W, R), BIG, dtype=np.int64)
        self.next_fin = np.full(W, BIG, dtype=np.int64)  # per worker: its slots' earliest `fin`
        self.n_ent = np.zeros(W, dtype=np.int64)  # per worker: slots entering at the current boundary
        self.ent_ctx = np.zeros(W, dtype=np.int64)  # and their context tokens
        self.t_end = np.zeros(W)  # the planned segment's end
        self.usable = np.arange(R)[None, :] < self.max_rows[:, None]
        # waiting requests, a ring per worker
        self.qcap = 64
        self.qs = np.zeros((W, self.qcap), dtype=np.int64)
        self.qh = np.zeros(W, dtype=np.int64)
        self.qn = np.zeros(W, dtype=np.int64)

    def _sample_arrays(self, prompts: int) -> None:
        """The samples (grown as groups are admitted) and each of the `prompts` prompts' home worker."""
        self.n_samples = 0
        self.s_target = np.zeros(1024, dtype=np.int64)
        self.s_stop = np.zeros(1024, dtype=bool)
        self.s_group = np.zeros(1024, dtype=np.int64)
        self.s_prompt = np.zeros(1024, dtype=np.int64)
        self.s_v0 = np.zeros(1024, dtype=np.int64)
        self.s_tok = np.zeros(1024, dtype=np.int64)  # tokens a sample holds while it waits (carried by APRIL)
        self.home = np.full(prompts, -1, dtype=np.int64)

    # ------------------------------------------------------------ samples and routing
    def _grow(self, need: int) -> None:
        if need <= len(self.s_target):
            return
        size = max(need, 2 * len(self.s_target))
        for name in ("s_target", "s_stop", "s_group", "s_prompt", "s_v0", "s_tok"):
            old = getattr(self, name)
            new = np.zeros(size, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def add_groups(self, serials: list[int], prompts: list[int], n: int, at) -> None:
        """Route the groups' fresh samples (each group's n samples in order) and queue them;
        a worker replans from its first boundary at or after each group's arrival `at` (one
        time, or one per group in non-decreasing order)."""
        base, k = self.n_samples, len(serials)
        self._grow(base + n * k)
        sl = slice(base, base + n * k)
        g_arr, p_arr = np.asarray(serials, dtype=np.int64), np.asarray(prompts, dtype=np.int64)
        self.s_target[sl], self.s_stop[sl] = self.draws.targets(p_arr, g_arr, n)
        self.s_group[sl], self.s_prompt[sl] = np.repeat(g_arr, n), np.repeat(p_arr, n)
        home_dest, home_m, best_dest = self._route(prompts, n)
        dest = np.repeat(np.stack([home_dest, best_dest], axis=1).ravel(),
                         np.stack([home_m, n - home_m], axis=1).ravel())
        self.n_samples = base + n * k
        at = np.repeat(np.broadcast_to(np.asarray(at, dtype=np.float64), (k,)), n)
        self._enqueue(dest, np.arange(base, self.n_samples, dtype=np.int64), at)

    def _route(self, prompts: list[int], n: int):
        """The Ray router's picks for each group's n fresh samples (`rollover.sim.route.groups`):
        per group, (home, how many go there, the least-loaded)."""
        return route.groups(self.load, self.home, prompts, n, self.budget, self.slack, self.compiled)

    def _enqueue(self, dest: np.ndarray, sids: np.ndarray, at) -> None:
        """Queue samples (in routing order) at their workers; `at`: one arrival time, or one per
        sample, non-decreasing in routing order."""
        order = np.argsort(dest, kind="stable")
        dest, sids = dest[order], sids[order]
        workers, first, counts = np.unique(dest, return_index=True, return_counts=True)
        need = int((self.qn[workers] + counts).max())
        if need > self.qcap:
            self._grow_queue(need)
        rank = np.arange(len(dest)) - np.repeat(first, counts)
        pos = (self.qh[dest] + self.qn[dest] + rank) % self.qcap
        self.qs[dest, pos] = sids
        at = np.broadcast_to(np.asarray(at, dtype=np.float64), (len(order),))[order]
        # the samples reach their worker in arrival batches: each batch at the worker's first
        # boundary at or after its time (admitted and replanned there), one batch per round
        start = np.ones(len(dest), dtype=bool)
        start[1:] = (dest[1:] != dest[:-1]) | (at[1:] != at[:-1])
        batch = np.cumsum(start) - 1
        b_first = np.nonzero(start)[0]
        b_worker, b_time = dest[b_first], at[b_first]
        b_count = np.diff(np.append(b_first, len(dest)))
        b_round = np.arange(len(b_first)) - np.searchsorted(b_worker, b_worker)  # batches sorted by worker
        del batch
        for r in range(int(b_round.max()) + 1):
            sel = b_round == r
            w = b_worker[sel]
            self.cut(w, b_time[sel])
            self.qn[w] += b_count[sel]
            self.plan(w)

    def _grow_queue(self, need: int) -> None:
        cap = max(need, 2 * self.qcap)
        idx = (self.qh[:, None] + np.arange(self.qcap)[None, :]) % self.qcap
        new = np.zeros((self.W, cap), dtype=np.int64)
        new[:, : self.qcap] = np.take_along_axis(self.qs, idx, axis=1)
        self.qs, self.qh, self.qcap = new, np.zeros(self.W, dtype=np.int64), cap

    # ------------------------------------------------------------ segments
    def end(self, idx: np.ndarray, j: np.ndarray) -> np.ndarray:
        jf = j.astype(np.float64)
        return self.t[idx] + np.where(j > 0, self.extra[idx], 0.0) + jf * self.base[idx] + self.slope[idx] * jf * (jf - 1) / 2

    def first_at_or_after(self, idx: np.ndarray, T: float) -> np.ndarray:
        """Steps of each planned segment until its first boundary at or after T (at most k)."""
        k = self.k[idx]
        a, b = self.slope[idx] / 2, self.base[idx] - self.slope[idx] / 2
        c = self.t[idx] + self.extra[idx] - T
        with np.errstate(divide="ignore", invalid="ignore"):
            quad = np.ceil((-b + np.sqrt(np.maximum(b * b - 4 * a * c, 0.0))) / (2 * a))
            lin = np.where(b > 0, np.ceil(-c / b), 1.0)
        j = np.where(a > 0, quad, lin)
        j = np.nan_to_num(j, nan=1.0, posinf=1.0, neginf=1.0)
        j = np.minimum(np.maximum(j, 1), np.maximum(k, 1)).astype(np.int64)
        for _ in range(64):  # float rounding: settle on the exact boundary
            down = (j > 1) & (self.end(idx, j - 1) >= T)
            up = (j < k) & (self.end(idx, j) < T)
            if not (down.any() or up.any()):
                break
            j = j - down + up
        return np.where((T <= self.t[idx]) | (k == 0), 0, j)

    def cut(self, idx: np.ndarray, T) -> None:
        """Bring the workers to their first step boundary at or after T (one time, or one per
        worker; idle ones: to T); sequences finishing there finish at its time."""
        T = np.broadcast_to(np.asarray(T, dtype=np.float64), (len(idx),))
        idle = self.k[idx] == 0
        w = idx[idle]
        self.t[w] = np.maximum(self.t[w], T[idle])
        busy = idx[~idle]
        if len(busy):
            j = self.first_at_or_after(busy, T[~idle])
            go = j > 0
            if go.any():
                self.apply(busy[go], j[go])

    def apply(self, idx: np.ndarray, j: np.ndarray) -> None:
        """Apply j steps of the planned segments, then take out the finished sequences."""
        n = self.rows[idx]
        end = self.end(idx, j)
        self._record(idx, self.t[idx], end)
        self.row_steps[idx] += n * j
        self.pre_recompute[idx] = 0
        self.wstep[idx] += j
        self.ctx[idx] += n * j
        self.load[idx] -= n * j
        self.t[idx] = end
        self.k[idx] -= j  # the caller plans again
        self.n_ent[idx] = 0
        self.ent_ctx[idx] = 0
        idx = idx[self.next_fin[idx] == self.wstep[idx]]
        if len(idx):
            rows, cols = np.nonzero(self.fin[idx] == self.wstep[idx][:, None])
            w = idx[rows]
            sids = self.sid[w, cols]
            toks = self.wstep[w] - self.born[w, cols]
            self.ctx -= np.bincount(w, weights=self.prompt_tokens + toks, minlength=self.W).astype(np.int64)
            self.load -= np.bincount(w, weights=self.budget - toks, minlength=self.W).astype(np.int64)
            self.rows -= np.bincount(w, minlength=self.W)
            self.sid[w, cols] = -1
            self.fin[w, cols] = BIG
            self.next_fin[idx] = self.fin[idx].min(axis=1)
            self.finished.append((sids, self.t[w], w, self.seq[w, cols]))

    def _record(self, idx: np.ndarray, start: np.ndarray, end: np.ndarray) -> None:
        self.busy_s[idx] += end - start
        if self.timeline is None:
            return
        o = self.open[idx]
        joined = np.abs(o[:, 1] - start) < 1e-9
        for i in np.nonzero(~joined & ~np.isnan(o[:, 0]))[0]:
            self.timeline[idx[i]].append([float(o[i, 0]), float(o[i, 1]), "generate"])
        o[:, 0] = np.where(joined, o[:, 0], start)
        o[:, 1] = end
        self.open[idx] = o

    def add_requests(self, sids: np.ndarray, at: float) -> None:
        """Route existing samples (a carried group's: resumed ones, with tokens, to the
        least-loaded worker; never-started ones by their prompt's home, as the router does
        request by request; `rollover.sim.route.requests`) and queue them; their workers
        replan from `at`."""
        dest = route.requests(self.load, self.home, self.s_tok[sids], self.s_prompt[sids], self.budget, self.slack,
                              self.compiled)
        self._enqueue(dest, sids, at)

    def abort_all(self, T: float) -> np.ndarray:
        """Abort every request at T: each worker at its first boundary at or after T (sequences
        finishing there finish), then the running ones keep their tokens (`s_tok`) and, with the
        waiting ones, leave; the aborted samples."""
        idx = np.arange(self.W)
        self.cut(idx, T)
        occ = self.sid >= 0
        r, c = np.nonzero(occ)
        running = self.sid[r, c]
        self.s_tok[running] = self.wstep[r] - self.born[r, c]
        qpos = (self.qh[:, None] + np.arange(self.qcap)[None, :]) % self.qcap
        qmask = np.arange(self.qcap)[None, :] < self.qn[:, None]
        waiting = np.take_along_axis(self.qs, qpos, axis=1)[qmask]
        self.sid[occ] = -1
        self.fin[occ] = BIG
        self.next_fin[:] = BIG
        self.n_ent[:] = 0
        self.ent_ctx[:] = 0
        self.rows[:] = 0
        self.ctx[:] = 0
        self.load[:] = 0
        self.recompute[:] = 0
        self.pre_recompute[:] = 0
        self.qn[:] = 0
        self.k[:] = 0
        return np.concatenate([running, waiting])

    def pause(self, T: float) -> None:
        """Every worker stops at its last step boundary at or before T; nothing runs until
        `resume` (running sequences keep their rows and K/V)."""
        idx = np.nonzero(self.k > 0)[0]
        if len(idx):
            j = self.first_at_or_after(idx, T)
            j = np.where((j > 0) & (self.end(idx, j) > T), j - 1, j)
            go = j > 0
            if go.any():
                self.apply(idx[go], j[go])
        self.k[:] = 0
        self.paused = True

    def resume(self, T: float) -> None:
        self.paused = False
        idx = np.arange(self.W)
        self.t = np.maximum(self.t, T)
        self.plan(idx)

    _STATE = ("t", "rows", "ctx", "load", "k", "extra", "base", "slope", "pre_recompute", "recompute", "busy_s",
              "stall_s", "wstep", "born", "entered", "fin", "next_fin", "n_ent", "ent_ctx", "seq", "sid", "t_end", "qs", "qh",
              "qn", "home", "row_steps", "open", "admitted", "preempted")

    def snapshot(self) -> dict:
        """The state a window changes (sample arrays only grow: their count is enough)."""
        snap = {k: getattr(self, k).copy() for k in self._STATE}
        snap["_n_samples"], snap["_version"], snap["_finished"] = self.n_samples, self.version, list(self.finished)
        if self.timeline is not None:
            snap["_timeline"] = [len(t) for t in self.timeline]
        return snap

    def restore(self, snap: dict) -> None:
        for k, v in snap.items():  # copies: a snapshot may be restored more than once
            if not k.startswith("_"):
                setattr(self, k, v.copy())
        self.n_samples, self.version = snap["_n_samples"], snap["_version"]
        if self.timeline is not None:
            for t, n in zip(self.timeline, snap["_timeline"]):
                del t[n:]
        self.qcap = self.qs.shape[1]
        self.finished = list(snap["_finished"])

    def stall(self, T: float, seconds: float, version: int, inflight: str) -> None:
        """A weight update at T: each worker at its first boundary at or after T stalls
        `seconds` (the dissemination), then generates with `version`."""
        idx = np.arange(self.W)
        self.cut(idx, T)
        start = np.maximum(self.t, T)
        self.close_timeline()
        if self.timeline is not None and seconds > 0:
            for w in range(self.W):
                self.timeline[w].append([float(start[w]), float(start[w] + seconds), "sync"])
        self.stall_s += seconds
        self.t = start + seconds
        self.version = version
        self._preempt(idx)  # before counting what to recompute: a preempted row recomputes on readmission
        fresh = (self.sid >= 0) & (self.born == self.wstep[:, None])  # no token yet: its first is the new version's
        self.s_v0[self.sid[fresh]] = version
        if inflight == "continue":
            self.recompute += self.ctx
        self.plan(idx)

    def close_timeline(self) -> None:
        if self.timeline is None:
            return
        for w in np.nonzero(~np.isnan(self.open[:, 0]))[0]:
            self.timeline[w].append([float(self.open[w, 0]), float(self.open[w, 1]), "generate"])
        self.open[:] = np.nan

    # ------------------------------------------------------------ admission and planning
    def plan(self, idx: np.ndarray) -> None:
        """Admit waiting sequences into free rows and plan the next segment (SimCore._plan)."""
        if not len(idx):
            return
        self.k[idx] = 0
        if self.paused:
            return
        self._preempt(idx)
        self.pre_recompute[idx] = np.where(self.rows[idx] > 0, self.pre_recompute[idx], 0)
        # most plans follow a finish with nothing to admit, prefill or recompute: plain decoding
        plain = (self.n_ent[idx] == 0) & ((self.qn[idx] == 0) | (self.rows[idx] == self.max_rows[idx])) \
            & (self.pre_recompute[idx] + self.recompute[idx] == 0)
        if self.batching:  # nothing waits, or no row is free: admission is not waiting for a batch
            self.deferred_from[idx[plain]] = -1
        if plain.all():
            return self._plan_plain(idx)
        if plain.any():
            self._plan_plain(idx[plain])
            idx = idx[~plain]
        self._plan_full(idx)

    def _plan_plain(self, idx: np.ndarray) -> None:
        rows = self.rows[idx]
        idx, rows = idx[rows > 0], rows[rows > 0]
        if not len(idx):
            return
        self.base[idx] = self.cost.step(idx, rows, self.ctx[idx])
        self.extra[idx] = 0.0
        self.slope[idx] = self.cost.per_ctx[idx] * rows
        k = self._kv_bound(idx, rows, self.next_fin[idx] - self.wstep[idx])
        self.k[idx] = k
        self.t_end[idx] = self.end(idx, k)

    def _kv_bound(self, idx: np.ndarray, rows: np.ndarray, k: np.ndarray) -> np.ndarray:
        """At most the steps after which the K/V cache would overflow (then a preemption)."""
        if not self.has_kv:
            return k
        return np.minimum(k, (self.kv[idx] - self.ctx[idx]) // rows)

    def _preempt(self, idx: np.ndarray) -> None:
        """Free K/V for the next step's token of every row (`SimCore._preempt`): the newest
        running sequences go back to the front of their worker's queue with their tokens,
        recomputed when readmitted."""
        if not self.has_kv or not len(idx):
            return
        P = self.prompt_tokens
        for w in idx[self.ctx[idx] + self.rows[idx] > self.kv[idx]].tolist():
            out = []
            while self.rows[w] and self.ctx[w] + self.rows[w] > self.kv[w]:
                occ = np.nonzero(self.sid[w] >= 0)[0]
                c = occ[np.argmax(self.seq[w, occ])]
                s, tok = self.sid[w, c], self.wstep[w] - self.born[w, c]
                self.s_tok[s] = tok
                self.ctx[w] -= P + tok
                if self.entered[w, c] == self.wstep[w]:
                    self.n_ent[w] -= 1
                    self.ent_ctx[w] -= P + tok
                self.rows[w] -= 1
                self.sid[w, c], self.fin[w, c] = -1, BIG
                out.append(s)
            self.next_fin[w] = self.fin[w].min()
            self.preempted[0] += len(out)
            if self.qn[w] + len(out) > self.qcap:
                self._grow_queue(int(self.qn[w]) + len(out))
            for s in out:  # newest first, each to the front: the oldest ends up first
                self.qh[w] = (self.qh[w] - 1) % self.qcap
                self.qs[w, self.qh[w]] = s
                self.qn[w] += 1

    def _plan_full(self, idx: np.ndarray) -> None:
        n_keys, key_tokens, longest, admit, cand = (admission.plan_nb if self.compiled else admission.plan_py)(self, idx)
        wait_left = admission.wait_for_batch(self, idx, admit, cand) if self.batching else None
        if wait_left is not None:  # a worker that waits has nothing entering: it prefills nothing
            waits = wait_left > 0
            admit = np.where(waits, 0, admit)
            n_keys, key_tokens, longest = (np.where(waits, 0, a) for a in (n_keys, key_tokens, longest))
        if admit.any():
            admission.admit(self, idx, cand, admit)
        rows = self.rows[idx]
        live = rows > 0
        idx, rows = idx[live], rows[live]
        if not len(idx):
            return
        fresh = np.where(self.cost.padded[idx], n_keys[live] * longest[live], key_tokens[live])
        rec = self.pre_recompute[idx] + self.recompute[idx]
        self.pre_recompute[idx], self.recompute[idx] = rec, 0
        n_ent, ent_ctx = self.n_ent[idx], self.ent_ctx[idx]  # after admission
        decoding = rows - n_ent
        ctx = self.ctx[idx]
        first = self.cost.prefill(idx, rec)
        pf = self.cost.prefill(idx, fresh)
        dec = self.cost.step(idx, decoding, ctx - ent_ctx)
        mixed = decoding > 0
        part = np.where(mixed, first + np.where(fresh > 0, pf - self.cost.mixed_saves[idx], 0.0), first + pf)
        decode = np.where(mixed, dec, 0.0)
        base = self.cost.step(idx, rows, ctx)
        self.base[idx] = base
        self.extra[idx] = decode + part - base
        self.slope[idx] = self.cost.per_ctx[idx] * rows
        k = self._kv_bound(idx, rows, self.next_fin[idx] - self.wstep[idx])
        held = (self.qn[idx] > 0) & (rows < self.max_rows[idx])
        if self.has_kv:  # held back by the prefill budget, not by the K/V capacity
            nxt = self.qs[idx, self.qh[idx] % self.qcap]
            held &= self.ctx[idx] + self.prompt_tokens + self.s_tok[nxt] + rows + 1 <= self.kv[idx]
        if wait_left is None:
            k = np.where(held, 1, k)
        else:  # a worker waiting for a batch is not held back by the budget
            wait_left = wait_left[live]
            k = np.where(held & (wait_left == 0), 1, np.where(wait_left > 0, np.minimum(k, wait_left), k))
        self.k[idx] = k
        self.t_end[idx] = self.end(idx, k)

    # ------------------------------------------------------------ running
    def run_until(self, H: float, inclusive: bool = False) -> None:
        """Apply every planned segment that ends before H (or at H, `inclusive`), and the
        ones planned after them."""
        while True:
            idx = np.nonzero(self.k > 0)[0]
            if not len(idx):
                return
            due = self.t_end[idx] <= H if inclusive else self.t_end[idx] < H
            if not due.any():
                return
            idx = idx[due]
            self.apply(idx, self.k[idx])
            self.plan(idx)

    def horizon(self, events: int) -> float:
        """Just past the planned boundary by which `events` workers have reached their next
        finish (inf: nothing runs): a window that holds about that many finishes, whatever
        their rate."""
        ends = self.t_end[self.k > 0]
        if not len(ends):
            return math.inf
        kth = ends.max() if events >= len(ends) else np.partition(ends, events - 1)[events - 1]
        return float(np.nextafter(kth, math.inf))

    def next_event(self) -> float:
        """Just past the earliest planned boundary (inf: nothing runs): a window must reach it."""
        busy = self.k > 0
        return float(np.nextafter(self.t_end[busy].min(), math.inf)) if busy.any() else math.inf

    def take_finished(self, before: float = math.inf, inclusive: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Samples finished since the last call before `before` (at it too, `inclusive`) and their
        times, in time order; later ones (a cut for an admission can finish a sequence past the
        window) stay for a later call."""
        if not self.finished:
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        sids, times, workers, seqs = (np.concatenate([f[i] for f in self.finished]) for i in range(4))
        now = times <= before if inclusive else times < before
        later = ~now
        self.finished = [(sids[later], times[later], workers[later], seqs[later])] if later.any() else []
        sids, times, workers, seqs = sids[now], times[now], workers[now], seqs[now]
        order = np.lexsort((seqs, workers, times))  # ties: by worker, then in admission order, as SimCore's rows
        return sids[order], times[order]
