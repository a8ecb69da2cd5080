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
  decode steps (in-flight requests continue with their K/V recomputed, or are interrupted and
  resumed, per `rollout.inflight_weight_update`) and bumps the version.

Locally the three are threads of one process joined by queues; what crosses between them is
typed (`PendingGroup`, `Group`, named tensors + version), the same seams a multi-process
runtime uses. Objective: decoupled PPO by default (proximal policy = the weights before the
update, behaviour = the engine's logprobs), so slightly stale samples are weighted correctly.

Failure: an exception in any component stops all of them within about a second, with a
message naming the component; the trainer saves a checkpoint of the last consistent state
(between two steps) unless the trainer itself failed, in which case the last periodic
checkpoint stands.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter

from rollover.config import Config
from rollover.loops.common import Run, bad_steps_error, build_run, train_batch_from
from rollover.rollout.async_rollout import ComponentError, DataManager, RolloutService, StalenessGate
from rollover.rollout.groups import rollout_metrics

log = logging.getLogger("rollover")


def train_async(cfg: Config, *, run: Run | None = None) -> dict:
    from rollover.metrics import Progress

    run = run or build_run(cfg)
    B, eta = cfg.rollout.prompts_per_step, cfg.async_.max_staleness
    gate = StalenessGate(B, eta, max_groups=cfg.steps * B)
    inbox: queue.Queue = queue.Queue()
    batches: queue.Queue = queue.Queue()
    failure: dict = {}
    stop = threading.Event()

    def on_error(component: str, e: BaseException) -> None:
        if "error" not in failure:
            failure.update(component=component, error=e)
            log.error("async: %s failed: %r", component, e)
        stop.set()

    service = RolloutService(run, gate, inbox, on_error)
    manager = DataManager(run, gate, service, inbox, batches, on_error)
    _restore(run.resumed_extra.get("async"), gate, manager, service)
    step = run.start_step
    samples_trained = run.resumed_extra.get("samples_consumed", 0)
    last_eval: dict = {}
    progress = Progress(cfg.steps, initial=step, desc="train (async)") if cfg.logging.progress else None
    staleness_hist: Counter = Counter()
    trainer_busy = 0.0
    t_start = time.perf_counter()
    engine_s0 = run.engine.stats()

    def checkpoint(step: int, resume: bool = True) -> None:
        groups = service.pause()
        with manager.lock:
            run.save(step, {"samples_consumed": samples_trained, "async": {
                "gate": gate.state_dict(), "manager": manager.state_dict(), "inflight": groups,
                "success_rate": dict(service.success_rate)}})
        if resume:
            service.resume()

    try:
        if step == 0 and cfg.eval.at_start:
            last_eval = run.evaluate(0)
        manager.start()
        service.resume()  # submits restored in-flight groups, then admits new ones
        while step < cfg.steps:
            # 1. the next batch, oldest groups first
            t_wait = time.perf_counter()
            groups = _next_batch(run, batches, stop, failure)
            waited = time.perf_counter() - t_wait
            version = run.engine.version
            stale = [version - g.start_version for g in groups]
            if max(stale) > eta:  # the gate's guarantee; a violation is a bug, never trained silently
                raise AssertionError(f"staleness {max(stale)} exceeds max_staleness={eta} at version {version}")
            staleness_hist.update(stale)

            # 2. train on it (decoupled PPO by default), then push the weights
            t0 = time.perf_counter()
            batch, adv_info = train_batch_from(groups, cfg)
            train_metrics = run.trainer.train_step(batch)
            t_train = time.perf_counter() - t0
            step += 1
            t0 = time.perf_counter()
            run.engine.update_weights(run.trainer.named_weights(), version=step,
                                      inflight=cfg.rollout.inflight_weight_update)
            t_sync = time.perf_counter() - t0
            trainer_busy += t_train + t_sync
            service.admit()  # the new version opens the gate for more groups

            # 3. metrics
            samples_trained += len(batch)
            wall = time.perf_counter() - t_start
            eng = run.engine.stats()
            engine_busy = (eng.prefill_s + eng.decode_s - engine_s0.prefill_s - engine_s0.decode_s) / wall
            tok_lag = (version - batch.versions_BT[batch.mask_BT]).float()
            metrics = {
                **rollout_metrics(groups, cfg, run.primary_reward),
                **train_metrics,
                **{f"rollout/{k}": v for k, v in manager.metrics.items()},
                "adv/zero_std_groups": adv_info.get("zero_std_groups", 0),
                "samples_consumed": samples_trained,
                "staleness/max": max(stale),
                "staleness/mean": sum(stale) / len(stale),
                **{f"staleness/hist/{k}": v for k, v in sorted(staleness_hist.items())},
                "staleness/token_lag_mean": float(tok_lag.mean()) if tok_lag.numel() else 0.0,
                "queue/finished_groups": inbox.qsize(),
                "queue/batches": batches.qsize(),
                "queue/inflight_groups": len(service.inflight),
                "busy/rollout": engine_busy,
                "busy/data_manager": manager.busy_s / wall,
                "busy/trainer": trainer_busy / wall,
                "timing_s/wait_for_batch": waited,
                "timing_s/train": t_train,
                "timing_s/weight_sync": t_sync,
                "perf/samples_trained_per_s": samples_trained / wall,
            }
            run.logger.log(step, metrics)
            if progress:
                progress.update(step, reward=metrics["reward/mean"], acc=metrics["accuracy"],
                                samples_per_s=metrics["perf/samples_trained_per_s"])
            if (error := bad_steps_error(run, step)) is not None:
                checkpoint(step, resume=False)
                raise error
            if step == cfg.steps or (cfg.eval.every and step % cfg.eval.every == 0):
                last_eval = run.evaluate(step)
            if step == cfg.steps or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                checkpoint(step)
        return {"step": step, **last_eval}
    except ComponentError:
        # another component failed while the trainer was between steps: its state is consistent
        try:
            checkpoint(step, resume=False)
        except Exception as e:  # pragma: no cover - best effort, the original error matters more
            log.error("async: could not save a checkpoint after the failure: %r", e)
        raise
    finally:
        stop.set()
        manager.stop.set()
        service.stop()
        manager.thread.join(timeout=30) if manager.thread.is_alive() else None
        if progress:
            progress.close()
        run.close()


def _restore(extra: dict | None, gate: StalenessGate, manager: DataManager, service: RolloutService) -> None:
    """Put the gate, the data manager and the groups in flight back as a checkpoint saved them."""
    if not extra:
        return
    gate.load_state_dict(extra["gate"])
    manager.load_state_dict(extra["manager"])
    service.success_rate = dict(extra["success_rate"])
    for g in extra["inflight"]:
        service.inflight[g.id] = g


def _next_batch(run: Run, batches: queue.Queue, stop: threading.Event, failure: dict) -> list:
    """Wait for the data manager's next batch; raise as soon as any component has failed."""
    while True:
        if stop.is_set():
            raise ComponentError(f"async run stopped: the {failure['component']} failed: "
                                 f"{failure['error']!r}") from failure["error"]
        try:
            return batches.get(timeout=0.5)
        except queue.Empty:
            run.engine.stats()  # raises if the engine thread died
