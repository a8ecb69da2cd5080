"""`rollover simulate`: rollover's own schedulers on a simulated cluster.

The synchronous collector, the APRIL collector, and the async rollout service, data manager
and staleness gate are the objects that train models; here they drive a `SimEngine` (rollout
workers on a virtual clock) and a simulated trainer whose step and weight-dissemination times
come from the profile's cost models. Only the trainer's timing is the simulation's own:

    sync / APRIL:  collect (engine time) -> train (TrainCost) -> push weights (SyncCost), in turn
    async:         the rollout service runs on; the trainer takes each batch when it has formed
                   and the previous step is done, trains (the engine runs meanwhile, up to the
                   time the training ends), then the weights reach every worker (SyncCost:
                   workers stall) and the gate opens for the next version.

The data manager scores groups the moment they finish (on the engine thread: scoring takes no
simulated time). Everything is deterministic: the same config gives the same numbers.
"""

from __future__ import annotations

import gc
import queue
from collections import Counter
from contextlib import contextmanager
from dataclasses import replace

from typing import TYPE_CHECKING

from rollover.config import ConfigError
from rollover.rollout.inputs import RolloutInputs
from rollover.sim.config import SimRunConfig
from rollover.sim.costs import Profile, RewardCost, RewardPool
from rollover.sim.workload import LengthModel, SimRewards, SimTokenizer, make_prompts

if TYPE_CHECKING:  # the schedulers' path imports these where it builds its run (the fast path needs none)
    from rollover.sim.engine import SimEngine


def profile_of(cfg: SimRunConfig) -> Profile:
    """The profile file (or the built-in defaults) with the config's cost overrides on top."""
    s = cfg.simulate
    base = Profile.load(s.profile) if s.profile else Profile(name="defaults")
    return replace(base, decode=replace(base.decode, **s.decode), train=replace(base.train, **s.train),
                   sync=replace(base.sync, **s.sync), contention=replace(base.contention, **s.contention))


def length_model(cfg: SimRunConfig) -> LengthModel:
    try:
        return LengthModel(**{k: tuple(v) if k == "values" else v for k, v in cfg.simulate.lengths.items()})
    except TypeError as e:
        raise ConfigError(f"simulate.lengths: {e}") from None
    except ValueError as e:
        raise ConfigError(f"simulate.{e}") from None


def build_engine(cfg: SimRunConfig, profile: Profile) -> SimEngine:
    from rollover.sim.core import SimCore, SimWorker
    from rollover.sim.engine import SimEngine

    s, r = cfg.simulate, cfg.rollout
    lengths = length_model(cfg)
    workers = []
    for pool in s.pools:
        cost = replace(profile.decode, **pool.decode)
        for _ in range(pool.workers):
            workers.append(SimWorker(len(workers), cost, pool.max_rows, pool=pool.name, kv_tokens=pool.kv_tokens,
                                     admit_batch=pool.admit_batch))
    slack = r.samples_per_prompt * r.max_new_tokens
    longest = cfg.env.max_total_tokens if s.env.enabled else s.prompt_tokens + r.max_new_tokens
    core = SimCore(workers, lengths, max_len=longest + 1, slack=slack)
    return SimEngine(core)


def build_sim_run(cfg: SimRunConfig, engine: SimEngine):
    """A `Run` whose parts are simulated: prompts, rewards and tokenizer (the loops' helpers,
    prompt selection included, are the real ones)."""
    import torch

    from rollover.data import PromptIterator
    from rollover.loops.common import Run, _NoRecord

    s = cfg.simulate
    prompts, ids = make_prompts(s.prompts, cfg.seed, s.prompt_tokens, s.solve_alpha, s.solve_beta)
    run = Run(cfg=cfg, device=torch.device("cpu"), tokenizer=SimTokenizer(), model=None, engine=engine, trainer=None,
              train_iter=PromptIterator(prompts, seed=cfg.seed, shuffle=cfg.data.shuffle), eval_prompts=[],
              rewards=SimRewards(cfg.seed), prompt_ids=ids, logger=_NoRecord())
    if cfg.selection.policy != "uniform" or cfg.selection.allocation != "fixed":
        from rollover.rollout.selection import PromptSelection

        run.selection = PromptSelection(cfg.selection, seed=cfg.seed, correct=cfg.reward.correct_threshold,
                                        per_step=cfg.rollout.prompts_per_step)
    if s.env.enabled:
        from rollover.sim.envs import SimEnvBuilder, SimEnvRunner

        e = cfg.env
        run.env_runner = SimEnvRunner(engine, e.max_concurrent, e.step_timeout_s)
        run.env_builder = SimEnvBuilder(s.env, run.env_runner, cfg.seed, s.prompt_tokens)
        if e.dynamic_turns:
            from rollover.rollout.curation import TurnBudget

            run.turn_budget = TurnBudget(e.max_turns, e.min_turns, e.dynamic_turns_threshold,
                                         cfg.reward.correct_threshold)
    return run


