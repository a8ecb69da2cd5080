"""The simulator's fast path (`simulate.fast: true`): the same cluster, vectorised over workers.

The schedulers' path runs rollover's own schedulers, so every sample is a request with its
future, its routing decision and its completion: about 200 us of Python each, half an hour for
1,024 workers and 1,000 steps. This path models the same policies on arrays instead:

- **Workers** are rows of numpy arrays (a slot's sample, the worker step it entered at and the
  one it finishes at). Every worker moves from event to event as `SimCore` does (admission at a
  step boundary with one prefill per prompt and the same prefill budget, closed-form segments
  between finishes, a pure or mixed prefill step, a command taking effect at the first
  boundary at or after its time), all workers in lockstep: one numpy pass applies each
  worker's next event.
- **Routing** is the Ray router's rule (least outstanding tokens, prompt affinity within
  `slack`), in closed form per fresh group, request by request for resumed samples.
- **Sync**: every group of the step is routed at its start and the workers run until the last
  sample finishes; then train, then push the weights. Exact: the same draws give the
  schedulers' path's times (tests/test_sim_fast.py).
- **Async**: the rollout service's admission rule (keep a batch's groups, and the rows, supplied,
  within the staleness gate `started < (version + eta + 1) x B`), batches in start order, the
  trainer taking each batch when it has formed and the previous step is done, the update at the
  end of the training step (workers stall for the dissemination; running sequences recompute
  their K/V with `continue`, not with `keep`).
- **APRIL**: the collector's refills (ceil(alpha x B) groups' worth of samples unfinished in
  flight), its stop at B ready groups (all but the last `score_lag` completions counted), the
  abort with tokens carried and resubmitted first (`resubmit`) or the pause in place
  (`keep_kv`), groups completing after the stop carried as ready, the B lowest-serial ready
  groups trained.

Async and APRIL run the workers in windows of simulated time, each ending when a quarter of the
workers have reached their next finish (counted in events, not seconds: a window's length
follows the finish rate as it changes, at a step's start and in its tail); the finishes of a
window are processed in time order, and a group admitted at a finish reaches its worker at
that time unless the worker already ran past it inside the window (then at its current
boundary, a few decode steps late; its load, which the router reads, is then also a few steps
ahead). A window in which an APRIL step stops is run again up to the stop, so the stop itself
is exact. The tests bound the effect against the schedulers' path.

Not modelled here (refused, with the schedulers' path named): adaptive alpha and
`on_stale: regenerate`, dynamic sampling and prompt selection, scoring time, a device shared by
training and rollout, multi-turn environments. Response lengths come from the same
distribution as the schedulers' path's, drawn by a vectorised generator (`draws="exact"` takes
the schedulers' path's own per-sample draws, for comparisons).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from rollover.config import Config, ConfigError
from rollover.sim.costs import DecodeCost, Profile

BIG = np.int64(1 << 60)
# finishes per worker in a window of async and APRIL runs: smaller is closer to the schedulers'
# path and slower. At 1,024 workers (examples/sim_1024.yaml, 12 steps, the schedulers' draws),
# APRIL's samples/s against the schedulers' path: -0.005% at 0.05, -0.07% at 0.25, -0.25% at
# 0.5, -4.5% at 1. (Windows measured in seconds, from the last window's finish rate, gave -1.9%
# at 0.25: a window that began in a sparse stretch ran long into the next burst.)
WINDOW_EVENTS = 0.25
WINDOW_EVENTS_APRIL = 0.25


def check(cfg: Config) -> None:
    """What the fast path does not model yet, named with the way to simulate it."""
    why = []
    p = cfg.partial_rollout
    if p.enabled and p.adaptive:
        why.append("adaptive APRIL (partial_rollout.adaptive)")
    if p.enabled and p.on_stale == "regenerate":
        why.append("partial_rollout.on_stale=regenerate")
    if cfg.algorithm.dynamic_sampling:
        why.append("dynamic sampling (algorithm.dynamic_sampling)")
    if cfg.selection.policy != "uniform" or cfg.selection.allocation != "fixed":
        why.append("prompt selection (selection.policy / selection.allocation)")
    if cfg.selection.dars != "off":
        why.append("DARS (selection.dars)")
    from rollover.runtime.routing import MAX_PREFIXES

    if cfg.simulate.prompts > MAX_PREFIXES:
        why.append(f"the router forgetting prompts (simulate.prompts={cfg.simulate.prompts} > the "
                   f"{MAX_PREFIXES:,} prompt prefixes it remembers)")
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
        # samples (grown as groups are admitted)
        self.n_samples = 0
        self.s_target = np.zeros(1024, dtype=np.int64)
        self.s_stop = np.zeros(1024, dtype=bool)
        self.s_group = np.zeros(1024, dtype=np.int64)
        self.s_prompt = np.zeros(1024, dtype=np.int64)
        self.s_v0 = np.zeros(1024, dtype=np.int64)
        self.s_tok = np.zeros(1024, dtype=np.int64)  # tokens a sample holds while it waits (carried by APRIL)
        self.home = np.full(s.prompts, -1, dtype=np.int64)
        self.version = 0
        self.paused = False
        self.row_steps = np.zeros(W, dtype=np.int64)  # rows x steps: tokens generated
        self.finished: list[tuple[np.ndarray, np.ndarray]] = []  # (sample ids, times) not yet taken
        self.timeline = [[] for _ in range(W)] if timeline else None
        self.open = np.full((W, 2), np.nan)  # the worker's open [start, end] timeline interval

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
        """The Ray router's picks for each group's n fresh samples: sample j goes to the prompt's
        home worker while home's load + j x budget is within `slack` of the least-loaded worker,
        the rest (and a prompt's first group) to the least-loaded, which becomes its home. Per
        group: (home, how many go there, the least-loaded)."""
        import heapq

        b, slack, home_of = self.budget, self.slack, self.home
        heap = None
        if len(prompts) > 64:  # many groups at once: a heap of (load, worker); ties to the lowest index
            loads = self.load.tolist()
            heap = list(zip(loads, range(self.W)))
            heapq.heapify(heap)
        else:  # a few: the loads in place
            loads = self.load
        out_h, out_m, out_b = [], [], []
        for p in prompts:
            if heap is None:
                best = int(loads.argmin())
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
        if heap is not None:
            self.load[:] = loads
        return np.array(out_h, dtype=np.int64), np.array(out_m, dtype=np.int64), np.array(out_b, dtype=np.int64)

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
        request by request) and queue them; their workers replan from `at`."""
        import heapq

        b, slack, home_of, loads = self.budget, self.slack, self.home.tolist(), self.load.tolist()
        heap = list(zip(loads, range(self.W)))
        heapq.heapify(heap)
        dest = []
        for carried, p in zip(self.s_tok[sids].tolist(), self.s_prompt[sids].tolist()):
            while heap[0][0] != loads[heap[0][1]]:
                heapq.heappop(heap)
            pick = best = heap[0][1]
            if not carried:
                home = home_of[p]
                if home >= 0 and loads[home] <= loads[best] + slack:
                    pick = home
                home_of[p] = pick
            dest.append(pick)
            loads[pick] += b - carried
            if pick == best:  # the heap's top: replaced in one operation
                heapq.heapreplace(heap, (loads[pick], pick))
            else:
                heapq.heappush(heap, (loads[pick], pick))
        self.load[:] = loads
        self.home[:] = home_of
        self._enqueue(np.array(dest, dtype=np.int64), sids, at)

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
              "stall_s", "wstep", "born", "entered", "fin", "next_fin", "n_ent", "ent_ctx", "seq", "sid", "t_end", "qs", "qh", "qn", "home",
              "row_steps", "open", "admitted")

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
        self.pre_recompute[idx] = np.where(self.rows[idx] > 0, self.pre_recompute[idx], 0)
        # most plans follow a finish with nothing to admit, prefill or recompute: plain decoding
        plain = (self.n_ent[idx] == 0) & ((self.qn[idx] == 0) | (self.rows[idx] == self.max_rows[idx])) \
            & (self.pre_recompute[idx] + self.recompute[idx] == 0)
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
        k = self.next_fin[idx] - self.wstep[idx]
        self.k[idx] = k
        self.t_end[idx] = self.end(idx, k)

    def _keys(self, sids: np.ndarray, carried: np.ndarray) -> np.ndarray:
        """Prefill keys: a fresh sample's prompt (its group's samples prefill it once), a resumed
        sample's own (its prompt and tokens)."""
        return np.where(carried == 0, self.s_prompt[np.maximum(sids, 0)], -10 - sids)

    def _plan_full(self, idx: np.ndarray) -> None:
        P = self.prompt_tokens
        m = len(idx)
        n_keys = np.zeros(m, dtype=np.int64)
        key_tokens = np.zeros(m, dtype=np.int64)
        longest = np.zeros(m, dtype=np.int64)
        # the prompts entering at this boundary already (admitted since the last step): their keys
        rows_ent = np.nonzero(self.n_ent[idx])[0]
        if len(rows_ent):
            w = idx[rows_ent]
            sid = self.sid[w]
            ent = (self.entered[w] == self.wstep[w][:, None]) & (sid >= 0)
            ent_carried = np.where(ent, self.entered[w] - self.born[w], 0)
            ent_keys = np.where(ent, self._keys(sid, ent_carried), -1)
            order = np.argsort(ent_keys, axis=1, kind="stable")
            srt = np.take_along_axis(ent_keys, order, axis=1)
            tok = np.take_along_axis(np.where(ent, P + ent_carried, 0), order, axis=1)
            first = (srt != -1) & np.concatenate([np.ones((len(w), 1), bool), srt[:, 1:] != srt[:, :-1]], axis=1)
            n_keys[rows_ent] = first.sum(axis=1)
            key_tokens[rows_ent] = (first * tok).sum(axis=1)
            longest[rows_ent] = (first * tok).max(axis=1)
        budget = self.max_prefill - key_tokens - self.pre_recompute[idx]
        free = self.max_rows[idx] - self.rows[idx]
        take = np.minimum(free, self.qn[idx])
        F = int(take.max()) if m else 0
        if F > 0:
            cols = np.arange(F)
            pos = (self.qh[idx][:, None] + cols[None, :]) % self.qcap
            cand = self.qs[idx[:, None], pos]
            valid = cols[None, :] < take[:, None]
            carried = np.where(valid, self.s_tok[cand], 0)
            keys = np.where(valid, self._keys(cand, carried), -2 - cols[None, :])
            need = P + carried
            # a key's first candidate in each row (by a stable sort: the earliest among equals)
            order = np.argsort(keys, axis=1, kind="stable")
            srt = np.take_along_axis(keys, order, axis=1)
            first = np.ones((m, F), dtype=bool)
            first[:, 1:] = srt[:, 1:] != srt[:, :-1]
            new_key = np.empty((m, F), dtype=bool)
            np.put_along_axis(new_key, order, first, axis=1)
            new_key &= valid
            if len(rows_ent):  # not a key already entering
                new_key[rows_ent] &= ~(keys[rows_ent, :, None] == ent_keys[:, None, :]).any(axis=2)
            spent = np.cumsum(new_key * need, axis=1) - new_key * need  # budget used before each candidate
            keys_before = (n_keys[:, None] > 0) | (cols[None, :] > 0)
            stop = valid & keys_before & (need > budget[:, None] - spent)
            admit = np.where(stop.any(axis=1), stop.argmax(axis=1), take)
            got = new_key & (cols[None, :] < admit[:, None])
            n_keys = n_keys + got.sum(axis=1)
            key_tokens = key_tokens + (got * need).sum(axis=1)
            longest = np.maximum(longest, (got * need).max(axis=1))
            if admit.any():
                self._admit(idx, cand, admit)
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
        part = np.where(mixed, first + np.where(fresh > 0, pf - self.cost.prefill_s[idx], 0.0), first + pf)
        decode = np.where(mixed, dec, 0.0)
        base = self.cost.step(idx, rows, ctx)
        self.base[idx] = base
        self.extra[idx] = decode + part - base
        self.slope[idx] = self.cost.per_ctx[idx] * rows
        k = self.next_fin[idx] - self.wstep[idx]
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
        carried = self.s_tok[s]
        self.sid[w, c] = s
        self.born[w, c] = self.wstep[w] - carried
        self.entered[w, c] = self.wstep[w]
        order = np.lexsort((c, r))  # rows fill in queue order
        self.seq[w[order], c[order]] = self.admitted[0] + np.arange(len(order))
        self.admitted[0] += len(order)
        self.fin[w, c] = self.born[w, c] + self.s_target[s]
        np.minimum.at(self.next_fin, w, self.fin[w, c])
        self.n_ent[idx] += admit
        first = carried == 0
        self.s_v0[s[first]] = self.version  # a resumed sample's first token is older
        self.rows[idx] += admit
        tokens = np.bincount(w, weights=self.prompt_tokens + carried, minlength=self.W).astype(np.int64)
        self.ctx += tokens
        self.ent_ctx += tokens
        self.qh[idx] = (self.qh[idx] + admit) % self.qcap
        self.qn[idx] -= admit

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

    def busy_any(self) -> bool:
        return bool((self.k > 0).any())


