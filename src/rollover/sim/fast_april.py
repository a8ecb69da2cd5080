"""APRIL on the fast path (`rollover.sim.fast`): the collector's refills, its stop at B ready
groups, the abort with tokens carried (`resubmit`) or the pause in place (`keep_kv`), in windows of
simulated time, the window of the stop run again up to it (the module docstring of
`rollover.sim.fast` says how)."""

from __future__ import annotations

import math

import numpy as np

from rollover.sim.fast_parts import _completions, _Groups, _train_and_push
from rollover.sim.fleet import Fleet


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
    lag = min(pr.score_lag, B - 1)
    keep = cfg.april_carry[0] == "keep_kv"
    collector = _AprilCollector(fleet, next_groups, max(B, math.ceil(pr.oversample * B)), n,
                                max(1, round(window_events * fleet.W)))
    ready_carry: list[int] = []
    carried = np.zeros(0, dtype=np.int64)  # resubmit: the aborted samples, resubmitted first next step
    rows, trainer_tl = [], []
    now = 0.0
    for step in range(cfg.steps):
        t0, made = now, int(fleet.row_steps.sum())
        ready = sorted(ready_carry)
        ready_carry, collector.completed = [], []
        t1 = now
        if len(ready) < B:  # else: enough carried, nothing generated this step
            if len(carried):
                fleet.add_requests(np.sort(carried), now)
                carried = carried[:0]
            if keep:
                fleet.resume(now)
            collector.refill(np.array([now]), np.zeros(1, dtype=np.int64))
            tau = collector.run_to_stop(step, need=B - len(ready) + lag)  # completions that stop the step
            if keep:  # requests stay in their rows, paused
                fleet.pause(tau)
                t1 = tau
            else:  # every request aborted: sequences finishing in the step in progress finish
                carried = fleet.abort_all(tau)
                t1 = max([tau] + [float(f[1].max()) for f in fleet.finished])
            collector.take(None, refilling=False)
        ready = sorted(ready + collector.completed)
        out, ready_carry = ready[:B], ready[B:]
        sids = (np.asarray(out, dtype=np.int64)[:, None] * n + np.arange(n)[None, :]).ravel()
        now = _train_and_push(profile, fleet, step, t0, t1, sids, made, "keep" if keep else "continue", rows,
                              trainer_tl, progress)
    fleet.close_timeline()
    return rows, trainer_tl


class _AprilCollector:
    """APRIL's generation on the fleet: the groups in flight, refills as samples finish, the
    step's group completions, and the windows up to the completion that stops the step."""

    def __init__(self, fleet: Fleet, next_groups, capacity: int, n: int, per_window: int):
        self.fleet, self.next_groups = fleet, next_groups
        self.capacity, self.n, self.per_window = capacity, n, per_window
        self.groups = _Groups()
        self.unfinished = 0  # samples of groups in flight not finished
        self.completed: list[int] = []  # this step's group completions, in order
        self.inflight: set[int] = set()

    def refill(self, times: np.ndarray, f: np.ndarray) -> None:
        """After each event (f: samples finished up to it): fresh groups until capacity x n
        samples are unfinished in flight."""
        n = self.n
        want = np.maximum.accumulate(np.maximum(-(-(self.capacity * n - self.unfinished + f) // n), 0))
        new = np.diff(np.concatenate([[0], want]))
        total = int(new.sum())
        if total:
            serials, ps = self.next_groups(total)
            self.groups.add(serials, n)
            self.inflight.update(serials)
            self.fleet.add_groups(serials, ps, n, at=np.repeat(times, new))
            self.unfinished += n * total

    def take(self, need: int | None = None, refilling: bool = True, before: float = math.inf,
             inclusive: bool = False) -> tuple[list[float], bool, int]:
        """Process the finishes so far (before `before`) in time order, refilling after each;
        the times of the group completions among them, whether one stopped the step (with
        `need`, the completions that stop it: refilling stops at that event), how many."""
        sids, times = self.fleet.take_finished(before, inclusive)
        if not len(sids):
            return [], False, 0
        g = self.fleet.s_group[sids]
        until, stopped = len(sids), False
        if need is not None:
            hit = np.nonzero(len(self.completed) + np.cumsum(_completions(self.groups.left, g)) >= need)[0]
            if len(hit):
                until, stopped = int(hit[0]), True
        complete = self.groups.finish(g, times).astype(bool)
        if refilling and until:
            self.refill(times[:until], np.arange(1, until + 1))
        self.unfinished -= len(sids)
        for gg in g[complete].tolist():
            self.inflight.discard(gg)
            self.completed.append(gg)
        return times[complete].tolist(), stopped, len(sids)

    def window_to(self, H: float) -> list[float]:
        """Every event before H (finishes processed as they come, refills included); the
        completion times."""
        done = []
        while True:
            self.fleet.run_until(H)
            more, _, k = self.take(before=H)
            if not k:
                return done
            done += more

    def run_to_stop(self, step: int, need: int) -> float:
        """Windows until the step's `need`-th group completion, which stops it: the events at
        its time before the stop (SimCore's order) are processed and refill, the rest wait.
        The stop's time."""
        step_snap, windows = self.save(), []  # the state at the step's start, the windows run since
        most = 1  # the most completions one window has had
        while True:
            H = self.fleet.horizon(self.per_window)
            if H == math.inf:
                raise RuntimeError(f"fast simulation stalled in step {step + 1}: nothing runs and "
                                   f"{len(self.completed)}/{need} completions are in")
            before = len(self.completed)
            snap = self.save() if before + 2 * most >= need else None  # the stop may come in this window
            done = self.window_to(H)
            most = max(most, len(done))
            if before + len(done) < need:
                windows.append(H)
                continue
            tau = self._stop_time(need, sorted(done)[need - before - 1], snap, step_snap, windows)
            self.fleet.run_until(tau, inclusive=True)
            if self.take(need, before=tau, inclusive=True)[1]:
                return tau
            # the stop did not come (a group reached a worker earlier than in the window): go on
            step_snap, windows = self.save(), []

    def _stop_time(self, need: int, tau: float, snap, step_snap, windows: list[float]) -> float:
        """The window in which the step stops, run again from its start (`snap`; without one,
        the step again from `step_snap` through `windows`) up to the time of the stopping
        completion, `tau` at first; finishes of later passes can be earlier than ones already
        counted (the count is by time), so until that time holds. Left at the window's state
        just before `tau`."""
        while True:
            if snap is not None:
                self.load(snap)
            else:  # no snapshot of this window: the step again, window by window
                self.load(step_snap)
                for h in windows:
                    self.window_to(h)
            done = self.window_to(tau)
            base = len(self.completed) - len(done)
            if base + len(done) < need:
                return tau
            tau = sorted(done)[need - base - 1]  # earlier than before (all before tau): this ends

    def save(self) -> tuple:
        lo = min(self.inflight) if self.inflight else self.next_groups.serial
        hi = self.next_groups.serial
        return (self.fleet.snapshot(), self.next_groups.snapshot(), self.unfinished, len(self.completed),
                set(self.inflight), lo, self.groups.left[lo:hi].copy(), self.groups.done[lo:hi].copy())

    def load(self, snap: tuple) -> None:
        self.fleet.restore(snap[0])
        self.next_groups.restore(snap[1])
        self.unfinished = snap[2]
        del self.completed[snap[3]:]
        self.inflight.clear()
        self.inflight.update(snap[4])
        lo = snap[5]
        self.groups.left[lo:lo + len(snap[6])] = snap[6]
        self.groups.done[lo:lo + len(snap[7])] = snap[7]