def reward_cost(cfg: SimRunConfig) -> RewardCost:
    cost = RewardCost(**cfg.simulate.reward)
    if cost.workers < 1 or cost.workers != int(cost.workers):
        raise ConfigError(f"simulate.reward.workers={cost.workers:g}: must be a whole number >= 1")
    return cost


def check(cfg: SimRunConfig) -> None:
    if not reward_cost(cfg).free and cfg.partial_rollout.enabled:
        raise ConfigError("rollover simulate: scoring time (simulate.reward) is not modelled with APRIL yet (it "
                          "scores on a thread while generation runs); simulate sync or async mode")
    episodes = cfg.simulate.env.enabled
    if cfg.env.name is not None and not episodes:
        raise ConfigError("rollover simulate: env.name's environment does not run on a simulated clock; describe "
                          "it in simulate.env (turns, step_s, sigma, open_s, obs_tokens)")
    if episodes and cfg.simulate.fast:
        raise ConfigError("rollover simulate: simulated environments (simulate.env) run on the schedulers' path; "
                          "set simulate.fast: false")
    if episodes and not reward_cost(cfg).free:
        raise ConfigError("rollover simulate: with simulated environments the environment scores each episode "
                          "(its last step's time); leave simulate.reward unset")
    e = cfg.simulate.env
    if e.max_s is not None and e.max_s < e.min_s:
        raise ConfigError(f"simulate.env: max_s={e.max_s:g} is below min_s={e.min_s:g}")
    if episodes and cfg.simulate.prompt_tokens + 2 > cfg.env.max_total_tokens:
        raise ConfigError(f"rollover simulate: simulate.prompt_tokens={cfg.simulate.prompt_tokens} leaves no room "
                          f"to generate within env.max_total_tokens={cfg.env.max_total_tokens}")
    longest = cfg.env.max_total_tokens if episodes else cfg.simulate.prompt_tokens + cfg.rollout.max_new_tokens
    for pool in cfg.simulate.pools:
        if pool.kv_tokens is not None and pool.kv_tokens <= longest:
            raise ConfigError(f"simulate.pools: pool {pool.name!r} has kv_tokens={pool.kv_tokens}, too few for one "
                              f"sequence of {longest} tokens (its prompt and response) and its next token")
    if cfg.runtime != "local":
        raise ConfigError("rollover simulate: runtime must be local (the simulated cluster is set in simulate.pools)")


def simulate(cfg: SimRunConfig, progress=None, prepare=None) -> dict:
    """Simulate `cfg.steps` training steps; the report (see `summarize`). `prepare(run)` may
    change the simulated run before it starts (a benchmark's workload)."""
    check(cfg)
    if cfg.simulate.fast:
        if prepare is not None:
            raise ConfigError("simulate.fast: this simulation changes the simulated run before it starts "
                              "(a benchmark's workload), which only the schedulers' path can do")
        from rollover.sim.fast import simulate_fast

        return simulate_fast(_with_rows(cfg), profile_of(cfg), progress)
    with _lean_gc():
        return _simulate(cfg, progress, prepare)


def _with_rows(cfg: SimRunConfig) -> SimRunConfig:
    """The schedulers size their in-flight work by the engine's rows: the whole simulated cluster's."""
    rows = sum(p.workers * p.max_rows for p in cfg.simulate.pools)
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"max_rows": rows})})


@contextmanager
def _lean_gc():
    """The cyclic garbage collector off the objects alive before the simulation (modules, torch:
    a full collection walked them all, a third of a large simulation's time) and run less often
    (a step makes thousands of token lists, freed by reference counting, not by collections)."""
    mine = gc.get_freeze_count() == 0  # a caller's own frozen objects stay as the caller left them
    if mine:
        gc.collect()
        gc.freeze()
    threshold = gc.get_threshold()
    gc.set_threshold(100_000, 50, 100)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if mine:
            gc.unfreeze()


