"""The run configuration: typed, documented per field, validated when parsed.

A config is YAML (or a dict) with the sections below, plus `key.path=value` overrides from
the command line. Unknown keys are errors that suggest the nearest known name; options that
contradict each other are rejected, never silently repaired.

Every field carries its own range (`Field(ge=..., gt=..., le=...)`), so a value out of range is
reported as `key=value: must be >= 1`; `Config._consistent` holds only the checks that
involve more than one field.
"""

from __future__ import annotations

import difflib
import types
import typing
import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config that cannot run; the message names the key."""


def _numeric(annotation: Any) -> bool:
    """int or float (optionally | None): pydantic would quietly read true/false as 1/0."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else (annotation,)
    args = [typing.get_args(a)[0] if typing.get_origin(a) is Annotated else a for a in args if a is not type(None)]
    return bool(args) and all(a in (int, float) for a in args)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                if key not in cls.model_fields:
                    close = difflib.get_close_matches(str(key), list(cls.model_fields), n=1, cutoff=0.5)
                    hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(cls.model_fields)}"
                    raise ValueError(f"unknown key {key!r}; {hint}")
                if isinstance(data[key], bool) and _numeric(cls.model_fields[key].annotation):
                    raise ValueError(f"{key}={str(data[key]).lower()}: must be a number, not true/false")
        return data


def _reward_spec(spec: Any) -> Any:
    """A `reward.functions` entry: a non-empty name, or a mapping {fn, weight, kwargs, name,
    isolate} whose weight is a finite number (returned as a float)."""
    if isinstance(spec, str):
        if not spec.strip():
            raise ValueError("a reward name must not be empty")
        return spec
    if not isinstance(spec, dict):
        raise ValueError("must be a reward name or a mapping {fn, weight, kwargs, name, isolate}")
    unknown = sorted(set(spec) - {"fn", "weight", "kwargs", "name", "isolate"})
    if unknown:
        raise ValueError(f"unknown keys {unknown} (known: fn, weight, kwargs, name, isolate)")
    if spec.get("isolate") is not None and not isinstance(spec["isolate"], bool):
        raise ValueError(f"isolate={spec['isolate']!r}: must be true or false (run in a killable worker process)")
    if not isinstance(spec.get("fn"), str) or not spec["fn"].strip():
        raise ValueError(f"needs `fn`, a reward name, got {spec.get('fn')!r}")
    weight = spec.get("weight", 1.0)
    if isinstance(weight, str):
        try:
            weight = float(weight)
        except ValueError:
            raise ValueError(f"weight={spec['weight']!r}: must be a number") from None
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
        raise ValueError(f"weight={spec.get('weight')!r}: must be a finite number")
    if not isinstance(spec.get("kwargs", {}), dict):
        raise ValueError(f"kwargs={spec['kwargs']!r}: must be a mapping")
    if spec.get("name") is not None and not isinstance(spec["name"], str):
        raise ValueError(f"name={spec['name']!r}: must be a string")
    return {**spec, "weight": float(weight)}


def _lora(lora: dict[str, Any] | None) -> dict[str, Any] | None:
    """`train.lora`: known keys only, r and alpha >= 1, dropout in [0, 1)."""
    if lora is None:
        return None
    unknown = sorted(set(lora) - {"r", "alpha", "dropout", "target_modules"})
    if unknown:
        raise ValueError(f"unknown keys {unknown} (known: r, alpha, dropout, target_modules)")
    for key in ("r", "alpha"):
        if key in lora and (isinstance(lora[key], bool) or not isinstance(lora[key], int) or lora[key] < 1):
            raise ValueError(f"{key}={lora[key]!r}: must be an integer >= 1")
    dropout = lora.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise ValueError(f"dropout={dropout!r}: must be a number in [0, 1)")
    return lora


NonEmptyStr = Annotated[str, Field(min_length=1)]
RewardSpecEntry = Annotated[Any, AfterValidator(_reward_spec)]
Beta = Annotated[float, Field(ge=0, lt=1)]


class DataConfig(Section):
    train: NonEmptyStr = "gen:arithmetic?digits=1&n=2000"
    """Training prompts: a .jsonl or .parquet file, a `save_to_disk` directory, `hf:owner/name`
    (where a hub is reachable) or a generator `gen:NAME?option=value&...` (see docs/data_and_rewards.md).
    With env.name: `env` (tasks from the environment's own prompts(n, seed)) or a dataset whose
    rows the environment's make_group(prompt, n) reads; it must then be set explicitly."""
    eval: NonEmptyStr | None = None
    """Held-out prompts (same forms as `train`). When unset, `eval_size` prompts are carved
    from the training data (no overlap)."""
    eval_size: int = Field(48, ge=0)
    """How many held-out prompts to evaluate on (carved from `train` when `eval` is unset)."""
    prompt_key: NonEmptyStr = "prompt"
    """Column holding the prompt: a string or a list of chat messages."""
    answer_key: NonEmptyStr | None = None
    """Column holding the ground truth; by default the first of answer, solution,
    reward_model.ground_truth."""
    system_prompt: str | None = None
    """A system message prepended to every prompt."""
    instruction: str | None = None
    """Text appended to the last user message (e.g. "Put the final answer in \\boxed{}.")."""
    chat_template: bool = True
    """Render prompts with the tokenizer's chat template."""
    max_prompt_tokens: int = Field(256, ge=1)
    """Prompts longer than this are rejected at start-up (with the row named)."""
    on_bad_row: Literal["raise", "skip"] = "raise"
    """A malformed row stops the run with an error naming file and row, or is skipped and counted."""
    shuffle: bool = True
    """Shuffle the training prompts every epoch (deterministic from `seed`)."""


