"""`rollout` (sampling and the engine) and `partial_rollout` (APRIL)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rollover.config.base import NonEmptyStr, Section


class RolloutConfig(Section):
    engine: Literal["torch", "vllm"] = "torch"
    """Rollout engine: the built-in TorchEngine, or vLLM (the `vllm` extra)."""
    prompts_per_step: int = Field(8, ge=1)
    """Prompt groups trained on per step."""
    samples_per_prompt: int = Field(4, ge=1)
    """Samples per prompt (the group size n)."""
    max_new_tokens: int = Field(256, ge=1)
    """Bound on each response's length (across any number of resumes)."""
    temperature: float = Field(1.0, ge=0.01)
    """Sampling temperature (at least 0.01, vLLM's floor: greedy rollouts have no exploration);
    the trainer divides its logits by the same value."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass (1 = off)."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling (0 = off)."""
    min_p: float = Field(0.0, ge=0, le=1)
    """Min-p sampling (0 = off): drop the tokens less likely than min_p times the likeliest one
    (applied before top-k / top-p, as vLLM)."""
    repetition_penalty: float = Field(1.0, gt=0)
    """Repetition penalty (1 = off), HF's and vLLM's rule: the logit l of a token that is in the
    prompt or the response so far becomes l / p when positive, l * p otherwise. With min_p,
    top-k, top-p or a penalty the behaviour logprobs are the processed distribution's, which the
    trainer does not reproduce: actor/rollout_kl shows the gap, algorithm.tis_cap corrects it.
    Evaluation samples with min_p, top-k, top-p and the penalty too."""
    max_rows: int = Field(64, ge=1)
    """Sequences the engine decodes together (its slot limit). The engine admits samples one at
    a time as rows free up, so a group need not fit at once: any value >= 1 runs."""
    ignore_eos: bool = False
    """Generate through EOS up to max_new_tokens (benchmark workloads only)."""
    stop: list[NonEmptyStr] = []
    """Strings that end a response (vLLM's stop, TRL's generation_kwargs stop), in every mode,
    environment turn and evaluation: the response ends with the token that completes one (kept
    whole, with any text of it after the string), finish reason stop. Only the response is
    searched, not the prompt."""
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
    weights (needs algorithm.loss=decoupled_ppo, algorithm.tis_cap or loss_options is_level)."""
    carry: Literal["auto", "resubmit", "keep_kv"] = "auto"
    """How unfinished samples cross a step: `resubmit` aborts them and resumes them next step from
    their tokens (K/V recomputed under the new weights: exact, APRIL's design); `keep_kv` pauses
    them in the engine and continues on the K/V the older weights computed (PipelineRL-style
    in-flight update: no recompute; every token's logprob and version are still those it was
    sampled with). TorchEngine, and vLLM through its `pause_generation(mode="keep")`. `auto`:
    keep_kv for single-turn runs whose objective corrects tokens sampled under older weights
    (decoupled_ppo, tis_cap or m2po_tau), else resubmit; the run logs which and why
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
