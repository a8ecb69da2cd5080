"""The run configuration: typed, documented per field, validated when parsed.

A config is YAML (or a dict) with the sections below, plus `key.path=value` overrides from
the command line. Unknown keys are errors that suggest the nearest known name; options that
contradict each other are rejected, never silently repaired.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator


class ConfigError(ValueError):
    """A config that cannot run; the message names the key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                if key not in cls.model_fields:
                    close = difflib.get_close_matches(str(key), list(cls.model_fields), n=1, cutoff=0.5)
                    hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(cls.model_fields)}"
                    raise ValueError(f"unknown key {key!r}; {hint}")
        return data


class DataConfig(Section):
    train: str = "gen:arithmetic?digits=1&n=2000"
    """Training prompts: a .jsonl or .parquet file, a `save_to_disk` directory, `hf:owner/name`
    (where a hub is reachable) or a generator `gen:NAME?option=value&...` (see docs/data_and_rewards.md)."""
    eval: str | None = None
    """Held-out prompts (same forms as `train`). When unset, `eval_size` prompts are carved
    from the training data (no overlap)."""
    eval_size: int = 48
    """How many held-out prompts to evaluate on (carved from `train` when `eval` is unset)."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string or a list of chat messages."""
    answer_key: str | None = None
    """Column holding the ground truth; by default the first of answer, solution,
    reward_model.ground_truth."""
    system_prompt: str | None = None
    """A system message prepended to every prompt."""
    instruction: str | None = None
    """Text appended to the last user message (e.g. "Put the final answer in \\boxed{}.")."""
    chat_template: bool = True
    """Render prompts with the tokenizer's chat template."""
    max_prompt_tokens: int = 256
    """Prompts longer than this are rejected at start-up (with the row named)."""
    on_bad_row: Literal["raise", "skip"] = "raise"
    """A malformed row stops the run with an error naming file and row, or is skipped and counted."""
    shuffle: bool = True
    """Shuffle the training prompts every epoch (deterministic from `seed`)."""


