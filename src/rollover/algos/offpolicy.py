"""Corrections for training on tokens the trainer's policy did not sample itself.

Three log-probabilities of each response token meet here:

- `behav_logp_BT`: the engine's sampling log-prob (behaviour policy, possibly several versions
  old, possibly a different numerical implementation of the same weights);
- `old_logp_BT`: the trainer's log-prob before this update (PPO's old policy, AReaL's
  proximal policy), without gradient;
- `logp_BT`: the trainer's current log-prob, with gradient (used by the losses, not here).

Both corrections below depend only on `old` and `behav`, never on the current policy, so a
trainer can compute them once per step on the full batch.

- **Truncated importance sampling** (Yao et al., fengyao.notion.site/off-policy-rl; IcePop /
  MIS for the mask mode): each token's (or sequence's) loss is multiplied by a detached weight
  `ρ = π_old / π_behav`, truncated (`min(ρ, cap)`) or masked (`ρ` kept only inside
  `[floor, cap]`, the token dropped from the loss mask outside). AReaL's decoupled PPO weight
  `π_prox / π_behav` is the same quantity.
- **M2PO** (arXiv 2510.01161): drop the fewest tokens with the largest `(log ρ)²` such that the
  mean `(log ρ)²` of the remaining tokens is <= `tau`. The mean is over the batch given, so the
  trainer computes the mask once per update, over all its loss tokens (every micro-batch, every
  rank: `m2po_update_mask`), before any backward pass, and hands it to the loss as its mask.

Departures and library differences:
- Sequence-level `ρ` is the product `exp(Σ_t log ρ_t)` by default (verl, TRL);
  `is_seq_ratio="geo_mean"` gives `exp(mean_t log ρ_t)` (OpenRLHF seq-mask, AReaL).
- `log ρ` is clamped to ±20 before `exp`, as in verl; only the metrics can tell.
- Defaults: `is_cap` 2.0 (verl; TRL uses 3.0, AReaL 5.0, OpenRLHF [0.5, 5.0]).
- M2PO follows AReaL (`(π_prox vs π_behav)` per token, `<=` tau). The paper writes the second
  moment of `log π_θ/π_behav`; it equals ours at the first update of a step when `old` is
  recomputed by the trainer. If the trainer does not recompute (`old == behav`) M2PO masks
  nothing. The authors' own code instead solves a clipped budget over "harmful" tokens only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollover.algos.aggregate import masked_max, masked_mean

MAX_LOG_RATIO = 20.0  # verl's clamp before exp: keeps ratios finite, e^20 ≈ 4.9e8


def importance_weights(
    old_logp_BT: Tensor,
    behav_logp_BT: Tensor,
    mask_BT: Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    cap: float = 2.0,
    floor: float | None = None,
    seq_ratio: str = "product",
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Truncated importance sampling (TIS; MIS/IcePop in mask mode): detached weights `[B, T]`
    `ρ = exp(old_logp - behav_logp)` of the trainer's policy against the engine's.

    `level`: `token` (one ratio per token) or `sequence` (one ratio per response, broadcast;
    `seq_ratio` picks the product or the geometric mean of the token ratios).
    `mode`: `truncate` (`clamp(ρ, floor, cap)`) or `mask` (`ρ` inside `[floor, cap]`, else the
    token, or the whole sequence, leaves the mask). Returns `(weight_BT, mask_BT, metrics)`;
    `mask_BT` is the input mask minus masked tokens; weights are 0 outside it.
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"is_level must be 'token' or 'sequence', got {level!r}")
    if mode not in ("truncate", "mask"):
        raise ValueError(f"is_mode must be 'truncate' or 'mask', got {mode!r}")
    if seq_ratio not in ("product", "geo_mean"):
        raise ValueError(f"is_seq_ratio must be 'product' or 'geo_mean', got {seq_ratio!r}")
    if not cap > 0 or (floor is not None and not 0 <= floor < cap):
        raise ValueError(f"need 0 <= is_floor < is_cap, got floor={floor}, cap={cap}")
    valid_BT = mask_BT.bool()
    mask_BT = valid_BT
    with torch.no_grad():
        log_rho_BT = torch.where(valid_BT, old_logp_BT - behav_logp_BT, torch.zeros_like(old_logp_BT))
        if level == "sequence":
            log_rho_B = log_rho_BT.sum(dim=1)
            if seq_ratio == "geo_mean":
                log_rho_B = log_rho_B / valid_BT.sum(dim=1).clamp(min=1)
            log_rho_BT = log_rho_B[:, None].expand_as(log_rho_BT)
        rho_BT = log_rho_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
        inside_BT = rho_BT <= cap
        if floor is not None:
            inside_BT &= rho_BT >= floor
        if mode == "truncate":
            weight_BT = rho_BT.clamp(min=floor, max=cap)
        else:
            weight_BT = rho_BT
            mask_BT = mask_BT & inside_BT
        weight_BT = torch.where(mask_BT, weight_BT, torch.zeros_like(weight_BT))
        metrics = {
            "is_ratio_mean": masked_mean(rho_BT, valid_BT),
            "is_ratio_max": masked_max(rho_BT, valid_BT),
            "is_weight_mean": masked_mean(weight_BT, mask_BT),
            "is_clip_frac": masked_mean((~inside_BT).to(rho_BT.dtype), valid_BT),
        }
    return weight_BT, mask_BT, metrics


def m2po_drop(m2_N: Tensor, tau: float) -> tuple[Tensor, dict[str, Tensor]]:
    """M2PO's cut over a 1-D tensor of squared log-ratios (double): which to drop, the fewest
    largest ones such that the mean of the rest is <= `tau`. Ties at the cut go to the earlier
    entry (a stable sort), so the caller's order is the tie-break. If even the smallest value
    exceeds `tau`, all are dropped. Returns `(drop_N, metrics)`, the metrics in double."""
    if not tau >= 0:
        raise ValueError(f"m2po_tau must be >= 0, got {tau}")
    n = m2_N.numel()
    m2_desc_N, order_N = torch.sort(m2_N, descending=True, stable=True)
    # Mean of what is left after dropping the top k, for k = 0..n (k = n: nothing left, 0).
    # Suffix sums are accumulated from the small end, which keeps them exact enough to
    # compare with tau; `total - prefix` would cancel catastrophically.
    suffix_K = torch.cat([m2_desc_N.flip(0).cumsum(0).flip(0), m2_desc_N.new_zeros(1)])
    left_K = torch.arange(n, -1, -1, device=m2_N.device)
    mean_left_K = suffix_K / left_K.clamp(min=1)
    # mean_left is non-increasing in k (each dropped value is >= the mean it leaves), so the
    # first k meeting the bound is the smallest.
    k = int(torch.nonzero(mean_left_K <= tau)[0, 0])
    drop_N = torch.zeros(n, dtype=torch.bool, device=m2_N.device)
    drop_N[order_N[:k]] = True
    metrics = {
        "m2po_m2_before": mean_left_K[0],
        "m2po_m2_after": mean_left_K[k],
        "m2po_masked_frac": m2_N.new_tensor(k / max(n, 1)),
    }
    return drop_N, metrics


def m2po_mask(
    old_logp_BT: Tensor, behav_logp_BT: Tensor, mask_BT: Tensor, *, tau: float = 0.04
) -> tuple[Tensor, dict[str, Tensor]]:
    """M2PO's second-moment mask (arXiv 2510.01161): the loss mask minus the fewest tokens with
    the largest `(old - behav)²` such that the mean `(old - behav)²` of the rest is <= `tau`
    (0.04 in the paper and AReaL, which the paper reports as insensitive), over the tokens given.

    Ties at the cut are broken by position (a stable sort); if even the smallest value exceeds
    `tau`, every token is masked. Returns `(mask_BT, metrics)`. The trainer masks each update
    whole, across micro-batches and ranks, with `m2po_update_mask`.
    """
    mask_BT = mask_BT.bool()
    with torch.no_grad():
        m2_N = (old_logp_BT - behav_logp_BT)[mask_BT].double().square()
        drop_N, metrics = m2po_drop(m2_N, tau)
        new_mask_BT = torch.zeros_like(mask_BT)
        new_mask_BT[mask_BT] = ~drop_N
    return new_mask_BT, {k: v.to(old_logp_BT.dtype) for k, v in metrics.items()}


def m2po_update_mask(
    old_logp_BT: Tensor, behav_logp_BT: Tensor, mask_BT: Tensor, group_B: Tensor, *, tau: float, gather=None
) -> tuple[Tensor, dict[str, Tensor]]:
    """`m2po_mask` over a whole update whose rows may be split over ranks: each rank passes its
    own rows and gets its part of the one mask (the same metrics on every rank).

    `gather(x_N2)`: every rank's rows of `x` concatenated in rank order, and where this rank's
    begin (None: one process). Ties at the cut go by group (`group_B`, numbered over the step),
    then rank, then row, then position: with each group's rows on one rank, in their order, the
    mask does not depend on how the update is split into micro-batches or ranks.
    """
    mask_BT = mask_BT.bool()
    with torch.no_grad():
        m2_N = (old_logp_BT - behav_logp_BT)[mask_BT].double().square()
        group_N = group_B.to(mask_BT.device)[:, None].expand_as(mask_BT)[mask_BT].double()
        mine_N2 = torch.stack([m2_N, group_N], dim=1).cpu()
        every_N2, start = gather(mine_N2) if gather is not None else (mine_N2, 0)
        by_group_N = torch.sort(every_N2[:, 1], stable=True).indices
        drop_N = torch.empty(len(every_N2), dtype=torch.bool)
        drop_N[by_group_N], metrics = m2po_drop(every_N2[by_group_N, 0], tau)
        new_mask_BT = torch.zeros_like(mask_BT)
        new_mask_BT[mask_BT] = ~drop_N[start: start + len(m2_N)].to(mask_BT.device)
    return new_mask_BT, {k: v.to(old_logp_BT.dtype) for k, v in metrics.items()}


def off_policy_correction(
    old_logp_BT: Tensor,
    behav_logp_BT: Tensor | None,
    mask_BT: Tensor,
    *,
    is_level: str | None = None,
    is_mode: str = "truncate",
    is_cap: float = 2.0,
    is_floor: float | None = None,
    is_seq_ratio: str = "product",
    m2po_tau: float | None = None,
) -> tuple[Tensor | None, Tensor, dict[str, Tensor]]:
    """The options every policy loss accepts: M2PO masking (`m2po_tau`), then importance
    weighting (`is_level` not None; see `importance_weights` for the `is_*` options).

    Returns `(weight_BT or None, mask_BT, metrics)`.
    """
    mask_BT = mask_BT.bool()
    metrics: dict[str, Tensor] = {}
    if (m2po_tau is not None or is_level is not None) and behav_logp_BT is None:
        raise ValueError("m2po_tau and is_level need behav_logp_BT (the engine's sampling log-probs)")
    if m2po_tau is not None:
        mask_BT, m2_metrics = m2po_mask(old_logp_BT, behav_logp_BT, mask_BT, tau=m2po_tau)
        metrics.update(m2_metrics)
    weight_BT = None
    if is_level is not None:
        weight_BT, mask_BT, is_metrics = importance_weights(
            old_logp_BT, behav_logp_BT, mask_BT,
            level=is_level, mode=is_mode, cap=is_cap, floor=is_floor, seq_ratio=is_seq_ratio,
        )
        metrics.update(is_metrics)
    return weight_BT, mask_BT, metrics
