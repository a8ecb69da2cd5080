"""From a step's groups to what the trainer takes and what the run records of them: the typed
batch (advantages, D3S down-sampling), the trained-groups ledger, and the rules that stop a run
after too many bad steps (non-finite losses, collections with nothing to train on)."""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

from rollover.config import Config
from rollover.loops.samples import log_samples
from rollover.rollout.groups import DROP_COUNTS, group_advantages
from rollover.rollout.stops import TooManyBadSteps, TooManyEmptyCollections

if TYPE_CHECKING:
    from rollover.loops.common import Run

log = logging.getLogger("rollover")


def bad_steps_error(run: Run, step: int) -> TooManyBadSteps | None:
    """The error that stops a run after `train.max_bad_steps` non-finite steps in a row."""
    n, limit = run.trainer.bad_steps, run.cfg.train.max_bad_steps
    if n < limit:
        return None
    return TooManyBadSteps(f"{n} steps in a row had a non-finite loss or gradient (train.max_bad_steps={limit}); "
                           f"stopped at step {step} with a checkpoint in {run.cfg.run_dir}/checkpoints")


class EmptyCollections:
    """Collections with no trainable group (every group skipped for failed samples or, with
    dynamic sampling, filtered for equal rewards), in a row. Each is counted and the step is
    collected again from the next prompts, at the same step and weights; `train.max_bad_steps`
    in a row stop the run after a checkpoint. Their losses are reported with the step that
    trains next (`rollout/empty_collections` and the counts in `FOLDED`)."""

    # counts and the seconds they took (an episode's averages are not carried)
    FOLDED = (*DROP_COUNTS, "generated_tokens", "rounds", "generate_s", "reward_s", "env/episodes", "env/failed",
              "env/timed_out", "env/resampled")

    def __init__(self):
        self.count = 0
        self.lost: Counter = Counter()

    def state_dict(self) -> dict:
        """What a checkpoint taken after empty collections keeps of them (a signal stops the run
        there): the next step's row reports them after a resume as it would have."""
        return {"count": self.count, "lost": dict(self.lost)}

    def load_state_dict(self, state: dict | None) -> None:
        if state:  # (a checkpoint written before these were kept has none)
            self.count, self.lost = state["count"], Counter(state["lost"])

    def add(self, run: Run, step: int, gen: dict) -> TooManyEmptyCollections | None:
        """Count an empty collection for the (step+1)-th step; the error that stops the run
        when it is the `train.max_bad_steps`-th in a row."""
        self.count += 1
        self.lost.update({k: v for k, v in gen.items() if self.folded(k)})
        limit = run.cfg.train.max_bad_steps
        log.warning("step %d: no trainable group (%d groups skipped, %d filtered, %d samples dropped); collecting "
                    "again from the next prompts (%d of train.max_bad_steps=%d in a row)", step + 1,
                    gen.get("skipped_groups", 0), gen.get("filtered_groups", 0), gen.get("dropped_samples", 0),
                    self.count, limit)
        if self.count < limit:
            return None
        return TooManyEmptyCollections(
            f"{self.count} collections in a row produced no trainable group (every group skipped for samples "
            "without a reward: a failed reward call under reward.on_error=skip, a failed episode, or rewards that "
            f"returned None; or, with dynamic sampling, filtered for equal rewards; train.max_bad_steps={limit}); "
            f"stopped at step {step} with a checkpoint in {run.cfg.run_dir}/checkpoints")

    @classmethod
    def folded(cls, key: str) -> bool:
        """Whether a collector metric is a count the next training step carries: `FOLDED`, and
        each reward function's errors and timeouts (`rewards/<fn>/errors`, a part of `reward_errors`;
        `rewards/<fn>/timeouts`)."""
        return key in cls.FOLDED or (key.startswith("rewards/") and key.endswith(("/errors", "/timeouts")))

    def fold(self, gen: dict) -> dict:
        """The training step's collector metrics with the empty collections before it added in."""
        out = {**gen, "empty_collections": self.count}
        for k, v in self.lost.items():
            out[k] = out.get(k, 0) + v
        self.count, self.lost = 0, Counter()
        return out


def train_batch_from(groups, cfg: Config, step: int = 1):
    """Advantages, then the typed tensor batch the trainer takes (for the `step`-th training
    step: D3S down-sampling, when configured, keeps its subset of samples and tokens)."""
    from rollover.train.batch import TrainBatch

    token_adv = None
    if cfg.env.credit != "episode" and cfg.algorithm.advantage == "gae":  # each turn's reward where it was earned
        from rollover.rollout.episodes import turn_rewards

        adv, token_adv, info = turn_rewards(groups)
    elif cfg.env.credit != "episode":  # each turn its own advantage (downsample is refused with it)
        from rollover.rollout.episodes import gigpo_credit, turn_credit

        adv, token_adv, info = (gigpo_credit if cfg.env.credit == "gigpo" else turn_credit)(groups, cfg)
    else:
        adv, info = group_advantages(groups, cfg)
    rollouts = [r for g in groups for r in g.rollouts]
    d = cfg.downsample
    if d.keep or d.token_fraction < 1 or d.token_fraction_start is not None:
        from rollover.rollout.downsample import downsample

        rollouts, adv, kept = downsample(groups, [float(a) for a in adv], d, step)
        info = {**info, **kept}
    return TrainBatch.from_rollouts(rollouts, adv, token_adv), info


def advantage_metrics(adv_info: dict) -> dict:
    """A step's advantage figures: flat groups, GiGPO's step groups (env.credit=gigpo: how many,
    their mean size, the turns alone in theirs), and the down-sampling's (when on)."""
    out = {"adv/zero_std_groups": adv_info.get("zero_std_groups", 0)}
    out.update({f"adv/{k}": v for k, v in adv_info.items() if k.startswith("step_")})
    out.update({k: v for k, v in adv_info.items() if k.startswith("downsample/")})
    return out


def ledger_rows(groups, kept: list[list[int]] | None = None) -> list[dict]:
    """What `trained_groups.jsonl` records of each trained group (`samples`: those trained, of
    each group the `kept` ones where D3S down-sampling chose some, and then `generated`: how many
    it had; `dropped`: its failed samples, left out)."""
    rows = []
    for i, g in enumerate(groups):
        trained = g.rollouts if kept is None else [g.rollouts[j] for j in kept[i]]
        rows.append({"group": g.id, "prompt": g.prompt.id, "samples": len(trained),
                     **({"generated": len(g.rollouts)} if kept is not None else {}), "dropped": g.dropped,
                     "start_version": g.start_version, "tokens": sum(len(r.response_ids) for r in trained),
                     "lengths": [len(r.response_ids) for r in trained]})
    return rows


def record_step(run: Run, step: int, metrics: dict, groups, batch, collected: dict | None = None,
                kept: list[list[int]] | None = None) -> None:
    """A trained step on record: its metrics row (`samples`: the batch's), its groups in the
    ledger (`kept`: each group's samples D3S down-sampling kept), and (every `logging.samples`
    steps) its samples."""
    run.logger.log(step, {**metrics, "samples": len(batch),  # (D3S trains fewer than the groups hold)
                          "data/epochs": run.train_iter.epochs_drawn})  # passes over the prompts drawn
    run.logger.log_groups(step, ledger_rows(groups, kept))
    log_samples(run, step, groups, batch, collected, kept)