# ---------------------------------------------------------------------------- the drivers
def simulate_fast(cfg: Config, profile: Profile, progress=None, draws: str = "vector",
                  window_events: float | None = None, timeline: bool | None = None) -> dict:
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
    next_groups = _Prompts(PromptIterator(prompts, seed=cfg.seed, shuffle=cfg.data.shuffle), prompts)
    driver = _async if cfg.mode == "async" else _april if cfg.partial_rollout.enabled else _sync
    if window_events is None:  # finishes per worker per window (see the module docstring)
        window_events = WINDOW_EVENTS_APRIL if driver is _april else WINDOW_EVENTS
    rows, trainer_tl = driver(cfg, profile, fleet, next_groups, progress, window_events)
    return _summary(cfg, profile, fleet, rows, trainer_tl)


class _Prompts:
    """The run's prompt order (the real PromptIterator) as groups: `(serials, prompt indices)`."""

    def __init__(self, data, prompts):
        self.data, self.serial = data, 0
        self.index = {p.id: i for i, p in enumerate(prompts)}

    def __call__(self, k: int) -> tuple[list[int], list[int]]:
        ps = [self.index[p.id] for p in self.data.next_batch(k)]
        serials = list(range(self.serial, self.serial + k))
        self.serial += k
        return serials, ps

    def snapshot(self) -> tuple:
        d = self.data
        return self.serial, d.epoch, d.position, d._order, d.prompts_served

    def restore(self, snap: tuple) -> None:
        d = self.data
        self.serial, d.epoch, d.position, d._order, d.prompts_served = snap


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
    for step in range(cfg.steps):
        t0, made = now, int(fleet.row_steps.sum())
        serials, ps = next_groups(B)
        first = fleet.n_samples
        fleet.add_groups(serials, ps, n, at=now)
        fleet.run_until(math.inf)
        _, times = fleet.take_finished()
        t1 = max(now, float(times[-1])) if len(times) else now
        sids = np.arange(first, fleet.n_samples)
        now = _train_and_push(profile, fleet, step, t0, t1, sids, made, "continue", rows, trainer_tl, progress)
    return rows, trainer_tl


