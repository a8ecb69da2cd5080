"""Policy-gradient losses over per-token log-probabilities.

Every loss has the signature

    fn(logp_BT, old_logp_BT, adv, mask_BT, behav_logp_BT=None, *, <its own options>,
       **correction) -> PolicyLossOutput

- `logp_BT`: current policy, with gradient. `old_logp_BT`: the policy before this update
  (PPO's old / AReaL's proximal policy), detached here. `behav_logp_BT`: the engine's sampling
  log-probs, needed only by the off-policy options.
- `adv`: `[B]` (broadcast over tokens) or `[B, T]`.
- `**correction`: `is_level`, `is_mode`, `is_cap`, `is_floor`, `is_seq_ratio` (truncated or
  masked importance sampling against the engine) and `m2po_tau` (M2PO mask); every loss takes
  them (see `offpolicy.off_policy_correction`). M2PO and TIS are options, not loss names.
- Returns `loss_BT` (to be *minimised*, i.e. the negated objective, 0 outside `mask_BT`),
  `mask_BT` (the tokens that count, after M2PO / IS masking) and detached scalar `metrics`.

Reduce `loss_BT` with `aggregate(out.loss_BT, out.mask_BT, ...)`. Masked positions may hold
any value, `-inf` and NaN included: they are replaced before any arithmetic, so neither the
loss nor its gradient sees them.

Common departures:
- `log(π/π_old)` is clamped to ±20 before `exp` (verl, OpenRLHF; TRL does not clamp). Tokens
  beyond the clamp get no gradient. GSPO averages the *unclamped* token log-ratios over the
  sequence and clamps the mean: a clamped token would make the sequence ratio wrong and take
  its gradient away even when the mean is small.
- Clip fractions count the tokens whose gradient the clip zeroes: `clip_frac_low` is
  `A < 0, r < low`, `clip_frac_high` is `A > 0, r > high` (TRL's definition; verl's
  `pg_clipfrac` is their sum and its `pg_clipfrac_lower` is our `dual_clip_frac`).
- `approx_kl` is the k3 estimate `mean(r - 1 - log r)` of KL(π_old ‖ π) over loss tokens;
  verl's `ppo_kl` is the k1 estimate `mean(-log r)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from rollover.algos.aggregate import masked_max, masked_mean
from rollover.algos.bapo_bounds import BAPO_GRID, bapo_bounds, bapo_grid, bapo_search, bapo_tables
from rollover.algos.offpolicy import MAX_LOG_RATIO, off_policy_correction


@dataclass(frozen=True)
class PolicyLossOutput:
    loss_BT: Tensor  # [B, T] per-token loss to minimise, 0 where mask_BT is False
    mask_BT: Tensor  # [B, T] bool: loss tokens after M2PO / importance-sampling masking
    metrics: dict[str, Tensor]  # detached 0-dim tensors


class _Inputs(NamedTuple):
    logp_BT: Tensor  # 0 outside mask_BT
    log_ratio_BT: Tensor  # log(π/π_old), clamped, 0 outside mask_BT
    raw_log_ratio_BT: Tensor  # the same before the clamp (GSPO's sequence mean)
    adv_BT: Tensor
    mask_BT: Tensor  # bool, after corrections
    weight_BT: Tensor | None  # detached importance weights
    metrics: dict[str, Tensor]


def _prepare(logp_BT, old_logp_BT, adv, mask_BT, behav_logp_BT, correction) -> _Inputs:
    if logp_BT.dim() != 2:
        raise ValueError(f"logp_BT must be [B, T], got {tuple(logp_BT.shape)}")
    for name, t in (("old_logp_BT", old_logp_BT), ("mask_BT", mask_BT), ("behav_logp_BT", behav_logp_BT)):
        if t is not None and t.shape != logp_BT.shape:
            raise ValueError(f"{name} {tuple(t.shape)} must match logp_BT {tuple(logp_BT.shape)}")
    if adv.shape == logp_BT.shape[:1]:
        adv_BT = adv[:, None].expand_as(logp_BT)
    elif adv.shape == logp_BT.shape:
        adv_BT = adv
    else:
        raise ValueError(f"adv must be [B] or [B, T] = {tuple(logp_BT.shape)}, got {tuple(adv.shape)}")
    given_BT = mask_BT.bool()
    weight_BT, mask_BT, metrics = off_policy_correction(old_logp_BT.detach(), behav_logp_BT, given_BT, **correction)
    given = given_BT.sum()
    metrics["masked_frac"] = ((given - mask_BT.sum()) / given.clamp(min=1)).to(logp_BT.dtype)
    zeros_BT = torch.zeros_like(logp_BT)
    logp_BT = torch.where(mask_BT, logp_BT, zeros_BT)
    old_logp_BT = torch.where(mask_BT, old_logp_BT.detach(), zeros_BT)
    raw_log_ratio_BT = logp_BT - old_logp_BT
    log_ratio_BT = raw_log_ratio_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    adv_BT = torch.where(mask_BT, adv_BT.detach().to(logp_BT.dtype), zeros_BT)
    return _Inputs(logp_BT, log_ratio_BT, raw_log_ratio_BT, adv_BT, mask_BT, weight_BT, metrics)


def _finish(loss_BT: Tensor, x: _Inputs, metrics: dict[str, Tensor]) -> PolicyLossOutput:
    if x.weight_BT is not None:
        loss_BT = loss_BT * x.weight_BT
    loss_BT = torch.where(x.mask_BT, loss_BT, torch.zeros_like(loss_BT))
    return PolicyLossOutput(loss_BT, x.mask_BT, {**x.metrics, **metrics})


def _ratio_metrics(ratio_BT: Tensor, x: _Inputs) -> dict[str, Tensor]:
    """Statistics of the ratio being clipped, and k3 KL(π_old ‖ π) over loss tokens."""
    ratio_BT, log_ratio_BT = ratio_BT.detach(), x.log_ratio_BT.detach()
    return {
        "ratio_mean": masked_mean(ratio_BT, x.mask_BT),
        "ratio_max": masked_max(ratio_BT, x.mask_BT),
        "approx_kl": masked_mean(log_ratio_BT.exp() - 1 - log_ratio_BT, x.mask_BT),
    }


def _check_bounds(low: float, high: float) -> None:
    if not 0.0 <= low <= 1.0 <= high:
        raise ValueError(f"clip bounds must satisfy 0 <= low <= 1 <= high, got low={low}, high={high}")


def _clipped_surrogate(
    ratio_BT: Tensor, x: _Inputs, low: float, high: float, dual_clip: float | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's pessimistic surrogate `max(-A·r, -A·clip(r, low, high))`, optionally dual-clipped
    (`min(·, -c·A)` for `A < 0`, Ye et al. arXiv 1912.09729)."""
    adv_BT, mask_BT = x.adv_BT, x.mask_BT
    loss_BT = torch.maximum(-adv_BT * ratio_BT, -adv_BT * ratio_BT.clamp(low, high))
    with torch.no_grad():
        r = ratio_BT.detach()
        metrics = {
            "clip_frac_low": masked_mean(((adv_BT < 0) & (r < low)).to(r.dtype), mask_BT),
            "clip_frac_high": masked_mean(((adv_BT > 0) & (r > high)).to(r.dtype), mask_BT),
        }
    if dual_clip is not None:
        if not dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        floor_BT = -adv_BT * dual_clip  # a constant: the capped tokens carry no gradient
        capped_BT = (adv_BT < 0) & (loss_BT > floor_BT)
        loss_BT = torch.where(capped_BT, floor_BT, loss_BT)
        metrics["dual_clip_frac"] = masked_mean(capped_BT.to(loss_BT.dtype), mask_BT).detach()
    return loss_BT, metrics


