"""The fast path's inputs as arrays over workers and samples (`rollover.sim.fleet`): response
lengths drawn by a vectorised hash (or the schedulers' path's own draws, for comparisons) and
each pool's step costs evaluated for many workers at once."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rollover.sim.config import SimRunConfig
from rollover.sim.costs import DecodeCost


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

    def __init__(self, cfg: SimRunConfig, kind: str = "vector"):
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


class Costs:
    """Step and prefill seconds of many workers, each by its pool's DecodeCost."""

    def __init__(self, costs: list[DecodeCost], pool_of: np.ndarray):
        self.single = len(set(costs)) == 1
        self.pools = [_Cost(c, None if self.single else pool_of == i) for i, c in enumerate(costs)]
        self.pool_of = pool_of
        self.per_ctx = np.array([c.per_context_token_s for c in costs])[pool_of]
        self.mixed_saves = np.array([c.mixed_saves_s for c in costs])[pool_of]
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
