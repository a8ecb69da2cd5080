"""The asynchronous RL loop: rollout service, data manager and trainer run concurrently.

    rollout service ──finished groups──▶ data manager ──batches──▶ trainer
          ▲  (engine + staleness gate)     (rewards, filters,        │
          └──────────── weights (named tensors, version) ◀───────────┘
                                            curation, advantages)

- The rollout service keeps the engine busy with every group the staleness gate admits
  (`async.max_staleness` = eta; see rollover/rollout/async_rollout.py for the rule and its
  proof); it never waits for the trainer unless eta would be exceeded.
- The data manager scores groups as they finish (concurrently with generation), applies the
  dynamic-sampling filter and DART curation, and forms batches in start order.
- The trainer (this thread) trains each batch, pushes the new weights to the engine between
  decode steps (in-flight requests continue with their K/V recomputed, go on over the K/V the
  older weights computed, or are interrupted and resumed, per `rollout.inflight_weight_update`)
  and bumps the version.

Locally the three are threads of one process joined by queues; what crosses between them is
typed (`PendingGroup`, `Group`, named tensors + version), the same seams a multi-process
runtime uses. Objective: decoupled PPO by default (proximal policy = the weights before the
update, behaviour = the engine's logprobs), so slightly stale samples are weighted correctly.

Failed samples leave their groups, which train on the rest; a group left with fewer than two
is dropped and the gate admits another in its place. `train.max_bad_steps` collections' worth
of groups dropped in a row (in start order; a collection is a batch of groups, or
`algorithm.max_resample_rounds` of them with dynamic sampling) stop the run after a
checkpoint, as that many empty collections stop the sync loop. The data manager's counters
(`rollout/*`) count what it did since the previous row.

Failure: an exception in any component stops all of them within about a second, with a
message naming the component; the trainer saves a checkpoint of the last consistent state
(between two steps) unless the trainer itself failed, in which case the last periodic
checkpoint stands. A wait that sees no progress for `rollout.stall_timeout_s` ends the run
with an error naming who waited for what (loops/guard.py). SIGINT/SIGTERM: the trainer
finishes its step (or stops waiting for a batch), saves a consistent checkpoint and returns.

Checkpoints are consistent snapshots: generation is paused (aborted samples back in their
groups with their tokens), the data manager is between two groups (it takes a group off its
inbox and resolves it under the lock the snapshot holds), the trainer between two steps. Every
group is then in exactly one place: in flight, in the inbox, resolved, or in a batch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter

from rollover.config import Config
from rollover.engine.cpu import openmp
from rollover.loops.batch import bad_steps_error, advantage_metrics, record_step, train_batch_from
from rollover.loops.common import Run, run_to_train
from rollover.metrics.progress import reward_errors
from rollover.loops.guard import Interrupts, interrupted_result, resume_point
from rollover.rewards import RewardFailed
from rollover.rollout.stops import Stalled, TooManyEmptyCollections, Watchdog, engine_progress
from rollover.rollout.async_rollout import ComponentError, DataManager, RolloutService, StalenessGate
from rollover.rollout.core import env_step_metrics
from rollover.rollout.groups import rollout_metrics
from rollover.rollout.inputs import RolloutInputs

log = logging.getLogger("rollover")


def staleness(groups, version: int, eta: int) -> list[int]:
    """Each group's staleness at `version`; above `eta` is the gate's failure, never trained
    silently, and so is a sampled token older than that (a substituted trajectory's)."""
    stale = [version - g.start_version for g in groups]
    oldest = min((_oldest_sampled(r.versions, version) for g in groups for r in g.rollouts), default=version)
    if max(stale) > eta or version - oldest > eta:
        raise AssertionError(f"staleness {max(max(stale), version - oldest)} exceeds max_staleness={eta} at version "
                             f"{version}")
    return stale


def _oldest_sampled(versions: list[int], default: int) -> int:
    """The oldest version of a sample's sampled tokens (an environment's carry -1): min() in C,
    the filter only for an episode."""
    oldest = min(versions, default=default)
    return oldest if oldest >= 0 else min((v for v in versions if v >= 0), default=default)


def train_async(cfg: Config, *, run: Run | None = None) -> dict:
    """Run `cfg.steps` asynchronous steps (continuing from a checkpoint when there is one) of a
    `mode: async` config; `run`: one `build_run(cfg)` built from this config (None: built here)."""
    from rollover.metrics import Progress

    run = run_to_train(cfg, run, "async")
    parts = _Services(run)
    step = run.start_step
    samples_trained = run.resumed_extra.get("samples_consumed", 0)
    last_eval: dict = {}
    progress = Progress(cfg.steps, initial=step, desc="train (async)") if cfg.logging.progress else None
    stats = _Throughput(run)
    try:
        with Interrupts() as interrupts:
            # a step-0 checkpoint was saved after this evaluation was logged: its resume does not log it again
            if step == 0 and cfg.eval.at_start and run.checkpoint is None:
                last_eval = run.evaluate(0)
            last_eval = run.resumed_evaluation(step) or last_eval  # (before the rollouts start)
            parts.start()
            while step < cfg.steps:
                # 1. the next batch, oldest groups first (None: a signal asked us to stop)
                t_wait = time.perf_counter()
                groups = parts.next_batch(interrupts, step)
                if groups is None:
                    break
                waited = time.perf_counter() - t_wait
                version = run.engine.version
                stale = staleness(groups, version, cfg.async_.max_staleness)

                # 2. train on it (decoupled PPO by default), then push the weights
                t0 = time.perf_counter()
                batch, adv_info = train_batch_from(groups, cfg, step + 1)
                train_metrics = run.trainer.train_step(batch)
                t_train = time.perf_counter() - t0
                step += 1
                t0 = time.perf_counter()
                run.weights.push(run.trainer.named_weights(), version=step,
                                          inflight=cfg.rollout.inflight_weight_update)
                run.at_step(step)
                parts.manager.training = 0  # after the push: meanwhile the estimate errs high (refuses, never admits, a stale one)
                t_sync = time.perf_counter() - t0
                parts.service.admit()  # the new version opens the gate for more groups

                # 3. metrics, the ledger of trained groups (and, every logging.samples steps, their samples)
                samples_trained += len(batch)
                metrics = {
                    **rollout_metrics(groups, cfg, run.primary_reward), **train_metrics,
                    **advantage_metrics(adv_info),
                    "samples_consumed_total": samples_trained, **stats.step(stale, batch, version, t_train, t_sync),
                    **parts.metrics(stats.wall()), "timing_s/wait_for_batch": waited,
                    **run.weights.metrics(), **run.worker_metrics(),
                }
                record_step(run, step, metrics, groups, batch, kept=adv_info.get("kept_samples"))
                if progress:
                    progress.update(step, reward=metrics["reward/mean"], acc=metrics["accuracy"],
                                    samples_per_s=metrics["perf/samples_trained_per_s"], **reward_errors(metrics))

                # 4. stop on repeated non-finite losses; evaluation; checkpoints
                if (error := bad_steps_error(run, step)) is not None:
                    parts.checkpoint(step, samples_trained, resume=False)
                    raise error
                if interrupts.requested:
                    break
                if step == cfg.steps or (cfg.eval.every and step % cfg.eval.every == 0):
                    try:
                        last_eval = run.evaluate(step)
                    except RewardFailed as e:  # the step is trained: kept (a resume runs this evaluation again)
                        parts.checkpoint(step, samples_trained, resume=False)
                        raise resume_point(e, cfg.run_dir, step, saved=True) from e.__cause__
                if step == cfg.steps or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                    parts.checkpoint(step, samples_trained)
            if interrupts.requested:
                path = parts.checkpoint(step, samples_trained, resume=False)
                return interrupted_result(step, interrupts.requested, path)
        return {"step": step, **last_eval}
    except (ComponentError, TooManyEmptyCollections) as stop:
        # another component failed, or every group came back dropped, while the trainer was
        # between steps: its state is consistent
        try:
            parts.checkpoint(step, samples_trained, resume=False)
        except Exception as e:  # pragma: no cover - best effort, the original error matters more
            log.error("async: could not save a checkpoint after the failure: %r", e)
            raise stop
        if isinstance(stop.__cause__, RewardFailed):  # the same error a sync run raises
            raise resume_point(stop.__cause__, cfg.run_dir, step, saved=True) from stop.__cause__.__cause__
        raise
    finally:
        parts.stop()
        if progress:
            progress.close()
        run.close()


DATA_COUNTS = ("skipped_groups", "dropped_samples", "filtered_groups", "filtered_tokens", "reward_errors",
               "empty_collections")


class _Services:
    """The rollout service and the data manager with the queues and gate between them, as the
    trainer sees them: start, wait for a batch, snapshot, stop."""

    def __init__(self, run: Run):
        cfg = run.cfg
        self.run, self.cfg = run, cfg
        B = cfg.rollout.prompts_per_step
        self.gate = StalenessGate(B, cfg.async_.max_staleness, max_groups=cfg.steps * B)
        self.inbox: queue.Queue = queue.Queue()
        self.batches: queue.Queue = queue.Queue()
        self.failure: dict = {}
        self.stopped = threading.Event()
        inputs = RolloutInputs.of(run)  # the rollout side sees these, not the run
        self.service = RolloutService(inputs, self.gate, self.inbox, self._on_error)
        self.manager = DataManager(inputs, self.gate, self.service, self.inbox, self.batches, self._on_error)
        self._env_since = (0.0, time.perf_counter())  # environment busy seconds and time at the last metrics row
        self.counts = DATA_COUNTS + (("experience_pool_substitutions",) if cfg.async_.experience_pool else ()) + \
            (("entropy_masked_samples",) if cfg.async_.top_entropy_fraction < 1 else ()) + \
            (() if run.env_builder is not None else
             tuple(f"rewards/{r.name}/{count}" for r in run.rewards.rewards for count in ("errors", "timeouts")))
        # (0s shown: a count is in every row, as in sync mode's)
        _restore(run.resumed_extra.get("async"), self.gate, self.manager, self.service)

    def _on_error(self, component: str, e: BaseException) -> None:
        if "error" not in self.failure:
            self.failure.update(component=component, error=e)
            log.error("async: %s failed: %r", component, e)
        self.stopped.set()

    def start(self) -> None:
        self.manager.start()
        self.service.resume()  # submits restored in-flight groups, then admits new ones

    def next_batch(self, interrupts: Interrupts, step: int) -> list | None:
        """The data manager's next batch; raises as soon as any component has failed, nothing
        has moved for the stall timeout or `train.max_bad_steps` collections' worth of groups in
        a row were dropped; None once a signal asked the run to stop."""
        m = self.manager
        dog = Watchdog("the trainer", "a batch from the data manager",
                       lambda: (engine_progress(self.run.engine), m.resolved_count, self.inbox.qsize()),
                       self.cfg.rollout.stall_timeout_s, describe=m.describe)
        while True:
            if self.stopped.is_set():
                raise ComponentError(f"async run stopped: the {self.failure['component']} failed: "
                                     f"{self.failure['error']!r}") from self.failure["error"]
            if interrupts.requested:
                return None
            with m.version_lock:  # taken and counted as in training at once (the experience pool's version estimate)
                try:
                    batch = self.batches.get_nowait()
                except queue.Empty:
                    batch = None
                else:
                    m.training = 1  # until its weights are pushed
            if batch is not None:
                return batch
            if (error := m.empty_collections_error(step)) is not None:
                raise error
            openmp.release()  # the trainer waits while the engine computes
            with self.batches.not_empty:
                if not self.batches.queue:
                    self.batches.not_empty.wait(0.5)
            dog.check()  # also raises if the engine thread died

    def checkpoint(self, step: int, samples_trained: int, resume: bool = True):
        """A consistent snapshot: generation paused (partials back in their groups), the data
        manager between two groups, the trainer between two steps."""
        groups = self.service.pause()
        timeout = self.cfg.rollout.stall_timeout_s
        if not self.manager.lock.acquire(timeout=timeout):
            raise Stalled(f"the trainer waited {timeout:g} s (rollout.stall_timeout_s) for the data manager to "
                          f"finish the group in its hands before a checkpoint ({self.manager.describe()})")
        try:
            path = self.run.save(step, {"samples_consumed": samples_trained, "async": {
                "gate": self.gate.state_dict(), "manager": self.manager.state_dict(), "inflight": groups,
                "success_rate": dict(self.service.success_rate)}})
        finally:
            self.manager.lock.release()
        if resume:
            self.service.resume()
        return path

    def metrics(self, wall: float) -> dict:
        with self.manager.lock:
            trajectories, self.manager.trajectories = self.manager.trajectories, []
            counts, self.manager.metrics = self.manager.metrics, Counter()
        busy, since = self.service.driver.env_busy_s, self._env_since
        self._env_since = (busy, time.perf_counter())
        counts.pop("reward_s", None)  # scoring seconds, no count (the data manager's share of time: busy/*)
        return {
            **{f"rollout/{k}": v for k, v in {**dict.fromkeys(self.counts, 0), **counts}.items()},
            **{f"rollout/{k}": v for k, v in env_step_metrics(self.service.inputs, trajectories, busy - since[0],
                                                               time.perf_counter() - since[1]).items()},
            "queue/finished_groups": self.inbox.qsize(),
            "queue/batches": self.batches.qsize(),
            "queue/inflight_groups": len(self.service.inflight),
            "busy/data_manager": self.manager.busy_s / wall,
        }

    def stop(self) -> None:
        self.stopped.set()
        self.manager.stop.set()
        self.service.stop()
        if self.manager.thread.is_alive():
            self.manager.thread.join(timeout=30)


class _Throughput:
    """The step's staleness (and its histogram); busy fractions and samples/s since this
    process's loop started (a resume starts them again)."""

    def __init__(self, run: Run):
        self.run = run
        self.samples = 0  # trained by this process: samples_consumed_total also counts the run before a resume
        self.trainer_busy = 0.0
        self.t_start = time.perf_counter()
        self.engine0 = run.engine.stats()

    def wall(self) -> float:
        return time.perf_counter() - self.t_start

    def step(self, stale: list[int], batch, version: int, t_train: float, t_sync: float) -> dict:
        self.samples += len(batch)
        self.trainer_busy += t_train + t_sync
        wall, eng, e0 = self.wall(), self.run.engine.stats(), self.engine0
        tok_lag = (version - batch.versions_BT[batch.mask_BT]).float()
        return {
            "staleness/max": max(stale),
            "staleness/mean": sum(stale) / len(stale),
            **{f"staleness/hist/{k}": v for k, v in sorted(Counter(stale).items())},  # this step's groups
            "staleness/token_lag_mean": float(tok_lag.mean()) if tok_lag.numel() else 0.0,
            "staleness/token_lag_max": float(tok_lag.max()) if tok_lag.numel() else 0.0,
            "busy/rollout": (eng.prefill_s + eng.decode_s - e0.prefill_s - e0.decode_s) / wall,
            "busy/trainer": self.trainer_busy / wall,
            "timing_s/train": t_train,
            "timing_s/weight_sync": t_sync,
            "perf/samples_trained_per_s": self.samples / wall,
        }


def _restore(extra: dict | None, gate: StalenessGate, manager: DataManager, service: RolloutService) -> None:
    """Put the gate, the data manager and the groups in flight back as a checkpoint saved them."""
    if not extra:
        return
    gate.load_state_dict(extra["gate"])
    manager.load_state_dict(extra["manager"])
    service.success_rate = dict(extra["success_rate"])
    for g in extra["inflight"]:
        service.inflight[g.id] = g
