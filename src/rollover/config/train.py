"""`train` (the optimizer, micro-batches, the sharded trainer), `eval`, `checkpoint` and `logging`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from rollover.config.base import Beta, NonEmptyStr, Section, _lora


class TrainConfig(Section):
    lr: float = Field(1e-5, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay."""
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    """AdamW betas, each in [0, 1)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up over this many steps: of its N updates (warmup_steps x the updates a step),
    update u steps at (u+1)/N of `lr`, so the first is not spent at 0 (where transformers'
    schedules start). `actor/lr` logs the rate each update stepped with."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warm-up."""
    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm (0 = off)."""
    micro_batch_tokens: Annotated[int, Field(ge=1)] | None = None
    """Tokens per forward/backward; sequences are packed into rows up to `pack_length`. Unset:
    on CPU as many whole rows as fit `activation_memory_gb` by the trainer's activation
    estimate; on CUDA 65,536 (or one row if longer). On CUDA an update that runs out of memory
    is redone at half the size, down to one row (logged); the sharded trainer's ranks cannot
    redo one alone, so there the run stops naming this key."""
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
    per sample (same loss and gradients; needs the sdpa or eager attention of transformers; off for models
    with linear-attention or state-space layers, whose sequences go one to a row)."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each step's batch."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer updates per epoch; with ppo_epochs=1 and mini_batches=1 no extra forward is made for old logprobs."""
    dtype: Literal["auto", "float32", "autocast_bf16"] = "auto"
    """Trainer weights: auto (float32 on every device), float32, autocast_bf16 (float32
    weights, bf16 autocast on every device: on CPUs with bf16 instructions the step's matrix
    multiplies run 2-2.8x faster; the demo learns as in float32, docs/benchmarks.md)."""
    disable_dropout: bool = True
    """Set the model's dropout rates to 0 while training (every dropout layer and attention
    dropout, LoRA's included): the loss compares the trainer's logprobs with the sampler's and
    with its own earlier pass, which dropout would make noisy. false: the model's own rates."""
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
    sequence_parallel: int = Field(1, ge=1)
    """train.parallel=fsdp: split each packed row's tokens over this many ranks (Ulysses sequence
    parallelism, verl's ulysses_sequence_parallel_size): a rank holds 1/N of every row's
    activations, and attention exchanges heads for sequence (an all-to-all before and after each
    layer's attention). train.ranks must be a multiple; the step's samples are split over
    ranks / N groups of ranks. For sequences too long for one device's activations."""
    fsdp_offload: bool = False
    """train.parallel=fsdp on GPUs: keep the sharded weights, gradients and optimizer state in CPU
    memory, copying each layer to the GPU for its passes (larger models, slower steps)."""
    weight_bucket_mb: float = Field(256.0, gt=0)
    """train.parallel=fsdp: weights go from the ranks to the engine in buckets of about this many
    MiB (rank 0's extra memory during a push)."""
    collective_timeout_s: float = Field(600.0, gt=0)
    """train.parallel=fsdp: a rank waiting this long in a collective (a peer died) gives up; with
    train.colocate the driver waits this long for a rank's engine to answer a call (twice it for
    a weight load), then takes the rank for hung and stops the run at its last checkpoint."""
    colocate: bool = False
    """train.parallel=fsdp: every rank also runs a rollout engine on its own device (N GPUs
    generate, not one), loaded from its own gather of the weights; TorchEngine frees its K/V
    cache while the ranks train. Sync mode (APRIL included); TorchEngine or vLLM (rollout.engine);
    local ranks, torchrun's, or Ray rank actors (runtime=ray: no rollout workers start)."""
    colocate_free_weights: bool = True
    """train.colocate: the engines also free their copy of the weights while the ranks train and
    load them again after the step (a model needs room for a whole copy only while generating;
    vLLM: sleep level 2, on GPUs only). false: they keep it (no reallocation; on CUDA the decode
    graphs stay recorded)."""


class CriticConfig(Section):
    """The learned value model of algorithm.advantage=gae (PPO with a critic)."""

    lr: float = Field(1e-5, gt=0)
    """The critic's AdamW learning rate (verl's critic.optim.lr); betas, weight decay, warm-up,
    schedule, gradient clipping, ppo_epochs and mini_batches are the train section's."""
    value_clip: Annotated[float, Field(gt=0)] | None = 0.5
    """A value prediction moves at most this far from the one recorded before the step's updates
    (verl's critic.cliprange_value); None: the plain squared error."""
    warmup_steps: int = Field(0, ge=0)
    """Steps in which only the critic trains, the policy and its learning-rate schedule left as they
    are (verl's trainer.critic_warmup); below steps."""
    model: NonEmptyStr | None = None
    """The checkpoint the critic starts from (verl's critic.model.path): a causal LM's trunk with a
    value head at zero, or a reward model's (a one-label sequence classifier) with its score head;
    it must have the policy's tokenizer. Unset: a copy of the policy's trunk."""