class RolloutConfig(Section):
    engine: Literal["torch", "vllm"] = "torch"
    """Rollout engine: the built-in TorchEngine, or vLLM (the `vllm` extra)."""
    prompts_per_step: int = Field(8, ge=1)
    """Prompt groups trained on per step."""
    samples_per_prompt: int = Field(4, ge=1)
    """Samples per prompt (the group size n)."""
    max_new_tokens: int = Field(256, ge=1)
    """Bound on each response's length (across any number of resumes)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (> 0: greedy rollouts have no exploration); the trainer divides its
    logits by the same value."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass (1 = off)."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling (0 = off)."""
    max_rows: int = Field(64, ge=1)
    """Sequences the engine decodes together (its slot limit). The engine admits samples one at
    a time as rows free up, so a group need not fit at once: any value >= 1 runs."""
    ignore_eos: bool = False
    """Generate through EOS up to max_new_tokens (benchmark workloads only)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Engine dtype: auto (float32 on every device), float32, bfloat16, float16. On one H200 the
    real 135M model learned more with float32 rollouts and trainer than with bf16 (3 seeds in each
    of four modes, docs/gpu.md); bfloat16 halves the engine's memory for large models, with
    algorithm.tis_cap correcting the rollout-vs-trainer gap (actor/rollout_kl)."""
    quantize: Literal["none", "int8"] = "none"
    """TorchEngine only: "int8" multiplies by int8 copies of the weight matrices (one scale per
    row, remade after every weight update): a quarter of the fp32 bytes read per decode step.
    Its logprobs differ from the trainer's (actor/rollout_kl); algorithm.tis_cap corrects that."""
    inflight_weight_update: Literal["continue", "keep", "abort"] = "continue"
    """What a weight update does to sequences still generating (async mode): `continue` goes on
    with their K/V recomputed under the new weights; `keep` goes on over the K/V the older
    weights computed (PipelineRL's in-flight update: nothing is prefilled again; each token still
    carries the version and logprob it was sampled with, which decoupled PPO / TIS correct);
    `abort` interrupts them and resumes them from their tokens."""
    engine_options: dict[str, Any] = {}
    """Passed through to the engine constructor (e.g. vLLM's gpu_memory_utilization)."""
    stall_timeout_s: float = Field(600.0, gt=0)
    """A wait between components (the trainer for a batch, a collector for the engine, the
    rollout service for aborted requests) that sees no progress at all for this long ends the
    run with an error naming who waited for what; any generated token counts as progress."""


class PartialRolloutConfig(Section):
    enabled: bool = False
    """APRIL: over-provision, stop at `prompts_per_step` complete groups, abort the rest and
    resume them next step from their tokens."""
    oversample: float = Field(2.0, ge=1)
    """alpha: keep alpha x prompts_per_step groups' worth of samples (x samples_per_prompt)
    unfinished in flight; rows freed by finished samples go to fresh groups at once."""
    max_carry_steps: int = Field(2, ge=0)
    """A carried-over prefix may lag the current policy by at most this many versions."""
    on_stale: Literal["mask", "regenerate", "is"] = "mask"
    """Past `max_carry_steps`: mask the stale tokens in the loss, regenerate the sample from
    scratch (its old tokens are dropped and reported), or keep them and correct with importance
    weights (needs algorithm.loss=decoupled_ppo or algorithm.tis_cap)."""
    carry: Literal["auto", "resubmit", "keep_kv"] = "auto"
    """How unfinished samples cross a step: `resubmit` aborts them and resumes them next step from
    their tokens (K/V recomputed under the new weights: exact, APRIL's design); `keep_kv` pauses
    them in the engine and continues on the K/V the older weights computed (PipelineRL-style
    in-flight update: no recompute; every token's logprob and version are still those it was
    sampled with). TorchEngine, and vLLM through its `pause_generation(mode="keep")`. `auto`:
    keep_kv for single-turn runs whose objective corrects tokens sampled under older weights
    (decoupled_ppo, bapo, tis_cap or m2po_tau), else resubmit; the run logs which and why
    (`Config.april_carry`)."""
    adaptive: bool = False
    """Adjust alpha each step from the observed completion rate."""
    min_oversample: float = Field(1.0, ge=1)
    """Lower bound for adaptive alpha."""
    max_oversample: float = Field(4.0, ge=1)
    """Upper bound for adaptive alpha."""
    score_lag: int = Field(1, ge=0)
    """Complete groups are scored on a scoring thread while decoding goes on; the stop decision
    at each group completion uses the scores of all but the last score_lag completed groups
    (waiting only when scoring is further behind), so the schedule stays a function of the
    seeds (exact resume) while a slow judge overlaps with decoding. Each unit of lag can carry
    one more complete group (one version old) into the next step; the lag used is at most
    prompts_per_step - 1, so a step is never served only by groups carried from the last. 0:
    score in the engine's callback (decoding waits for every group's score)."""


class RewardConfig(Section):
    functions: list[RewardSpecEntry] = Field(["numeric"], min_length=1)
    """Reward functions: built-in names (math, numeric, exact, format, countdown),
    `module:function` or `file.py:function`, or {fn, weight, kwargs, name} mappings (weight: a
    number). The first one decides accuracy (see `correct_threshold`)."""
    timeout_s: float = Field(10.0, gt=0)
    """Per-call timeout; a call past it counts as an error."""
    on_error: Literal["raise", "zero", "skip"] = "raise"
    """A raising or hanging reward: stop the run, score 0 (counted and reported), or skip the sample."""
    workers: int = Field(4, ge=1)
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
    eps_low: float = Field(0.2, ge=0)
    """Lower clip range (ratio >= 1 - eps_low)."""
    eps_high: float = Field(0.28, ge=0)
    """Upper clip range (ratio <= 1 + eps_high); DAPO uses 0.28."""
    dual_clip: Annotated[float, Field(gt=1)] | None = None
    """Dual-clip constant c (> 1) for negative advantages; None = off."""
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "drgrpo"] = "token-mean"
    """How per-token losses become the step loss; token-mean divides by the step's global token
    count, drgrpo by (sequences x max_new_tokens)."""
    loss_options: dict[str, Any] = {}
    """Extra keyword options for the policy loss (see docs/algorithms.md)."""
    tis_cap: Annotated[float, Field(gt=0)] | None = None
    """Truncated importance sampling against the engine's logprobs (token level): cap on the
    weight pi_old / pi_behav; None = off."""
    m2po_tau: Annotated[float, Field(gt=0)] | None = None
    """M2PO: mask the fewest tokens so the second moment of log(pi_old / pi_behav) is <= tau; None = off."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the reference (initial) model; > 0 loads a reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator for the penalty."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus weight."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal and top up with new prompts."""
    max_resample_rounds: int = Field(4, ge=1)
    """Dynamic sampling: generation rounds per step before training on what was kept."""
    overlong_buffer: int = Field(0, ge=0)
    """DAPO soft overlong punishment: penalise the last `overlong_buffer` tokens before the cap (0 = off)."""
    overlong_penalty: float = Field(1.0, ge=0)
    """Maximum soft overlong punishment."""
    mask_truncated: bool = False
    """Exclude completions cut by max_new_tokens from the loss."""