def _simulate(cfg: SimRunConfig, progress, prepare) -> dict:
    cfg = _with_rows(cfg)
    profile = profile_of(cfg)
    engine = build_engine(cfg, profile)
    run = build_sim_run(cfg, engine)
    if prepare is not None:
        prepare(run)
    cost = reward_cost(cfg)
    rewards = None if cost.free else cost.pool()
    try:
        driver = _async if cfg.mode == "async" else _sync
        steps, trainer_tl = driver(cfg, run, engine, profile, progress, rewards)
        engine.wait_idle(stuck_s=engine.stuck_s)
        return summarize(cfg, profile, engine, steps, trainer_tl, rewards, run.env_runner)
    finally:
        engine.shutdown()
        if run.env_runner is not None:
            run.env_runner.close()


def _trained_tokens(groups) -> int:
    return sum(len(r.prompt_ids) + len(r.response_ids) for g in groups for r in g.rollouts)


def _ages(groups, version: int) -> Counter:
    """Samples by age: versions between training and the oldest token's (the first: a sample's
    tokens are made in order, by versions that only grow)."""
    return Counter(version - r.versions[0] if r.versions else 0 for g in groups for r in g.rollouts)


def _sync(cfg: SimRunConfig, run, engine: SimEngine, profile: Profile, progress, rewards: RewardPool | None):
    from rollover.rollout.april import AprilCollector
    from rollover.rollout.sync_collect import SyncCollector

    if rewards is not None:  # the collector scores a round once it is generated: the clock moves on meanwhile
        def score(sizes: list[int]) -> None:
            at = engine.now
            engine.run(until=max(rewards.score(at, n) for n in sizes))
            engine.release()

        run.rewards.on_score = score

    inputs = RolloutInputs.of(run)
    collector = AprilCollector(inputs) if cfg.partial_rollout.enabled else SyncCollector(inputs)
    if cfg.partial_rollout.enabled:
        # the clock runs only inside a step, which ends at its stop: environment calls a step left
        # out are taken in when the next starts (a real one lands meanwhile and its sample waits,
        # held, for that step), so the schedule does not depend on when the threads get there
        engine.gate(lambda: collector.st is not None and not collector.st.finished.is_set())
    n_workers = len(engine.workers())
    rows, trainer_tl = [], []
    try:
        for step in range(cfg.steps):
            engine.release()
            t0, made = engine.now, engine.stats().generated_tokens
            groups, m = collector.collect(step)
            engine.wait_idle(stuck_s=engine.stuck_s)
            t1 = engine.now
            m = {**m, "engine_tokens": engine.stats().generated_tokens - made}
            version = engine.version
            train_s = _train(cfg, engine, profile, t1, _trained_tokens(groups))
            sync_s = profile.sync.seconds(n_workers)
            engine.update_weights([], step + 1, collector.inflight_mode, stall_s=sync_s)
            engine.run(until=t1 + train_s + sync_s)
            trainer_tl += [[t1, t1 + train_s, "train"], [t1 + train_s, t1 + train_s + sync_s, "sync"]]
            rows.append(_row(step, t0, t1, t1 + train_s + sync_s, groups, version, train_s, sync_s, m))
            if progress:
                progress(rows[-1])
    finally:
        collector.close()
    return rows, trainer_tl


def _train(cfg: SimRunConfig, engine: SimEngine, profile: Profile, t0: float, tokens: int) -> float:
    """A training step from t0 over `tokens` while the engine runs on; its seconds. On a shared
    device (simulate.shared_device) decode steps run `contention.decode` times slower meanwhile,
    and the step progresses `contention.train` times slower while workers generate (looked at
    in 16 slices of the step)."""
    work = profile.train.seconds(tokens)
    c = profile.contention
    if not cfg.simulate.shared_device or (c.decode == 1.0 and c.train == 1.0):
        engine.run(until=t0 + work)
        return work
    engine.slow_down(c.decode)
    t, left, piece = t0, work, work / 16
    while left > 1e-9 * work:
        rate = 1.0 / c.train if engine.busy() else 1.0
        dt = min(piece, left / rate)
        engine.run(until=t + dt)
        t, left = t + dt, left - dt * rate
    engine.slow_down(1.0)
    return t - t0