class RolloutConfig(Section):
    engine: Literal["torch", "vllm"] = "torch"
    """Rollout engine: the built-in TorchEngine, or vLLM (the `vllm` extra)."""
    prompts_per_step: int = 8
    """Prompt groups trained on per step."""
    samples_per_prompt: int = 4
    """Samples per prompt (the group size n)."""
    max_new_tokens: int = 256
    """Bound on each response's length (across any number of resumes)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer divides its logits by the same value."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    max_rows: int = 64
    """Sequences the engine decodes together (its slot limit)."""
    ignore_eos: bool = False
    """Generate through EOS up to max_new_tokens (benchmark workloads only)."""
    dtype: str = "auto"
    """Engine dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16."""
    inflight_weight_update: Literal["continue", "abort"] = "continue"
    """What a weight update does to sequences still generating (async mode)."""
    engine_options: dict[str, Any] = {}
    """Passed through to the engine constructor (e.g. vLLM's gpu_memory_utilization)."""
    stall_timeout_s: float = 600.0
    """A wait between components (the trainer for a batch, a collector for the engine, the
    rollout service for aborted requests) that sees no progress at all for this long ends the
    run with an error naming who waited for what; any generated token counts as progress."""


class PartialRolloutConfig(Section):
    enabled: bool = False
    """APRIL: over-provision, stop at `prompts_per_step` complete groups, abort the rest and
    resume them next step from their tokens."""
    oversample: float = 2.0
    """alpha: keep alpha x prompts_per_step groups' worth of samples (x samples_per_prompt)
    unfinished in flight; rows freed by finished samples go to fresh groups at once."""
    max_carry_steps: int = 2
    """A carried-over prefix may lag the current policy by at most this many versions."""
    on_stale: Literal["mask", "regenerate", "is"] = "mask"
    """Past `max_carry_steps`: mask the stale tokens in the loss, regenerate the sample from
    scratch (its old tokens are dropped and reported), or keep them and correct with importance
    weights (needs algorithm.loss=decoupled_ppo or algorithm.tis_cap)."""
    carry: Literal["resubmit", "keep_kv"] = "resubmit"
    """How unfinished samples cross a step: `resubmit` aborts them and resumes them next step from
    their tokens (K/V recomputed under the new weights: exact, APRIL's design); `keep_kv` pauses
    them in the engine and continues on the K/V the older weights computed (PipelineRL-style
    in-flight update: no recompute; every token's logprob and version are still those it was
    sampled with). TorchEngine only."""
    adaptive: bool = False
    """Adjust alpha each step from the observed completion rate."""
    min_oversample: float = 1.0
    """Lower bound for adaptive alpha."""
    max_oversample: float = 4.0
    """Upper bound for adaptive alpha."""


class RewardConfig(Section):
    functions: list[Any] = ["numeric"]
    """Reward functions: built-in names (math, numeric, exact, format, countdown),
    `module:function` or `file.py:function`, or {fn, weight, kwargs, name} mappings."""
    timeout_s: float = 10.0
    """Per-call timeout; a call past it counts as an error."""
    on_error: Literal["raise", "zero", "skip"] = "raise"
    """A raising or hanging reward: stop the run, score 0 (counted and reported), or skip the sample."""
    workers: int = 4
    """Worker processes for isolated rewards (built-in `math`, and functions marked `isolate`),
    started on first use; a call past `timeout_s` is killed with its worker, which is replaced."""
    correct_threshold: float = 1.0
    """A sample counts as correct (accuracy metrics) when its first reward function scores at least this."""


class AlgorithmConfig(Section):
    advantage: Literal["grpo", "drgrpo", "rloo", "reinforce_pp_baseline", "gapo"] = "grpo"
    """Advantage estimator over each prompt's group."""
    loss: Literal["ppo", "gspo", "gspo_token", "cispo", "decoupled_ppo", "bapo"] | None = None
    """Policy loss; unset: ppo in sync mode, decoupled_ppo in async mode. ppo with
    eps_high > eps_low is DAPO's clip-higher."""
    eps_low: float = 0.2
    """Lower clip range (ratio >= 1 - eps_low)."""
    eps_high: float = 0.28
    """Upper clip range (ratio <= 1 + eps_high); DAPO uses 0.28."""
    dual_clip: float | None = None
    """Dual-clip constant c (> 1) for negative advantages; None = off."""
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "drgrpo"] = "token-mean"
    """How per-token losses become the step loss; token-mean divides by the step's global token
    count, drgrpo by (sequences x max_new_tokens)."""
    loss_options: dict[str, Any] = {}
    """Extra keyword options for the policy loss (see docs/algorithms.md)."""
    tis_cap: float | None = None
    """Truncated importance sampling against the engine's logprobs (token level): cap on the
    weight pi_old / pi_behav; None = off."""
    m2po_tau: float | None = None
    """M2PO: mask the fewest tokens so the second moment of log(pi_old / pi_behav) is <= tau; None = off."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference (initial) model; > 0 loads a reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator for the penalty."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal and top up with new prompts."""
    max_resample_rounds: int = 4
    """Dynamic sampling: generation rounds per step before training on what was kept."""
    overlong_buffer: int = 0
    """DAPO soft overlong punishment: penalise the last `overlong_buffer` tokens before the cap (0 = off)."""
    overlong_penalty: float = 1.0
    """Maximum soft overlong punishment."""
    mask_truncated: bool = False
    """Exclude completions cut by max_new_tokens from the loss."""


class TrainConfig(Section):
    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warm-up."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (0 = off)."""
    micro_batch_tokens: int = 4096
    """Tokens per forward/backward; sequences are packed into rows up to `pack_length`."""
    pack_length: int | None = None
    """Row length for sequence packing (default: data.max_prompt_tokens + rollout.max_new_tokens)."""
    ppo_epochs: int = 1
    """Passes over each step's batch."""
    mini_batches: int = 1
    """Optimizer updates per epoch; with ppo_epochs=1 and mini_batches=1 no extra forward is made for old logprobs."""
    dtype: str = "auto"
    """Trainer weights: auto (float32; bf16 autocast on CUDA), float32."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more compute)."""
    max_bad_steps: int = 3
    """Consecutive steps with a NaN/inf loss that stop the run (after a checkpoint)."""
    lora: dict[str, Any] | None = None
    """LoRA via peft, e.g. {r: 16, alpha: 32, dropout: 0.0, target_modules: all-linear}; None = full fine-tuning."""


