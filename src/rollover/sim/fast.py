"""The simulator's fast path (`simulate.fast: true`): the same cluster, vectorised over workers.

The default path runs rollover's own schedulers, so every sample is a request with its future,
its routing decision and its completion: about 200 us of Python each, half an hour for 1,024
workers and 1,000 steps. This path models the same policies on arrays instead:

- **Workers** are rows of numpy arrays (a row's slots: sample, tokens left, tokens made). Every
  worker moves from event to event as `SimCore` does (admission at a step boundary with one
  prefill per prompt and the same prefill budget, closed-form segments between finishes, a
  pure or mixed prefill step, a command taking effect at the first boundary at or after its
  time), all workers in lockstep: one numpy pass applies each worker's next event.
- **Routing** is the Ray router's rule (least outstanding tokens, prompt affinity within
  `slack`), evaluated in closed form per group instead of per sample.
- **Sync**: every group of the step is routed at its start and the workers run until the last
  sample finishes; then train, then push the weights. This is exact: the same draws give
  the default path's times (tests/test_sim_fast.py).
- **Async**: the rollout service's admission rule (keep a batch's groups, and the rows, supplied,
  within the staleness gate `started < (version + eta + 1) x B`), batches in start order, the
  trainer taking each batch when it has formed and the previous step is done, the update at the
  end of the training step (workers stall for the dissemination; running sequences recompute
  their K/V with `continue`, not with `keep`). Workers run in windows of simulated time; the
  finishes of a window are processed in time order, and a group admitted at a finish reaches
  its worker at that time, unless the worker has already run past it inside the window (then
  at its current boundary: a delay of at most one window, `window_steps` decode steps). The
  tests bound the effect against the default path.

Not modelled here (refused, with the default path named): APRIL, dynamic sampling and prompt
selection, scoring time, a device shared by training and rollout, multi-turn environments.
Response lengths come from the same distribution as the default path's, drawn by a vectorised
generator (`draws="exact"` takes the default path's own per-sample draws, for comparisons).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from rollover.config import Config, ConfigError
from rollover.sim.costs import DecodeCost, Profile

BIG = np.int64(1 << 60)  # tokens left in an empty slot


def check(cfg: Config) -> None:
    """What the fast path does not model yet, named with the way to simulate it."""
    why = []
    if cfg.partial_rollout.enabled:
        why.append("APRIL (partial_rollout.enabled)")
    if cfg.algorithm.dynamic_sampling:
        why.append("dynamic sampling (algorithm.dynamic_sampling)")
    if cfg.selection.policy != "uniform" or cfg.selection.allocation != "fixed":
        why.append("prompt selection (selection.policy / selection.allocation)")
    if any(float(v) for v in cfg.simulate.reward.values()):
        why.append("scoring time (simulate.reward)")
    if cfg.simulate.shared_device:
        why.append("a shared device (simulate.shared_device)")
    if cfg.mode == "async":
        a = cfg.async_
        if a.dynamic_samples or a.experience_pool:
            why.append("async.dynamic_samples / async.experience_pool")
        if cfg.rollout.inflight_weight_update not in ("continue", "keep"):
            why.append(f"rollout.inflight_weight_update={cfg.rollout.inflight_weight_update}")
    if why:
        raise ConfigError("simulate.fast does not model " + ", ".join(why) + " yet; set simulate.fast=false to "
                          "run rollover's own schedulers on the simulated cluster")


# ---------------------------------------------------------------------------- draws
def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 of uint64 values."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _uniform(x: np.ndarray) -> np.ndarray:
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def _normal(key: np.ndarray) -> np.ndarray:
    a = _mix(key)
    b = _mix(a ^ np.uint64(0xD1B54A32D192ED03))
    return np.sqrt(-2.0 * np.log(_uniform(a))) * np.cos(2 * math.pi * _uniform(b))


class Draws:
    """Response lengths of samples: `vector` (numpy, the default path's distribution) or
    `exact` (the default path's own per-sample draws: slow, for comparisons)."""

    def __init__(self, cfg: Config, kind: str = "vector"):
        from rollover.sim.run import length_model
        from rollover.sim.workload import make_prompts

        self.kind, self.cfg = kind, cfg
        self.model = length_model(cfg)
        s = cfg.simulate
        self.budget = cfg.rollout.max_new_tokens
        self.ignore_eos = cfg.rollout.ignore_eos
        if kind == "exact":
            _, ids = make_prompts(s.prompts, cfg.seed, s.prompt_tokens, s.solve_alpha, s.solve_beta)
            self.keys = [hash(tuple(ids[f"sim{i}"])) for i in range(s.prompts)]
        else:
            m = self.model
            self.factor = m.prompt_sigma * _normal(np.arange(s.prompts, dtype=np.uint64) * np.uint64(2654435761)
                                                   + np.uint64(17))
            self.values = np.asarray(m.values, dtype=np.int64) if m.kind == "empirical" else None

    def targets(self, prompts: np.ndarray, serials: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens each sample generates (n per group, groups `serials` of `prompts`, in order),
        and whether it stops on its own (else it runs to its budget)."""
        from rollover.rollout.groups import sample_seed

        if self.kind == "exact":
            want = np.array([self.model.draw(self.keys[p], sample_seed(self.cfg.seed, g, j))
                             for p, g in zip(prompts.tolist(), serials.tolist()) for j in range(n)], dtype=np.int64)
        else:  # sample_seed, vectorised (exact in int64 for seeds < 2**32)
            seeds = ((np.int64(self.cfg.seed) * 1_000_003 + np.repeat(serials, n).astype(np.int64)) * 1_009
                     + np.tile(np.arange(n, dtype=np.int64), len(serials))) % (1 << 62)
            key = seeds.astype(np.uint64)
            if self.values is not None:
                idx = (_uniform(_mix(key)) * len(self.values)).astype(np.int64)
                want = np.maximum(1, self.values[idx])
            else:
                z = _normal(key) * self.model.sigma + np.repeat(self.factor[prompts], n)
                want = np.maximum(1, np.rint(self.model.median * np.exp(z))).astype(np.int64)
        stop = want < self.budget
        if self.ignore_eos:
            stop[:] = False
        return np.where(stop, want, self.budget), stop


# ---------------------------------------------------------------------------- costs
@dataclass
class _Cost:
    """One pool's DecodeCost over the workers `mask` selects."""

    cost: DecodeCost
    mask: np.ndarray | None  # None: every worker

    def rows_time(self, rows: np.ndarray) -> np.ndarray:
        c = self.cost
        r = rows.astype(np.float64)
        t = c.rows_table
        if not t:
            return c.step_s + c.per_row_s * r
        xs = np.array([p[0] for p in t], dtype=np.float64)
        ys = np.array([p[1] for p in t], dtype=np.float64)
        out = np.interp(r, xs, ys)
        out = np.where(r < xs[0], ys[0] + c.per_row_s * (r - xs[0]), out)
        return np.where(r > xs[-1], ys[-1] + c.per_row_s * (r - xs[-1]), out)

    def prefill(self, tokens: np.ndarray) -> np.ndarray:
        c = self.cost
        x = tokens.astype(np.float64)
        return np.where(tokens > 0, c.prefill_s + c.prefill_per_token_s * x + c.prefill_quadratic_s * x * x, 0.0)


class _Costs:
    def __init__(self, costs: list[DecodeCost], pool_of: np.ndarray):
        self.single = len(set(costs)) == 1
        self.pools = [_Cost(c, None if self.single else pool_of == i) for i, c in enumerate(costs)]
        self.pool_of = pool_of
        self.per_ctx = np.array([c.per_context_token_s for c in costs])[pool_of]
        self.prefill_s = np.array([c.prefill_s for c in costs])[pool_of]
        self.padded = np.array([c.prefill_padded for c in costs])[pool_of]

    def _each(self, idx: np.ndarray, fn: str, x: np.ndarray) -> np.ndarray:
        if self.single:
            return getattr(self.pools[0], fn)(x)
        out = np.empty(len(idx))
        which = self.pool_of[idx]
        for i, p in enumerate(self.pools):
            sel = which == i
            if sel.any():
                out[sel] = getattr(p, fn)(x[sel])
        return out

    def step(self, idx, rows, context) -> np.ndarray:
        return self._each(idx, "rows_time", rows) + self.per_ctx[idx] * context

    def prefill(self, idx, tokens) -> np.ndarray:
        return self._each(idx, "prefill", tokens)


# ---------------------------------------------------------------------------- the workers
class Fleet:
    """Every rollout worker as a row of arrays; see the module docstring."""

    def __init__(self, cfg: Config, profile: Profile, draws: Draws, timeline: bool):
        from dataclasses import replace

        s, r = cfg.simulate, cfg.rollout
        costs, pool_of, rows, names = [], [], [], []
        for i, pool in enumerate(s.pools):
            costs.append(replace(profile.decode, **pool.decode))
            pool_of += [i] * pool.workers
            rows += [pool.max_rows] * pool.workers
            names.append(pool.name)
        self.W = W = len(pool_of)
        self.R = R = max(rows)
        self.pool_of = np.array(pool_of)
        self.pool_names = names
        self.cost = _Costs(costs, self.pool_of)
        self.max_rows = np.array(rows, dtype=np.int64)
        self.max_prefill = 8192  # SimWorker's default
        self.prompt_tokens = s.prompt_tokens
        self.budget = r.max_new_tokens
        self.slack = r.samples_per_prompt * r.max_new_tokens
        self.draws = draws
        # per worker
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
        self.busy_s = np.zeros(W)
        self.stall_s = np.zeros(W)
        # slots
        self.sid = np.full((W, R), -1, dtype=np.int64)
        # a slot's tokens are counted by its worker's steps: it entered at step `born` and
        # finishes at step `fin` (BIG: empty); entering = admitted at the current boundary
        self.wstep = np.zeros(W, dtype=np.int64)
        self.born = np.zeros((W, R), dtype=np.int64)
        self.fin = np.full((W, R), BIG, dtype=np.int64)
        self.t_end = np.zeros(W)  # the planned segment's end
        self.usable = np.arange(R)[None, :] < self.max_rows[:, None]
        # waiting requests, a ring per worker
        self.qcap = 64
        self.qs = np.zeros((W, self.qcap), dtype=np.int64)
        self.qh = np.zeros(W, dtype=np.int64)
        self.qn = np.zeros(W, dtype=np.int64)
        # samples (grown as groups are admitted)
        self.n_samples = 0
        self.s_target = np.zeros(1024, dtype=np.int64)
        self.s_stop = np.zeros(1024, dtype=bool)
        self.s_group = np.zeros(1024, dtype=np.int64)
        self.s_prompt = np.zeros(1024, dtype=np.int64)
        self.s_v0 = np.zeros(1024, dtype=np.int64)
        self.home = np.full(s.prompts, -1, dtype=np.int64)
        self.version = 0
        self.row_steps = np.zeros(W, dtype=np.int64)  # rows x steps: tokens generated
        self.finished: list[tuple[np.ndarray, np.ndarray]] = []  # (sample ids, times) not yet taken
        self.timeline = [[] for _ in range(W)] if timeline else None
        self.open = np.full((W, 2), np.nan)  # the worker's open [start, end] timeline interval

    # ------------------------------------------------------------ samples and routing
    def _grow(self, need: int) -> None:
        if need <= len(self.s_target):
            return
        size = max(need, 2 * len(self.s_target))
        for name in ("s_target", "s_stop", "s_group", "s_prompt", "s_v0"):
            old = getattr(self, name)
            new = np.zeros(size, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def add_groups(self, serials: list[int], prompts: list[int], n: int, at: float) -> None:
        """Route the groups' fresh samples (each group's n samples in order) and queue them;
        every worker that got some replans from its first boundary at or after `at`."""
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
        self._enqueue(dest, np.arange(base, self.n_samples, dtype=np.int64), at)

    def _route(self, prompts: list[int], n: int):
        """The Ray router's picks for each group's n fresh samples: sample j goes to the prompt's
        home worker while home's load + j x budget is within `slack` of the least-loaded worker,
        the rest (and a prompt's first group) to the least-loaded, which becomes its home. Per
        group: (home, how many go there, the least-loaded)."""
        import heapq

        b, slack, home_of = self.budget, self.slack, self.home
        loads = self.load.tolist()
        heap = None
        if len(prompts) > 8:  # many groups at once: a heap of (load, worker); ties to the lowest index
            heap = list(zip(loads, range(self.W)))
            heapq.heapify(heap)
        out_h, out_m, out_b = [], [], []
        for p in prompts:
            if heap is None:
                best = min(range(self.W), key=loads.__getitem__) if self.W < 64 else int(np.argmin(loads))
            else:
                while heap[0][0] != loads[heap[0][1]]:
                    heapq.heappop(heap)
                best = heap[0][1]
            home = int(home_of[p])
            if home < 0 or home == best:
                m, home = n, best
            else:
                m = min(n, max(0, (loads[best] + slack - loads[home]) // b + 1))
            out_h.append(home)
            out_m.append(m)
            out_b.append(best)
            home_of[p] = best if m < n else home
            for w, c in ((home, m), (best, n - m)):
                if c:
                    loads[w] += c * b
                    if heap is not None:
                        heapq.heappush(heap, (loads[w], w))
        self.load[:] = loads
        return np.array(out_h, dtype=np.int64), np.array(out_m, dtype=np.int64), np.array(out_b, dtype=np.int64)

    def _enqueue(self, dest: np.ndarray, sids: np.ndarray, at: float) -> None:
        order = np.argsort(dest, kind="stable")
        dest, sids = dest[order], sids[order]
        workers, first, counts = np.unique(dest, return_index=True, return_counts=True)
        need = int((self.qn[workers] + counts).max())
        if need > self.qcap:
            self._grow_queue(need)
        rank = np.arange(len(dest)) - np.repeat(first, counts)
        pos = (self.qh[dest] + self.qn[dest] + rank) % self.qcap
        self.qs[dest, pos] = sids
        # each worker: to its first boundary at or after `at`, then admit and replan
        self.cut(workers, at)
        self.qn[workers] += counts
        self.plan(workers)

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

    def cut(self, idx: np.ndarray, T: float) -> None:
        """Bring the workers to their first step boundary at or after T (idle ones: to T);
        sequences finishing there finish at its time."""
        idle = self.k[idx] == 0
        w = idx[idle]
        self.t[w] = np.maximum(self.t[w], T)
        busy = idx[~idle]
        if len(busy):
            j = self.first_at_or_after(busy, T)
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
        done = self.fin[idx] == self.wstep[idx][:, None]
        if done.any():
            rows, cols = np.nonzero(done)
            w = idx[rows]
            sids = self.sid[w, cols]
            toks = self.wstep[w] - self.born[w, cols]
            self.ctx -= np.bincount(w, weights=self.prompt_tokens + toks, minlength=self.W).astype(np.int64)
            self.load -= np.bincount(w, weights=self.budget - toks, minlength=self.W).astype(np.int64)
            self.rows -= np.bincount(w, minlength=self.W)
            self.sid[w, cols] = -1
            self.fin[w, cols] = BIG
            self.finished.append((sids, self.t[w]))

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
        self.pre_recompute[idx] = np.where(self.rows[idx] > 0, self.pre_recompute[idx], 0)
        sid = self.sid[idx]
        ent = (self.born[idx] == self.wstep[idx][:, None]) & (sid >= 0)
        # most plans follow a finish with nothing to admit, prefill or recompute: plain decoding
        plain = ~ent.any(axis=1) & ((self.qn[idx] == 0) | (self.rows[idx] == self.max_rows[idx])) \
            & (self.pre_recompute[idx] + self.recompute[idx] == 0)
        if plain.all():
            return self._plan_plain(idx)
        if plain.any():
            self._plan_plain(idx[plain])
            idx, sid, ent = idx[~plain], sid[~plain], ent[~plain]
        self._plan_full(idx, sid, ent)

    def _plan_plain(self, idx: np.ndarray) -> None:
        rows = self.rows[idx]
        idx, rows = idx[rows > 0], rows[rows > 0]
        if not len(idx):
            return
        self.base[idx] = self.cost.step(idx, rows, self.ctx[idx])
        self.extra[idx] = 0.0
        self.slope[idx] = self.cost.per_ctx[idx] * rows
        k = self.fin[idx].min(axis=1) - self.wstep[idx]
        self.k[idx] = k
        self.t_end[idx] = self.end(idx, k)

    def _plan_full(self, idx: np.ndarray, sid: np.ndarray, ent: np.ndarray) -> None:
        P = self.prompt_tokens
        ent_keys = np.where(ent, self.s_prompt[np.maximum(sid, 0)], -1)
        n_keys = np.zeros(len(idx), dtype=np.int64)
        if ent.any():
            srt = np.sort(ent_keys, axis=1)
            n_keys = ((srt >= 0) & np.concatenate([np.ones((len(idx), 1), bool), srt[:, 1:] != srt[:, :-1]],
                                                  axis=1)).sum(axis=1)
        budget = self.max_prefill - n_keys * P - self.pre_recompute[idx]
        free = self.max_rows[idx] - self.rows[idx]
        take = np.minimum(free, self.qn[idx])
        F = int(take.max()) if len(take) else 0
        if F > 0:
            cols = np.arange(F)
            pos = (self.qh[idx][:, None] + cols[None, :]) % self.qcap
            cand = self.qs[idx[:, None], pos]
            valid = cols[None, :] < take[:, None]
            prompt = np.where(valid, self.s_prompt[cand], -2)
            new_key = np.ones_like(valid)
            new_key[:, 1:] = prompt[:, 1:] != prompt[:, :-1]
            if ent.any():
                new_key &= ~(prompt[:, :, None] == ent_keys[:, None, :]).any(axis=2)
            new_key &= valid
            spent = np.cumsum(new_key * P, axis=1) - new_key * P  # budget used before each candidate
            keys_before = (n_keys[:, None] > 0) | (cols[None, :] > 0)
            stop = valid & keys_before & (P > budget[:, None] - spent)
            admit = np.where(stop.any(axis=1), stop.argmax(axis=1), take)
            n_new_keys = (new_key & (cols[None, :] < admit[:, None])).sum(axis=1)
            n_keys = n_keys + n_new_keys
            if admit.any():
                self._admit(idx, cand, admit)
        rows = self.rows[idx]
        live = rows > 0
        idx, rows, n_keys = idx[live], rows[live], n_keys[live]
        if not len(idx):
            return
        fresh = n_keys * P  # every key a fresh prompt of P tokens; padded: rows x the longest, the same
        rec = self.pre_recompute[idx] + self.recompute[idx]
        self.pre_recompute[idx], self.recompute[idx] = rec, 0
        n_ent = ((self.born[idx] == self.wstep[idx][:, None]) & (self.sid[idx] >= 0)).sum(axis=1)  # after admission
        decoding = rows - n_ent
        ctx = self.ctx[idx]
        first = self.cost.prefill(idx, rec)
        pf = self.cost.prefill(idx, fresh)
        dec = self.cost.step(idx, decoding, ctx - n_ent * P)
        mixed = decoding > 0
        part = np.where(mixed, first + np.where(fresh > 0, pf - self.cost.prefill_s[idx], 0.0), first + pf)
        decode = np.where(mixed, dec, 0.0)
        base = self.cost.step(idx, rows, ctx)
        self.base[idx] = base
        self.extra[idx] = decode + part - base
        self.slope[idx] = self.cost.per_ctx[idx] * rows
        k = self.fin[idx].min(axis=1) - self.wstep[idx]
        held = (self.qn[idx] > 0) & (rows < self.max_rows[idx])
        k = np.where(held, 1, k)
        self.k[idx] = k
        self.t_end[idx] = self.end(idx, k)

    def _admit(self, idx: np.ndarray, cand: np.ndarray, admit: np.ndarray) -> None:
        free = (self.sid[idx] < 0) & self.usable[idx]
        rank = np.cumsum(free, axis=1) - 1
        put = free & (rank < admit[:, None])
        r, c = np.nonzero(put)
        w = idx[r]
        s = cand[r, rank[r, c]]
        self.sid[w, c] = s
        self.born[w, c] = self.wstep[w]
        self.fin[w, c] = self.wstep[w] + self.s_target[s]
        self.s_v0[s] = self.version
        self.rows[idx] += admit
        self.ctx[idx] += admit * self.prompt_tokens
        self.qh[idx] = (self.qh[idx] + admit) % self.qcap
        self.qn[idx] -= admit

    # ------------------------------------------------------------ running
    def run_until(self, H: float) -> None:
        """Apply every planned segment that ends before H (and the ones planned after them)."""
        while True:
            idx = np.nonzero(self.k > 0)[0]
            if not len(idx):
                return
            due = self.t_end[idx] < H
            if not due.any():
                return
            idx = idx[due]
            self.apply(idx, self.k[idx])
            self.plan(idx)

    def take_finished(self) -> tuple[np.ndarray, np.ndarray]:
        """Samples finished since the last call and their times, in time order."""
        if not self.finished:
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        sids = np.concatenate([f[0] for f in self.finished])
        times = np.concatenate([f[1] for f in self.finished])
        self.finished = []
        order = np.argsort(times, kind="stable")
        return sids[order], times[order]

    def busy_any(self) -> bool:
        return bool((self.k > 0).any())


# ---------------------------------------------------------------------------- the drivers
def simulate_fast(cfg: Config, profile: Profile, progress=None, draws: str = "vector",
                  window_events: float = 0.25, timeline: bool | None = None) -> dict:
    """`cfg.steps` training steps on the fast path; the report `rollover.sim.run.summarize`
    gives on the default path (same keys)."""
    from rollover.data import PromptIterator
    from rollover.sim.workload import make_prompts

    check(cfg)
    s = cfg.simulate
    workers = sum(p.workers for p in s.pools)
    if timeline is None:
        timeline = workers * cfg.steps <= 20_000
    fleet = Fleet(cfg, profile, Draws(cfg, draws), timeline)
    prompts, _ = make_prompts(s.prompts, cfg.seed, s.prompt_tokens, s.solve_alpha, s.solve_beta)
    data = PromptIterator(prompts, seed=cfg.seed, shuffle=cfg.data.shuffle)
    index = {p.id: i for i, p in enumerate(prompts)}
    state = {"serial": 0}

    def next_groups(k: int) -> tuple[list[int], list[int]]:
        ps = [index[p.id] for p in data.next_batch(k)]
        serials = list(range(state["serial"], state["serial"] + k))
        state["serial"] += k
        return serials, ps

    driver = _async if cfg.mode == "async" else _sync
    rows, trainer_tl = driver(cfg, profile, fleet, next_groups, progress, window_events)
    return _summary(cfg, profile, fleet, rows, trainer_tl)


def _train_tokens(fleet: Fleet, sids: np.ndarray) -> tuple[int, int]:
    resp = int(fleet.s_target[sids].sum())
    return resp + len(sids) * fleet.prompt_tokens, resp


def _row(step, t_start, t_train, t_end, sids, fleet, version, train_s, sync_s, groups, engine_tokens=None) -> dict:
    ages = Counter((version - fleet.s_v0[sids]).tolist())
    return {"step": step + 1, "t_start": t_start, "t_train": t_train, "t_end": t_end, "wait_s": t_train - t_start,
            "train_s": train_s, "sync_s": sync_s, "samples": len(sids), "groups": groups,
            "response_tokens": int(fleet.s_target[sids].sum()), "ages": {int(k): v for k, v in ages.items()},
            "filtered_groups": 0, "discarded_tokens": 0, "engine_tokens": engine_tokens}


def _sync(cfg, profile, fleet: Fleet, next_groups, progress, window_events):
    B, n = cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt
    rows, trainer_tl = [], []
    now = 0.0
    sync_s = profile.sync.seconds(fleet.W)
    for step in range(cfg.steps):
        t0, made = now, int(fleet.row_steps.sum())
        serials, ps = next_groups(B)
        first = fleet.n_samples
        fleet.add_groups(serials, ps, n, at=now)
        fleet.run_until(math.inf)
        _, times = fleet.take_finished()
        t1 = max(now, float(times[-1])) if len(times) else now
        sids = np.arange(first, fleet.n_samples)
        tokens, _ = _train_tokens(fleet, sids)
        train_s = profile.train.seconds(tokens)
        version = fleet.version
        fleet.stall(t1 + train_s, sync_s, step + 1, "continue")
        now = t1 + train_s + sync_s
        trainer_tl += [[t1, t1 + train_s, "train"], [t1 + train_s, now, "sync"]]
        rows.append(_row(step, t0, t1, now, sids, fleet, version, train_s, sync_s, B,
                         int(fleet.row_steps.sum()) - made))
        if progress:
            progress(rows[-1])
    return rows, trainer_tl


def _async(cfg, profile, fleet: Fleet, next_groups, progress, window_events):
    """The async loop (rollover.sim.run._async with RolloutService, DataManager and
    StalenessGate) on the fleet; see the module docstring."""
    r = cfg.rollout
    B, n, eta, steps = r.prompts_per_step, r.samples_per_prompt, cfg.async_.max_staleness, cfg.steps
    R = int(fleet.max_rows.sum())
    inflight_mode = r.inflight_weight_update
    sync_s = profile.sync.seconds(fleet.W)
    train_lb = profile.train.seconds(B * n * (fleet.prompt_tokens + 1))
    if train_lb <= 0:
        raise ConfigError("simulate.fast in async mode needs a training step that takes time "
                          "(simulate.train.step_s or per_token_s > 0)")
    # a window: about `window_events` finishes per worker (measured over the last window), at
    # least a decode step, never longer than the shortest training step (so a batch that forms
    # inside a window is trained after it: the update time is known before workers reach it)
    full = float(np.median(fleet.cost.step(np.arange(fleet.W), fleet.max_rows,
                                           fleet.max_rows * (fleet.prompt_tokens + 1))))
    window = min(16 * full, train_lb)
    g_left = np.zeros(steps * B, dtype=np.int64)
    g_done = np.full(steps * B, np.nan)
    c = {"live": 0, "inflight": 0, "running": 0}

    def admit(at: float, f: np.ndarray, cg: np.ndarray, times: np.ndarray) -> None:
        """The service's admissions at each event: fill to the level the rows and the batch ask
        for, within the gate (see the module docstring); f, cg: samples and groups finished up
        to each event."""
        cap = min((fleet.version + eta + 1) * B, steps * B)
        level = c["live"] + np.maximum(B - c["inflight"] + cg, -(-(R - c["running"] + f) // n))
        level = np.maximum.accumulate(np.minimum(level, cap))
        new = np.diff(np.concatenate([[c["live"]], np.maximum(level, c["live"])]))
        for i in np.nonzero(new > 0)[0]:
            k = int(new[i])
            serials, ps = next_groups(k)
            g_left[serials] = n
            fleet.add_groups(serials, ps, n, at=float(times[i]) if times is not None else at)
            c["live"] += k
            c["inflight"] += k
            c["running"] += n * k

    admit(0.0, np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), None)
    rows, trainer_tl = [], []
    T, t_free, step = 0.0, 0.0, 0
    update_at = admit_at = None
    formed = 0  # batches formed
    batch_time: list[float] = []
    while step < steps:
        if update_at is None and formed > step:  # batch `step` formed: its update time is known
            sids = np.nonzero((fleet.s_group[: fleet.n_samples] // B) == step)[0]
            t0 = max(t_free, batch_time[step])
            tokens, _ = _train_tokens(fleet, sids)
            train_s = profile.train.seconds(tokens)
            update_at, pending = t0 + train_s, (t0, train_s, sids)
        H = T + window
        for fixed in (update_at, admit_at):
            if fixed is not None:
                H = min(H, fixed)
        H = max(H, T)
        events = 0
        while True:  # the window: workers to H, then the finishes in time order, until none is left before H
            fleet.run_until(H)
            sids_f, times = fleet.take_finished()
            if not len(sids_f):
                break
            events += len(sids_f)
            groups = fleet.s_group[sids_f]
            np.subtract.at(g_left, groups, 1)
            np.fmax.at(g_done, groups, times)
            complete = np.zeros(len(sids_f), dtype=np.int64)
            last = g_left[groups] == 0
            # a group completes at the event of its last sample (each group counted once)
            _, first_idx = np.unique(groups[::-1], return_index=True)
            mark = np.zeros(len(sids_f), dtype=bool)
            mark[len(sids_f) - 1 - first_idx] = True
            complete[last & mark] = 1
            cg = np.cumsum(complete)
            admit(H, np.arange(1, len(sids_f) + 1), cg, times)  # counted from the state before these events
            c["running"] -= len(sids_f)
            c["inflight"] -= int(cg[-1])
            while formed < steps and c["live"] >= (formed + 1) * B and not g_left[formed * B:(formed + 1) * B].any():
                batch_time.append(float(g_done[formed * B:(formed + 1) * B].max()))
                formed += 1
        if events and H > T:
            window = min(max(window_events * fleet.W * (H - T) / events, full), train_lb)
        T = H
        if update_at is not None and T >= update_at:
            t0, train_s, sids = pending
            version = fleet.version
            if len(sids) and int((version - fleet.s_v0[sids]).max()) > eta:
                raise AssertionError(f"fast simulation: staleness above max_staleness={eta} at version {version}")
            fleet.stall(update_at, sync_s, step + 1, inflight_mode)
            t_wait, t_free = t_free, update_at + sync_s
            trainer_tl += [[t0, t0 + train_s, "train"], [t0 + train_s, t_free, "sync"]]
            rows.append(_row(step, t_wait, t0, t_free, sids, fleet, version, train_s, sync_s, B))
            if progress:
                progress(rows[-1])
            step += 1
            update_at, admit_at = None, t_free
        elif admit_at is not None and T >= admit_at:
            admit(T, np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), None)
            admit_at = None
    fleet.cut(np.arange(fleet.W), t_free)  # the run ends: what is in flight is aborted at its boundary
    fleet.close_timeline()
    return rows, trainer_tl


def _summary(cfg: Config, profile: Profile, fleet: Fleet, rows: list[dict], trainer_tl: list) -> dict:
    from rollover.sim.run import report

    fleet.close_timeline()
    generated = int(fleet.row_steps.sum())
    total_rows = int((fleet.max_rows * fleet.wstep).sum())
    return report(cfg, profile, rows, trainer_tl, pools=[fleet.pool_names[i] for i in fleet.pool_of],
                  busy_s=fleet.busy_s.tolist(), stall_s=fleet.stall_s.tolist(), generated=generated,
                  occupancy=generated / total_rows if total_rows else 0.0,
                  timelines=fleet.timeline if fleet.timeline is not None else [], mode=" [fast path]")