def ppo(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv: Tensor,
    mask_BT: Tensor,
    behav_logp_BT: Tensor | None = None,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    **correction,
) -> PolicyLossOutput:
    """PPO-clip (Schulman et al., arXiv 1707.06347) with DAPO's asymmetric clip-higher bounds
    (arXiv 2503.14476) and optional dual clip.

    `r = exp(logp - old_logp)`, `ℓ = max(-A·r, -A·clip(r, 1 - eps_low, 1 + eps_high))`, then
    `ℓ = min(ℓ, -dual_clip·A)` where `A < 0`.

    Defaults 0.2/0.2 as in verl and TRL; DAPO uses `eps_high=0.28`. Dual clip is off by default
    (TRL has none); verl applies `clip_ratio_c=3.0` unconditionally.
    """
    _check_bounds(1.0 - eps_low, 1.0 + eps_high)
    x = _prepare(logp_BT, old_logp_BT, adv, mask_BT, behav_logp_BT, correction)
    ratio_BT = x.log_ratio_BT.exp()
    loss_BT, metrics = _clipped_surrogate(ratio_BT, x, 1.0 - eps_low, 1.0 + eps_high, dual_clip)
    return _finish(loss_BT, x, {**metrics, **_ratio_metrics(ratio_BT, x)})