class _Inbox:
    """The data manager's inbox, processed inline: a finished group is scored and batched on
    the engine thread the moment it lands (its put), so batches form at exact virtual times."""

    def __init__(self, engine: SimEngine, rewards: RewardPool | None):
        self.manager = None
        self.queue: list = []
        self.engine, self.rewards = engine, rewards
        self.ready = 0.0  # when the rewards of every group put so far are in

    def put(self, group) -> None:
        if self.rewards is not None:  # scored while generation runs on; a batch is ready once its groups are
            self.ready = max(self.ready, self.rewards.score(self.engine.now, group.n))
        with self.manager.lock:
            self.manager._process(group)

    def qsize(self) -> int:
        return 0


class _Batches(queue.Queue):
    """Formed batches with the virtual time each formed; while `armed` (the trainer waits), a
    batch halts the engine."""

    def __init__(self, engine: SimEngine, inbox: _Inbox):
        super().__init__()
        self.engine, self.inbox, self.armed = engine, inbox, False

    def put(self, batch, block=True, timeout=None) -> None:
        super().put((batch, max(self.engine.now, self.inbox.ready)))
        if self.armed:
            self.engine.halt()


def _async(cfg: SimRunConfig, run, engine: SimEngine, profile: Profile, progress, rewards: RewardPool | None):
    from rollover.rollout.async_rollout import DataManager, RolloutService, StalenessGate

    B, eta = cfg.rollout.prompts_per_step, cfg.async_.max_staleness
    errors: list = []

    def on_error(who, e):
        errors.append((who, e))
        engine.halt()

    gate = StalenessGate(B, eta, cfg.steps * B)
    inbox = _Inbox(engine, rewards)
    batches = _Batches(engine, inbox)
    service = RolloutService(RolloutInputs.of(run), gate, inbox, on_error)
    inbox.manager = DataManager(service.inputs, gate, service, inbox, batches, on_error)
    n_workers = len(engine.workers())
    rows, trainer_tl = [], []
    service.resume()  # opens admission (the service starts held)
    t_free = 0.0
    for step in range(cfg.steps):
        t_wait = t_free
        if batches.empty():
            batches.armed = True
            engine.run()
            batches.armed = False
        if errors:
            who, e = errors[0]
            raise RuntimeError(f"simulation: the {who} failed: {e!r}") from e
        if batches.empty():
            raise RuntimeError(f"simulation stalled before step {step + 1}: no batch formed and nothing is in flight "
                               f"({inbox.manager.describe()})")
        groups, t_ready = batches.get()
        inbox.manager.training = 1  # until the update below (the experience pool's version estimate)
        t0 = max(t_free, t_ready)
        engine.run(until=t0)
        version = engine.version
        if max(version - g.start_version for g in groups) > eta:
            raise AssertionError(f"simulation: staleness above max_staleness={eta} at version {version}")
        train_s = _train(cfg, engine, profile, t0, _trained_tokens(groups))
        sync_s = profile.sync.seconds(n_workers)
        engine.update_weights([], step + 1, cfg.rollout.inflight_weight_update, stall_s=sync_s)
        inbox.manager.training = 0
        engine.run(until=t0 + train_s + sync_s)
        t_free = t0 + train_s + sync_s
        service.admit()
        trainer_tl += [[t0, t0 + train_s, "train"], [t0 + train_s, t_free, "sync"]]
        m = {"filtered_groups": inbox.manager.metrics["filtered_groups"]}
        rows.append(_row(step, t_wait, t0, t_free, groups, version, train_s, sync_s, m))
        if progress:
            progress(rows[-1])
    service.stop()
    return rows, trainer_tl


def _row(step, t_start, t_train, t_end, groups, version, train_s, sync_s, m) -> dict:
    return {"step": step + 1, "t_start": t_start, "t_train": t_train, "t_end": t_end,
            "wait_s": t_train - t_start, "train_s": train_s, "sync_s": sync_s,
            "samples": sum(len(g.rollouts) for g in groups), "groups": len(groups),
            "response_tokens": sum(len(r.response_ids) for g in groups for r in g.rollouts),
            "sampled_tokens": sum(sum(v >= 0 for v in r.versions) for g in groups for r in g.rollouts),
            "loss_tokens": sum(sum(r.loss_mask) for g in groups for r in g.rollouts),
            "ages": dict(_ages(groups, version)), "filtered_groups": m.get("filtered_groups", 0),
            "discarded_tokens": m.get("discarded_tokens", 0), "engine_tokens": m.get("engine_tokens")}


