"""The synchronous RL loop, readable top to bottom.

    generate -> rewards -> advantages -> train -> push weights -> evaluate -> checkpoint

Generation is plain (every group waits for its longest sample; DAPO dynamic sampling tops up
zero-variance groups) or, with `partial_rollout.enabled`, APRIL: over-provisioned, stopped at
the target number of complete groups, the rest aborted and resumed next step from its tokens.

Where this departs from the papers:
- GRPO's KL term is off by default (kl_coef: 0), as in DAPO and most recent recipes; when on,
  it is a per-token loss term (k3 by default), not a reward penalty.
- With one update per step the old policy is the current forward (ratio = 1), so clipping only
  matters with several PPO epochs / mini-batches or off-policy data; DAPO's clip-higher is
  still the default bound (eps_high 0.28).
- The loss is normalised by the step's global token count (token-mean), which DAPO proposes
  and which stays exact under micro-batching; GRPO's original per-sequence mean is
  `aggregation: seq-mean-token-mean`.
- A step whose loss or gradient is not finite is skipped with a warning; `train.max_bad_steps`
  in a row stop the run after a checkpoint.
- A failed sample (a reward error under on_error=skip, a failed episode) leaves its group, which
  trains on the rest (GRPO's baseline over the survivors, not over n). A collection with no
  trainable group is counted and collected again from the next prompts at the same step;
  `train.max_bad_steps` of those in a row also stop the run after a checkpoint.
"""

from __future__ import annotations

import logging
import time

from rollover.config import Config
from rollover.loops.batch import (
    EmptyCollections, bad_steps_error, advantage_metrics, record_step, train_batch_from,
)
from rollover.loops.common import Run, run_to_train
from rollover.metrics.progress import reward_errors
from rollover.loops.guard import Interrupts, interrupted_result, resume_point
from rollover.rewards import RewardFailed
from rollover.rollout.api import CollectorAPI
from rollover.rollout.groups import rollout_metrics
from rollover.rollout.inputs import RolloutInputs
from rollover.train import checkpoint

log = logging.getLogger("rollover")


def make_collector(run: Run) -> CollectorAPI:
    """The step's collector, given the run's rollout inputs (not the run)."""
    inputs = RolloutInputs.of(run)
    if run.cfg.partial_rollout.enabled:
        from rollover.rollout.april import AprilCollector

        return AprilCollector(inputs)
    from rollover.rollout.sync_collect import SyncCollector

    return SyncCollector(inputs)


def step_metrics(run: Run, groups, gen: dict, train_metrics: dict, adv_info: dict, timings: dict,
                 samples_consumed: int, samples: int) -> dict:
    """One step's metrics row: rollout statistics, the trainer's, the collector's, timings."""
    return {
        **rollout_metrics(groups, run.cfg, run.primary_reward),
        **train_metrics,
        **{f"rollout/{k}": v for k, v in gen.items() if not k.endswith("_s")},
        **advantage_metrics(adv_info),
        "samples_consumed_total": samples_consumed,
        "timing_s/generate": gen["generate_s"],
        "timing_s/reward": gen["reward_s"],
        **{f"timing_s/{k}": v for k, v in timings.items()},
        "perf/tokens_per_s": gen["generated_tokens"] / max(gen["generate_s"], 1e-9),
        **({"perf/useful_tokens_per_s": gen["useful_tokens_per_s"]} if "useful_tokens_per_s" in gen else {}),
        "perf/samples_per_s": samples / timings["step"],
        **run.weights.metrics(),
        **run.worker_metrics(),
    }


