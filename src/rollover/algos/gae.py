"""PPO with a learned critic: generalised advantage estimation and the clipped value loss.

`algorithm.advantage: gae` (verl's `adv_estimator: gae`). The critic predicts, before each
response token, the return still to come; the sequence's reward arrives at its last trained
token. Over the trained tokens of a sequence, in order (tokens out of the loss, such as an
environment's replies in an episode, are not states: they are skipped, not scored 0):

    delta_t = r_t + gamma * V_{t+1} - V_t          (V after the last token: 0)
    A_t     = delta_t + gamma * lam * A_{t+1}
    R_t     = A_t + V_t                             (the critic's target)

The advantages are then whitened over every trained token of the step (verl's
`masked_whiten`). With gamma = lam = 1 (verl's defaults) A_t = reward - V_t: the critic is a
per-token baseline.

The value loss is PPO's clipped one (verl's `compute_value_loss`): a prediction may move at most
`clip` from the value recorded before the step's updates,
`0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)` per token.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rollover.algos.aggregate import masked_mean


def gae(rewards_B: Tensor, values_BT: Tensor, mask_BT: Tensor, *, gamma: float = 1.0,
        lam: float = 1.0, token_rewards_BT: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-token advantages and returns [B, T] (0 on tokens out of the loss) of sequences whose
    reward `rewards_B` comes at their last trained token, under the critic's `values_BT`;
    `token_rewards_BT`: a reward on every token besides (a KL penalty), read on trained tokens."""
    if values_BT.shape != mask_BT.shape or rewards_B.shape != values_BT.shape[:1]:
        raise ValueError(f"gae: rewards {tuple(rewards_B.shape)}, values {tuple(values_BT.shape)} and mask "
                         f"{tuple(mask_BT.shape)} do not match")
    B, T = values_BT.shape
    mask_BT = mask_BT.bool()
    # each row's trained tokens moved to its front, in order (a stable sort of "not trained")
    order_BT = torch.sort((~mask_BT).to(torch.int8), dim=1, stable=True).indices
    n_B = mask_BT.sum(dim=1)
    live_BT = torch.arange(T, device=values_BT.device)[None] < n_B[:, None]
    v_BT = values_BT.float().gather(1, order_BT) * live_BT
    r_BT = torch.zeros_like(v_BT) if token_rewards_BT is None else \
        token_rewards_BT.float().gather(1, order_BT) * live_BT
    has = n_B > 0
    r_BT[has, n_B[has] - 1] += rewards_B.float()[has]
    adv_BT = torch.zeros_like(v_BT)
    last_B = torch.zeros(B, dtype=v_BT.dtype, device=v_BT.device)
    for t in range(T - 1, -1, -1):
        next_B = v_BT[:, t + 1] if t + 1 < T else torch.zeros_like(last_B)
        delta_B = r_BT[:, t] + gamma * next_B - v_BT[:, t]
        last_B = (delta_B + gamma * lam * last_B) * live_BT[:, t]
        adv_BT[:, t] = last_B
    ret_BT = adv_BT + v_BT
    # back to the tokens' own places; positions past a row's trained tokens land on untrained ones
    adv_out = torch.zeros_like(adv_BT).scatter(1, order_BT, adv_BT) * mask_BT
    ret_out = torch.zeros_like(ret_BT).scatter(1, order_BT, ret_BT) * mask_BT
    return adv_out, ret_out


def _moments(x_BT: Tensor, mask_BT: Tensor, reduce) -> tuple[float, float, float]:
    """(count, mean, unbiased variance) of `x` over the mask, the sums taken by `reduce` (a float64
    tensor summed over the ranks that hold parts of the step; None: this one alone)."""
    vals = x_BT[mask_BT.bool()].double()
    sums = torch.tensor([float(vals.numel()), float(vals.sum()), float(vals.square().sum())], dtype=torch.float64)
    n, s, ss = (sums if reduce is None else reduce(sums)).tolist()
    mean = s / n if n else 0.0
    var = max(ss - n * mean * mean, 0.0) / (n - 1) if n > 1 else 0.0
    return n, mean, var


def masked_whiten(x_BT: Tensor, mask_BT: Tensor, eps: float = 1e-8, reduce=None) -> Tensor:
    """`x` less its mean over the mask, divided by its (unbiased) standard deviation there; 0
    off the mask. One token: only centred. `reduce`: the moments over every rank's tokens."""
    n, mean, var = _moments(x_BT, mask_BT, reduce)
    centred = x_BT - mean
    if n > 1:
        centred = centred / math.sqrt(var + eps)
    return centred * mask_BT.bool()


def value_loss(v_BT: Tensor, old_v_BT: Tensor, returns_BT: Tensor, mask_BT: Tensor,
               clip: float | None) -> tuple[Tensor, dict]:
    """PPO's clipped value loss per token [B, T] (0 off the mask), and its metrics: the share of
    tokens where the clipped term is the larger (`vf_clipfrac`: the prediction moved more than
    `clip`, away from the return) and the mean prediction (`vpred_mean`). `clip` None: the plain
    squared error."""
    err_BT = (v_BT - returns_BT) ** 2
    if clip is None:
        loss_BT, clipped_BT = 0.5 * err_BT, torch.zeros_like(err_BT, dtype=torch.bool)
    else:
        moved_BT = v_BT - old_v_BT
        err_clip_BT = (old_v_BT + moved_BT.clamp(-clip, clip) - returns_BT) ** 2
        # counted where the clip took hold: a prediction equal to the old value up to rounding is not clipped
        loss_BT, clipped_BT = 0.5 * torch.maximum(err_BT, err_clip_BT), (moved_BT.abs() > clip) & (err_clip_BT > err_BT)
    mask_BT = mask_BT.bool()
    metrics = {"vf_clipfrac": masked_mean(clipped_BT.to(v_BT.dtype), mask_BT).detach(),
               "vpred_mean": masked_mean(v_BT.detach(), mask_BT)}
    return loss_BT * mask_BT, metrics


def explained_variance(values_BT: Tensor, returns_BT: Tensor, mask_BT: Tensor, reduce=None) -> float:
    """1 - Var(returns - values) / Var(returns) over the mask (verl's vf_explained_var): 1 when the
    critic predicts every return, 0 when it does no better than their mean. NaN under 2 tokens.
    `reduce`: over every rank's tokens."""
    n, _, var_r = _moments(returns_BT, mask_BT, reduce)
    _, _, var_d = _moments(returns_BT - values_BT, mask_BT, reduce)
    return 1.0 - var_d / (var_r + 1e-8) if n > 1 else float("nan")