def decoupled_ppo(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv: Tensor,
    mask_BT: Tensor,
    behav_logp_BT: Tensor | None = None,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    is_level: str = "token",
    is_mode: str = "mask",
    is_cap: float = 5.0,
    is_floor: float | None = None,
    is_seq_ratio: str = "geo_mean",
    m2po_tau: float | None = None,
) -> PolicyLossOutput:
    """Decoupled PPO (AReaL, arXiv 2505.24298, Eq. 5): PPO clipped around the *proximal* policy
    `old_logp_BT`, times the detached behaviour weight `w = π_prox / π_behav`:

    `ℓ = w · max(-A·r, -A·clip(r, 1 - eps_low, 1 + eps_high))`, `r = π / π_prox`.

    The weight is exactly the truncated-IS weight of `ppo(..., is_level=...)`, so this is `ppo`
    with AReaL's defaults: token level, tokens with `w > 5` dropped from the loss (`is_mode=
    "mask"`; `"truncate"` caps them at 5 instead), geometric mean at sequence level.
    With `behav == old` every weight is 1 and the loss equals `ppo`.
    AReaL divides by the token count before masking; here that is the caller's `num_tokens`.
    """
    if behav_logp_BT is None:
        raise ValueError("decoupled_ppo needs behav_logp_BT (the engine's sampling log-probs)")
    return ppo(
        logp_BT, old_logp_BT, adv, mask_BT, behav_logp_BT,
        eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip,
        is_level=is_level, is_mode=is_mode, is_cap=is_cap, is_floor=is_floor,
        is_seq_ratio=is_seq_ratio, m2po_tau=m2po_tau,
    )


def _mean_log_ratio_B(x: _Inputs) -> Tensor:
    """Length-normalised sequence log-ratio `Σ_t m·log r_t / Σ_t m` of the unclamped token
    log-ratios; the caller clamps the mean."""
    len_B = x.mask_BT.sum(dim=1).clamp(min=1)
    return x.raw_log_ratio_BT.sum(dim=1) / len_B


def gspo(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv: Tensor,
    mask_BT: Tensor,
    behav_logp_BT: Tensor | None = None,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    **correction,
) -> PolicyLossOutput:
    """GSPO (Zheng et al., arXiv 2507.18071): one clipped ratio per sequence.

    `s_i = exp(mean_t log(π/π_old))` (geometric mean of token ratios),
    `ℓ_i = max(-A_i·s_i, -A_i·clip(s_i, 1 - eps_low, 1 + eps_high))`, written to every loss
    token of sequence i. Aggregate with `seq-mean-token-mean` for the paper's `(1/G) Σ_i ℓ_i`
    (verl forces that mode); `token-mean` weights sequences by length instead.

    Needs `adv` as `[B]`; for per-token advantages use `gspo_token`. Defaults are the paper's
    (3e-4, 4e-4). No dual clip, as in verl. The mean is taken over the unclamped token
    log-ratios and then clamped to ±20 (verl clamps at +10 only).
    """
    if adv.dim() != 1:
        raise ValueError(f"gspo clips one ratio per sequence and needs adv [B], got {tuple(adv.shape)}; use gspo_token")
    _check_bounds(1.0 - eps_low, 1.0 + eps_high)
    x = _prepare(logp_BT, old_logp_BT, adv, mask_BT, behav_logp_BT, correction)
    ratio_BT = _mean_log_ratio_B(x).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()[:, None].expand_as(logp_BT)
    loss_BT, metrics = _clipped_surrogate(ratio_BT, x, 1.0 - eps_low, 1.0 + eps_high, None)
    return _finish(loss_BT, x, {**metrics, **_ratio_metrics(ratio_BT, x)})