def _train_and_push(profile, fleet: Fleet, step: int, t0: float, t1: float, sids: np.ndarray, made: int,
                    inflight: str, rows: list, trainer_tl: list, progress) -> float:
    """Sync and APRIL: train on `sids` from t1, push the weights (workers stall), record the
    step; when the next step starts."""
    train_s = profile.train.seconds(_train_tokens(fleet, sids)[0])
    sync_s = profile.sync.seconds(fleet.W)
    version = fleet.version
    fleet.stall(t1 + train_s, sync_s, step + 1, inflight)
    now = t1 + train_s + sync_s
    trainer_tl += [[t1, t1 + train_s, "train"], [t1 + train_s, now, "sync"]]
    rows.append(_row(step, t0, t1, now, sids, fleet, version, train_s, sync_s, len(np.unique(fleet.s_group[sids])),
                     int(fleet.row_steps.sum()) - made))
    if progress:
        progress(rows[-1])
    return now


def _completions(left: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """For finish events in time order (their groups), 1 where the event is its group's last
    sample (`left`: each group's samples not finished before these events)."""
    order = np.argsort(groups, kind="stable")
    g = groups[order]
    starts = np.concatenate([[True], g[1:] != g[:-1]])
    first = np.maximum.accumulate(np.where(starts, np.arange(len(g)), 0))
    seen = np.empty(len(g), dtype=np.int64)
    seen[order] = np.arange(len(g)) - first + 1  # events of its group up to this one
    return (seen == left[groups]).astype(np.int64)


class _Groups:
    """Per group (by serial): samples not finished, and when it completed."""

    def __init__(self):
        self.left = np.zeros(1024, dtype=np.int64)
        self.done = np.full(1024, np.nan)

    def add(self, serials: list[int], n: int) -> None:
        need = serials[-1] + 1
        if need > len(self.left):
            size = max(need, 2 * len(self.left))
            self.left = np.concatenate([self.left, np.zeros(size - len(self.left), dtype=np.int64)])
            self.done = np.concatenate([self.done, np.full(size - len(self.done), np.nan)])
        self.left[serials] = n
        self.done[serials] = np.nan

    def finish(self, groups: np.ndarray, times: np.ndarray) -> np.ndarray:
        """Count finished samples (events in time order); per event, 1 where it completed its group."""
        complete = _completions(self.left, groups)
        np.subtract.at(self.left, groups, 1)
        np.fmax.at(self.done, groups, times)
        return complete


def _april(cfg, profile, fleet: Fleet, next_groups, progress, window_events):
    """The APRIL collector (rollover.rollout.april) and the synchronous loop on the fleet:
    keep ceil(alpha x B) groups' worth of samples unfinished in flight (rows freed by finished
    samples go to fresh groups at once); the stop decision at each group completion counts all
    but the last `score_lag` completed groups; at B ready groups every request is aborted (its
    tokens carried, resubmitted first next step, with their K/V recomputed) or, with keep_kv,
    paused in place; groups completing after the stop are carried as ready; the B lowest-serial
    ready groups train. Windows of simulated time as in async mode; the window in which the step
    stops is run again from its start up to the stop, so the stop is exact."""
    r, pr = cfg.rollout, cfg.partial_rollout
    B, n = r.prompts_per_step, r.samples_per_prompt
    capacity = max(B, math.ceil(pr.oversample * B))
    lag = min(pr.score_lag, B - 1)
    keep = cfg.april_carry[0] == "keep_kv"
    per_window = max(1, round(window_events * fleet.W))
    groups = _Groups()
    st = {"unfinished": 0, "completed": []}  # samples of groups in flight not finished; this step's completions
    inflight: set[int] = set()
    ready_carry: list[int] = []
    carried = np.zeros(0, dtype=np.int64)  # resubmit: the aborted samples, resubmitted first next step
    rows, trainer_tl = [], []
    now = 0.0

    def refill(times: np.ndarray, f: np.ndarray) -> None:
        """After each event (f: samples finished up to it): fresh groups until capacity x n
        samples are unfinished in flight."""
        want = np.maximum.accumulate(np.maximum(-(-(capacity * n - st["unfinished"] + f) // n), 0))
        new = np.diff(np.concatenate([[0], want]))
        total = int(new.sum())
        if total:
            serials, ps = next_groups(total)
            groups.add(serials, n)
            inflight.update(serials)
            fleet.add_groups(serials, ps, n, at=np.repeat(times, new))
            st["unfinished"] += n * total

    def take(need: int | None = None, refilling: bool = True, before: float = math.inf,
             inclusive: bool = False) -> tuple[list[float], bool, int]:
        """Process the finishes so far (before `before`) in time order, refilling after each;
        the times of the group completions among them, whether one stopped the step (with
        `need`, the completions that stop it: refilling stops at that event), how many."""
        sids, times = fleet.take_finished(before, inclusive)
        if not len(sids):
            return [], False, 0
        g = fleet.s_group[sids]
        until, stopped = len(sids), False
        if need is not None:
            hit = np.nonzero(len(st["completed"]) + np.cumsum(_completions(groups.left, g)) >= need)[0]
            if len(hit):
                until, stopped = int(hit[0]), True
        complete = groups.finish(g, times).astype(bool)
        if refilling and until:
            refill(times[:until], np.arange(1, until + 1))
        st["unfinished"] -= len(sids)
        for gg in g[complete].tolist():
            inflight.discard(gg)
            st["completed"].append(gg)
        return times[complete].tolist(), stopped, len(sids)

    def window_to(H: float) -> list[float]:
        """Every event before H (finishes processed as they come, refills included); the
        completion times."""
        done = []
        while True:
            fleet.run_until(H)
            more, _, k = take(before=H)
            if not k:
                return done
            done += more

    def save() -> tuple:
        lo = min(inflight) if inflight else next_groups.serial
        return (fleet.snapshot(), next_groups.snapshot(), st["unfinished"], len(st["completed"]), set(inflight),
                lo, groups.left[lo:next_groups.serial].copy(), groups.done[lo:next_groups.serial].copy())

    def load(snap: tuple) -> None:
        fleet.restore(snap[0])
        next_groups.restore(snap[1])
        st["unfinished"] = snap[2]
        del st["completed"][snap[3]:]
        inflight.clear()
        inflight.update(snap[4])
        lo = snap[5]
        groups.left[lo:lo + len(snap[6])] = snap[6]
        groups.done[lo:lo + len(snap[7])] = snap[7]

    for step in range(cfg.steps):
        t0, made = now, int(fleet.row_steps.sum())
        ready = sorted(ready_carry)
        ready_carry, st["completed"] = [], []
        t1 = now
        if len(ready) < B:  # else: enough carried, nothing generated this step
            need = B - len(ready) + lag  # completions that stop the step
            if len(carried):
                fleet.add_requests(np.sort(carried), now)
                carried = carried[:0]
            if keep:
                fleet.resume(now)
            refill(np.array([now]), np.zeros(1, dtype=np.int64))
            step_snap, windows = save(), []  # the state at the step's start, the windows run since
            most = 1  # the most completions one window has had
            while True:
                H = fleet.horizon(per_window)
                if H == math.inf:
                    raise RuntimeError(f"fast simulation stalled in step {step + 1}: nothing runs and "
                                       f"{len(st['completed'])}/{need} completions are in")
                before = len(st["completed"])
                snap = save() if before + 2 * most >= need else None  # the stop may come in this window
                done = window_to(H)
                most = max(most, len(done))
                if before + len(done) < need:
                    windows.append(H)
                    continue
                # the step stops inside this window: run it again from its start up to the
                # time of the stopping completion (finishes of later passes can be earlier
                # than ones already counted: the count is by time), until that time holds
                tau = sorted(done)[need - before - 1]
                while True:
                    if snap is not None:
                        load(snap)
                    else:  # no snapshot of this window: the step again, window by window
                        load(step_snap)
                        for h in windows:
                            window_to(h)
                    done = window_to(tau)
                    base = len(st["completed"]) - len(done)
                    if base + len(done) < need:
                        break
                    tau = sorted(done)[need - base - 1]  # earlier than before (all before tau): this ends
                # the events at tau: those before the stop (SimCore's order) refill, the rest not
                fleet.run_until(tau, inclusive=True)
                if take(need, before=tau, inclusive=True)[1]:
                    break
                # the stop did not come (a group reached a worker earlier than in the window): go on
                step_snap, windows = save(), []
            if keep:  # requests stay in their rows, paused
                fleet.pause(tau)
                t1 = tau
            else:  # every request aborted: sequences finishing in the step in progress finish
                carried = fleet.abort_all(tau)
                t1 = max([tau] + [float(f[1].max()) for f in fleet.finished])
            take(None, refilling=False)
        ready = sorted(ready + st["completed"])
        out, ready_carry = ready[:B], ready[B:]
        sids = (np.asarray(out, dtype=np.int64)[:, None] * n + np.arange(n)[None, :]).ravel()
        now = _train_and_push(profile, fleet, step, t0, t1, sids, made, "keep" if keep else "continue", rows,
                              trainer_tl, progress)
    fleet.close_timeline()
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
    # a window: until about `window_events` finishes per worker, never longer than the shortest
    # training step (so a batch that forms inside a window is trained after it: the update time
    # is known before workers reach it)
    per_window = max(1, round(window_events * fleet.W))
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
        k = int(new.sum())
        if k:
            serials, ps = next_groups(k)
            g_left[serials] = n
            fleet.add_groups(serials, ps, n, at=np.repeat(times, new) if times is not None else at)
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
        H = fleet.horizon(per_window)
        if H < math.inf:
            H = min(H, max(T + train_lb, fleet.next_event()))
        for fixed in (update_at, admit_at):
            if fixed is not None:
                H = min(H, fixed)
        if H == math.inf:
            raise RuntimeError(f"fast simulation stalled before step {step + 1}: nothing runs and no batch formed")
        H = max(H, T)
        while True:  # the window: workers to H, then the finishes in time order, until none is left before H
            fleet.run_until(H)
            sids_f, times = fleet.take_finished(H)
            if not len(sids_f):
                break
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