def train_sync(cfg: Config, *, run: Run | None = None) -> dict:
    """Run `cfg.steps` synchronous steps (continuing from a checkpoint when there is one) of a
    `mode: sync` config; `run`: one `build_run(cfg)` built from this config (None: built here)."""
    from rollover.metrics import Progress

    run = run_to_train(cfg, run, "sync")
    collector = make_collector(run)
    if "collector" in run.resumed_extra:
        collector.load_state_dict(run.resumed_extra["collector"])
    step = run.start_step
    last_eval: dict = {}
    progress = Progress(cfg.steps, initial=step, desc="train") if cfg.logging.progress else None
    samples_consumed = run.resumed_extra.get("samples_consumed", 0)
    empty = EmptyCollections()
    empty.load_state_dict(run.resumed_extra.get("empty_collections"))

    def extra() -> dict:
        return {"collector": collector.state_dict(), "samples_consumed": samples_consumed,
                "empty_collections": empty.state_dict()}

    def save(step: int, state: dict | None = None):
        return run.save(step, extra(), state=state)

    # a reward that raises (reward.on_error=raise) stops a collection half done: the state before
    # it, with the weights it has not changed, is a checkpoint of the steps trained so far (APRIL's
    # requests carried in the engine cannot be set back to it)
    keep_start = cfg.reward.on_error == "raise" and not cfg.partial_rollout.enabled
    start, start_at = None, None

    interrupts = Interrupts().__enter__()  # SIGINT/SIGTERM: finish the step, checkpoint, return
    try:
        if step == 0 and cfg.eval.at_start and run.checkpoint is None:  # a step-0 checkpoint follows it: logged
            last_eval = run.evaluate(0)
        last_eval = run.resumed_evaluation(step) or last_eval
        t_step = None  # a step's wall time: from its first collection, empty ones included
        while step < cfg.steps:
            if t_step is None:
                t_step = time.perf_counter()

            # 1. generate and score (sync or APRIL); nothing trainable: count it, collect again
            if keep_start and step > run.start_step and start_at != step:  # once a step: before its empty collections too
                start, start_at = run.state(extra(), rng=True), step
            try:
                groups, gen = collector.collect(step)
            except RewardFailed as e:
                if start is None or checkpoint.exists(cfg.run_dir, step):  # say what a resume retrains
                    raise resume_point(e, cfg.run_dir, step) from e.__cause__  # the reward's own error
                save(step, start)
                raise resume_point(e, cfg.run_dir, step, saved=True) from e.__cause__
            if not groups:
                if (error := empty.add(run, step, gen)) is not None:
                    save(step)
                    raise error
                if interrupts.requested:
                    return interrupted_result(step, interrupts.requested, save(step))
                continue
            gen = empty.fold(gen)

            # 2. advantages and the typed batch
            t0 = time.perf_counter()
            batch, adv_info = train_batch_from(groups, cfg, step + 1)
            t_adv = time.perf_counter() - t0

            # 3. policy update (the idle engine frees what it can rebuild: its packed weights)
            t0 = time.perf_counter()
            run.engine.release_memory()
            train_metrics = run.trainer.train_step(batch)
            t_train = time.perf_counter() - t0
            step += 1

            # 4. new weights to the engine (tokens generated from now on carry version `step`)
            t0 = time.perf_counter()
            run.weights.push(run.trainer.named_weights(), version=step, inflight=collector.inflight_mode)
            run.at_step(step)
            t_sync = time.perf_counter() - t0

            # 5. metrics
            samples_consumed += len(batch)
            timings = {"advantage": t_adv, "train": t_train, "weight_sync": t_sync, "step": time.perf_counter() - t_step}
            t_step = None
            metrics = step_metrics(run, groups, gen, train_metrics, adv_info, timings, samples_consumed, len(batch))
            record_step(run, step, metrics, groups, batch, gen, adv_info.get("kept_samples"))
            if progress:
                progress.update(step, reward=metrics["reward/mean"], acc=metrics["accuracy"],
                                tokens_per_s=metrics["perf/tokens_per_s"], **reward_errors(metrics))

            # 6. stop, with a checkpoint: repeated non-finite losses (an error) or a signal (the step is done)
            if (error := bad_steps_error(run, step)) is not None:
                save(step)
                raise error
            if interrupts.requested:
                return interrupted_result(step, interrupts.requested, save(step))

            # 7. evaluation and checkpoints
            if step == cfg.steps or (cfg.eval.every and step % cfg.eval.every == 0):
                collector.set_aside()  # APRIL's live requests: the evaluation would run them to their end
                try:
                    last_eval = run.evaluate(step)
                except RewardFailed as e:  # the step is trained: kept (a resume runs this evaluation again)
                    save(step)
                    raise resume_point(e, cfg.run_dir, step, saved=True) from e.__cause__
            if step == cfg.steps or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                save(step)
        return {"step": step, **last_eval}
    finally:
        interrupts.__exit__()
        if progress:
            progress.close()
        collector.close()
        run.close()
