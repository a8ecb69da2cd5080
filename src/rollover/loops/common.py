"""The run a loop drives (`Run`): its parts, next prompts, evaluation, checkpoints.

`rollover.loops.build.build_run(cfg)` builds one from a config; the loops (`sync.py`,
`async_.py`) drive it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING

import torch

from rollover.config import Config, ConfigError, dump_config
from rollover.loops.prompts import MediaStore, _named_eval
from rollover.loops.resume import has_metrics
from rollover.rewards import RewardRunner, TrainerState
from rollover.rollout.groups import PendingGroup, eval_metrics, sampling_from
from rollover.rollout.inputs import RolloutInputs
from rollover.train import checkpoint
from rollover.train.weight_sync import WeightSync
from rollover.types import Prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rollover.data import MixedIterator, PromptIterator
    from rollover.engine import Engine
    from rollover.envs.base import EnvGroupBuilder
    from rollover.metrics import MetricsLogger
    from rollover.rollout.core import EnvRunner
    from rollover.rollout.curation import TurnBudget
    from rollover.rollout.selection import PromptSelection
    from rollover.train.api import TrainerAPI

log = logging.getLogger("rollover")



@dataclass
class Run:
    """What a loop drives: the parts of a run, built by `build_run`."""

    cfg: Config
    device: torch.device
    tokenizer: PreTrainedTokenizerBase
    model: torch.nn.Module  # the trainer's policy (HF module, maybe peft-wrapped)
    engine: Engine
    trainer: TrainerAPI  # one process, a Ray actor, or N FSDP ranks
    train_iter: PromptIterator | MixedIterator
    eval_prompts: list[Prompt]
    rewards: RewardRunner
    prompt_ids: dict[str, list[int]]  # rendered prompts by Prompt.id
    logger: MetricsLogger | _NoRecord
    start_step: int = 0
    serial: int = 0  # prompts drawn so far (seeds sampling; survives resume)
    resumed_extra: dict = field(default_factory=dict)
    data_skipped: int = 0
    checkpoint: Path | None = None  # the checkpoint whose weights and state were restored
    env_builder: EnvGroupBuilder | None = None  # env.name's group builder (multi-turn episodes); None: single-turn
    env_runner: EnvRunner | None = None  # where environment calls run
    env_workers: object | None = None  # ray.env_workers: the RayEnvBuilder whose actors hold the environments
    turn_budget: TurnBudget | None = None  # env.dynamic_turns: per-task turn limits
    lock: IO | None = None  # the open RUN_DIR/.lock this process holds while it writes there
    weights: WeightSync | None = None  # the trainer -> engine seam
    selection: PromptSelection | None = None  # selection.policy other than uniform
    eval_sources: dict[str, str] = field(default_factory=dict)  # held-out prompt id -> its source (eval/<source>/...)
    last_eval: tuple[int, dict] | None = None  # the latest evaluation's step and metrics (a checkpoint's eval.json)
    media: MediaStore | None = None  # prompts with images: their pixel values by prompt (a vision-language model)
    env_processor: object | None = None  # episodes with a vision-language model: its processor renders their images

    # ------------------------------------------------------------ prompts
    def next_groups(self, k: int, version: int) -> list[PendingGroup]:
        """The next k prompts (from the data order, or chosen by `selection.policy`) as pending
        groups of `samples_per_prompt` samples (or sized by `selection.allocation`), after a
        greedy one under ReMax."""
        out = []
        n = self.cfg.rollout.samples_per_prompt
        if self.selection is None:
            prompts = self.train_iter.next_batch(k)
            sizes = [n] * k
        else:
            prompts = self.selection.next(self.train_iter, k, version)
            sizes = self.selection.sizes(prompts, n)
        greedy = self.cfg.algorithm.advantage == "remax"  # each group's first request: its greedy baseline
        for p, size in zip(prompts, sizes):
            gid = f"g{self.serial}"
            out.append(PendingGroup(id=gid, prompt=p, prompt_ids=self.prompt_ids[p.id], serial=self.serial,
                                    n=size + greedy, start_version=version, media=self.media(p) if self.media else None,
                                    max_turns=self.turn_budget.limit(p.id) if self.turn_budget else None,
                                    greedy_first=greedy))
            self.serial += 1
        return out

    # ------------------------------------------------------------ eval
    def sample(self, prompts: list[Prompt], n: int, temperature: float, tag: str, first: int = 0) -> list[PendingGroup]:
        """`n` samples (or episodes) of each of `prompts` with the current weights, outside
        training (evaluation, `rollover filter`): complete groups, not yet scored. `first`: the
        place of `prompts[0]` in a longer list sampled in parts, which seeds its samples apart."""
        from rollover.rollout.core import run_groups

        self.engine.settle()  # lazy pulls: every worker holds the current weights first
        sp = replace(sampling_from(self.cfg), temperature=temperature)
        pending = [PendingGroup(id=f"{tag}-{i}", prompt=p, prompt_ids=self.prompt_ids[p.id], serial=10**9 + first + i,
                                n=n, start_version=self.engine.version, media=self.media(p) if self.media else None)
                   for i, p in enumerate(prompts)]
        paused = self.engine.paused  # APRIL keep_kv pauses it between steps
        if paused:
            self.engine.resume()
        try:
            run_groups(RolloutInputs.of(self), pending, sp, self.cfg.seed, "evaluation")
        finally:
            if paused:
                self.engine.pause()
        return pending

    def evaluate(self, step: int) -> dict:
        """Sample the held-out prompts (or episodes) with the current weights; reward, accuracy."""
        cfg = self.cfg
        self.engine.settle()  # lazy pulls: every worker holds the current weights, evaluated or not
        if not self.eval_prompts:
            return {}
        pending = self.sample(self.eval_prompts, cfg.eval.samples_per_prompt, cfg.eval.temperature, f"eval-{step}")
        least = 1 if _named_eval(cfg) else 2  # named sets always; data_source values when several
        if self.env_builder is not None:
            from rollover.rollout.episodes import episode_eval_metrics

            metrics = episode_eval_metrics(pending, cfg, self.eval_sources, least)
            groups = None
        else:
            metrics, groups = eval_metrics(pending, RolloutInputs.of(self), self.eval_sources, least)
        self.logger.log(step, metrics, kind="eval")
        self.last_eval = (step, metrics)
        if cfg.logging.eval_samples:
            from rollover.loops.samples import eval_sample_rows

            if groups is None:  # episodes: their rollouts with turns, as training logs them
                from rollover.rollout.episodes import to_group

                groups = [to_group(pg, [pg.done[j] for j in range(pg.n)]) for pg in pending[: cfg.logging.eval_samples]]
            self.logger.log_samples(step, eval_sample_rows(step, groups, self.tokenizer, cfg, self.primary_reward,
                                                           self.eval_sources), kind="eval")
        return metrics

    def resumed_evaluation(self, step: int) -> dict:
        """At the start of a loop, the evaluation of the resumed checkpoint's step where one was
        due there: a signal ends a step at its checkpoint, before its evaluation, so one missing
        is run now (and added to the checkpoint), and a resumed run logs every evaluation an
        unstopped run does; one the checkpoint holds is read back (a finished run reports it)."""
        cfg = self.cfg
        if self.checkpoint is None or step == 0 or not self.eval_prompts:
            return {}
        if not (step == cfg.steps or (cfg.eval.every and step % cfg.eval.every == 0)):
            return {}
        recorded = checkpoint.read_evaluation(self.checkpoint)
        if recorded is None:  # logged but not in the checkpoint (one written without it): the row stands
            from rollover.metrics import read_metrics

            rows = [r for r in read_metrics(cfg.run_dir, kind="eval") if r["step"] == step] \
                if has_metrics(Path(cfg.run_dir)) else []
            recorded = {k: v for k, v in rows[-1].items() if k not in ("step", "kind", "time")} if rows else None
        if recorded is None:
            log.info("step %d's evaluation was not run before the run stopped: running it now", step)
            recorded = self.evaluate(step)
        self.last_eval = (step, recorded)  # a save at this step again keeps it
        mine = Path(cfg.run_dir).resolve() in self.checkpoint.resolve().parents
        if mine and checkpoint.read_evaluation(self.checkpoint) is None:
            try:
                checkpoint.record_evaluation(self.checkpoint, recorded)
            except OSError as e:
                log.warning("could not add step %d's evaluation to %s: %s", step, self.checkpoint, e)
        return recorded

    @property
    def primary_reward(self) -> str:
        return "env" if self.env_builder is not None else self.rewards.rewards[0].name

    def at_step(self, step: int) -> None:
        """`step` training steps done: what reward functions read as TRL's `trainer_state`."""
        self.rewards.trainer_state = TrainerState(global_step=step, max_steps=self.cfg.steps)

    # ------------------------------------------------------------ checkpoints
    def state(self, extra: dict | None = None, *, rng: bool = False) -> dict:
        """What a checkpoint keeps besides the weights and the trainer's state: the run's data,
        prompt and selection state, `extra` (the loop's) and, with `rng`, the random generators'
        (else `save` takes theirs last, after writing the weights). Taken with `rng` before a
        step's collection, it is still the checkpoint's of the step before when the collection
        fails (`save(step, state=...)`)."""
        return {"data": self.train_iter.state_dict(), "serial": self.serial, "version": self.engine.version,
                "turn_budget": self.turn_budget.state_dict() if self.turn_budget else None,
                "selection": self.selection.state_dict() if self.selection else None,
                **({"rng": checkpoint.rng_state()} if rng else {}), **(extra or {})}

    def save(self, step: int, extra: dict | None = None, *, state: dict | None = None) -> Path:
        """Save a checkpoint of `step`: the weights, the trainer's state and `state` (None: this
        moment's `self.state(extra)`)."""
        state = dict(state) if state is not None else self.state(extra)
        rng = state.pop("rng", None)
        c = self.cfg.checkpoint
        return checkpoint.save(self.cfg.run_dir, step, model=self.model,
                               tokenizer=self.media.renderer.processor if self.media else self.tokenizer,
                               trainer_state=self.trainer.state_dict(), extra=state, rng=rng, keep=c.keep,
                               config=dump_config(self.cfg),
                               evaluation=self.last_eval[1] if self.last_eval and self.last_eval[0] == step else None,
                               best=(c.best, c.best_mode) if c.best else None)

    def worker_metrics(self) -> dict:
        """Counts of the Ray reward and environment workers (started, died), when there are any;
        and the reward calls abandoned at their timeout whose threads still run."""
        out = {"reward/stuck_threads": self.rewards.stuck_threads()}
        for part in (getattr(self.rewards, "pool", None), self.env_workers):
            metrics = getattr(part, "metrics", None)
            if metrics is not None:
                out.update(metrics())
        return out

    def close(self) -> None:
        # environments and rewards first: they may run on Ray actors, and the engine's shutdown
        # stops a Ray instance the run started
        try:
            if self.env_runner is not None:
                self.env_runner.close()
            if self.env_workers is not None:
                self.env_workers.close()
            self.rewards.close()
            self.engine.shutdown()
        finally:
            self.trainer.close()  # last: a trainer actor (ray.trainer: actor) may own Ray
        self.logger.close()
        if self.lock is not None:
            self.lock.close()  # releases the run dir (the kernel does too if the process dies)