class TrainConfig(Section):
    lr: float = Field(1e-5, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay."""
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    """AdamW betas, each in [0, 1)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warm-up."""
    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm (0 = off)."""
    micro_batch_tokens: Annotated[int, Field(ge=1)] | None = None
    """Tokens per forward/backward; sequences are packed into rows up to `pack_length`. Unset:
    on CPU as many whole rows as fit `activation_memory_gb` by the trainer's activation
    estimate; on CUDA 65,536 (or one row if longer). On CUDA an update that runs out of memory
    is redone at half the size, down to one row (logged)."""
    activation_memory_gb: float = Field(1.0, gt=0, allow_inf_nan=False)
    """Budget for one micro-batch's saved activations when micro_batch_tokens is unset (the
    estimate is in rollover.train.memory; `rollover bench memory` shows what it gives)."""
    logit_chunk_tokens: int = Field(512, ge=0)
    """Response tokens whose full-vocabulary logits exist at once in the loss (chunks are
    recomputed in the backward pass instead of kept); 0 = all tokens of a micro-batch at once."""
    pack_length: Annotated[int, Field(ge=1)] | None = None
    """Row length for sequence packing (default: the longest sequence, data.max_prompt_tokens +
    rollout.max_new_tokens; with shared_prefix, room for a group's prompt and all its responses
    up to 4 x the longest sequence)."""
    shared_prefix: bool = True
    """Pack the samples that share a prompt as one prompt followed by their responses, with an
    attention mask that keeps responses apart: the prompt's forward runs once per group, not once
    per sample (same loss and gradients; needs the sdpa or eager attention of transformers)."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each step's batch."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer updates per epoch; with ppo_epochs=1 and mini_batches=1 no extra forward is made for old logprobs."""
    dtype: Literal["auto", "float32", "autocast_bf16"] = "auto"
    """Trainer weights: auto (float32 on every device), float32, autocast_bf16 (float32
    weights, bf16 autocast on every device: on CPUs with bf16 instructions the step's matrix
    multiplies run 2-2.8x faster; the demo learns as in float32, docs/benchmarks.md)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more compute)."""
    deterministic: bool = False
    """Kernels that give the same bits on every run (torch's deterministic algorithms, a fixed
    cuBLAS workspace, the math attention backend), so that on a GPU a run resumed from a
    checkpoint matches the uninterrupted one bit for bit (checked on an H200). Process-wide (a
    Ray trainer actor sets it in its own process) and slower on a GPU. CPU runs are
    deterministic without it while their thread count stays the same; by default the engine and
    trainer on a CPU run fewer threads while other processes hold cores (which can change a
    sum's last bits), and with this on they keep torch's count. Whether TorchEngine's CUDA graphs still capture under it is not
    checked: if a capture fails the engine logs it and decodes eagerly."""
    max_bad_steps: int = Field(3, ge=1)
    """Consecutive steps with a NaN/inf loss, or consecutive collections with no trainable group
    (all skipped for failed samples or filtered), that stop the run (after a checkpoint)."""
    lora: Annotated[dict[str, Any] | None, AfterValidator(_lora)] = None
    """LoRA via peft, e.g. {r: 16, alpha: 32, dropout: 0.0, target_modules: all-linear}; None = full fine-tuning."""
    parallel: Literal["none", "fsdp"] = "none"
    """How the trainer spreads: none (one trainer in this process) or fsdp (train.ranks processes
    of PyTorch FSDP2, each holding 1/N of the weights, gradients and optimizer state, each
    training its share of the step's samples; on GPUs rank r uses cuda:r). docs/gpu.md."""
    ranks: int = Field(1, ge=1)
    """Trainer ranks with train.parallel=fsdp (processes this command starts; one per GPU)."""
    fsdp_offload: bool = False
    """train.parallel=fsdp: keep the sharded weights, gradients and optimizer state in CPU memory,
    copying each layer to the GPU for its passes (larger models, slower steps)."""
    weight_bucket_mb: float = Field(256.0, gt=0)
    """train.parallel=fsdp: weights go from the ranks to the engine in buckets of about this many
    MiB (rank 0's extra memory during a push)."""
    collective_timeout_s: float = Field(600.0, gt=0)
    """train.parallel=fsdp: a rank waiting this long in a collective (a peer died) gives up."""
    colocate: bool = False
    """train.parallel=fsdp: every rank also runs a rollout engine on its own device (N GPUs
    generate, not one), loaded from its own gather of the weights; the engines free their K/V
    cache while the ranks train. Sync mode (APRIL included), TorchEngine, local runtime."""


class EvalConfig(Section):
    every: int = Field(5, ge=0)
    """Evaluate every this many steps (0 = only at the start and the end)."""
    samples_per_prompt: int = Field(4, ge=1)
    """Samples per held-out prompt."""
    temperature: float = Field(1.0, ge=0)
    """Evaluation sampling temperature (0 = greedy)."""
    at_start: bool = True
    """Evaluate before the first step (the baseline)."""


class CheckpointConfig(Section):
    every: int = Field(10, ge=0)
    """Save every this many steps (and always at the end); 0 = only at the end."""
    keep: int = Field(2, ge=1)
    """Checkpoints kept on disk (oldest removed; the one just written is always kept)."""


class LoggingConfig(Section):
    tensorboard: bool | None = None
    """Write TensorBoard scalars (None: when the package is installed)."""
    wandb: dict[str, Any] | None = None
    """wandb.init arguments (e.g. {project: rollover, mode: offline}); None = off."""
    progress: bool = True
    """Show a progress bar with the live reward, throughput and ETA."""
    samples: int = Field(0, ge=0)
    """Every this many steps, write the step's trained samples (prompt and response text and
    token ids, loss-mask spans, reward and its parts, advantage, logprobs, versions) to
    RUN_DIR/samples/step_<N>.jsonl; read them with `rollover show RUN_DIR`. 0 = off."""


class EnvConfig(Section):
    name: NonEmptyStr | None = None
    """Multi-turn environment (rollover.envs): guess_number, arithmetic_retry, tools, or
    `module:Name` / `path/to/file.py:Name` (a class or factory taking `options` as keyword
    arguments, returning an object with make_group(prompt, n)). Unset: single-turn, scored by
    reward.functions. With an environment, the environment gives the reward (reward.functions
    are not used)."""
    options: dict[str, Any] = {}
    """Keyword arguments for the environment (e.g. {low: 1, high: 8, max_guesses: 4})."""
    max_turns: int = Field(8, ge=1)
    """Sampled turns per episode at most (rollout.max_new_tokens bounds each turn)."""
    max_total_tokens: int = Field(512, ge=2)
    """Bound on an episode's whole token sequence (the opening, every turn, every insertion);
    training rows default to this length."""
    step_timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    """An environment call past this fails its episode (counted, reported; never scored 0)."""
    tasks: int = Field(2000, ge=1)
    """With data.train: env, how many tasks the environment's own generator makes."""
    dynamic_turns: bool = False
    """DART dynamic trajectory length: a task solved in at least dynamic_turns_threshold of its
    last group's episodes gets one turn more than its longest success used (at least
    min_turns); other tasks keep max_turns."""
    dynamic_turns_threshold: float = Field(0.5, gt=0, le=1)
    """Success rate from which a task counts as easy for dynamic_turns."""
    min_turns: int = Field(1, ge=1)
    """dynamic_turns: the fewest turns a task is given."""
    max_concurrent: int = Field(64, ge=1)
    """Environment calls running at once across all episodes (the environment cluster's size);
    more wait for a slot (the wait does not count against step_timeout_s)."""
    inline: bool = False
    """Run environment calls on the engine's thread between decode steps instead of on their
    own event loop: the schedule then depends on the seeds alone (APRIL and async runs resume
    bit-exactly), but decoding stops while an environment works. For fast environments (games);
    off for tools, sandboxes and anything slow."""


class AsyncConfig(Section):
    max_staleness: int = Field(1, ge=0)
    """eta: no sample is trained more than this many policy versions after the version that
    started it (0 = synchronous)."""
    experience_pool: bool = False
    """DART: replace an all-fail group's worst sample with the prompt's latest success."""
    dynamic_samples: bool = False
    """DART: fewer samples for prompts the policy solved every time last round."""
    min_samples: int = Field(2, ge=2)
    """DART dynamic samples: the fewest samples a prompt gets (a group of 1 has no baseline)."""
    top_entropy_fraction: float = Field(1.0, gt=0, le=1)
    """Train only on this fraction of highest-entropy steps (1 = all)."""


class SelectionConfig(Section):
    policy: Literal["uniform", "thompson", "skip_saturated", "thompson_skip_saturated"] = "uniform"
    """Which prompts a step trains on (rollover.rollout.selection): uniform (the data order,
    plain GRPO), thompson (VADE-style: prompts whose sampled success rate promises reward
    variance), skip_saturated (skip prompts always or never solved, re-probed every
    reprobe_every steps), or both. Not uniform: each draw takes candidates x k prompts from
    the data and keeps k (the others are passed over for this epoch)."""
    candidates: float = Field(4.0, ge=1)
    """Prompts drawn from the data per prompt kept (not uniform)."""
    decay: float = Field(1.0, gt=0, le=1)
    """Every prompt's history is scaled by this once per training step (VADE's decay toward the prior)."""
    alpha0: float = Field(1.0, gt=0, allow_inf_nan=False)
    """Beta prior of a prompt's success rate (thompson): pseudo-successes."""
    beta0: float = Field(1.0, gt=0, allow_inf_nan=False)
    """Beta prior of a prompt's success rate (thompson): pseudo-failures."""
    min_attempts: int = Field(8, ge=1)
    """skip_saturated: samples seen before a prompt can count as always / never solved."""
    reprobe_every: int = Field(10, ge=1)
    """skip_saturated: training steps after which a skipped prompt is offered again."""
    allocation: Literal["fixed", "xrpo"] = "fixed"
    """Samples per group: fixed (rollout.samples_per_prompt each) or xrpo (the draw's
    prompts_per_step x samples_per_prompt samples split by how much one more sample narrows
    each prompt's reward estimate, at least min_samples each; rollover.rollout.allocation)."""
    min_samples: int = Field(2, ge=2)
    """allocation=xrpo: the fewest samples a group gets (2: a group baseline needs two)."""
    dars: Literal["off", "equal", "hardest"] = "off"
    """DARS's second stage (sync mode): once a step's groups are scored, each prompt solved by
    fewer than half its samples gets extra samples in the same step, by DARS's equal-treatment
    or hardness-weighted schedule (rollover.rollout.allocation.dars_extra_samples), merged into
    its group before advantages."""
    dars_max_samples: int | None = Field(None, ge=2)
    """DARS: a group's size after the second stage at most (unset: DARS's 32 for equal, 64 for hardest)."""


class DownsampleConfig(Section):
    """D3S (dynamic dual-level down-sampling): generate many samples, train on the most
    informative (rollover.rollout.downsample). Advantages come from the whole group first."""

    keep: int = Field(0, ge=0)
    """Samples trained per group, the subset with the largest variance of advantages (D3S's
    sample level, PODS's max-variance rule); 0 trains every sample. Must be >= 2 and below
    rollout.samples_per_prompt."""
    token_fraction: float = Field(1.0, gt=0, le=1)
    """Fraction of the step's trained response tokens kept, those with the largest |advantage| x
    entropy (D3S's token level; entropy estimated by the sampled token's negative
    log-probability); 1 keeps all. The value reached after anneal_steps."""
    token_fraction_start: float | None = Field(None, gt=0, le=1)
    """D3S's curriculum from aggressive to relaxed: the token fraction at step 1, moving linearly
    to token_fraction over anneal_steps steps (unset: token_fraction throughout)."""
    anneal_steps: int = Field(0, ge=0)
    """Steps over which the token fraction moves from token_fraction_start to token_fraction."""


class RayConfig(Section):
    address: str | None = None
    """Where the Ray cluster is: unset starts a local instance (or uses the one this process
    already started); "auto" joins the cluster `ray start` runs on this machine; "HOST:PORT"
    joins that head node. Used with runtime=ray."""
    rollout_workers: int = Field(1, ge=1)
    """Rollout workers, each a Ray actor owning one engine (rollout.engine)."""
    cpus_per_worker: float = Field(1.0, gt=0)
    """CPUs each rollout worker reserves (and, on CPU, torch threads: the integer part, at least 1)."""
    gpus_per_worker: float = Field(0.0, ge=0)
    """GPUs each rollout worker reserves: 1 (disaggregated: a GPU per worker), a fraction to
    share a GPU (colocated with other workers or the trainer), 0 on CPU clusters."""
    affinity_slack_tokens: int | None = Field(None, ge=0)
    """The router keeps requests with a seen prompt prefix on the worker holding it while that
    worker's outstanding tokens exceed the least-loaded worker's by at most this much (default:
    one group's budget, rollout.max_new_tokens x rollout.samples_per_prompt)."""
    weight_delta: bool | None = None
    """Send only what changed in a weight update: unchanged tensors are skipped and tensors with
    few changed elements go as (indices, values), in the engine's dtype. Unset: on for a 16-bit
    engine (most bits survive an update) or a LoRA run (most tensors do), off otherwise (in
    float32 a full update changes every element, and comparing costs more than it saves)."""
    weight_transport: Literal["object_store", "gloo"] = "object_store"
    """How weight updates reach the rollout workers: "object_store" (the driver puts each tensor
    once, every worker pulls it; deltas possible) or "gloo" (a torch.distributed group of the
    driver and the workers: the driver sends one packed buffer to each worker over TCP; whole
    tensors only). Either way a worker's first weights come through the object store."""
    reward_workers: int = Field(0, ge=0)
    """Reward workers, Ray actors that score every reward call of the run (any node; a worker
    that dies or times out fails only the samples it was scoring, counted in the reward error
    metrics, and is replaced). 0: rewards run on the driver (isolated ones in its worker
    processes, reward.workers of them)."""
    cpus_per_reward_worker: float = Field(1.0, ge=0)
    """CPUs each reward worker reserves (0: none, for light rewards that share a node's CPUs)."""
    env_workers: int = Field(0, ge=0)
    """Environment workers, Ray actors that hold the environments of a multi-turn run (env.name)
    and answer their calls (any node; an actor that dies fails only the episodes it held, and
    is replaced). 0: environments run on the driver."""
    cpus_per_env_worker: float = Field(1.0, ge=0)
    """CPUs each environment worker reserves."""
    weight_sync: Literal["eager", "lazy"] = "eager"
    """When rollout workers load a weight update: "eager", every worker loads it before the push
    returns (the trainer waits); "lazy" (async mode), the push puts the weights in the object
    store and returns, and each worker loads the newest version on its own time while it goes on
    generating (ECHO-2's lazy pulls, DART's per-worker updates). Tokens keep their exact
    versions, and the staleness gate admits new groups by the oldest version a worker still
    holds, so async.max_staleness holds for every token."""
    sync_timeout_s: float = Field(300.0, gt=0)
    """Bound on every call to a worker that must answer (weight loads, aborts, stats): past it the
    run stops with an error naming the worker and the call."""
    max_restarts: int = Field(3, ge=0)
    """Restarts per rollout worker after its process died (its requests resume elsewhere from
    their tokens); one more death ends the run."""
    trainer: Literal["driver", "actor"] = "driver"
    """Where the trainer (policy, optimizer, reference model) runs: in the driver process (the
    `rollover train` process, which then needs the trainer's GPU), or as a Ray actor placed on
    `gpus_for_trainer` GPUs and `cpus_for_trainer` CPUs of any node (disaggregated: a head
    node without GPUs drives a trainer elsewhere). An actor that dies stops the run at its last
    checkpoint."""
    cpus_for_trainer: float = Field(1.0, ge=0)
    """CPUs the trainer actor reserves (and, on CPU, its torch threads: the integer part, at
    least 1). With ray.trainer=actor."""
    gpus_for_trainer: float = Field(0.0, ge=0)
    """GPUs the trainer actor reserves: 1 or more to train on its own GPU(s) (disaggregated), a
    fraction to share a GPU with rollout workers (colocated), 0 on CPU clusters. With
    ray.trainer=actor."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs of a local instance this run starts (default: all of the machine)."""
    dashboard: bool = False
    """Start the Ray dashboard with a local instance."""


def _cost_fields(kind: str):
    """A validator that a dict names only fields of the cost model `kind` (rollover/sim/costs.py)."""

    def check(d: dict[str, Any]) -> dict[str, Any]:
        from rollover.sim import costs

        cls = {"decode": costs.DecodeCost, "train": costs.TrainCost, "sync": costs.SyncCost,
               "contention": costs.Contention, "reward": costs.RewardCost}[kind]
        names = cls.__dataclass_fields__
        bad = sorted(set(d) - set(names))
        if bad:
            raise ValueError(f"unknown {kind} cost keys {bad}; known: {', '.join(names)}")
        out = {}
        for k, v in d.items():
            if k in ("prefill_padded", "separate_admission"):
                if not isinstance(v, bool):
                    raise ValueError(f"{kind}.{k}={v!r}: must be true or false")
                out[k] = v
                continue
            if k == "rows_table":
                try:
                    out[k] = tuple((int(r), float(t)) for r, t in v)
                except (TypeError, ValueError):
                    raise ValueError(f"{kind}.rows_table={v!r}: must be a list of [rows, seconds] pairs") from None
                if any(t < 0 or r < 1 for r, t in out[k]) or [r for r, _ in out[k]] != sorted({r for r, _ in out[k]}):
                    raise ValueError(f"{kind}.rows_table: rows must increase from 1 up and seconds be >= 0")
                continue
            try:  # YAML reads 1e-7 (no dot) as a string
                x = float(v) if isinstance(v, str) else v
            except ValueError:
                x = None
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x < math.inf:
                raise ValueError(f"{kind}.{k}={v!r}: must be a finite number >= 0")
            out[k] = x
        return out

    return AfterValidator(check)


class SimPoolConfig(Section):
    name: NonEmptyStr = "rollout"
    """Name of this pool of identical rollout workers (in reports and the Gantt chart)."""
    workers: int = Field(1, ge=1)
    """Rollout workers (one engine each: a GPU, or a tensor-parallel group)."""
    max_rows: int = Field(64, ge=1)
    """Sequences each worker decodes together."""
    kv_tokens: int | None = Field(None, ge=1)
    """K/V-cache capacity of each worker, in tokens (prompt and response tokens of its running
    sequences, e.g. the memory left after the weights over K/V bytes per token). A request is
    admitted only with room for it; when the running sequences' growth would overrun the cache,
    the newest is preempted (its K/V dropped, recomputed when it is readmitted), as vLLM and
    SGLang do. None: the rows alone limit a worker. The schedulers' path only."""
    gpus_per_worker: int = Field(1, ge=1)
    """GPUs one worker uses (tensor parallel): counted in `rollover simulate plan`'s GPU totals."""
    admit_batch: int | None = Field(None, ge=1)
    """While rows decode, admit waiting requests once this many fit (or after 16 steps), as
    TorchEngine's `admit_batch`. None: its default, max_rows / 8 where the decode cost has
    `separate_admission` (CUDA graphs), else 1. The schedulers' path only."""
    decode: Annotated[dict[str, Any], _cost_fields("decode")] = {}
    """This pool's decode cost, over the profile's (keys of DecodeCost: step_s, per_row_s,
    per_context_token_s, prefill_s, prefill_per_token_s)."""


class SimEnvConfig(Section):
    turns: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Mean sampled turns of a simulated episode (geometric, at least 1; env.max_turns caps it).
    0 (and no turn_values): no environment (single-turn samples, scored by the simulated
    reward); 1: one turn, then one environment call that scores it (a sandboxed check)."""
    turn_values: list[Annotated[int, Field(ge=1)]] = []
    """Turns of episodes measured in a real run (e.g. its trajectories' turn counts): each
    simulated episode draws one of them (instead of the geometric draw of `turns`)."""
    step_s: float = Field(1.0, ge=0, allow_inf_nan=False)
    """Median seconds of one environment step (log-normal around it)."""
    sigma: float = Field(0.5, ge=0, allow_inf_nan=False)
    """Spread of a step's log-seconds (0: every step takes step_s)."""
    min_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    """A step takes at least this long (its draw clipped from below)."""
    max_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    """A step takes at most this long (clipped from above; unset: no limit but env.step_timeout_s)."""
    open_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Seconds of an episode's opening (initial_observation: a sandbox or VM starting)."""
    obs_tokens: int = Field(64, ge=5)
    """Tokens an environment answer inserts between turns (its message and the template's 5)."""

    @property
    def enabled(self) -> bool:
        """Whether samples are simulated episodes."""
        return self.turns > 0 or bool(self.turn_values)


class SimConfig(Section):
    profile: NonEmptyStr | None = None
    """A profile JSON (`rollover simulate calibrate` writes one): the decode, train and sync costs."""
    pools: list[SimPoolConfig] = Field([SimPoolConfig()], min_length=1)
    """Rollout worker pools (several: a heterogeneous cluster)."""
    decode: Annotated[dict[str, Any], _cost_fields("decode")] = {}
    """Decode cost over the profile's, for every pool."""
    train: Annotated[dict[str, Any], _cost_fields("train")] = {}
    """Training step cost over the profile's (step_s, per_token_s)."""
    sync: Annotated[dict[str, Any], _cost_fields("sync")] = {}
    """Weight dissemination cost over the profile's (latency_s, bytes, bandwidth_bytes_per_s, per_worker_s)."""
    reward: Annotated[dict[str, Any], _cost_fields("reward")] = {}
    """Scoring time (per_sample_s, per_group_s, workers): each group is scored on one of
    `workers` reward workers in arrival order; unset, scoring takes no time. Sync mode scores a
    round's groups once it is generated (the workers wait); async mode scores each group as it
    lands while generation runs on. Not modelled with APRIL yet."""
    shared_device: bool = False
    """Rollout and training share one device (a one-box run, as on a CPU): while both run, each
    is slowed by the profile's `contention` factors."""
    contention: Annotated[dict[str, Any], _cost_fields("contention")] = {}
    """Contention factors over the profile's (decode, train: slowdowns >= 1 when both run)."""
    lengths: dict[str, Any] = {}
    """Response lengths (rollover/sim/workload.py LengthModel): kind lognormal (median, sigma,
    prompt_sigma) or empirical (values)."""
    trainer_gpus: int = Field(1, ge=1)
    """GPUs of the trainer whose step the train cost describes (`rollover simulate plan` counts
    them and scales them with the batch)."""
    prompts: int = Field(512, ge=1)
    """Distinct simulated prompts."""
    prompt_tokens: int = Field(128, ge=1)
    """Tokens of every simulated prompt."""
    solve_alpha: float = Field(1.0, gt=0)
    """Each prompt is solved with probability p ~ Beta(solve_alpha, solve_beta) per sample."""
    solve_beta: float = Field(1.0, gt=0)
    """See solve_alpha (Beta(1, 1): solve rates uniform over prompts)."""
    env: SimEnvConfig = SimEnvConfig()
    """Simulated multi-turn environments (rollover/sim/envs.py): each call takes virtual time,
    at most env.max_concurrent at once; env.max_turns, env.max_total_tokens and
    env.step_timeout_s apply as in a real run."""
    fast: bool = False
    """The fast path (rollover/sim/fast.py): the same cluster and policies on arrays, vectorised
    over workers (1,024 workers x 1,000 steps in a minute or two); sync, async and APRIL; not
    yet adaptive alpha, dynamic sampling, prompt selection, scoring time or a shared device.
    False: run rollover's own schedulers on the simulated workers."""
    router: Literal["auto", "numba", "python"] = "auto"
    """The fast path's per-event loops: the router (the Ray router's rule over every worker's
    load, rollover/sim/route.py) and admission at a step boundary (rollover/sim/admission.py).
    `numba` compiles them (needs numba: `pip install rollover[sim]`; vLLM brings it too),
    `python` runs the router in plain Python and admission on numpy arrays (slower: at 1,024
    workers APRIL with `carry: resubmit` routes about 16,000 resumed requests one by one every
    step), `auto` compiles when numba is installed. The decisions are the same either way; the
    report names the router that ran."""


class Config(Section):
    run_dir: NonEmptyStr = "runs/default"
    """Where metrics, checkpoints and plots go."""
    model: NonEmptyStr = "smollm2-135m-instruct"
    """A local path, a hub id, or the alias smollm2-135m-instruct."""
    seed: int = Field(0, ge=0, lt=2**32)
    """Seeds data order, sampling (per sample, so resume is exact) and initialisation."""
    steps: int = Field(20, ge=1)
    """Training steps."""
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
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    async_: AsyncConfig = AsyncConfig()
    env: EnvConfig = EnvConfig()
    selection: SelectionConfig = SelectionConfig()
    downsample: DownsampleConfig = DownsampleConfig()
    ray: RayConfig = RayConfig()
    simulate: SimConfig = SimConfig()
    """The cluster `rollover simulate` simulates; training ignores it."""

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
                pr = data.get("partial_rollout")
                april = bool(pr.get("enabled") if isinstance(pr, dict) else getattr(pr, "enabled", False))
                # async and APRIL train tokens sampled under older weights: correct for them
                algo["loss"] = "decoupled_ppo" if data.get("mode") == "async" or april else "ppo"
                data["algorithm"] = algo
        return data

    @property
    def april_carry(self) -> tuple[str, str]:
        """APRIL's carry mode (`resubmit` or `keep_kv`, resolving `auto`) and why."""
        p, a = self.partial_rollout, self.algorithm
        if p.carry != "auto":
            return p.carry, f"partial_rollout.carry={p.carry} in the config"
        if self.env.name is not None or self.simulate.env.enabled:  # real or simulated episodes
            return "resubmit", "episodes carry their tokens and environment state"
        corrected = [n for n, on in (("algorithm.loss=" + str(a.loss), a.loss in ("decoupled_ppo", "bapo")),
                                     ("algorithm.tis_cap", a.tis_cap is not None),
                                     ("algorithm.m2po_tau", a.m2po_tau is not None)) if on]
        if not corrected:
            return "resubmit", (f"algorithm.loss={a.loss} without tis_cap or m2po_tau does not correct tokens "
                                "sampled under older weights, so their K/V is recomputed")
        engine = "TorchEngine" if self.rollout.engine == "torch" else "vLLM"
        return "keep_kv", (f"{engine} keeps K/V across weight updates and {corrected[0]} corrects the "
                           "older tokens: no carried prefix is prefilled again")

    @model_validator(mode="after")
    def _consistent(self) -> "Config":
        """Checks across fields (each field's own range is declared with the field)."""
        r, a, p, t = self.rollout, self.algorithm, self.partial_rollout, self.train
        problems = []
        if a.dynamic_sampling and r.samples_per_prompt < 2:
            problems.append("algorithm.dynamic_sampling needs rollout.samples_per_prompt >= 2 (a group of 1 has no variance)")
        if a.advantage in ("grpo", "drgrpo", "rloo", "gapo") and r.samples_per_prompt < 2:
            problems.append(f"algorithm.advantage={a.advantage} compares samples of a group: rollout.samples_per_prompt must be >= 2")
        if a.loss in ("gspo", "gspo_token") and a.aggregation != "seq-mean-token-mean":
            problems.append("algorithm.loss=gspo is defined with aggregation=seq-mean-token-mean; set it explicitly")
        if a.overlong_buffer >= r.max_new_tokens:
            problems.append(f"algorithm.overlong_buffer={a.overlong_buffer} must be smaller than "
                            f"rollout.max_new_tokens={r.max_new_tokens}")
        if p.min_oversample > p.max_oversample:
            problems.append(f"partial_rollout.min_oversample={p.min_oversample} exceeds max_oversample={p.max_oversample}")
        if p.enabled and p.adaptive and not p.min_oversample <= p.oversample <= p.max_oversample:
            problems.append(f"partial_rollout.oversample={p.oversample} must lie in [min_oversample, max_oversample] = "
                            f"[{p.min_oversample}, {p.max_oversample}]")
        if p.enabled and p.on_stale == "is" and a.loss != "decoupled_ppo" and a.tis_cap is None:
            problems.append("partial_rollout.on_stale=is weights stale tokens by importance sampling: set "
                            "algorithm.loss=decoupled_ppo or algorithm.tis_cap")
        if p.enabled and p.score_lag and p.on_stale != "is" and p.max_carry_steps == 0:
            problems.append(f"partial_rollout.score_lag={p.score_lag} carries complete groups one version old into the "
                            f"next step, which max_carry_steps=0 with on_stale={p.on_stale} throws away: set score_lag 0 "
                            "or max_carry_steps >= 1")
        if r.quantize != "none" and r.engine != "torch":
            problems.append(f"rollout.quantize={r.quantize} is TorchEngine's (rollout.engine=torch)")
        if self.mode == "async" and p.enabled:
            problems.append("partial_rollout.enabled applies to sync mode; async mode already overlaps generation "
                            "with training and carries in-flight requests across weight updates "
                            "(rollout.inflight_weight_update)")
        problems += self._selection_problems() + self._train_problems() + self._ray_problems()
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
        if t.mini_batches > r.prompts_per_step:
            problems.append(f"train.mini_batches={t.mini_batches} cannot exceed rollout.prompts_per_step="
                            f"{r.prompts_per_step} (a mini-batch holds whole groups)")
        if problems:
            raise ValueError("; ".join(problems))
        return self

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
            episodes = self.env.name is not None or self.simulate.env.enabled
            if self.mode != "sync" or self.partial_rollout.enabled or episodes:
                problems.append("selection.dars (a second generation stage inside a step) runs in sync mode "
                                "without partial_rollout and without env")
            if s.dars_max_samples is not None and s.dars_max_samples <= self.rollout.samples_per_prompt:
                problems.append(f"selection.dars_max_samples={s.dars_max_samples} must be above "
                                f"rollout.samples_per_prompt={self.rollout.samples_per_prompt} (room for extra samples)")
        if a.loss_options:  # checked now, not at the first update after the run dir was written
            from rollover.algos.policy import check_loss_options

            wrong = check_loss_options(a)
            if wrong:
                problems.append(f"algorithm.loss_options={a.loss_options} for algorithm.loss={a.loss}: {wrong}")
        return problems

    def _train_problems(self) -> list[str]:
        """The trainer's ranks, offload and colocated engines."""
        t = self.train
        problems = []
        if t.ranks > 1 and t.parallel != "fsdp":
            problems.append(f"train.ranks={t.ranks} needs train.parallel=fsdp (one trainer cannot use several ranks)")
        if t.parallel == "fsdp" and self.runtime == "ray" and self.ray.trainer != "actor":
            problems.append("train.parallel=fsdp with runtime=ray runs the ranks as Ray actors: set ray.trainer=actor "
                            "(ray.cpus_for_trainer / ray.gpus_for_trainer are then per rank)")
        if t.fsdp_offload and t.parallel != "fsdp":
            problems.append("train.fsdp_offload applies to train.parallel=fsdp")
        if t.colocate:
            if t.parallel != "fsdp":
                problems.append("train.colocate runs an engine in every trainer rank: it needs train.parallel=fsdp")
            if self.mode != "sync":
                problems.append("train.colocate: the ranks' engines share the devices with training, so they generate "
                                "only between steps (mode=sync, APRIL included); async mode needs engines of their own")
            if self.runtime != "local":
                problems.append("train.colocate runs with runtime=local (with Ray, place rollout workers and trainer "
                                "ranks with ray.gpus_per_worker / ray.gpus_for_trainer)")
            if self.rollout.engine != "torch":
                problems.append("train.colocate runs TorchEngine in the ranks (rollout.engine=torch); vLLM in the "
                                "ranks is not built yet")
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
        simulated = self.simulate.env.enabled  # `rollover simulate`'s episodes: the schedules' rules hold
        if e.name is None and not simulated:
            out = ["env.options are set but env.name is not"] if e.options else []
            return out + (["data.train: env needs env.name"] if self.data.train == "env" else [])
        out = []
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


def _set_path(d: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        if not isinstance(d.get(k, {}), dict):
            raise ConfigError(f"override {dotted}: {k!r} is not a section")
        d = d.setdefault(k, {})
    d[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """`key.path=value` strings as (key, value) pairs; each value is read as YAML."""
    out = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like key.path=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or e
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({problem})") from None
        out.append((key.strip(), value))
    return out


def read_yaml(path: str | Path) -> dict:
    """A YAML mapping from a file; invalid YAML is a ConfigError naming file:line:column."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} not found")
    if path.is_dir():
        raise ConfigError(f"{path} is a directory, not a YAML config file")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{where}: invalid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(raw).__name__}")
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] = (), **data: Any) -> Config:
    """Read YAML (optional), apply overrides, validate. Raises ConfigError naming the key."""
    raw: dict = read_yaml(path) if path is not None else {}
    for k, v in data.items():
        _set_path(raw, k, v)
    for k, v in parse_overrides(list(overrides)):
        _set_path(raw, k, v)
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        where = f"{path}: " if path is not None else ""
        raise ConfigError(where + "; ".join(_error_line(err) for err in e.errors())) from None


_BOUNDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"),
           "less_than_equal": ("le", "<="), "less_than": ("lt", "<")}
_TYPE_ERRORS = {"int_parsing": "must be an integer", "int_type": "must be an integer",
                "int_from_float": "must be an integer", "float_parsing": "must be a number",
                "float_type": "must be a number", "finite_number": "must be a finite number",
                "bool_parsing": "must be true or false", "bool_type": "must be true or false",
                "string_type": "must be a string", "string_too_short": "must not be empty",
                "too_short": "must not be empty", "dict_type": "must be a mapping", "list_type": "must be a list"}


def _number(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _error_line(err: dict) -> str:
    """One pydantic error as `key=value: what is allowed`."""
    loc = ".".join("async" if x == "async_" else str(x) for x in err["loc"])
    kind, value = err["type"], err.get("input")
    if kind in _BOUNDS:
        name, symbol = _BOUNDS[kind]
        msg = f"must be {symbol} {_number(err['ctx'][name])}"
    elif kind == "string_pattern_mismatch" and loc == "device":
        msg = "must be auto, cpu, cuda, cuda:N or mps"
    else:
        msg = _TYPE_ERRORS.get(kind) or err["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
    if not loc:
        return msg
    if value is None or isinstance(value, str | int | float):
        quoted = isinstance(value, str) and kind not in _BOUNDS  # a bound was checked on a number
        shown = repr(value) if quoted else value if isinstance(value, str) else json.dumps(value)
        return f"{loc}={shown}: {msg}"
    return f"{loc}: {msg}"


# Keys a resumed run may change freely: how long it runs, where and on what it runs, how it
# evaluates, checkpoints and logs, knobs that change speed but not the samples' meaning
# (packing is exact, the engine is behind one contract), and what a failing reward call does
# (a run stopped by reward.on_error=raise is meant to be resumed with zero or skip). Every other
# key — model, seed, mode, data, reward functions, algorithm, train, rollout sampling,
# partial_rollout, async — changes what is trained, and a new key is in that group until it is
# listed here.
RESUME_FREE_KEYS = (
    "run_dir", "steps", "resume", "device", "eval", "checkpoint", "logging", "runtime", "ray", "simulate",
    "rollout.engine", "rollout.max_rows", "rollout.dtype", "rollout.engine_options", "rollout.stall_timeout_s",
    "reward.timeout_s", "reward.on_error", "reward.workers",
    "train.micro_batch_tokens", "train.pack_length", "train.shared_prefix", "train.gradient_checkpointing",
    "train.activation_memory_gb", "train.logit_chunk_tokens", "train.max_bad_steps", "train.deterministic",
    "train.ranks", "train.fsdp_offload", "train.weight_bucket_mb", "train.collective_timeout_s", "train.colocate",
)


_SECTIONS = {("async" if n == "async_" else n) for n, f in Config.model_fields.items()
             if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)}


def _flat(data: dict, prefix: str = "") -> dict[str, Any]:
    """A dumped config as {dotted key: value}, descending into sections only."""
    out = {}
    for key, value in data.items():
        key = "async" if key == "async_" else key
        if isinstance(value, dict) and prefix == "" and key in _SECTIONS:
            out.update(_flat(value, f"{key}."))
        else:
            out[prefix + key] = value
    return out


def config_changes(saved: dict, cfg: Config) -> list[str]:
    """`key: old -> new` for each key outside RESUME_FREE_KEYS where `cfg` differs from a
    saved config (a mapping read from a run's config.yaml; keys it lacks count as defaults)."""
    old = {**_flat(Config().model_dump(mode="json")), **_flat(saved)}
    new = _flat(cfg.model_dump(mode="json"))
    changes = []
    for key, value in new.items():
        if any(key == free or key.startswith(free + ".") for free in RESUME_FREE_KEYS):
            continue
        if key in old and _plain(old[key]) != _plain(value):
            changes.append(f"{key}: {json.dumps(old[key])} -> {json.dumps(value)}")
    return changes


def _plain(value: Any) -> Any:
    """Tuples as lists (as a YAML round trip gives them back)."""
    return json.loads(json.dumps(value))


def dump_config(cfg: Config) -> str:
    data = cfg.model_dump(mode="json")
    data["async"] = data.pop("async_")
    return yaml.safe_dump(data, sort_keys=False)


def _bounds(metadata: list) -> str:
    """A field's declared range for `describe`, e.g. "  (>= 1)"."""
    parts = [f"{symbol} {_number(getattr(m, name))}" for m in metadata
             for name, symbol in _BOUNDS.values() if getattr(m, name, None) is not None]
    return f"  ({', '.join(parts)})" if parts else ""


def markdown_reference() -> str:
    """docs/config.md: every key of every section with its default, range and meaning, from the
    config models (`python -m rollover.config docs/config.md` writes it; a test keeps it current)."""
    out = ["# Configuration reference", "",
           "Generated from the config models by `python -m rollover.config docs/config.md`; do not edit by hand.",
           "Keys are set in a YAML file or as `section.key=value` overrides on the command line "
           "([configuration.md](configuration.md)).", ""]

    def cell(text: str) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    def walk(section: type[BaseModel], prefix: str) -> None:
        rows, subs = [], []
        for name, f in section.model_fields.items():
            key = prefix + ("async" if name == "async_" else name)
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                subs.append((key, ann))
            else:
                rows.append(f"| `{key}` | `{cell(repr(f.default))}` | {cell(_bounds(f.metadata).strip(' ()'))} | "
                            f"{cell(f.description or '')} |")
        if rows:
            out.extend([f"## {prefix.rstrip('.') or 'top level'}", "", "| key | default | range | meaning |",
                        "| --- | --- | --- | --- |", *rows, ""])
        for key, ann in subs:
            walk(ann, key + ".")

    walk(Config, "")
    return "\n".join(out)


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
            lines.append(f"  {key} = {f.default!r}{_bounds(f.metadata)}\n      {f.description or ''}")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m rollover.config docs/config.md
    import sys

    Path(sys.argv[1]).write_text(markdown_reference() + "\n")
