"""`algorithm`: advantages, the policy loss and its aggregation, KL and shaping."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from rollover.config.base import Section

# a loss's clip range when the config leaves eps_low / eps_high unset (the others: DAPO's clip-higher, 0.2 / 0.28):
# GSPO clips a sequence's geometric-mean ratio, which moves far less than a token's (the paper's 3e-4 / 4e-4);
# CISPO clips only its weight's top (MiniMax-M1)
CLIP_DEFAULTS = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "cispo": (1.0, 0.28)}


class AlgorithmConfig(Section):
    advantage: Literal["grpo", "grpo_batch_std", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gapo",
                       "gdpo", "opo", "gpg", "grpo_passk", "remax", "gae", "otb"] = "grpo"
    """Advantage estimator over each prompt's group. reinforce_pp: no group baseline, the rewards
    whitened over the step (REINFORCE++; works with samples_per_prompt 1). opo: the group's
    length-weighted mean reward as baseline. gpg: the group mean as baseline, scaled by the step's
    samples over those with a nonzero reward (with loss reinforce). grpo_passk: only each group's best
    sample learns, by its lead over the second best (pass@k training). remax: the reward of the
    prompt's greedy answer as baseline; the run generates it beside the samples_per_prompt samples
    and does not train on it (works with samples_per_prompt 1). gdpo (several reward functions): each
    function's scores normalised within the group, then their weighted sum over the batch (TRL's
    multi_objective_aggregation=normalize_then_sum). gae: PPO with a learned critic (verl's default), each
    token's advantage by generalised advantage estimation from the critic's values (section critic; gamma,
    lam; works with samples_per_prompt 1). otb: the optimal token baseline (verl's optimal_token_baseline),
    each token's own baseline, its group's rewards weighted by how uncertain each sample's path was up to
    that position (from the policy's distributions before the step)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """advantage=gae: discount per token (verl's algorithm.gamma)."""
    lam: float = Field(1.0, ge=0, le=1)
    """advantage=gae: GAE's lambda (verl's algorithm.lam); 1 with gamma 1 makes each token's advantage
    the reward less the critic's value there."""
    loss: Literal["ppo", "gspo", "gspo_token", "cispo", "decoupled_ppo", "bapo", "sapo", "vespo", "reinforce"] | None = None
    """Policy loss; unset: ppo in sync mode, decoupled_ppo in async mode or with APRIL
    (partial_rollout.enabled). ppo with
    eps_high > eps_low is DAPO's clip-higher. sapo: a soft gate instead of the clip (loss_options:
    tau_pos, tau_neg; eps_low and eps_high do not apply). vespo: no clip, each sequence weighted by
    a smooth function of its importance ratio (loss_options: k_pos, lambda_pos, k_neg, lambda_neg;
    eps_low and eps_high do not apply). reinforce: the plain policy gradient -A * log pi, no ratio
    and no clip (verl's gpg loss mode; for one update per step)."""
    eps_low: float = Field(0.2, ge=0, le=1)
    """Lower clip range (ratio >= 1 - eps_low; 1 is no lower bound). Unset with loss gspo or
    gspo_token: 3e-4 (GSPO's sequence ratio); with cispo: 1.0 (no lower bound)."""
    eps_high: float = Field(0.28, ge=0)
    """Upper clip range (ratio <= 1 + eps_high); DAPO uses 0.28; a large value such as 1e9 is no
    upper bound (M2PO's unclipped objective: with eps_low 1). Unset with loss gspo or
    gspo_token: 4e-4."""
    dual_clip: Annotated[float, Field(gt=1)] | None = None
    """Dual-clip constant c (> 1) for negative advantages; None = off."""
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "drgrpo"] = "token-mean"
    """How per-token losses become an update's loss; token-mean divides by the update's token count
    over every micro-batch and rank (the step's, with one update a step), drgrpo by (sequences x
    max_new_tokens)."""
    loss_options: dict[str, Any] = {}
    """Extra keyword options for the policy loss (see docs/algorithms.md)."""
    tis_cap: Annotated[float, Field(gt=0)] | None = None
    """Truncated importance sampling against the engine's logprobs (token level): cap on the
    weight pi_old / pi_behav; None = off."""
    m2po_tau: Annotated[float, Field(gt=0)] | None = None
    """M2PO: mask the fewest tokens so the second moment of log(pi_old / pi_behav) is <= tau; None = off."""
    opsm_delta: Annotated[float, Field(ge=0)] | None = None
    """Off-policy sequence masking (DeepSeek-V3.2; TRL's off_policy_mask_threshold): a sequence
    whose mean log(pi_behav / pi) over its tokens exceeds this drops its negative-advantage tokens
    from the policy term (their KL term stays; TRL's example value: 0.5); None = off."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the reference (initial) model; > 0 loads a reference model."""
    kl_in_reward: float = Field(0.0, ge=0)
    """advantage=gae: the KL to the reference as a per-token penalty in the reward, with this
    weight (verl's use_kl_in_reward with kl_ctrl.kl_coef; its starting value with
    kl_in_reward_target): each token's reward is -kl_in_reward * (log pi_old - log pi_ref) (k1,
    verl's kl_penalty: kl), the sequence's reward added at its last token, and GAE runs over
    them. > 0 loads a reference model; it is apart from kl_coef's term in the loss."""
    kl_in_reward_target: Annotated[float, Field(gt=0)] | None = None
    """Adaptive KL control of kl_in_reward (verl's kl_ctrl.type: adaptive, target_kl; Ziegler et
    al. 2019): after each step the weight is multiplied by 1 + e * sequences / horizon, e the
    step's mean KL (per sequence, over its tokens) relative to this target less 1, clipped to
    +-0.2. A resumed run goes on with the weight it had moved to. None: a fixed weight (the
    config's, on a resume too)."""
    kl_in_reward_horizon: int = Field(10000, ge=1)
    """Adaptive KL control's horizon in sequences (verl's kl_ctrl.horizon)."""
    kl_estimator: Literal["k1", "k2", "k3", "k3+"] = "k3"
    """KL estimator for the penalty: k1 log(pi/ref), k2 half its square, k3 ref/pi - log(ref/pi) - 1,
    k3+ k3's value with k2's gradient (verl's kl, mse, low_var_kl without its clamp, and k3+)."""
    kl_is_correction: bool = False
    """Weight each token's KL estimate by pi / pi_old, gradient included (DeepSeek-V3.2's unbiased
    KL estimate; TRL's use_bias_correction_kl): an unbiased estimate of the KL's gradient when the
    tokens were sampled from pi_old."""
    ref_sync_every: Annotated[int, Field(ge=1)] | None = None
    """Move the KL reference toward the policy every this many steps (TR-DPO, arXiv 2404.09656;
    TRL's sync_ref_model): ref = ref_mixup_alpha * policy + (1 - ref_mixup_alpha) * ref, after
    the step's updates. None = the reference stays the starting model. The reference then goes
    into every checkpoint (a resumed run keeps the moved one). Needs a reference (kl_coef or kl_in_reward
    > 0); not with LoRA."""
    ref_mixup_alpha: float = Field(0.6, gt=0, le=1)
    """The policy's weight in each reference sync (TRL's ref_model_mixup_alpha; 1 copies it)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus weight (with entropy_target: its starting value)."""
    entropy_target: Annotated[float, Field(ge=0)] | None = None
    """Adaptive entropy control (Skywork-OR1, arXiv 2505.22312; TRL's use_adaptive_entropy): after
    each update the coefficient moves up by entropy_coef_delta when the update's mean entropy (over
    the tokens the bonus acts on) is at or below this target, down otherwise, within
    [entropy_coef_min, entropy_coef_max]; the bonus applies only while the entropy last measured is
    at or below the target. None = a fixed entropy_coef."""
    entropy_coef_delta: float = Field(0.005, gt=0)
    """Adaptive entropy control's step."""
    entropy_coef_min: float = Field(0.0, ge=0)
    """Adaptive entropy control's lower bound."""
    entropy_coef_max: float = Field(1.0, ge=0)
    """Adaptive entropy control's upper bound."""
    top_entropy_quantile: float = Field(1.0, ge=0, le=1)
    """Train only the highest-entropy fraction of each update's loss tokens ("Beyond the 80/20
    rule", arXiv 2506.01939, which uses 0.2; TRL's top_entropy_quantile): the threshold is that
    quantile of the trainer's entropies over the update's tokens on every rank, measured under
    the policy before the step in one no-grad pass. It weighs the policy term and the entropy
    bonus; the KL term and the denominators count every token (TRL). 1 = every token; 0 = the
    highest-entropy token only."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal (before overlong shaping, as
    DAPO filters on accuracy) and top up with new prompts."""
    dynamic_sampling_metric: Literal["reward", "accuracy"] = "reward"
    """What dynamic sampling compares within a group: reward (its total before overlong shaping:
    a group whose samples all score alike has no advantage to train on) or accuracy (each
    sample right or not by the first reward function and reward.correct_threshold, as DAPO and
    verl's filter_groups.metric=acc: an all-wrong group whose format scores differ is dropped too)."""
    max_resample_rounds: int = Field(4, ge=1)
    """Dynamic sampling: generation rounds per step before training on what was kept."""
    overlong_buffer: int = Field(0, ge=0)
    """DAPO soft overlong punishment: penalise the last `overlong_buffer` tokens before the cap (0 = off)."""
    overlong_penalty: float = Field(1.0, ge=0)
    """Maximum soft overlong punishment."""
    mask_truncated: bool = False
    """Exclude completions cut by max_new_tokens from the loss."""

    @field_validator("kl_estimator", mode="before")
    @classmethod
    def _verl_estimator_names(cls, value):
        """verl's names for the estimators, told which of ours each is (or that none is)."""
        ours = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "low_var_kl+": "k3+"}
        if isinstance(value, str) and value in ours:
            raise ValueError(f"{value!r} is verl's name for {ours[value]}: write {ours[value]}")
        if value in ("abs", "full", "kl+", "k1+"):
            raise ValueError(f"{value!r} (verl's) has no equivalent here: k1, k2, k3 or k3+")
        return value

    @model_validator(mode="before")
    @classmethod
    def _clip_of_the_loss(cls, data: Any) -> Any:
        """eps_low / eps_high left unset take the named loss's own range (`CLIP_DEFAULTS`)."""
        if isinstance(data, dict) and isinstance(data.get("loss"), str) and data["loss"] in CLIP_DEFAULTS:
            low, high = CLIP_DEFAULTS[data["loss"]]
            data = {"eps_low": low, "eps_high": high, **data}
        return data

    @property
    def stale_corrections(self) -> list[str]:
        """The settings by which the policy loss corrects tokens sampled under older weights
        (decoupled PPO's behaviour ratio, importance weights, M2PO's mask), as a config names them."""
        o = self.loss_options
        return [name for name, on in ((f"algorithm.loss={self.loss}", self.loss == "decoupled_ppo"),
                                      ("algorithm.tis_cap", self.tis_cap is not None),
                                      ("algorithm.loss_options.is_level", o.get("is_level") is not None),
                                      ("algorithm.m2po_tau", self.m2po_tau is not None),
                                      ("algorithm.loss_options.m2po_tau", o.get("m2po_tau") is not None)) if on]

    @property
    def uses_reference(self) -> bool:
        """Whether a KL reference model is loaded: for the loss's term or the reward's."""
        return self.kl_coef > 0 or self.kl_in_reward > 0