LOOPS = {"sync": "rollover.loops.sync.train_sync", "async": "rollover.loops.async_.train_async"}


def run_to_train(cfg: Config, run: Run | None, mode: str) -> Run:
    """The run the `mode` loop trains: `run` when it was built from `cfg` to be trained (not an
    evaluation's), else a new one. A config of the other mode is refused, as is a run built
    from another config: the loop would train one config's steps with the other's parts."""
    if not isinstance(cfg, Config):
        raise TypeError(f"{LOOPS[mode]} takes a Config, got {type(cfg).__name__}: build it with "
                        "rollover.config.load_config(path, overrides, **keys)")
    if cfg.mode != mode:
        raise ConfigError(f"mode={cfg.mode!r}, and {LOOPS[mode]} runs mode {mode!r}: train this config with "
                          f"{LOOPS[cfg.mode]}")
    if run is None:
        from rollover.loops.build import build_run

        return build_run(cfg)
    if run.cfg != cfg:
        changed = sorted(k for k in type(cfg).model_fields if getattr(cfg, k) != getattr(run.cfg, k))
        raise ValueError(f"run= was built from another config than the one given (they differ in "
                         f"{', '.join(changed)}): pass the run's own, train(run.cfg, run=run)")
    if isinstance(run.logger, _NoRecord):
        raise ValueError("run= was built with record=False, for evaluation: it writes nothing, so it cannot train "
                         "(build_run(cfg) builds one that can)")
    return run


class _NoRecord:
    """The logger of a run that writes nothing (`build_run(record=False)`)."""

    def log(self, step: int, metrics: dict, *, kind: str = "train") -> None:
        pass

    def log_groups(self, step: int, groups: list) -> None:
        pass

    def log_samples(self, step: int, rows: list, kind: str = "step") -> None:
        pass

    def close(self) -> None:
        pass