class EvalConfig(Section):
    every: int = 5
    """Evaluate every this many steps (0 = only at the start and the end)."""
    samples_per_prompt: int = 4
    """Samples per held-out prompt."""
    temperature: float = 1.0
    """Evaluation sampling temperature (0 = greedy)."""
    at_start: bool = True
    """Evaluate before the first step (the baseline)."""


class CheckpointConfig(Section):
    every: int = 10
    """Save every this many steps (and always at the end); 0 = only at the end."""
    keep: int = 2
    """Checkpoints kept on disk (oldest removed)."""


class LoggingConfig(Section):
    tensorboard: bool | None = None
    """Write TensorBoard scalars (None: when the package is installed)."""
    wandb: dict[str, Any] | None = None
    """wandb.init arguments (e.g. {project: rollover, mode: offline}); None = off."""
    progress: bool = True
    """Show a progress bar with the live reward, throughput and ETA."""


class AsyncConfig(Section):
    max_staleness: int = 1
    """eta: no sample is trained more than this many policy versions after the version that
    started it (0 = synchronous)."""
    experience_pool: bool = False
    """DART: replace an all-fail group's worst sample with the prompt's latest success."""
    dynamic_samples: bool = False
    """DART: fewer samples for prompts the policy solved every time last round."""
    min_samples: int = 2
    """DART dynamic samples: the fewest samples a prompt gets."""
    top_entropy_fraction: float = 1.0
    """Train only on this fraction of highest-entropy steps (1 = all)."""


class Config(Section):
    run_dir: str = "runs/default"
    """Where metrics, checkpoints and plots go."""
    model: str = "smollm2-135m-instruct"
    """A local path, a hub id, or the alias smollm2-135m-instruct."""
    seed: int = 0
    """Seeds data order, sampling (per sample, so resume is exact) and initialisation."""
    steps: int = 20
    """Training steps."""
    mode: Literal["sync", "async"] = "sync"
    """sync: generate -> train in turn (loops/sync.py); async: decoupled services (loops/async_.py)."""
    resume: str = "auto"
    """auto: continue from the latest checkpoint in run_dir if any; never; or a checkpoint path."""
    device: str = "auto"
    """auto (cuda if available), cpu, cuda."""
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    partial_rollout: PartialRolloutConfig = PartialRolloutConfig()
    reward: RewardConfig = RewardConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    async_: AsyncConfig = AsyncConfig()

    @model_validator(mode="before")
    @classmethod
    def _async_alias(cls, data: Any) -> Any:
        if isinstance(data, dict) and "async" in data:
            data = dict(data)
            data["async_"] = data.pop("async")
        if isinstance(data, dict):
            algo = data.get("algorithm")
            if not isinstance(algo, dict) or algo.get("loss") is None:
                data = dict(data)
                algo = dict(algo) if isinstance(algo, dict) else {}
                algo["loss"] = "decoupled_ppo" if data.get("mode") == "async" else "ppo"
                data["algorithm"] = algo
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "Config":
        r, a, p = self.rollout, self.algorithm, self.partial_rollout
        problems = []
        if r.prompts_per_step < 1 or r.samples_per_prompt < 1:
            problems.append("rollout.prompts_per_step and rollout.samples_per_prompt must be >= 1")
        if r.max_new_tokens < 1:
            problems.append("rollout.max_new_tokens must be >= 1")
        if r.temperature <= 0:
            problems.append("rollout.temperature must be > 0 for RL sampling (greedy rollouts have no exploration)")
        if a.dynamic_sampling and r.samples_per_prompt < 2:
            problems.append("algorithm.dynamic_sampling needs rollout.samples_per_prompt >= 2 (a group of 1 has no variance)")
        if a.advantage in ("grpo", "drgrpo", "rloo", "gapo") and r.samples_per_prompt < 2:
            problems.append(f"algorithm.advantage={a.advantage} compares samples of a group: rollout.samples_per_prompt must be >= 2")
        if a.loss in ("gspo", "gspo_token") and a.aggregation != "seq-mean-token-mean":
            problems.append("algorithm.loss=gspo is defined with aggregation=seq-mean-token-mean; set it explicitly")
        if a.eps_low < 0 or a.eps_high < 0:
            problems.append("algorithm.eps_low and eps_high must be >= 0")
        if a.dual_clip is not None and a.dual_clip <= 1:
            problems.append("algorithm.dual_clip must be > 1")
        if a.overlong_buffer >= r.max_new_tokens:
            problems.append("algorithm.overlong_buffer must be smaller than rollout.max_new_tokens")
        if p.enabled and p.oversample < 1:
            problems.append("partial_rollout.oversample must be >= 1")
        if p.enabled and p.adaptive and not p.min_oversample <= p.oversample <= p.max_oversample:
            problems.append("partial_rollout.oversample must lie in [min_oversample, max_oversample]")
        if p.enabled and p.on_stale == "is" and a.loss != "decoupled_ppo" and a.tis_cap is None:
            problems.append("partial_rollout.on_stale=is weights stale tokens by importance sampling: set "
                            "algorithm.loss=decoupled_ppo or algorithm.tis_cap")
        if p.enabled and p.carry == "keep_kv" and r.engine != "torch":
            problems.append("partial_rollout.carry=keep_kv needs rollout.engine=torch (it pauses the engine with K/V kept)")
        if p.max_carry_steps < 0:
            problems.append("partial_rollout.max_carry_steps must be >= 0")
        if self.mode == "async" and p.enabled:
            problems.append("partial_rollout.enabled applies to sync mode; async mode already overlaps generation "
                            "with training and carries in-flight requests across weight updates "
                            "(rollout.inflight_weight_update)")
        if self.mode == "sync" and self.async_ != AsyncConfig():
            problems.append("the async section is set but mode is sync; set mode: async")
        if self.async_.min_samples < 2 and self.async_.dynamic_samples:
            problems.append("async.min_samples must be >= 2 (a group of 1 has no baseline)")
        if not 0 < self.async_.top_entropy_fraction <= 1:
            problems.append("async.top_entropy_fraction must be in (0, 1]")
        if self.async_.max_staleness < 0:
            problems.append("async.max_staleness must be >= 0")
        longest = self.data.max_prompt_tokens + r.max_new_tokens
        if self.train.micro_batch_tokens < (self.train.pack_length or longest):
            problems.append("train.micro_batch_tokens must be >= train.pack_length")
        if self.train.pack_length is not None and self.train.pack_length < longest:
            problems.append(
                f"train.pack_length ({self.train.pack_length}) must hold the longest sequence: "
                f"data.max_prompt_tokens + rollout.max_new_tokens = {longest}"
            )
        if self.train.ppo_epochs < 1 or self.train.mini_batches < 1:
            problems.append("train.ppo_epochs and train.mini_batches must be >= 1")
        if self.train.mini_batches > r.prompts_per_step:
            problems.append("train.mini_batches cannot exceed rollout.prompts_per_step (a mini-batch holds whole groups)")
        if a.loss == "decoupled_ppo" and self.mode == "sync" and not p.enabled:
            pass  # allowed: with behaviour == proximal it is plain PPO
        if problems:
            raise ValueError("; ".join(problems))
        return self