def gspo_token(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv: Tensor,
    mask_BT: Tensor,
    behav_logp_BT: Tensor | None = None,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    **correction,
) -> PolicyLossOutput:
    """GSPO-token (arXiv 2507.18071, Eq. 13): per-token advantages with the sequence ratio.

    `s_it = sg(s_i) · π_t / sg(π_t)`: its value is `s_i` and its gradient that of `log π_t`
    scaled by `s_i`. `ℓ_it = max(-A_it·s_it, -A_it·clip(s_it, 1 - eps_low, 1 + eps_high))`.
    With one advantage per sequence and `seq-mean-token-mean` it equals `gspo` in value and
    gradient. This is verl's `gspo` loss; TRL's sequence level has no token form.

    The clamp acts on `sg(log s_i) + log π_t - sg(log π_t)`, whose value is `log s_i`: beyond
    ±20 the sequence's tokens get no gradient, as in `gspo` (verl clamps the same sum at +10).
    """
    _check_bounds(1.0 - eps_low, 1.0 + eps_high)
    x = _prepare(logp_BT, old_logp_BT, adv, mask_BT, behav_logp_BT, correction)
    seq_B = _mean_log_ratio_B(x).detach()
    ratio_BT = (seq_B[:, None] + x.logp_BT - x.logp_BT.detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    loss_BT, metrics = _clipped_surrogate(ratio_BT, x, 1.0 - eps_low, 1.0 + eps_high, None)
    return _finish(loss_BT, x, {**metrics, **_ratio_metrics(ratio_BT, x)})


def cispo(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv: Tensor,
    mask_BT: Tensor,
    behav_logp_BT: Tensor | None = None,
    *,
    eps_low: float = 1.0,
    eps_high: float = 0.28,
    **correction,
) -> PolicyLossOutput:
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, not the update.

    `ℓ = -sg(clip(r, 1 - eps_low, 1 + eps_high)) · A · logp`: every token keeps a gradient,
    scaled by its truncated ratio. The loss *value* is not comparable to PPO's.

    Defaults: no lower bound (`eps_low=1`, as the paper) and `eps_high=0.28`. verl clips with
    its PPO `clip_ratio_low/high` (0.2/0.2); TRL caps at `epsilon_high` alone. The clip
    fractions count truncated weights (any advantage sign), which here do not zero gradients.
    """
    _check_bounds(1.0 - eps_low, 1.0 + eps_high)
    x = _prepare(logp_BT, old_logp_BT, adv, mask_BT, behav_logp_BT, correction)
    ratio_BT = x.log_ratio_BT.exp()
    low, high = 1.0 - eps_low, 1.0 + eps_high
    loss_BT = -ratio_BT.clamp(low, high).detach() * x.adv_BT * x.logp_BT
    with torch.no_grad():
        r = ratio_BT.detach()
        metrics = {
            "clip_frac_low": masked_mean((r < low).to(r.dtype), x.mask_BT),
            "clip_frac_high": masked_mean((r > high).to(r.dtype), x.mask_BT),
        }
    return _finish(loss_BT, x, {**metrics, **_ratio_metrics(ratio_BT, x)})


def sapo(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv: Tensor,
    mask_BT: Tensor,
    behav_logp_BT: Tensor | None = None,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    **correction,
) -> PolicyLossOutput:
    """SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347): a smooth gate in place of the
    clip. `ℓ = -A · (4/τ) · σ(τ (r - 1))`, `τ = tau_pos` where `A > 0` and `tau_neg` where
    `A < 0`. Its gradient is `-A · w · ∇log π` with `w = 4 σ(1 - σ) r`: 1 at `r = 1` (the
    on-policy gradient); near 1 it follows `r` as the unclipped ratio does, and farther off it
    decays smoothly to 0, sooner for the larger `τ` (the defaults, 1.0 and 1.05, damp negative
    advantages a little more). No bound cuts a token's gradient (far off, the gate's slope
    underflows to 0 in float32 as it nears 0 in exact arithmetic). The clip fractions count the
    tokens whose gate factor `4σ(1 - σ)` is below 1/2 (`clip_frac_high`: `A > 0`,
    `clip_frac_low`: `A < 0`), and `gate_mean` is that factor's mean.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"sapo's temperatures must be positive, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    x = _prepare(logp_BT, old_logp_BT, adv, mask_BT, behav_logp_BT, correction)
    ratio_BT = x.log_ratio_BT.exp()
    tau_BT = torch.where(x.adv_BT > 0, torch.full_like(ratio_BT, tau_pos), torch.full_like(ratio_BT, tau_neg))
    gate_BT = torch.sigmoid(tau_BT * (ratio_BT - 1))
    loss_BT = -x.adv_BT * gate_BT * (4.0 / tau_BT)
    with torch.no_grad():
        g = gate_BT.detach()
        damping = 4 * g * (1 - g)  # the gate's own factor of the gradient weight (r aside)
        halved = (damping < 0.5).to(damping.dtype)
        metrics = {
            "clip_frac_low": masked_mean(halved * (x.adv_BT < 0), x.mask_BT),
            "clip_frac_high": masked_mean(halved * (x.adv_BT > 0), x.mask_BT),
            "gate_mean": masked_mean(damping, x.mask_BT),
        }
    return _finish(loss_BT, x, {**metrics, **_ratio_metrics(ratio_BT, x)})