def summarize(cfg: SimRunConfig, profile: Profile, engine: SimEngine, rows: list[dict], trainer_tl: list,
              rewards: RewardPool | None = None, envs=None) -> dict:
    """Throughput, utilization per role, the idle-time breakdown and the staleness histogram."""
    workers = engine.workers()
    stats = engine.stats()
    end = rows[-1]["t_end"] if rows else 0.0
    extra = {"reward": {"workers": len(rewards.free_at), "busy_s": rewards.busy_s,
                        "utilization": rewards.busy_s / (len(rewards.free_at) * end) if end else 0.0}} \
        if rewards is not None else {}
    if envs is not None:
        extra["env"] = envs.report(end)
    if any(w.kv_tokens is not None for w in workers):
        extra["preempted"] = stats.preempted  # sequences preempted for K/V capacity
    return report(cfg, profile, rows, trainer_tl, pools=[w.pool for w in workers],
                  busy_s=[w.busy_s for w in workers], stall_s=[w.stall_s for w in workers],
                  generated=stats.generated_tokens, occupancy=stats.occupancy,
                  timelines=[w.timeline for w in workers], extra=extra)


def report(cfg: SimRunConfig, profile: Profile, rows: list[dict], trainer_tl: list, *, pools: list[str], busy_s,
           stall_s, generated: int, occupancy: float, timelines: list, extra: dict | None = None,
           mode: str = "") -> dict:
    """The report of a simulation from its step rows and each worker's pool, generating and
    stalled seconds (both paths write it)."""
    end = rows[-1]["t_end"] if rows else 0.0
    by_pool: dict[str, dict] = {}
    for pool, busy, stall in zip(pools, busy_s, stall_s):
        p = by_pool.setdefault(pool, {"workers": 0, "generate_s": 0.0, "sync_s": 0.0})
        p["workers"] += 1
        p["generate_s"] += float(busy)
        p["sync_s"] += float(stall)
    for p in by_pool.values():
        total = p["workers"] * end
        p["utilization"] = p["generate_s"] / total if total else 0.0
        p["stalled_fraction"] = p["sync_s"] / total if total else 0.0
        p["idle_fraction"] = max(0.0, 1.0 - p["utilization"] - p["stalled_fraction"])
    train_s = sum(r["train_s"] for r in rows)
    sync_s = sum(r["sync_s"] for r in rows)
    ages = Counter()
    for r in rows:
        ages.update(r["ages"])
    samples = sum(r["samples"] for r in rows)
    return {
        "mode": _mode(cfg) + mode, "steps": len(rows), "workers": len(pools), "profile": profile.name,
        "simulated_s": end,
        "samples_trained": samples,
        "samples_per_s": samples / end if end else 0.0,
        "generated_tokens": generated,
        "generated_tokens_per_s": generated / end if end else 0.0,
        "row_occupancy": occupancy,
        "rollout": by_pool,
        "trainer": {"utilization": train_s / end if end else 0.0, "train_s": train_s, "sync_s": sync_s,
                    "wait_s": max(0.0, end - train_s - sync_s)},
        "staleness": {str(k): v for k, v in sorted(ages.items())},
        # sampled tokens the loss used (APRIL's on_stale=mask drops those older than max_carry_steps)
        "loss_token_share": (sum(r.get("loss_tokens", 0) for r in rows) / sampled
                             if (sampled := sum(r.get("sampled_tokens", 0) for r in rows)) else None),
        **(extra or {}),
        "discarded_tokens": sum(r["discarded_tokens"] for r in rows),
        "step_rows": rows,
        "timeline": {"trainer": trainer_tl, "workers": timelines, "pools": list(pools)},
    }


def _mode(cfg: SimRunConfig) -> str:
    if cfg.mode == "async":
        return f"async (eta={cfg.async_.max_staleness})"
    if cfg.partial_rollout.enabled:
        return f"APRIL (alpha={cfg.partial_rollout.oversample:g}, {cfg.april_carry[0]})"
    return "sync"
