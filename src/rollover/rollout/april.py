"""APRIL: active partial rollouts at the token level, with nothing discarded.

Each step:

1. Carried-over work goes first: groups that completed after last step's target (already
   scored) are ready at once; aborted samples resume from their tokens (logprobs and versions
   kept) with their remaining budget; never-started samples of a carried group stay with it.
2. Fresh prompts keep ceil(alpha x target) groups' worth of samples (x n) unfinished in flight,
   so the engine's rows stay full: as samples finish, fresh groups take their rows, even while
   the groups those samples belong to wait for their slowest member.
3. A group completes when all n samples have finished; it is scored on a scoring thread while
   decoding goes on, trains on its samples that did not fail (skipped with fewer than two; a
   step that skips `capacity` groups draws no more prompts) and, with dynamic sampling, is
   kept only if its rewards differ. The stop decision at each completion counts the groups
   whose scores are in, all but the last `score_lag` completed ones: the engine thread waits
   for a score only when scoring falls further behind than that, so a slow judge overlaps with
   decoding, and which groups the decision sees is fixed by the order of completions, not by
   how fast the judge was. When nothing is left in flight every score is awaited before
   deciding.
4. When `target` groups are ready, every in-flight request of the step is aborted at once.
   Aborted samples go back to their groups in the carry buffer; groups that complete in the
   same engine step as the target are kept for the next step. No reward is ever computed for
   aborted work, so the stop never waits on a judge, nor on an environment: an episode whose
   environment call is still out at the stop is carried as it stands, and the call's answer
   lands whenever it comes (between steps the episode then waits in its next phase).

All bookkeeping runs in engine done-callbacks, which the engine calls between its steps, so
with TorchEngine the whole schedule is a deterministic function of the seeds: a run killed and
resumed from a checkpoint (the carry buffer is saved in it) continues identically. (Episodes
whose environments answer on their own thread make it timing-dependent; `env.inline` keeps it
deterministic.)

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

import logging
import math
import threading
from collections import deque
from dataclasses import replace
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
import time
from collections import Counter

from rollover.engine.cpu import openmp
from rollover.rollout.stops import Stalled, Watchdog, engine_progress
from rollover.rollout.core import SampleDriver, env_step_metrics
from rollover.rollout.groups import PendingGroup, keep_group, observe_groups, sampling_from, scored_groups
from rollover.types import Completion, Group
from rollover.rollout.inputs import RolloutInputs

log = logging.getLogger("rollover")


class AprilCollector:
    def __init__(self, inputs: RolloutInputs):
        self.inputs = inputs
        self.cfg = inputs.cfg
        self.pcfg = inputs.cfg.partial_rollout
        carry, why = inputs.cfg.april_carry
        self.keep_kv = carry == "keep_kv"
        log.info("APRIL carries unfinished samples by %s: %s", carry, why)
        # what the loop's weight update does to requests still in flight (keep_kv: they stay)
        self.inflight_mode = "keep" if self.keep_kv else "continue"
        self.alpha = self.pcfg.oversample
        self.buffer: list[PendingGroup] = []  # carried groups to resubmit, oldest first
        self.ready_carry: list[Group] = []  # scored complete groups carried to the next step
        self.inflight: dict[str, PendingGroup] = {}  # groups with samples live in the engine or environments
        self.completion_rate: float | None = None  # EMA of completed / in-flight groups (adaptive alpha)
        self.st: _StepState | None = None
        self._late = Counter()  # counters of completions that land between steps (reported with the next step)
        self._late_trajectories: list = []  # and their episodes
        self._lock = threading.RLock()
        self._engine_thread = threading.local()  # .active: inside the engine's done-callback
        self._sampling = sampling_from(inputs.cfg)
        self.driver = SampleDriver(inputs, self._lock, on_finished=self._finished, on_aborted=lambda g, j: None,
                                   on_error=self._fail, on_done_callback=self._on_done,
                                   on_settled=self._maybe_finish)
        self._late_error: BaseException | None = None  # a failure between steps, raised by the next step
        self.lag = min(self.pcfg.score_lag, inputs.cfg.rollout.prompts_per_step - 1)  # a step is never all carried
        self._scorer = ThreadPoolExecutor(1, thread_name_prefix="rollover-scoring") if self.lag > 0 else None

    @property
    def pending_ids(self) -> set[str]:
        """The requests live in the engine."""
        return set(self.driver.routes)

    # ------------------------------------------------------------ one step
    def collect(self, step: int) -> tuple[list[Group], dict]:
        run, cfg, driver = self.inputs, self.cfg, self.driver
        target = cfg.rollout.prompts_per_step
        version = run.engine.version
        t_start = time.perf_counter()
        stats0 = run.engine.stats()
        capacity = max(target, math.ceil(self.alpha * target))
        st = _StepState(target=target, capacity=capacity, version=version)
        st.max_started = cfg.algorithm.max_resample_rounds * capacity if cfg.algorithm.dynamic_sampling else None
        m = st.m
        if self._late_error is not None:
            e, self._late_error = self._late_error, None
            raise e
        if self.keep_kv and driver.routes:  # outside the lock: these wait on the engine thread
            # tokens generated between steps (an evaluation ran the engine) are not this step's
            for rid, n in run.engine.lengths().items():
                if rid in driver.seen:
                    driver.seen[rid] = n
            self._regenerate_live(version)
        with self._lock:
            tokens0, env_busy0 = driver.new_tokens, driver.env_busy_s
            self.st = st
            m.update(self._late)
            st.trajectories += self._late_trajectories
            self._late, self._late_trajectories = Counter(), []
            driver.hold = False
            st.ready.extend(self._fresh_enough(self.ready_carry, version, m))  # carried complete groups
            self.ready_carry = []
            if len(st.ready) >= target:  # enough already: generate nothing this step
                st.stopping = driver.hold = True
            else:
                self._submit(self._apply_staleness(self.buffer, version, m))
                self.buffer = []
                self._refill()
            if self.keep_kv and not st.stopping:
                run.engine.resume()
            if st.stopping or driver.idle:
                st.finished.set()
        dog = Watchdog("APRIL collector", f"{target} complete groups",
                       lambda: (engine_progress(run.engine), driver.events), cfg.rollout.stall_timeout_s,
                       describe=lambda: f"{len(st.ready)} ready, {len(driver.routes)} requests in the engine, "
                                        f"{driver.env_calls} environment calls")
        openmp.release()  # this thread waits while the engine's computes
        while not st.finished.wait(timeout=0.02 if driver.episodes else 1.0):
            if st.abort_pending:  # the step stopped off the engine thread: abort from here
                st.abort_pending = False
                driver.abort_all()
            dog.check()  # also raises if the engine died
        # a command waits for the engine's step boundary: every callback of the step has run
        live = run.engine.lengths() if self.keep_kv else run.engine.stats()
        with self._lock:
            self.st = None
            driver.hold = True
            if st.error is None:
                self._settle(st, 0)  # groups that completed after the stop: scored, carried as ready
            if st.error is not None:
                raise st.error
            if self.keep_kv:  # live requests stay in the (paused) engine; account their new tokens
                for rid, n in live.items():
                    if rid in driver.seen:
                        driver.new_tokens += n - driver.seen[rid]
                        driver.seen[rid] = n
            else:  # everything aborted is back in its group: carry the groups (and any not started), oldest first
                self.buffer = sorted([*self.inflight.values(), *self.buffer], key=lambda g: g.serial)
                self.inflight = {}
            m["new_tokens"] = driver.new_tokens - tokens0
            m["env_busy_s"] = driver.env_busy_s - env_busy0
            # under the lock: an environment call landing from now on may complete a carried group
            ready = sorted(st.ready, key=lambda g: g.serial)  # deterministic: by draw order
            out, self.ready_carry = ready[:target], ready[target:] + self.ready_carry
            snapshot = self._carried()
        out = self._mask_stale(out, version)
        self._adapt(st)
        return out, self._metrics(out, st, stats0, time.perf_counter() - t_start, snapshot)

    def _carried(self) -> dict:
        """What crosses into the next step (under the lock): groups with work done (samples
        finished or holding tokens, complete groups ready) and drawn groups nothing has started
        yet; samples holding tokens, and of them those live in the engine with their K/V
        (keep_kv), besides requests queued there that hold none."""
        live = {(id(ref.group), ref.j) for rid, ref in self.driver.routes.items() if self.driver.seen.get(rid, 0) > 0}
        carried = list(self.buffer) + list(self.inflight.values())
        holding = live | {(id(g), j) for g in carried for j in _partial_places(g)}
        started = [g for g in carried if g.done or any((id(g), j) in holding for j in range(g.n))]
        return {"carried_groups": len(started) + len(self.ready_carry),
                "carried_unstarted_groups": len(carried) - len(started),
                "carried_partial_samples": len(holding),
                "carried_live_samples": len(live),
                "carried_queued_samples": len(self.driver.routes) - len(live)}

    def _submit(self, groups: list[PendingGroup]) -> None:
        for g in groups:
            self.inflight[g.id] = g
        self.driver.start(groups, self._sampling, self.cfg.seed)

    def _refill(self) -> None:
        """Keep capacity x n requests unfinished in flight (n: a group's samples and ReMax's greedy
        answer): rows freed by finished samples go to fresh groups at once, even while their own groups wait for their slowest member. A step
        that has skipped `capacity` groups (too few samples left after failures) draws no more:
        it ends with what is ready, and with nothing ready the loop counts an empty collection
        (a broken environment stops the run instead of drawing prompts for ever)."""
        st, n = self.st, self.cfg.requests_per_group
        if st is None or st.stopping:
            return
        unfinished = sum(g.n - len(g.done) for g in self.inflight.values())
        want = math.ceil((st.capacity * n - unfinished) / n)
        if want <= 0 or (st.max_started is not None and st.started >= st.max_started):
            return
        if st.m["skipped_groups"] >= st.capacity:
            return
        fresh = self.inputs.next_groups(want, version=st.version)
        st.started += len(fresh)
        self._submit(fresh)

    def _on_done(self, c: Completion) -> None:
        """The engine's done-callback (engine thread, between decode steps)."""
        outer, self._engine_thread.active = getattr(self._engine_thread, "active", False), True
        try:
            with self._lock:
                self.driver.completed(c)
                self._maybe_finish()
        except BaseException as e:  # a raising reward (on_error=raise) or a bug: stop the step loudly
            self._fail(e)
        finally:
            self._engine_thread.active = outer

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            st = self.st
            if st is None:  # between steps (a carried request finished during an evaluation)
                self._late_error = self._late_error or e
            elif st.error is None:
                st.error = e
                self._stop(st)
                st.finished.set()

    def _stop(self, st: "_StepState") -> None:
        """The step has what it needs: nothing new starts; live requests are aborted (their
        tokens go back to their samples) or, with keep_kv, paused in the engine."""
        st.stopping = True
        self.driver.hold = True
        if self.keep_kv:
            self.inputs.engine.pause()  # live requests keep their rows and K/V
            st.finished.set()
        elif self.driver.routes:
            on_engine = getattr(self.inputs.engine, "on_engine_thread", lambda: False)()
            if getattr(self._engine_thread, "active", False) or on_engine:  # between decode steps: at once
                self.inputs.engine.abort(sorted(self.driver.routes))
            else:  # an engine command waits for the engine thread, which may want this lock
                st.abort_pending = True

    def _finished(self, g: PendingGroup, j: int) -> None:
        """Sample j of g is done (under the lock): its row goes to fresh work at once; a complete
        group goes to scoring and, once its score is in, joins the step."""
        if not g.complete:
            self._refill()
            return
        if self.inflight.pop(g.id, None) is None:  # finished after its step was carried
            self.buffer = [b for b in self.buffer if b is not g]
        st = self.st
        if st is None or self._scorer is None:  # between steps, or score_lag 0: score here and now
            t0 = time.perf_counter()
            result = self._score(g)
            if st is not None:
                st.m["score_wait_s"] += time.perf_counter() - t0  # decoding waited for it
            self._count(st, result)
        else:
            st.scoring.append((g.id, self._scorer.submit(self._score, g)))
            self._settle(st, self.lag)
        self._check_target(st)
        self._refill()
        self._maybe_finish()

    def _score(self, g: PendingGroup) -> tuple:
        """Score a complete group (on the scoring thread): (the pending group, the scored group,
        whether it trains, its counters)."""
        m = Counter()
        t0 = time.perf_counter()
        group = scored_groups([g], self.inputs, m)[0]
        keep = keep_group(group, self.cfg, m, primary=self.inputs.primary_reward)
        m["reward_s"] = time.perf_counter() - t0  # the whole scoring time
        return g, group, keep, m

    def _settle(self, st: "_StepState", lag: int) -> None:
        """Take in the scores of all but the last `lag` completed groups, oldest first (waiting
        for them if they are not in yet)."""
        while len(st.scoring) > lag:
            gid, future = st.scoring.popleft()
            t0 = time.perf_counter()
            timeout = self.cfg.rollout.stall_timeout_s
            try:
                result = future.result(timeout=timeout)  # a reward that raised (on_error=raise) raises here
            except FuturesTimeout:
                raise Stalled(f"APRIL collector waited {timeout:g} s for the score of group {gid} and nothing moved; "
                              f"stopped by the stall timeout of {timeout:g} s (rollout.stall_timeout_s)") from None
            st.m["score_wait_s"] += time.perf_counter() - t0
            self._count(st, result)

    def _count(self, st: "_StepState | None", result) -> None:
        """Take in a group's score (under the lock, at a point fixed by the order of events)."""
        pg, group, keep, m = result
        observe_groups(self.inputs, [pg], [group])
        if st is None:  # completed between steps (an environment call landed, or during an evaluation)
            self._late.update(m)  # counted with the next step
            if pg.episodes is not None:
                self._late_trajectories += [pg.done[j] for j in range(pg.n)]
            if keep:
                self.ready_carry.append(group)
            return
        st.m.update(m)
        st.completed += 1
        if pg.episodes is not None:
            st.trajectories += [pg.done[j] for j in range(pg.n)]
        if keep:
            st.ready.append(group)

    def _check_target(self, st: "_StepState | None") -> None:
        if st is not None and len(st.ready) >= st.target and not st.stopping:
            self._stop(st)

    def _maybe_finish(self) -> None:
        st = self.st
        if st is None:
            return
        if not st.stopping:
            if not self.driver.idle:
                return
            if st.scoring:  # nothing in flight: every score decides what comes next
                self._settle(st, 0)
                self._check_target(st)
                self._refill()
            if not st.stopping:
                if self.driver.idle and not self.inflight:
                    st.finished.set()
                return
        if not self.driver.routes:  # the aborted requests are back; environment calls still out land when they do
            st.finished.set()

    def _regenerate_live(self, version: int) -> None:
        """keep_kv + regenerate: a live group that may hold tokens older than max_carry_steps
        (its start version is that old) has its live requests aborted and goes through the
        resubmit path, where `_apply_staleness` restarts the stale samples."""
        if self.pcfg.on_stale != "regenerate":
            return
        old = [g for g in self.inflight.values() if version - g.start_version > self.pcfg.max_carry_steps]
        ids = self.driver.live_ids(old)
        if ids:
            self.inputs.engine.abort(ids)  # callbacks put the partials back into their groups
        with self._lock:
            for g in old:
                del self.inflight[g.id]
            self.buffer = sorted(old, key=lambda g: g.serial) + self.buffer

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

    def _fresh_enough(self, ready: list[Group], version: int, m: Counter) -> list[Group]:
        """`regenerate`: a carried complete group holding a token older than max_carry_steps
        versions starts again from its prompt (its tokens reported as regenerated); the
        others are ready."""
        if self.pcfg.on_stale != "regenerate":
            return ready
        limit, out = self.pcfg.max_carry_steps, []
        for g in ready:
            if any(version - v > limit for r in g.rollouts for v in r.versions if v >= 0):
                m["regenerated_tokens"] += sum(len(r.response_ids) for r in g.rollouts) + \
                    (len(g.greedy.response_ids) if g.greedy is not None else 0)
                greedy = g.greedy is not None
                self.buffer.append(PendingGroup(id=g.id, prompt=g.prompt, prompt_ids=list(g.prompt_ids), serial=g.serial,
                                                n=len(g.rollouts) + g.dropped + greedy, start_version=version,
                                                media=g.rollouts[0].media if g.rollouts else None, greedy_first=greedy))
            else:
                out.append(g)
        self.buffer.sort(key=lambda g: g.serial)
        return out

    def _mask_stale(self, groups: list[Group], version: int) -> list[Group]:
        """`mask`: tokens older than max_carry_steps versions leave the loss (new rollouts)."""
        if self.pcfg.on_stale != "mask":
            return groups
        limit = self.pcfg.max_carry_steps
        return [replace(g, rollouts=[replace(r, loss_mask=[m if version - v <= limit else 0
                                                           for m, v in zip(r.loss_mask, r.versions)])
                                     for r in g.rollouts]) for g in groups]

    def _adapt(self, st: "_StepState") -> None:
        """Adaptive alpha: in-flight groups = target / (observed fraction completing per step)."""
        if not self.pcfg.adaptive:
            return
        rate = st.completed / max(st.capacity, 1)
        self.completion_rate = rate if self.completion_rate is None else 0.7 * self.completion_rate + 0.3 * rate
        want = 1.0 / max(self.completion_rate, 1e-3)
        self.alpha = min(self.pcfg.max_oversample, max(self.pcfg.min_oversample, want))

    def _metrics(self, out: list[Group], st: "_StepState", stats0, wall: float, carry: dict) -> dict:
        m, version = st.m, st.version
        stats1 = self.inputs.engine.stats()
        engine_tokens = stats1.generated_tokens - stats0.generated_tokens
        busy = stats1.busy_row_steps - stats0.busy_row_steps
        total = stats1.total_row_steps - stats0.total_row_steps
        samples = [r for g in out for r in g.rollouts]
        sampled = [[v for v in r.versions if v >= 0] for r in samples]  # episodes' inserted tokens carry -1
        useful = sum(v >= 0 and on for r in samples for v, on in zip(r.versions, r.loss_mask))  # tokens that train
        offp = sum(v < version for vs in sampled for v in vs)
        ages = Counter(version - min(vs) if vs else 0 for vs in sampled)
        return {
            "generate_s": wall - m["score_wait_s"],
            "reward_s": m["reward_s"],  # scoring time, overlapped with decoding (score_lag > 0)
            "generated_tokens": engine_tokens,
            "useful_tokens": useful,
            "useful_tokens_per_s": useful / max(wall, 1e-9),
            "occupancy": busy / total if total else 0.0,
            # tokens the engine produced that are in no sample we kept, carried or filtered: must be 0
            "discarded_tokens": engine_tokens - m["new_tokens"],
            "regenerated_tokens": m["regenerated_tokens"],
            "carry_keep_kv": int(self.keep_kv),  # which carry mode ran (auto resolves it; the log says why)
            "filtered_groups": m["filtered_groups"],
            "filtered_tokens": m["filtered_tokens"],
            "skipped_groups": m["skipped_groups"],
            "dropped_samples": m["dropped_samples"],
            "reward_errors": m["reward_errors"],
            "partial_fraction": sum(bool(vs) and min(vs) < version for vs in sampled) / max(len(samples), 1),
            "off_policy_token_ratio": offp / max(sum(map(len, sampled)), 1),
            **carry,  # carried_groups, carried_unstarted_groups, carried_{partial,live,queued}_samples
            "alpha": self.alpha,
            **{f"carry_age/{a}": n for a, n in sorted(ages.items())},
            **{k: v for k, v in m.items() if k.startswith("rewards/")},
            **env_step_metrics(self.inputs, st.trajectories, m["env_busy_s"], wall),
        }

    def close(self) -> None:
        """Stop the scoring thread (scores still queued are dropped: the run is ending)."""
        if self._scorer is not None:
            self._scorer.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ checkpoint
    def set_aside(self) -> None:
        """Live requests (keep_kv) leave the engine, their tokens back in their groups' samples,
        which go on next step from them with K/V recomputed. Before a checkpoint; and before an
        evaluation, which resumes the engine and would run them to their end under the new
        weights, completing groups between steps that the next steps then train on instead of
        generating."""
        self.driver.abort_all()
        self._land_env_calls()
        with self._lock:
            self.buffer = sorted(self.inflight.values(), key=lambda g: g.serial) + self.buffer
            self.inflight = {}

    def state_dict(self) -> dict:
        """The carry buffer, live requests set aside into it first (`set_aside`): they resume
        next step from their tokens, with K/V recomputed, in a straight run and in one resumed
        from this checkpoint alike. Episodes are saved with their tokens and action log (their
        environments are rebuilt by replay when they go on)."""
        self.set_aside()
        with self._lock:
            return {"buffer": list(self.buffer), "ready_carry": list(self.ready_carry), "alpha": self.alpha,
                    "completion_rate": self.completion_rate}

    def _land_env_calls(self) -> None:
        """Wait for the environment calls a step left out (it does not wait for them) to land,
        so a checkpoint holds episodes that nothing changes while they are written."""
        dog = Watchdog("APRIL collector", "the environment calls out to land before a checkpoint",
                       lambda: (self.driver.env_calls, self.driver.events), self.cfg.rollout.stall_timeout_s,
                       describe=lambda: f"{self.driver.env_calls} environment calls out")
        while True:
            with self._lock:
                if not self.driver.env_calls:
                    return
            time.sleep(0.005)
            dog.check()

    def load_state_dict(self, state: dict) -> None:
        self.buffer = list(state["buffer"])
        self.ready_carry = list(state["ready_carry"])
        self.alpha = state["alpha"]
        self.completion_rate = state["completion_rate"]


class _StepState:
    def __init__(self, target: int, capacity: int, version: int):
        self.target = target
        self.capacity = capacity
        self.version = version
        self.m = Counter()
        self.ready: list[Group] = []
        self.stopping = False
        self.started = 0
        self.completed = 0
        self.max_started: int | None = None
        self.trajectories: list = []  # episodes completed this step (multi-turn)
        self.scoring: deque = deque()  # (group id, future of its score), in completion order
        self.finished = threading.Event()
        self.abort_pending = False  # the collector thread is to abort the live requests
        self.error: BaseException | None = None


def _partial_places(g: PendingGroup) -> list[int]:
    """The places of g's samples holding the tokens of an aborted request."""
    if g.episodes is not None:
        return [j for j, ep in g.episodes.items() if ep.partial is not None]
    return list(g.partial)
