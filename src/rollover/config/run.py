"""`Config`: a whole run's configuration, its sections, and the checks that involve several fields."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, model_validator

from rollover.config.algorithm import CLIP_DEFAULTS, AlgorithmConfig
from rollover.config.base import NonEmptyStr, Section
from rollover.config.data import DataConfig
from rollover.config.env import EnvConfig
from rollover.config.ray import RayConfig
from rollover.config.reward import RewardConfig
from rollover.config.rollout import PartialRolloutConfig, RolloutConfig
from rollover.config.schedule import AsyncConfig, DownsampleConfig, SelectionConfig
from rollover.config.train import CheckpointConfig, CriticConfig, DistillConfig, EvalConfig, LoggingConfig, TrainConfig


# the built-in rewards that score a completion against the row's answer (rollover.rewards.builtins)
ANSWER_REWARDS = ("math", "numeric", "exact", "em", "countdown", "code")
# the built-in environments that score the final text with a reward (env.options.score), and their default
ANSWER_SCORED_ENVS = {"tools": "numeric", "interpreter": "numeric", "inline_tools": "em"}


RELOAD_TO_CHANGE = ("mode", "partial_rollout", "algorithm")  # refused by assignment: see Config.__setattr__


class Config(Section):
    run_dir: NonEmptyStr = "runs/default"
    """Where metrics, checkpoints and plots go."""
    model: NonEmptyStr = "smollm2-135m-instruct"
    """A local path, a hub id, or the alias smollm2-135m-instruct."""
    seed: int = Field(0, ge=0, lt=2**32)
    """Seeds data order, sampling (per sample, so resume is exact) and initialisation."""
    steps: int = Field(20, ge=1)
    """Training steps."""
    epochs: float | None = Field(None, gt=0)
    """Passes over the training prompts, instead of steps (TRL's num_train_epochs, verl's
    total_epochs): once the data is loaded, steps = ceil(epochs x training prompts / prompts
    drawn a step), the held-out prompts and skipped rows not counted. A step draws
    rollout.prompts_per_step prompts, selection.candidates times that when selection.policy
    chooses among them; the rounds that top up a step under algorithm.dynamic_sampling draw more,
    so such a run passes over the data more often than this. The run logs the figure and records
    it as steps in RUN_DIR/config.yaml. Give steps or epochs, not both."""
    mode: Literal["sync", "async"] = "sync"
    """sync: generate -> train in turn (loops/sync.py); async: decoupled services (loops/async_.py)."""
    runtime: Literal["local", "ray"] = "local"
    """local: one process; ray: rollout workers as Ray actors (section ray), the same loops."""
    resume: NonEmptyStr = "auto"
    """auto: continue from the latest checkpoint in run_dir if any; never; or a checkpoint path.
    Resuming under a config that changes what is trained (anything outside
    `RESUME_FREE_KEYS`) is refused unless allowed (`rollover train --allow-config-change`)."""
    device: str = Field("auto", pattern=r"^(auto|cpu|mps|cuda(:[0-9]+)?)$")
    """auto (cuda if available), cpu, cuda, cuda:N, mps."""
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    partial_rollout: PartialRolloutConfig = PartialRolloutConfig()
    reward: RewardConfig = RewardConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    train: TrainConfig = TrainConfig()
    critic: CriticConfig = CriticConfig()
    distill: DistillConfig = DistillConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    async_: AsyncConfig = AsyncConfig()
    env: EnvConfig = EnvConfig()
    selection: SelectionConfig = SelectionConfig()
    downsample: DownsampleConfig = DownsampleConfig()
    ray: RayConfig = RayConfig()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in RELOAD_TO_CHANGE:  # the default loss follows them, set when the config was loaded
            raise AttributeError(
                f"cfg.{name} is not assigned: the default algorithm.loss follows mode and partial_rollout "
                f"(decoupled PPO for async and APRIL), and was set when the config was loaded; load it again with "
                f"the new {name} (load_config(path, [\"{name}=...\"]) or load_config(..., {name}=...))")
        super().__setattr__(name, value)

    @model_validator(mode="before")
    @classmethod
    def _no_simulate_section(cls, data: Any) -> Any:
        """A training config with `rollover simulate`'s section: said plainly, not as a typo."""
        if isinstance(data, dict) and "simulate" in data and "simulate" not in cls.model_fields:
            raise ValueError("unknown key 'simulate': that section (a simulated cluster) is read by `rollover "
                             "simulate` (docs/simulator_config.md); training has none: run the file with `rollover "
                             "simulate`, or delete the section")
        return data

    @model_validator(mode="before")
    @classmethod
    def _async_alias(cls, data: Any) -> Any:
        if isinstance(data, dict) and "async" in data:
            data = dict(data)
            data["async_"] = data.pop("async")
        if isinstance(data, dict):
            algo = data.get("algorithm")
            if isinstance(algo, BaseModel) and getattr(algo, "loss", None) is not None:
                return data  # settled (an assignment to another field passes the config's own)
            if isinstance(algo, BaseModel):  # an AlgorithmConfig object: what it was given, the loss settled below
                algo = algo.model_dump(exclude_unset=True)
                data = {**data, "algorithm": algo}
            if not isinstance(algo, dict) or algo.get("loss") is None:
                data = dict(data)
                algo = dict(algo) if isinstance(algo, dict) else {}
                pr = data.get("partial_rollout")
                april = bool(pr.get("enabled") if isinstance(pr, dict) else getattr(pr, "enabled", False))
                # async and APRIL train tokens sampled under older weights: correct for them
                algo["loss"] = "decoupled_ppo" if data.get("mode") == "async" or april else "ppo"
                data["algorithm"] = algo
        return data

    @property
    def simulated_episodes(self) -> bool:
        """Whether samples are `rollover simulate`'s simulated episodes (its config, a subclass in
        rollover/sim/config.py, says when); a training run's never are. The checks below that
        concern episodes hold for them as for a real environment's."""
        return False

    @property
    def finds_stop_strings(self) -> bool:
        """Whether the run's engines look for stop strings (they then get the model's tokenizer):
        `rollout.stop`'s, or those an environment gives a turn (`StepResult.stop`)."""
        return bool(self.rollout.stop) or self.env.name is not None

    @property
    def april_carry(self) -> tuple[str, str]:
        """APRIL's carry mode (`resubmit` or `keep_kv`, resolving `auto`) and why."""
        p, a = self.partial_rollout, self.algorithm
        if p.carry != "auto":
            return p.carry, f"partial_rollout.carry={p.carry} in the config"
        if self.env.name is not None or self.simulated_episodes:  # real or simulated episodes
            return "resubmit", "episodes carry their tokens and environment state"
        if self.train.colocate and self.train.colocate_free_weights and self.rollout.engine == "vllm":
            return "resubmit", "vLLM in the trainer ranks sleeps while they train, which frees every request's K/V"
        corrected = a.stale_corrections
        if not corrected:
            return "resubmit", (f"algorithm.loss={a.loss} without tis_cap, m2po_tau or importance weights in "
                                "loss_options does not correct tokens sampled under older weights, so their K/V "
                                "is recomputed")
        engine = "TorchEngine" if self.rollout.engine == "torch" else "vLLM"
        return "keep_kv", (f"{engine} keeps K/V across weight updates and {corrected[0]} corrects the "
                           "older tokens: no carried prefix is prefilled again")

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> "Config":
        """Checks across fields (each field's own range is declared with the field)."""
        r, a, p, t = self.rollout, self.algorithm, self.partial_rollout, self.train
        problems = []
        if self.epochs is not None and "steps" in self.model_fields_set:
            problems.append(f"steps={self.steps} and epochs={self.epochs:g} both say how long to train: give one")
        if a.dynamic_sampling and r.samples_per_prompt < 2 and a.advantage != "remax":
            problems.append("algorithm.dynamic_sampling needs rollout.samples_per_prompt >= 2 (a group of 1 has no variance)")
        teacher_alone = self.distill.teacher is not None and self.distill.outcome_weight == 0
        if a.advantage not in ("reinforce_pp", "gae", "remax") and r.samples_per_prompt < 2 and not teacher_alone:
            problems.append(f"algorithm.advantage={a.advantage} compares samples of a group: rollout.samples_per_prompt must be >= 2")
        if a.loss in ("gspo", "gspo_token") and a.aggregation not in ("seq-mean-token-mean", "seq-mean-token-sum"):
            problems.append(f"algorithm.loss={a.loss} is defined with aggregation=seq-mean-token-mean (GSPO) or "
                            "seq-mean-token-sum (LUSPO: each sequence's loss times its length); set one explicitly")
        if a.overlong_buffer >= r.max_new_tokens:
            problems.append(f"algorithm.overlong_buffer={a.overlong_buffer} must be smaller than "
                            f"rollout.max_new_tokens={r.max_new_tokens}")
        if p.min_oversample > p.max_oversample:
            problems.append(f"partial_rollout.min_oversample={p.min_oversample} exceeds max_oversample={p.max_oversample}")
        if p.enabled and p.adaptive and not p.min_oversample <= p.oversample <= p.max_oversample:
            problems.append(f"partial_rollout.oversample={p.oversample} must lie in [min_oversample, max_oversample] = "
                            f"[{p.min_oversample}, {p.max_oversample}]")
        weighs = [c for c in a.stale_corrections if "m2po" not in c]  # (M2PO masks tokens: it weighs none)
        if p.enabled and p.on_stale == "is" and not weighs:
            problems.append("partial_rollout.on_stale=is weights stale tokens by importance sampling: set "
                            "algorithm.loss=decoupled_ppo, algorithm.tis_cap or algorithm.loss_options.is_level")
        if p.enabled and p.score_lag and p.on_stale != "is" and p.max_carry_steps == 0:
            problems.append(f"partial_rollout.score_lag={p.score_lag} carries complete groups one version old into the "
                            f"next step, which max_carry_steps=0 with on_stale={p.on_stale} throws away: set score_lag 0 "
                            "or max_carry_steps >= 1")
        if not self.data.chat_template and self.env.name is None:
            problems += [f"data.{k} goes to the chat template, which data.chat_template=false leaves out: drop one"
                         for k in ("system_prompt", "chat_template_kwargs") if getattr(self.data, k)]
        if r.quantize != "none" and r.engine != "torch":
            problems.append(f"rollout.quantize={r.quantize} is TorchEngine's (rollout.engine=torch)")
        if self.mode == "async" and p.enabled:
            problems.append("partial_rollout.enabled applies to sync mode; async mode already overlaps generation "
                            "with training and carries in-flight requests across weight updates "
                            "(rollout.inflight_weight_update)")
        problems += self._selection_problems() + self._train_problems() + self._ray_problems()
        if not (info.context or {}).get("recorded"):  # a run's own config.yaml loads as it was accepted
            problems += self._unused_keys()
        if self.runtime == "local" and self.ray != RayConfig():
            problems.append("the ray section is set but runtime is local; set runtime: ray")
        if self.mode == "sync" and self.async_ != AsyncConfig():
            problems.append("the async section is set but mode is sync; set mode: async")
        longest, what = self.longest_sequence()
        if t.micro_batch_tokens is not None and t.micro_batch_tokens < (t.pack_length or longest):
            problems.append(f"train.micro_batch_tokens={t.micro_batch_tokens} must be >= train.pack_length "
                            f"({t.pack_length or f'default: {what} = {longest}'})")
        if t.pack_length is not None and t.pack_length < longest:
            problems.append(f"train.pack_length={t.pack_length} must hold the longest sequence: {what} = {longest}")
        problems += self._env_problems()
        d = self.data
        if d.train_weights is not None and (not isinstance(d.train, dict) or set(d.train_weights) != set(d.train)):
            names = sorted(d.train) if isinstance(d.train, dict) else "one source"
            problems.append(f"data.train_weights names {sorted(d.train_weights)}; data.train has {names}: give a "
                            "weight to each of several named sources")
        if not d.require_answer and d.train != "env" and (compares := self._answer_user()):
            problems.append(f"data.require_answer=false keeps rows without an answer, and {compares} compares the "
                            "completion with the answer: keep require_answer true, or score with what needs none "
                            "(format, reward_model, judge, your own functions)")
        c = self.checkpoint
        if c.best is not None:
            if not c.best.startswith("eval/"):
                problems.append(f"checkpoint.best={c.best!r} names an evaluation metric: eval/accuracy, eval/pass_at_k, ...")
            elif not self.eval.every or not c.every or c.every % self.eval.every:
                problems.append(f"checkpoint.best needs an evaluation at every checkpoint: checkpoint.every={c.every} "
                                f"must be a multiple of eval.every={self.eval.every} (both >= 1)")
        if t.mini_batches > r.prompts_per_step:
            problems.append(f"train.mini_batches={t.mini_batches} cannot exceed rollout.prompts_per_step="
                            f"{r.prompts_per_step} (a mini-batch holds whole groups)")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _answer_user(self) -> str | None:
        """What in this run compares a completion with its row's answer (a built-in reward, an
        environment's built-in score, a game whose task is the answer), or None."""
        e = self.env
        if e.name is None:
            named = [f if isinstance(f, str) else f["fn"] for f in self.reward.functions]
            return next((f"reward {n!r}" for n in named if n in ANSWER_REWARDS), None)
        if e.name in ("guess_number", "arithmetic_retry"):
            return f"env.name={e.name} (its task's solution is the row's answer)"
        score = e.options.get("score", ANSWER_SCORED_ENVS.get(e.name))
        return f"env.name={e.name}'s score {score!r}" if isinstance(score, str) and score in ANSWER_REWARDS else None

    def _selection_problems(self) -> list[str]:
        """Prompt selection, down-sampling and the loss's options."""
        a = self.algorithm
        problems = []
        s = self.selection
        if s.allocation != "fixed" and s.min_samples > self.rollout.samples_per_prompt:
            problems.append(f"selection.min_samples={s.min_samples} must be <= rollout.samples_per_prompt="
                            f"{self.rollout.samples_per_prompt} (the mean group size allocation keeps)")
        d = self.downsample
        if d.keep and not 2 <= d.keep < self.rollout.samples_per_prompt:
            problems.append(f"downsample.keep={d.keep} must be >= 2 (a group baseline) and below "
                            f"rollout.samples_per_prompt={self.rollout.samples_per_prompt} (0: train every sample)")
        if d.token_fraction_start is not None and d.anneal_steps == 0:
            problems.append("downsample.token_fraction_start needs downsample.anneal_steps >= 1 (the steps it moves over)")
        if s.dars != "off":
            episodes = self.env.name is not None or self.simulated_episodes
            if self.mode != "sync" or self.partial_rollout.enabled or episodes:
                problems.append("selection.dars (a second generation stage inside a step) runs in sync mode "
                                "without partial_rollout and without env")
            if s.dars_max_samples is not None and s.dars_max_samples <= self.rollout.samples_per_prompt:
                problems.append(f"selection.dars_max_samples={s.dars_max_samples} must be above "
                                f"rollout.samples_per_prompt={self.rollout.samples_per_prompt} (room for extra samples)")
        if a.advantage == "remax" and s.dars != "off":
            problems.append("algorithm.advantage=remax with selection.dars: DARS's second stage adds samples that no "
                            "greedy answer of theirs was generated beside; use one or the other")
        if a.advantage == "gdpo" and (self.env.name is not None or a.overlong_buffer):
            what = f"env.name={self.env.name!r} scores episodes" if self.env.name is not None else \
                f"algorithm.overlong_buffer={a.overlong_buffer} adds to their total"
            problems.append(f"algorithm.advantage=gdpo normalises each reward function's scores; {what}, not the "
                            "reward functions (for a length penalty, give it as a reward function)")
        problems += self._critic_problems()
        problems += self._token_baseline_problems()
        problems += self._distill_problems()
        fields = type(a).model_fields
        moved = [k for k in ("entropy_coef_delta", "entropy_coef_min", "entropy_coef_max") if getattr(a, k) != fields[k].default]
        if a.entropy_target is None and moved:
            problems.append(f"algorithm.{', '.join(moved)} steer adaptive entropy control: set algorithm.entropy_target too")
        if a.entropy_target is not None and not a.entropy_coef_min <= a.entropy_coef <= a.entropy_coef_max:
            problems.append(f"algorithm.entropy_coef={a.entropy_coef} is where adaptive entropy control starts: it must "
                            f"lie in [entropy_coef_min, entropy_coef_max] = [{a.entropy_coef_min}, {a.entropy_coef_max}]")
        if a.kl_is_correction and a.kl_coef <= 0:
            problems.append("algorithm.kl_is_correction weighs the KL term, which algorithm.kl_coef=0 leaves out")
        if a.ref_mixup_alpha != fields["ref_mixup_alpha"].default and a.ref_sync_every is None:
            problems.append(f"algorithm.ref_mixup_alpha={a.ref_mixup_alpha} is the weight of a reference sync: set "
                            "algorithm.ref_sync_every too")
        if a.ref_sync_every is not None and (not a.uses_reference or self.train.lora is not None):
            why = "algorithm.kl_coef=0 and kl_in_reward=0 load no reference" if not a.uses_reference else \
                "with train.lora the reference is the base model under the adapter, which a sync would move"
            problems.append(f"algorithm.ref_sync_every={a.ref_sync_every} has no reference to move: {why}")
        if a.loss_options or (a.dual_clip is not None and a.loss is not None):  # now, not at the first update
            from rollover.algos.loss_options import check_loss_options

            wrong = check_loss_options(a)
            if wrong:
                given = f"algorithm.loss_options={a.loss_options}" if a.loss_options else f"algorithm.dual_clip={a.dual_clip}"
                problems.append(f"{given} for algorithm.loss={a.loss}: {wrong}")
        return problems

    @property
    def requests_per_group(self) -> int:
        """The requests a prompt's group sends: its samples, and ReMax's greedy answer."""
        return self.rollout.samples_per_prompt + (self.algorithm.advantage == "remax")

    def _distill_problems(self) -> list[str]:
        """On-policy distillation (distill.teacher) and what it does not combine with yet."""
        d, a = self.distill, self.algorithm
        fields = type(d).model_fields
        moved = [k for k in ("loss", "beta", "weight", "outcome_weight", "dtype") if getattr(d, k) != fields[k].default]
        if d.teacher is None:
            return [f"distill.{', distill.'.join(moved)} without distill.teacher: set the teacher they apply to"] if moved else []
        out = []
        # (by value, not by what was set: a run's config.yaml holds every key and must load again)
        if d.loss == "sampled" and d.beta != fields["beta"].default:
            out.append(f"distill.beta={d.beta} weighs the divergence of distill.loss=jsd; distill.loss is sampled")
        if a.advantage == "gae":
            out.append("distill.teacher with algorithm.advantage=gae: the critic's advantages and the teacher's term "
                       "are not combined yet; use a group estimator (grpo, drgrpo, rloo, ...)")
        if d.loss == "jsd":  # the sampler's logprob and one advantage a token play no part in the divergence
            return out + self._d3s_and_dynamic_sampling_with_teacher()
        if a.loss == "gspo":
            out.append("distill.teacher gives each token its own advantage; algorithm.loss=gspo clips one ratio per "
                       "sequence with one advantage per sequence: use gspo_token")
        out += self._d3s_and_dynamic_sampling_with_teacher()
        r = self.rollout
        cut = [f"rollout.{k}={v}" for k, v, off in (("top_p", r.top_p, 1.0), ("top_k", r.top_k, 0),
                                                     ("min_p", r.min_p, 0.0), ("repetition_penalty", r.repetition_penalty, 1.0))
               if v != off]
        if cut:
            out.append(f"distill.teacher with {', '.join(cut)}: the sampler's logprobs are then of a cut or penalised "
                       "distribution, not the policy's, and the teacher's term would push toward what the cut removes")
        return out

    def _d3s_and_dynamic_sampling_with_teacher(self) -> list[str]:
        """What picks samples by the rewards alone, which a teacher's signal would be lost to."""
        out, dw = [], self.downsample
        if dw.keep or dw.token_fraction < 1 or dw.token_fraction_start is not None:
            out.append("distill.teacher with downsample: D3S picks samples and tokens by the rewards' advantage "
                       "before the teacher's term is known")
        if self.algorithm.dynamic_sampling and self.distill.outcome_weight == 0:
            out.append("algorithm.dynamic_sampling with distill.outcome_weight=0: the rewards, which do not train, "
                       "would still drop the groups whose samples score alike (the teacher has a signal for them)")
        return out

    def _unused_keys(self) -> list[str]:
        """Keys of the algorithm section moved from their defaults where nothing reads them (a
        setting silently left unused reads as one that took effect). Moved, not given: a run's
        saved config.yaml gives every key."""
        a, out = self.algorithm, []
        fields = type(a).model_fields
        given = {k for k in a.model_fields_set if getattr(a, k) != fields[k].default}
        clips = [k for k in ("eps_low", "eps_high") if k in given]
        if clips and a.loss in ("sapo", "vespo", "bapo", "reinforce"):
            how = {"sapo": "its soft gate is steered by loss_options tau_pos, tau_neg",
                   "vespo": "it weighs whole sequences (loss_options k_pos, lambda_pos, k_neg, lambda_neg)",
                   "bapo": "it chooses its bounds (loss_options low_start, low_max, high_start, high_max)",
                   "reinforce": "it has no ratio to clip"}[a.loss]
            out.append(f"algorithm.{' and '.join(clips)} for algorithm.loss={a.loss}, which clips nothing by them: {how}")
        if "overlong_penalty" in given and not a.overlong_buffer:
            out.append(f"algorithm.overlong_penalty={a.overlong_penalty:g} weighs DAPO's overlong shaping, which "
                       "algorithm.overlong_buffer=0 leaves off: set the buffer's length too")
        for k, what in (("max_resample_rounds", "bounds dynamic sampling's rounds"),
                        ("dynamic_sampling_metric", "says what dynamic sampling compares")):
            if k in given and not a.dynamic_sampling:
                out.append(f"algorithm.{k}={getattr(a, k)} {what}: set algorithm.dynamic_sampling: true too")
        if a.tis_cap is not None and "is_cap" in a.loss_options:
            out.append(f"algorithm.tis_cap={a.tis_cap:g} and algorithm.loss_options.is_cap="
                       f"{a.loss_options['is_cap']} both cap the importance weight: give one")
        own = dict(zip(("eps_low", "eps_high"), CLIP_DEFAULTS.get(a.loss, (fields["eps_low"].default,
                                                                         fields["eps_high"].default))))
        for k in ("eps_low", "eps_high", "dual_clip", "m2po_tau"):  # loss_options would win, silently
            mine = getattr(a, k)
            if k in a.loss_options and mine is not None and mine != own.get(k) and mine != a.loss_options[k]:
                out.append(f"algorithm.{k}={mine:g} and algorithm.loss_options.{k}={a.loss_options[k]} "
                           "both set it: give one")
        moved = _moved(self.train, "weight_bucket_mb", "collective_timeout_s")
        if moved and self.train.parallel != "fsdp":
            out.append(f"train.{' and train.'.join(moved)} apply to the sharded trainer's ranks "
                       "(train.parallel=fsdp); one trainer uses neither")
        if self.async_.dynamic_samples and self.selection.allocation == "xrpo":
            out.append("async.dynamic_samples and selection.allocation=xrpo both size the groups: choose one")
        return out

    def unused_settings(self) -> list[str]:
        """Settings of a feature the config turns off or a mode it does not run, for a warning
        when the run starts: switching a feature off for a comparison keeps its settings, so
        these are not refused as the algorithm's are (selection, async, partial_rollout,
        downsample, rollout.inflight_weight_update)."""
        sel, out = self.selection, []
        unused = {"candidates": sel.policy == "uniform",
                  "alpha0": "thompson" not in sel.policy, "beta0": "thompson" not in sel.policy,
                  "min_attempts": "skip_saturated" not in sel.policy, "reprobe_every": "skip_saturated" not in sel.policy,
                  "decay": sel.policy == "uniform" and sel.allocation == "fixed",
                  "min_samples": sel.allocation != "xrpo", "dars_max_samples": sel.dars == "off"}
        moved = _moved(sel, *(k for k, off in unused.items() if off))
        if moved:
            out.append(f"selection.{', selection.'.join(moved)} unused: selection.policy={sel.policy}, "
                       f"allocation={sel.allocation}, dars={sel.dars} read none of them")
        if not self.async_.dynamic_samples and _moved(self.async_, "min_samples"):
            out.append("async.min_samples unused: it bounds DART's dynamic samples, which async.dynamic_samples turns on")
        if self.mode == "async" and (moved := _moved(self.partial_rollout, *type(self.partial_rollout).model_fields)):
            out.append(f"partial_rollout.{', partial_rollout.'.join(moved)} unused: they configure APRIL, a sync-mode "
                       "collector; async mode bounds its samples' age by async.max_staleness")
        if self.downsample.token_fraction_start is None and _moved(self.downsample, "anneal_steps"):
            out.append("downsample.anneal_steps unused: it anneals from downsample.token_fraction_start, which is unset")
        if self.mode == "sync" and _moved(self.rollout, "inflight_weight_update"):
            how = "APRIL's partial_rollout.carry decides" if self.partial_rollout.enabled else "nothing is in flight"
            out.append(f"rollout.inflight_weight_update unused: it applies to mode: async; at a sync step's weight "
                       f"update {how}")
        if self.env.name is not None and (moved := _moved(self.data, "system_prompt", "instruction", "chat_template")):
            out.append(f"data.{', data.'.join(moved)} unused: env.name={self.env.name} writes each episode's opening "
                       "(an environment's system_prompt option, where it has one, sets its system message)")
        return out

    def _critic_problems(self) -> list[str]:
        """PPO with a critic (algorithm.advantage=gae) and what it does not combine with yet."""
        a, out = self.algorithm, []
        afields = type(a).model_fields
        if a.kl_in_reward == 0 and any(getattr(a, k) != afields[k].default for k in ("kl_in_reward_target",
                                                                                 "kl_in_reward_horizon")):
            out.append("algorithm.kl_in_reward_target / kl_in_reward_horizon steer the KL penalty in the reward: set "
                       "algorithm.kl_in_reward > 0 too")
        if a.advantage != "gae":
            if a.kl_in_reward > 0:
                out.append(f"algorithm.kl_in_reward={a.kl_in_reward:g} puts a KL penalty on each token's reward, which "
                           f"the critic's GAE reads: it needs algorithm.advantage=gae (for a KL term with "
                           f"algorithm.advantage={a.advantage}, set algorithm.kl_coef)")
            fields = type(self.critic).model_fields
            moved = [f"algorithm.{k}" for k in ("gamma", "lam") if getattr(a, k) != 1.0]
            moved += [f"critic.{k}" for k in fields if getattr(self.critic, k) != fields[k].default]
            if moved:
                out.append(f"{', '.join(moved)} set the critic of algorithm.advantage=gae, which "
                           f"algorithm.advantage={a.advantage} does not use")
            return out
        if self.critic.warmup_steps >= self.steps and self.epochs is None:
            out.append(f"critic.warmup_steps={self.critic.warmup_steps} trains the critic alone for that many steps: "
                       f"with steps={self.steps} the policy would never train")
        if self.env.credit == "gigpo":
            out.append("algorithm.advantage=gae gives each token its own advantage from the critic; env.credit=gigpo "
                       "gives each turn one from its state's group: use env.credit=episode or reward_to_go (each turn's "
                       "reward where it was earned, for the critic to carry back)")
        elif self.env.credit == "reward_to_go" and self.env.gamma != 1.0:
            out.append(f"env.gamma={self.env.gamma:g} discounts per turn; with algorithm.advantage=gae the critic discounts "
                       "per token (algorithm.gamma): leave env.gamma at 1")
        if a.loss == "gspo":
            out.append("algorithm.advantage=gae gives each token its own advantage; algorithm.loss=gspo clips one ratio "
                       "per sequence against one advantage: use gspo_token, its form for per-token advantages")
        d = self.downsample
        if d.keep or d.token_fraction < 1 or d.token_fraction_start is not None:
            out.append("algorithm.advantage=gae with downsample: D3S picks samples and tokens by one advantage per "
                       "sample, which the critic's per-token advantages are not")
        return out

    def _token_baseline_problems(self) -> list[str]:
        """The optimal token baseline (algorithm.advantage=otb) and what it does not combine with yet."""
        if self.algorithm.advantage != "otb":
            return []
        out, d = [], self.downsample
        if self.distill.teacher is not None:
            out.append("distill.teacher with algorithm.advantage=otb: the teacher's term and the token baseline are "
                       "not combined yet; use a group estimator (grpo, drgrpo, rloo, ...)")
        if self.env.credit != "episode":
            out.append(f"algorithm.advantage=otb gives each token its own baseline from the episode's reward; env.credit="
                       f"{self.env.credit} gives each turn one: leave env.credit at episode")
        if self.algorithm.loss == "gspo":
            out.append("algorithm.advantage=otb gives each token its own advantage; algorithm.loss=gspo clips one ratio "
                       "per sequence against one advantage: use gspo_token, its form for per-token advantages")
        if d.keep or d.token_fraction < 1 or d.token_fraction_start is not None:
            out.append("algorithm.advantage=otb with downsample: D3S picks samples and tokens by one advantage per "
                       "sample, which the token baseline's are not")
        return out

    def _train_problems(self) -> list[str]:
        """The trainer's ranks, offload and colocated engines."""
        t = self.train
        problems = []
        if t.ranks > 1 and t.parallel != "fsdp":
            problems.append(f"train.ranks={t.ranks} needs train.parallel=fsdp (one trainer cannot use several ranks)")
        if t.parallel == "fsdp" and self.runtime == "ray" and self.ray.trainer != "actor":
            problems.append("train.parallel=fsdp with runtime=ray runs the ranks as Ray actors: set ray.trainer=actor "
                            "(ray.cpus_for_trainer / ray.gpus_for_trainer are then per rank)")
        lora_dropout = (t.lora or {}).get("dropout", 0.0)
        if t.disable_dropout and lora_dropout:
            problems.append(f"train.lora.dropout={lora_dropout} would be set to 0 by train.disable_dropout=true "
                            "(the default): set train.disable_dropout=false to keep it, or drop it")
        if t.sequence_parallel > 1:
            if t.parallel != "fsdp" or t.ranks % t.sequence_parallel:
                problems.append(f"train.sequence_parallel={t.sequence_parallel} splits rows over ranks of the sharded "
                                f"trainer: it needs train.parallel=fsdp and train.ranks a multiple of it (train.ranks="
                                f"{t.ranks})")
            if t.colocate:
                problems.append("train.sequence_parallel with train.colocate: not yet (the ranks' engines would each "
                                "hold a share of a row)")
        if t.fsdp_offload and t.parallel != "fsdp":
            problems.append("train.fsdp_offload applies to train.parallel=fsdp")
        if t.colocate:
            if t.parallel != "fsdp":
                problems.append("train.colocate runs an engine in every trainer rank: it needs train.parallel=fsdp")
            if self.mode != "sync":
                problems.append("train.colocate: the ranks' engines share the devices with training, so they generate "
                                "only between steps (mode=sync, APRIL included); async mode needs engines of their own")
            if self.runtime == "ray" and {"rollout_workers", "gpus_per_worker"} & self.ray.model_fields_set:
                problems.append("train.colocate with runtime=ray: the trainer rank actors generate and no rollout "
                                "worker starts; leave ray.rollout_workers / ray.gpus_per_worker unset (or set "
                                "train.colocate=false for workers of their own)")
            if self.rollout.engine == "vllm" and t.colocate_free_weights and self.partial_rollout.carry == "keep_kv":
                problems.append("partial_rollout.carry=keep_kv with vLLM in the ranks: vLLM's sleep while the ranks train "
                                "(train.colocate_free_weights) frees the K/V that keep_kv keeps; use carry: resubmit, "
                                "or train.colocate_free_weights: false")
        elif not t.colocate_free_weights:  # the default is true: false asks for engines this run does not have
            problems.append("train.colocate_free_weights applies to the ranks' own engines: it needs train.colocate=true")
        return problems

    def _ray_problems(self) -> list[str]:
        """The Ray runtime's placement, weight transport and workers."""
        problems = []
        if self.ray.trainer == "actor" and self.device == "cuda" and not self.ray.gpus_for_trainer:
            problems.append("device=cuda with ray.trainer=actor: give the trainer actor its GPU with "
                            "ray.gpus_for_trainer (it trains on the GPUs Ray reserves for it, else on its CPUs)")
        if self.ray.trainer == "driver" and (self.ray.cpus_for_trainer != 1.0 or self.ray.gpus_for_trainer):
            problems.append("ray.cpus_for_trainer / ray.gpus_for_trainer place the trainer actor: set ray.trainer=actor "
                            "(with ray.trainer=driver the trainer uses the driver's own CPUs and GPU)")
        if self.ray.weight_transport == "gloo" and self.ray.weight_delta:
            problems.append("ray.weight_delta=true needs ray.weight_transport=object_store (gloo sends whole tensors)")
        if self.ray.weight_sync == "lazy":
            if self.mode != "async":
                problems.append("ray.weight_sync=lazy needs mode: async (a synchronous step generates with the weights "
                                "it has just trained)")
            if self.ray.weight_transport != "object_store" or self.ray.weight_delta:
                problems.append("ray.weight_sync=lazy pulls whole tensors from the object store: needs "
                                "ray.weight_transport=object_store and ray.weight_delta unset or false")
            if self.rollout.inflight_weight_update != "continue":
                problems.append("ray.weight_sync=lazy loads under running requests, which go on with the new weights: "
                                "needs rollout.inflight_weight_update=continue")
        if self.ray.reward_workers and self.env.name is not None:
            problems.append("ray.reward_workers scores reward.functions, which a multi-turn run (env.name) does not "
                            "call: its environments give the rewards (ray.env_workers moves them to actors)")
        if self.ray.env_workers and self.env.name is None:
            problems.append("ray.env_workers needs a multi-turn run (env.name): a single-turn run has no environments")
        if self.ray.env_workers and self.env.inline:
            problems.append("ray.env_workers with env.inline=true: environments on actors are awaited on the "
                            "driver's environment loop; set env.inline=false")
        return problems

    def longest_sequence(self) -> tuple[int, str]:
        """The longest sequence a run can produce (training rows default to it), and its origin."""
        if self.env.name is not None:
            return self.env.max_total_tokens, "env.max_total_tokens"
        return self.data.max_prompt_tokens + self.rollout.max_new_tokens, "data.max_prompt_tokens + rollout.max_new_tokens"

    def _env_problems(self) -> list[str]:
        e = self.env
        simulated = self.simulated_episodes  # `rollover simulate`'s episodes: the schedules' rules hold
        if e.name is None and not simulated:
            out = ["env.options are set but env.name is not"] if e.options else []
            if e.credit != "episode" or e.gamma != 1.0 or e.step_weight != 1.0:
                out.append("env.credit, env.gamma and env.step_weight give the turns of episodes their credit: "
                           "they need env.name")
            if e.resample_failed:
                out.append("env.resample_failed runs failed episodes again: it needs an environment (env.name); "
                           "single-turn samples a reward function could not score follow reward.on_error")
            if e.dynamic_turns:
                out.append("env.dynamic_turns sets each task's limit on an episode's turns: it needs a multi-turn run "
                           "(env.name)")
            return out + (["data.train: env needs env.name"] if self.data.train == "env" else [])
        out = []
        if e.credit == "reward_to_go":
            adv = self.algorithm.advantage
            if adv not in ("drgrpo", "rloo", "gae"):  # gae: the critic carries each turn's reward back
                why = ("its baseline is not the group's mean of the other episodes' returns" if adv in
                       ("opo", "gpg", "remax") else "it divides by the spread of the episodes' returns, which would "
                       "scale turn returns that spread does not bound")
                out.append(f"env.credit=reward_to_go with algorithm.advantage={adv}: a turn's advantage is its return "
                           f"to go less the group's mean (drgrpo) or the others' mean (rloo), unscaled, or the critic's "
                           f"estimate of it (gae); {adv} does not fit ({why}): set algorithm.advantage=drgrpo, rloo or gae")
        if e.credit == "gigpo" and self.algorithm.advantage in ("remax", "opo"):
            what = "one baseline per episode (the greedy one's return)" if self.algorithm.advantage == "remax" else \
                "a baseline weighted by each episode's tokens, which a turn's state group has no single count of"
            out.append(f"env.credit=gigpo compares turns from the same state within their group; algorithm.advantage="
                       f"{self.algorithm.advantage} has {what}: set algorithm.advantage=drgrpo or rloo")
        if e.credit == "gigpo" and self.algorithm.advantage == "reinforce_pp":
            out.append("env.credit=gigpo compares turns from the same state within their group; algorithm.advantage="
                       "reinforce_pp has no group baseline (it whitens over the whole step): use a group estimator "
                       "(grpo, drgrpo, rloo, ...)")
        if e.credit != "episode":
            if self.algorithm.loss == "gspo":
                out.append(f"env.credit={e.credit} gives each turn its own advantage; algorithm.loss=gspo clips one "
                           "ratio per sequence against one advantage: use gspo_token, its form for per-token advantages")
            if self.downsample.keep or self.downsample.token_fraction < 1 or self.downsample.token_fraction_start is not None:
                out.append(f"env.credit={e.credit} with downsample: D3S picks samples and tokens by one advantage per "
                           "sample; not combined yet")
        elif e.gamma != 1.0:
            out.append(f"env.gamma={e.gamma:g} discounts turns for env.credit=reward_to_go or gigpo; with "
                       "credit=episode it would do nothing")
        if e.step_weight != 1.0 and e.credit != "gigpo":
            out.append(f"env.step_weight={e.step_weight:g} weighs GiGPO's per-state advantages: it needs env.credit=gigpo")
        pr = self.partial_rollout
        if pr.enabled and pr.carry == "keep_kv":
            out.append("partial_rollout.carry=keep_kv keeps single-turn requests in the engine; episodes carry their "
                       "tokens and environment state (carry: resubmit)")
        if pr.enabled and pr.on_stale == "regenerate":
            out.append("partial_rollout.on_stale=regenerate restarts single-turn samples; for episodes use mask or is")
        if self.algorithm.overlong_buffer:
            out.append("algorithm.overlong_buffer measures one response's length; it has no meaning for episodes")
        if e.name is None:  # simulated: the rest are about a real environment's time and prompts
            return out
        if e.name == "interpreter":
            marker = e.options.get("marker", "```output")  # rollover.envs.interpreter.MARKER
            if marker not in self.rollout.stop:
                out.append(f"env.name=interpreter runs the model's code when it writes {marker!r}: add it to "
                           f"rollout.stop (now {list(self.rollout.stop)}) so that its turn stops there")
        if e.name == "inline_tools" and isinstance(e.options.get("tools"), dict):
            missing = [f"</{t}>" for t in e.options["tools"] if f"</{t}>" not in self.rollout.stop]
            if missing:
                out.append(f"env.name=inline_tools calls a tool at its closing tag: add {missing} to rollout.stop "
                           f"(now {list(self.rollout.stop)}) so that the model's turn stops there")
        calls = e.options.get("max_calls", 4)  # both environments' default
        retries = e.options.get("max_retries", 1) if e.name == "inline_tools" and e.options.get("retry") else 0
        if e.name in ("interpreter", "inline_tools") and isinstance(calls, int) and isinstance(retries, int) \
                and e.max_turns <= calls + retries:
            with_retries = f" and env.options.max_retries={retries} (a retry is a turn too)" if retries else ""
            out.append(f"env.max_turns={e.max_turns} with env.options.max_calls={calls}{with_retries}: each call is a "
                       f"turn and so is the answer after the last; give max_turns >= {calls + retries + 1}, or the "
                       "answer is never scored")
        if "train" not in self.data.model_fields_set:  # the default prompts were not made for this environment
            out.append(f"env.name={e.name!r} with data.train unset: the default training prompts "
                       f"({DataConfig.model_fields['train'].default}) were not made for an environment; set "
                       "data.train: env (tasks from the environment's prompts(n, seed)) or a dataset whose rows "
                       "its make_group(prompt, n) reads")
        if e.step_timeout_s >= self.rollout.stall_timeout_s:
            out.append(f"env.step_timeout_s={e.step_timeout_s:g} must be below rollout.stall_timeout_s="
                       f"{self.rollout.stall_timeout_s:g} (a slow environment step is not a stalled engine)")
        if e.max_total_tokens <= self.data.max_prompt_tokens:
            out.append(f"env.max_total_tokens={e.max_total_tokens} leaves no room after the opening "
                       f"(data.max_prompt_tokens={self.data.max_prompt_tokens})")
        return out


def _moved(section, *keys: str) -> list[str]:
    """Those of `keys` whose value in `section` is not the default."""
    fields = type(section).model_fields
    return [k for k in keys if getattr(section, k) != fields[k].default]