def vespo(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv: Tensor,
    mask_BT: Tensor,
    behav_logp_BT: Tensor | None = None,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
    **correction,
) -> PolicyLossOutput:
    """VESPO (Variational Sequence-Level Soft Policy Optimization, arXiv 2602.10693; TRL's
    `loss_type="vespo"`): no clip; each sequence's REINFORCE term is scaled by a smooth weight of
    its importance ratio against the policy that sampled it, `w = Π_t π/π_behav`
    (`Π_t π/π_old` when no `behav_logp_BT` is given):

    `ℓ_it = -sg(φ(w_i)) · A_i · log π_it`, `φ(w) = e^λ · w^k · e^{-λw}` (so `φ(1) = 1`), with
    `(k, λ) = (k_pos, lambda_pos)` where `A ≥ 0` and `(k_neg, lambda_neg)` where `A < 0`: a
    sequence far from the old policy on either side gets little weight.

    `w` is `Π_t π/π_old · Π_t π_old/π_behav`. Token-level importance sampling options
    (`tis_cap`, or `is_level="token"`) shape the second factor instead of multiplying the loss,
    as TRL does with vLLM's weights: truncated, each token's ratio is capped; masked, a token
    outside the bounds has ratio 0 (`1e-8`), so its whole sequence gets a weight of about 0.
    Sequence-level importance sampling is refused. Token log-ratios are clamped (`π/π_old` to ±20, `π_old/π_behav`
    to `[log 1e-8, 20]`), then `log w` to `[log 1e-8, 20]` (TRL's bounds). `phi_mean` is
    the mean weight over loss tokens; the clip fractions count the tokens whose weight is below
    1/2, `clip_frac_low` those of sequences with `w < 1`, `clip_frac_high` with `w > 1`.
    """
    if correction.get("is_level") not in (None, "token"):
        raise ValueError(f"vespo takes importance sampling at token level only (its weights go into the sequence "
                         f"ratio), got is_level={correction['is_level']!r}")
    for name, v in (("k_pos", k_pos), ("lambda_pos", lambda_pos), ("k_neg", k_neg), ("lambda_neg", lambda_neg)):
        if not v >= 0:
            raise ValueError(f"vespo's {name} must be >= 0, got {v}")
    x = _prepare(logp_BT, old_logp_BT, adv, mask_BT, behav_logp_BT, correction)
    with torch.no_grad():
        floor = math.log(1e-8)
        log_w_BT = x.log_ratio_BT.detach()
        if x.weight_BT is not None:  # π_old/π_behav as the correction options made it (capped, say)
            is_log_BT = x.weight_BT.clamp(min=1e-30).log()
        elif behav_logp_BT is not None:  # π_old/π_behav as it is
            is_log_BT = old_logp_BT.detach() - behav_logp_BT
        if x.weight_BT is not None or behav_logp_BT is not None:
            is_log_BT = torch.where(x.mask_BT, is_log_BT.clamp(floor, MAX_LOG_RATIO), torch.zeros_like(log_w_BT))
            log_w_BT = log_w_BT + is_log_BT
        if correction.get("is_level") == "token" and correction.get("is_mode", "truncate") == "mask":
            # a token the mask drops has weight 0, as in TRL: log 1e-8, so its sequence's φ is about 0
            given_BT = mask_BT.bool()
            rho_BT = torch.where(given_BT, old_logp_BT.detach() - behav_logp_BT, 0.0).clamp(
                -MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
            lo = correction.get("is_floor")
            out_BT = given_BT & ((rho_BT > correction.get("is_cap", 2.0)) | ((rho_BT < lo) if lo is not None else False))
            log_w_BT = log_w_BT + torch.where(out_BT, floor, 0.0)
        log_w_B = log_w_BT.sum(dim=1).clamp(floor, MAX_LOG_RATIO)
        pos_BT = x.adv_BT >= 0
        k_BT = torch.where(pos_BT, torch.full_like(log_w_BT, k_pos), torch.full_like(log_w_BT, k_neg))
        lam_BT = torch.where(pos_BT, torch.full_like(log_w_BT, lambda_pos), torch.full_like(log_w_BT, lambda_neg))
        lam_BT = lam_BT.clamp(min=1e-4)
        log_w_BT = log_w_B[:, None].expand_as(log_w_BT)
        phi_BT = (lam_BT + k_BT * log_w_BT - lam_BT * log_w_BT.exp()).exp().nan_to_num(0.0, 0.0, 0.0)
        halved_BT = (phi_BT < 0.5).to(phi_BT.dtype)
        metrics = {
            "clip_frac_low": masked_mean(halved_BT * (log_w_BT < 0), x.mask_BT),
            "clip_frac_high": masked_mean(halved_BT * (log_w_BT > 0), x.mask_BT),
            "phi_mean": masked_mean(phi_BT, x.mask_BT),
        }
    loss_BT = -phi_BT * x.adv_BT * x.logp_BT
    return _finish(loss_BT, x._replace(weight_BT=None), {**metrics, **_ratio_metrics(x.log_ratio_BT.exp(), x)})


def bapo_update_bounds(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv: Tensor,
    mask_BT: Tensor,
    behav_logp_BT: Tensor | None = None,
    *,
    reduce: Callable[[Tensor], Tensor] | None = None,
    **opts,
) -> tuple[float, float, float]:
    """`(c_low, c_high, positive_share)` of an update whose loss tokens are split over micro-batches
    or ranks: the tables of what `bapo(logp_BT, old_logp_BT, adv, mask_BT, behav_logp_BT, **opts)`
    searches (its ratios, after its importance-sampling mask), summed over the ranks by `reduce`
    (a float64 CPU tensor in, its sum over the ranks out; None: one process), then searched. Each
    rank passes its own rows and gets the same bounds; hand them to every micro-batch's `bapo` as
    `bounds`. `opts` are `bapo`'s (`dual_clip` and `bounds` are ignored)."""
    grid = {k: opts.pop(k) for k in BAPO_GRID if k in opts}
    opts.pop("dual_clip", None)
    opts.pop("bounds", None)
    x = _prepare(logp_BT.detach(), old_logp_BT, adv, mask_BT, behav_logp_BT, opts)
    P_K, N_K = bapo_tables(x.log_ratio_BT.exp(), x.adv_BT, x.mask_BT, **grid)
    if reduce is not None:
        both = reduce(torch.cat([P_K, N_K]))
        P_K, N_K = both[: len(P_K)], both[len(P_K):]
    return bapo_search(P_K, N_K, **grid)


def bapo(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv: Tensor,
    mask_BT: Tensor,
    behav_logp_BT: Tensor | None = None,
    *,
    low_start: float = 0.6,
    low_max: float = 0.9,
    high_start: float = 1.2,
    high_max: float = 3.0,
    step: float = 0.05,
    target_pos_share: float = 0.5,
    dual_clip: float | None = 3.0,
    bounds: tuple[float, float] | None = None,
    **correction,
) -> PolicyLossOutput:
    """BAPO (Xi et al., arXiv 2510.18927): PPO whose ratio bounds `[c_low, c_high]` are chosen
    per call by `bapo_bounds`, then `max(-A·r, -A·clamp(r, c_low, c_high))` with dual clip 3.

    Bounds are explicit ratios (not epsilons). Defaults are the paper's: ranges [0.6, 0.9] and
    [1.2, 3.0], target share 0.5, step 0.05 (the recipe yaml uses [0.6, 0.8], [1.2, 2.0]).
    The bounds depend on the whole batch given, so a batch split into micro-batches would pick
    bounds per micro-batch (the recipe shares them across data-parallel ranks but not across
    gradient-accumulation steps). `bounds=(c_low, c_high)` skips the search and clips there:
    choose them once over the update with `bapo_update_bounds` and pass them to every
    micro-batch, as rollover's trainer does (the split then changes nothing). With `bounds`
    given, the metric `bapo_pos_share` is NaN (the share is the whole update's, known to the
    caller, not to this part of it); `bapo_c_low` / `bapo_c_high` are the bounds given.
    """
    grid = dict(low_start=low_start, low_max=low_max, high_start=high_start, high_max=high_max, step=step,
                target_pos_share=target_pos_share)
    x = _prepare(logp_BT, old_logp_BT, adv, mask_BT, behav_logp_BT, correction)
    ratio_BT = x.log_ratio_BT.exp()
    if bounds is None:
        c_low, c_high, pos_share = bapo_bounds(ratio_BT, x.adv_BT, x.mask_BT, **grid)
    else:
        bapo_grid(**grid)  # still checked
        c_low, c_high = (float(b) for b in bounds)
        _check_bounds(c_low, c_high)
        pos_share = float("nan")
    loss_BT, metrics = _clipped_surrogate(ratio_BT, x, c_low, c_high, dual_clip)
    new = logp_BT.new_tensor
    metrics.update(bapo_c_low=new(c_low), bapo_c_high=new(c_high), bapo_pos_share=new(pos_share))
    return _finish(loss_BT, x, {**metrics, **_ratio_metrics(ratio_BT, x)})


def reinforce(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv: Tensor,
    mask_BT: Tensor,
    behav_logp_BT: Tensor | None = None,
    **correction,
) -> PolicyLossOutput:
    """The plain policy gradient, `ℓ = -A · logp`: no ratio, no clip (verl's `gpg` and
    `reinforce` loss modes; GPG, arXiv 2504.02546, trains with it). Its gradient is REINFORCE's
    `-A·∇logp`, which equals PPO's at `r = 1`: exact for the first pass over a step's samples, and
    unbounded after it, so it suits one update per step. With `tis_cap` each token's loss is
    scaled by its truncated weight against the engine, as every loss here. The loss *value* is
    not comparable to PPO's."""
    x = _prepare(logp_BT, old_logp_BT, adv, mask_BT, behav_logp_BT, correction)
    none = x.logp_BT.new_zeros(())  # nothing is clipped
    return _finish(-x.adv_BT * x.logp_BT, x, {"clip_frac_low": none, "clip_frac_high": none,
                                              **_ratio_metrics(x.log_ratio_BT.exp(), x)})


PolicyLossFn = Callable[..., PolicyLossOutput]

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo": ppo,
    "gspo": gspo,
    "gspo_token": gspo_token,
    "cispo": cispo,
    "decoupled_ppo": decoupled_ppo,
    "bapo": bapo,
    "sapo": sapo,
    "vespo": vespo,
    "reinforce": reinforce,
}


def policy_loss(
    name: str,
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv: Tensor,
    mask_BT: Tensor,
    behav_logp_BT: Tensor | None = None,
    **opts,
) -> PolicyLossOutput:
    """Run the policy loss registered as `name` (see `POLICY_LOSSES`); unknown options raise."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; known: {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[name](logp_BT, old_logp_BT, adv, mask_BT, behav_logp_BT, **opts)
