"""APRIL: active partial rollouts at the token level, with nothing discarded.

Each step:

1. Carried-over work goes first: groups that completed after last step's target (already
   scored) are ready at once; aborted samples resume from their tokens (logprobs and versions
   kept) with their remaining budget; never-started samples of a carried group stay with it.
2. Fresh prompts keep ceil(alpha x target) groups' worth of samples (x n) unfinished in flight,
   so the engine's rows stay full: as samples finish, fresh groups take their rows, even while
   the groups those samples belong to wait for their slowest member.
3. A group completes when all n samples have finished; it is scored right then (in the engine
   thread, between decode steps) and, with dynamic sampling, kept only if its rewards differ.
4. When `target` groups are ready, every in-flight request of the step is aborted at once.
   Aborted samples go back to their groups in the carry buffer; groups that complete in the
   same engine step as the target are kept for the next step. No reward is ever computed for
   aborted work, so the stop never waits on a judge.

All bookkeeping runs in engine done-callbacks, which the engine calls between its steps, so
with TorchEngine the whole schedule is a deterministic function of the seeds: a run killed and
resumed from a checkpoint (the carry buffer is saved in it) continues identically.

Staleness: a carried sample whose oldest token lags the current policy by more than
`max_carry_steps` versions is handled by `on_stale`: `mask` (those tokens leave the loss),
`regenerate` (the sample restarts from scratch; its dropped tokens are reported as
`april/regenerated_tokens`) or `is` (kept; the loss's importance weights correct them).

Departures from the APRIL reference implementation (slime): resume is token-level (no
re-tokenisation); groups finishing just after the target are kept, not dropped; the carry
buffer is checkpointed; carried prefixes have an age limit; the response budget holds across
resumes; every token keeps its behaviour logprob and version.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter

from rollover.rollout.groups import PendingGroup, has_variance, sampling_from, score_groups, to_rollouts, trainable
from rollover.types import Completion, Group


class AprilCollector:
    def __init__(self, run):
        self.run = run
        self.cfg = run.cfg
        self.pcfg = run.cfg.partial_rollout
        self.alpha = self.pcfg.oversample
        self.buffer: list[PendingGroup] = []  # carried groups, oldest first
        self.ready_carry: list[Group] = []  # scored complete groups carried to the next step
        self.completion_rate: float | None = None  # EMA of completed / in-flight groups (adaptive alpha)
        self._lock = threading.RLock()

    # ------------------------------------------------------------ one step
    def collect(self, step: int) -> tuple[list[Group], dict]:
        run, cfg = self.run, self.cfg
        target = cfg.rollout.prompts_per_step
        version = run.engine.version
        sp = sampling_from(cfg)
        t_start = time.perf_counter()
        stats0 = run.engine.stats()
        m = Counter()
        n = cfg.rollout.samples_per_prompt
        st = _StepState(target=target, capacity=max(target, math.ceil(self.alpha * target)))
        st.max_started = cfg.algorithm.max_resample_rounds * st.capacity if cfg.algorithm.dynamic_sampling else None
        sample_budget = st.capacity * n  # unfinished samples kept in flight
        tokens_before: dict[str, int] = {}

        # carried complete groups are ready now (re-checked for staleness)
        for g in self.ready_carry:
            st.ready.append(g)
        self.ready_carry = []

        def submit(groups: list[PendingGroup]) -> None:
            reqs = []
            for g in groups:
                st.inflight[g.id] = g
                for j in range(g.n):
                    if j in g.done:
                        continue
                    req = g.request(j, sp, cfg.seed)
                    tokens_before[req.id] = len(req.response_ids)
                    st.pending_ids.add(req.id)
                    reqs.append(req)
            if reqs:
                run.engine.submit_many(reqs, on_done=on_done)

        def refill() -> None:
            # count unfinished samples, not groups: a group whose other samples are done holds
            # one row, and the rows it freed go to fresh groups at once
            want = math.ceil((sample_budget - len(st.pending_ids)) / n)
            if st.stopping or want <= 0:
                return
            if st.max_started is not None and st.started >= st.max_started:
                return
            fresh = run.next_groups(want, version=version)
            st.started += len(fresh)
            submit(fresh)

        def on_done(c: Completion) -> None:
            try:
                handle(c)
            except BaseException as e:  # a raising reward (on_error=raise) or a bug: stop the step loudly
                with self._lock:
                    if st.error is None:
                        st.error = e
                        st.stopping = True
                        run.engine.abort(sorted(st.pending_ids))
                    st.finished.set()

        def handle(c: Completion) -> None:
            with self._lock:
                gid, j = c.id.rsplit("/", 1)
                g = st.inflight[gid]
                j = int(j)
                st.pending_ids.discard(c.id)
                m["new_tokens"] += len(c.response_ids) - tokens_before[c.id]
                if c.finish == "abort":
                    if c.response_ids:
                        g.partial[j] = c
                else:
                    g.partial.pop(j, None)
                    g.done[j] = c
                    if g.complete:
                        del st.inflight[gid]
                        self._group_complete(g, st, m)
                        if len(st.ready) >= st.target and not st.stopping:
                            st.stopping = True
                            run.engine.abort(sorted(st.pending_ids))
                        refill()
                if not st.pending_ids and (st.stopping or not st.inflight):
                    st.finished.set()

        with self._lock:
            if len(st.ready) >= target:  # enough carried complete groups: nothing to generate
                st.stopping = True
                st.inflight = {g.id: g for g in self.buffer}
            else:
                carried = self._apply_staleness(self.buffer, version, m)
                submit(carried)
                refill()
            self.buffer = []
            if not st.pending_ids:
                st.finished.set()
        while not st.finished.wait(timeout=1.0):
            run.engine.stats()  # raises if the engine died
        if st.error is not None:
            raise st.error
        with self._lock:
            # everything still in flight goes back to the buffer, oldest first
            self.buffer = sorted(st.inflight.values(), key=lambda g: g.serial)
            ready = st.ready
        ready.sort(key=lambda g: int(g.id[1:]))  # deterministic: by draw order
        out, self.ready_carry = ready[:target], ready[target:]
        self._mask_stale(out, version)
        self._adapt(st)

        stats1 = run.engine.stats()
        wall = time.perf_counter() - t_start
        engine_tokens = stats1.generated_tokens - stats0.generated_tokens
        busy = stats1.busy_row_steps - stats0.busy_row_steps
        total = stats1.total_row_steps - stats0.total_row_steps
        samples = [r for g in out for r in g.rollouts]
        useful = sum(len(r.response_ids) for r in samples)
        offp = sum(v < version for r in samples for v in r.versions)
        ages = Counter(version - min(r.versions) if r.versions else 0 for r in samples)
        metrics = {
            "generate_s": wall - m["reward_s_x1e6"] / 1e6,
            "reward_s": m["reward_s_x1e6"] / 1e6,
            "generated_tokens": engine_tokens,
            "useful_tokens": useful,
            "useful_tokens_per_s": useful / max(wall, 1e-9),
            "occupancy": busy / total if total else 0.0,
            # tokens the engine produced that are in no sample we kept, carried or filtered: must be 0
            "discarded_tokens": engine_tokens - m["new_tokens"],
            "regenerated_tokens": m["regenerated_tokens"],
            "filtered_groups": m["filtered_groups"],
            "filtered_tokens": m["filtered_tokens"],
            "skipped_groups": m["skipped_groups"],
            "reward_errors": m["reward_errors"],
            "partial_fraction": sum(r.versions and min(r.versions) < version for r in samples) / max(len(samples), 1),
            "off_policy_token_ratio": offp / max(useful, 1),
            "carried_groups": len(self.buffer) + len(self.ready_carry),
            "carried_partial_samples": sum(len(g.partial) for g in self.buffer),
            "alpha": self.alpha,
            **{f"carry_age/{a}": n for a, n in sorted(ages.items())},
            **{k: v for k, v in m.items() if k.startswith("rewards/")},
        }
        return out, metrics

    def _group_complete(self, g: PendingGroup, st: "_StepState", m: Counter) -> None:
        """Score a completed group and decide whether it trains (engine thread)."""
        cfg = self.cfg
        group = to_rollouts(g, cfg, self.run.tokenizer)
        t0 = time.perf_counter()
        result = score_groups([group], self.run.rewards, cfg)
        m["reward_s_x1e6"] += int((time.perf_counter() - t0) * 1e6)
        for fn, count in result.error_counts.items():
            m[f"rewards/{fn}/errors"] += count
            m["reward_errors"] += count
        st.completed += 1
        if not trainable(group):
            m["skipped_groups"] += 1
        elif cfg.algorithm.dynamic_sampling and not has_variance(group):
            m["filtered_groups"] += 1
            m["filtered_tokens"] += sum(len(r.response_ids) for r in group.rollouts)
        else:
            st.ready.append(group)

    def _apply_staleness(self, groups: list[PendingGroup], version: int, m: Counter) -> list[PendingGroup]:
        """`regenerate`: restart carried samples whose oldest token is too old."""
        if self.pcfg.on_stale != "regenerate":
            return groups
        limit = self.pcfg.max_carry_steps
        for g in groups:
            for store in (g.partial, g.done):
                for j, c in list(store.items()):
                    if c.versions and version - min(c.versions) > limit:
                        m["regenerated_tokens"] += len(c.response_ids)
                        del store[j]
        return groups

    def _mask_stale(self, groups: list[Group], version: int) -> None:
        """`mask`: tokens older than max_carry_steps versions leave the loss."""
        if self.pcfg.on_stale != "mask":
            return
        limit = self.pcfg.max_carry_steps
        for g in groups:
            for r in g.rollouts:
                r.loss_mask = [m if version - v <= limit else 0 for m, v in zip(r.loss_mask, r.versions)]

    def _adapt(self, st: "_StepState") -> None:
        """Adaptive alpha: in-flight groups = target / (observed fraction completing per step)."""
        if not self.pcfg.adaptive:
            return
        rate = st.completed / max(st.capacity, 1)
        self.completion_rate = rate if self.completion_rate is None else 0.7 * self.completion_rate + 0.3 * rate
        want = 1.0 / max(self.completion_rate, 1e-3)
        self.alpha = min(self.pcfg.max_oversample, max(self.pcfg.min_oversample, want))

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        with self._lock:
            return {"buffer": list(self.buffer), "ready_carry": list(self.ready_carry), "alpha": self.alpha,
                    "completion_rate": self.completion_rate}

    def load_state_dict(self, state: dict) -> None:
        self.buffer = list(state["buffer"])
        self.ready_carry = list(state["ready_carry"])
        self.alpha = state["alpha"]
        self.completion_rate = state["completion_rate"]


class _StepState:
    def __init__(self, target: int, capacity: int):
        self.target = target
        self.capacity = capacity
        self.inflight: dict[str, PendingGroup] = {}
        self.pending_ids: set[str] = set()
        self.ready: list[Group] = []
        self.stopping = False
        self.started = 0
        self.completed = 0
        self.max_started: int | None = None
        self.finished = threading.Event()
        self.error: BaseException | None = None