class DistillConfig(Section):
    """On-policy distillation: a teacher scores every token the policy sampled."""

    teacher: NonEmptyStr | None = None
    """The teacher model (a path, hub id or alias) for on-policy distillation (GKD, arXiv
    2306.13649): the policy learns where its own answers leave what the teacher would say, in the
    form distill.loss names. The teacher reads the policy's token ids (its tokenizer gives them
    the same ids; extra tokens are fine) and is frozen, loaded where the trainer runs (sharded
    with the policy under train.parallel=fsdp). Unset: no teacher."""
    loss: Literal["sampled", "jsd"] = "sampled"
    """sampled: each token the policy trains on gains weight * (log pi_teacher - log pi_sampler)
    in its advantage, minus the token's sampled reverse KL to the teacher (Thinking Machines'
    on-policy distillation). jsd: the loss gains weight * the generalised Jensen-Shannon
    divergence between the policy's and the teacher's whole next-token distributions at each
    position the policy sampled (distill.beta; TRL's GKDTrainer and DistillationTrainer),
    aggregated as the policy loss."""
    beta: float = Field(0.5, ge=0, le=1)
    """distill.loss=jsd: 0 is the forward KL(teacher || policy), 1 the reverse KL(policy ||
    teacher), between them the generalised JSD (TRL's beta; 0.5 is its GKD default)."""
    weight: float = Field(1.0, gt=0)
    """The teacher term's weight: in each token's advantage (sampled), in the loss (jsd)."""
    outcome_weight: float = Field(1.0, ge=0)
    """The weight of the reward functions' advantage (algorithm.advantage) beside the teacher's
    term; 0: the teacher alone teaches, the rewards are only measured (then samples_per_prompt
    may be 1)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The teacher's weights: float32, or bfloat16 (half the memory, as an engine serving it
    would hold it: its logits come out of bfloat16 multiplies, then go to float32 for the
    log-softmax)."""


def _greedy_or_sampled(t: float) -> float:
    if not (t == 0 or t >= 0.01):  # (nan too)
        raise ValueError(f"must be 0 (greedy) or at least 0.01 (below it the logits overflow; vLLM raises it "
                         f"to 0.01), got {t}")
    return t


class EvalConfig(Section):
    every: int = Field(5, ge=0)
    """Evaluate every this many steps (0 = only at the start and the end)."""
    samples_per_prompt: int = Field(4, ge=1)
    """Samples per held-out prompt."""
    temperature: Annotated[float, Field(ge=0), AfterValidator(_greedy_or_sampled)] = 1.0
    """Evaluation sampling temperature (0 = greedy; else at least 0.01, vLLM's floor)."""
    at_start: bool = True
    """Evaluate before the first step (the baseline)."""


class CheckpointConfig(Section):
    every: int = Field(10, ge=0)
    """Save every this many steps (and always at the end); 0 = only at the end."""
    keep: int = Field(2, ge=1)
    """Checkpoints kept on disk (oldest removed; the one just written is always kept)."""
    best: NonEmptyStr | None = None
    """An evaluation metric (eval/accuracy, eval/pass_at_k, eval/<set>/accuracy, ...): the
    checkpoint with its best value so far is kept besides the last `keep`, and `rollover export
    RUN_DIR OUT --best` / `rollover eval RUN_DIR --best` take it. Every checkpoint holds the
    evaluation of its step (eval.json); checkpoint.every must then be a multiple of eval.every."""
    best_mode: Literal["max", "min"] = "max"
    """checkpoint.best: whether the largest or the smallest value is best."""


class LoggingConfig(Section):
    tensorboard: bool | None = None
    """Write TensorBoard scalars (None: when the package is installed)."""
    wandb: dict[str, Any] | None = None
    """wandb.init arguments (e.g. {project: rollover, mode: offline}); None = off."""
    progress: bool = True
    """Show a progress bar with the live reward, throughput and ETA."""
    eval_samples: int = Field(0, ge=0)
    """At every evaluation, write the samples of the first this many held-out prompts (text, token
    ids, reward and its parts, correct or not, the prompt's held-out source) to
    RUN_DIR/samples/eval_step_<N>.jsonl; read them with `rollover show RUN_DIR --eval`. 0 = off."""
    samples: int = Field(0, ge=0)
    """Every this many steps, write the step's trained samples (prompt and response text and
    token ids, loss-mask spans, reward and its parts, advantage, logprobs, versions) to
    RUN_DIR/samples/step_<N>.jsonl; read them with `rollover show RUN_DIR`. 0 = off."""
