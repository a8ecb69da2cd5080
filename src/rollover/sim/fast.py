"""The simulator's fast path (`simulate.fast: true`): the same cluster, vectorised over workers.

The schedulers' path runs rollover's own schedulers, so every sample is a request with its
future, its routing decision and its completion: about 200 us of Python each, half an hour for
1,024 workers and 1,000 steps. This path models the same policies on arrays instead:

- **Workers** are rows of numpy arrays (a slot's sample, the worker step it entered at and the
  one it finishes at). Every worker moves from event to event as `SimCore` does (admission at a
  step boundary with one prefill per prompt and the same prefill budget, closed-form segments
  between finishes, a pure or mixed prefill step, a command taking effect at the first
  boundary at or after its time, a K/V-cache capacity with the newest sequences preempted to
  the queue's front and recomputed on readmission), all workers in lockstep: one numpy pass applies each
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
workers (APRIL on 256 workers or more: half; `WINDOW_EVENTS`) have reached their next finish
(counted in events, not seconds: a window's length follows the finish rate as it changes, at a
step's start and in its tail); the finishes of a window are processed in time order, and a
group admitted at a finish reaches its worker at that time unless the worker already ran past
it inside the window (then at its current
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

import numpy as np

from rollover.config import ConfigError
from rollover.sim.config import SimRunConfig
from rollover.sim.costs import Profile
from rollover.sim.fleet import Fleet
from rollover.sim.vector import Draws
from rollover.sim.fast_april import _april
from rollover.sim.fast_parts import _row, _train_and_push, _train_tokens

# finishes per worker in a window of async and APRIL runs: smaller is closer to the schedulers'
# path and slower. At 1,024 workers (examples/sim_1024.yaml, 12 steps, the schedulers' draws),
# APRIL's samples/s against the schedulers' path: -0.005% at 0.05, -0.07% at 0.25, -0.25% at
# 0.5, -4.5% at 1. (Windows measured in seconds, from the last window's finish rate, gave -1.9%
# at 0.25: a window that began in a sparse stretch ran long into the next burst.) Async keeps
# 0.25 (there the same draws give the schedulers' schedule exactly at 1,024 workers, in under a
# minute); APRIL takes 0.5 on clusters of LARGE_CLUSTER workers or more: fewer windows, less wall
# time for a quarter of a percent there. On a few workers 0.5 is a window of one or two finishes
# more than 0.25, and step times move by up to 3% (tests/test_sim_fast.py's 4-16 workers); the
# speed matters only at scale.
WINDOW_EVENTS = {"async": 0.25, "april": 0.25, "april_large": 0.5}
LARGE_CLUSTER = 256


def check(cfg: SimRunConfig) -> None:
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
    if cfg.algorithm.advantage == "remax":
        why.append("ReMax's greedy request per group (algorithm.advantage=remax)")
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


# ---------------------------------------------------------------------------- the drivers
def simulate_fast(cfg: SimRunConfig, profile: Profile, progress=None, draws: str = "vector",
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
        window_events = WINDOW_EVENTS["async" if cfg.mode == "async" else
                                      "april_large" if workers >= LARGE_CLUSTER else "april"]
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


def _async(cfg, profile, fleet: Fleet, next_groups, progress, window_events):
    """The async loop (rollover.sim.run._async with RolloutService, DataManager and
    StalenessGate) on the fleet; see the module docstring."""
    r = cfg.rollout
    B, n, eta, steps = r.prompts_per_step, r.samples_per_prompt, cfg.async_.max_staleness, cfg.steps
    sync_s = profile.sync.seconds(fleet.W)
    train_lb = profile.train.seconds(B * n * (fleet.prompt_tokens + 1))
    if train_lb <= 0:
        raise ConfigError("simulate.fast in async mode needs a training step that takes time "
                          "(simulate.train.step_s or per_token_s > 0)")
    # a window: until about `window_events` finishes per worker, never longer than the shortest
    # training step (so a batch that forms inside a window is trained after it: the update time
    # is known before workers reach it)
    per_window = max(1, round(window_events * fleet.W))
    service = _AsyncService(fleet, next_groups, B, n, eta, steps)
    service.admit_now(0.0)
    rows, trainer_tl = [], []
    T, t_free, step = 0.0, 0.0, 0
    update_at = admit_at = None
    while step < steps:
        if update_at is None and service.formed > step:  # batch `step` formed: its update time is known
            sids = np.nonzero((fleet.s_group[: fleet.n_samples] // B) == step)[0]
            t0 = max(t_free, service.batch_time[step])
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
        service.window_to(H)
        T = H
        if update_at is not None and T >= update_at:
            t0, train_s, sids = pending
            version = fleet.version
            if len(sids) and int((version - fleet.s_v0[sids]).max()) > eta:
                raise AssertionError(f"fast simulation: staleness above max_staleness={eta} at version {version}")
            fleet.stall(update_at, sync_s, step + 1, r.inflight_weight_update)
            t_wait, t_free = t_free, update_at + sync_s
            trainer_tl += [[t0, t0 + train_s, "train"], [t0 + train_s, t_free, "sync"]]
            rows.append(_row(step, t_wait, t0, t_free, sids, fleet, version, train_s, sync_s, B))
            if progress:
                progress(rows[-1])
            step += 1
            update_at, admit_at = None, t_free
        elif admit_at is not None and T >= admit_at:
            service.admit_now(T)
            admit_at = None
    fleet.cut(np.arange(fleet.W), t_free)  # the run ends: what is in flight is aborted at its boundary
    fleet.close_timeline()
    return rows, trainer_tl


class _AsyncService:
    """Async mode's rollout service and data manager on the fleet: groups admitted within the
    staleness gate as rows and the batch ask, their completions, and the batches they form in
    start order (batch k: groups k x B to (k + 1) x B - 1) with the time each formed."""

    def __init__(self, fleet: Fleet, next_groups, B: int, n: int, eta: int, steps: int):
        self.fleet, self.next_groups = fleet, next_groups
        self.B, self.n, self.eta, self.steps = B, n, eta, steps
        self.R = int(fleet.max_rows.sum())
        self.g_left = np.zeros(steps * B, dtype=np.int64)  # per group: samples not finished
        self.g_done = np.full(steps * B, np.nan)  # per group: its last finish
        self.live = 0  # groups admitted
        self.inflight = 0  # groups admitted, not complete
        self.running = 0  # samples admitted, not finished
        self.formed = 0  # batches formed
        self.batch_time: list[float] = []

    def admit(self, at: float, f: np.ndarray, cg: np.ndarray, times: np.ndarray | None) -> None:
        """The service's admissions at each event: fill to the level the rows and the batch ask
        for, within the gate (see the module docstring); f, cg: samples and groups finished up
        to each event."""
        B, n = self.B, self.n
        cap = min((self.fleet.version + self.eta + 1) * B, self.steps * B)
        level = self.live + np.maximum(B - self.inflight + cg, -(-(self.R - self.running + f) // n))
        level = np.maximum.accumulate(np.minimum(level, cap))
        new = np.diff(np.concatenate([[self.live], np.maximum(level, self.live)]))
        k = int(new.sum())
        if k:
            serials, ps = self.next_groups(k)
            self.g_left[serials] = n
            self.fleet.add_groups(serials, ps, n, at=np.repeat(times, new) if times is not None else at)
            self.live += k
            self.inflight += k
            self.running += n * k

    def admit_now(self, at: float) -> None:
        """Admissions at `at` with nothing finished (the start, a weight update)."""
        self.admit(at, np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), None)

    def window_to(self, H: float) -> None:
        """The window: workers to H, then the finishes in time order (admitting at each), until
        none is left before H; batches whose groups all completed are formed."""
        fleet, B = self.fleet, self.B
        while True:
            fleet.run_until(H)
            sids_f, times = fleet.take_finished(H)
            if not len(sids_f):
                return
            groups = fleet.s_group[sids_f]
            np.subtract.at(self.g_left, groups, 1)
            np.fmax.at(self.g_done, groups, times)
            complete = np.zeros(len(sids_f), dtype=np.int64)
            last = self.g_left[groups] == 0
            # a group completes at the event of its last sample (each group counted once)
            _, first_idx = np.unique(groups[::-1], return_index=True)
            mark = np.zeros(len(sids_f), dtype=bool)
            mark[len(sids_f) - 1 - first_idx] = True
            complete[last & mark] = 1
            cg = np.cumsum(complete)
            self.admit(H, np.arange(1, len(sids_f) + 1), cg, times)  # counted from the state before these events
            self.running -= len(sids_f)
            self.inflight -= int(cg[-1])
            while (self.formed < self.steps and self.live >= (self.formed + 1) * B
                   and not self.g_left[self.formed * B:(self.formed + 1) * B].any()):
                self.batch_time.append(float(self.g_done[self.formed * B:(self.formed + 1) * B].max()))
                self.formed += 1


def _summary(cfg: SimRunConfig, profile: Profile, fleet: Fleet, rows: list[dict], trainer_tl: list) -> dict:
    from rollover.sim.run import report

    fleet.close_timeline()
    generated = int(fleet.row_steps.sum())
    total_rows = int((fleet.max_rows * fleet.wstep).sum())
    return report(cfg, profile, rows, trainer_tl, pools=[fleet.pool_names[i] for i in fleet.pool_of],
                  busy_s=fleet.busy_s.tolist(), stall_s=fleet.stall_s.tolist(), generated=generated,
                  occupancy=generated / total_rows if total_rows else 0.0,
                  timelines=fleet.timeline if fleet.timeline is not None else [],
                  extra={"preempted": int(fleet.preempted[0])} if fleet.has_kv else None,
                  mode=f" [fast path, {'numba' if fleet.compiled else 'python'} router]")