def _set_path(d: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        if not isinstance(d.get(k, {}), dict):
            raise ConfigError(f"override {dotted}: {k!r} is not a section")
        d = d.setdefault(k, {})
    d[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    out = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value")
        key, raw = item.split("=", 1)
        out.append((key.strip(), yaml.safe_load(raw) if raw.strip() else None))
    return out


def load_config(path: str | Path | None = None, overrides: list[str] = (), **data: Any) -> Config:
    """Read YAML (optional), apply overrides, validate. Raises ConfigError naming the key."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {str(path)!r} not found")
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
    for k, v in data.items():
        _set_path(raw, k, v)
    for k, v in parse_overrides(list(overrides)):
        _set_path(raw, k, v)
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"] if x != "async_") or "config"
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{loc}: {msg}")
        where = f"{path}: " if path else ""
        raise ConfigError(where + "; ".join(lines)) from None


def dump_config(cfg: Config) -> str:
    data = cfg.model_dump(mode="json")
    data["async"] = data.pop("async_")
    return yaml.safe_dump(data, sort_keys=False)


def describe(section: type[BaseModel] = Config, prefix: str = "") -> str:
    """Every field with its default and docstring (for `rollover train --help-config`)."""
    lines = []
    for name, f in section.model_fields.items():
        key = prefix + ("async" if name == "async_" else name)
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            lines.append(f"\n[{key}]")
            lines.append(describe(ann, key + "."))
        else:
            lines.append(f"  {key} = {f.default!r}\n      {f.description or ''}")
    return "\n".join(lines)
