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

import math
from fractions import Fraction

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
    entry, so the caller's order is the tie-break. If even the smallest value exceeds `tau`, all
    are dropped. Returns `(drop_N, metrics)`, the metrics in double."""
    m2_N = m2_N.double()
    return _m2po_cut(m2_N, torch.zeros_like(m2_N, dtype=torch.int64), tau, None, None)


def m2po_mask(
    old_logp_BT: Tensor, behav_logp_BT: Tensor, mask_BT: Tensor, *, tau: float = 0.04
) -> tuple[Tensor, dict[str, Tensor]]:
    """M2PO's second-moment mask (arXiv 2510.01161): the loss mask minus the fewest tokens with
    the largest `(old - behav)²` such that the mean `(old - behav)²` of the rest is <= `tau`
    (0.04 in the paper and AReaL, which the paper reports as insensitive), over the tokens given.

    Ties at the cut are broken by position; if even the smallest value exceeds `tau`, every
    token is masked. Returns `(mask_BT, metrics)`. The trainer masks each update whole, across
    micro-batches and ranks, with `m2po_update_mask`.
    """
    mask_BT = mask_BT.bool()
    with torch.no_grad():
        m2_N = (old_logp_BT - behav_logp_BT)[mask_BT].double().square()
        drop_N, metrics = m2po_drop(m2_N, tau)
        new_mask_BT = torch.zeros_like(mask_BT)
        new_mask_BT[mask_BT] = ~drop_N
    return new_mask_BT, {k: v.to(old_logp_BT.dtype) for k, v in metrics.items()}


def m2po_update_mask(
    old_logp_BT: Tensor, behav_logp_BT: Tensor, mask_BT: Tensor, group_B: Tensor, *, tau: float, reduce=None,
    gather=None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`m2po_mask` over a whole update whose rows may be split over ranks: each rank passes its
    own rows and gets its part of the one mask (the same metrics on every rank).

    `reduce(x, op)`: a CPU tensor summed ("sum") or its maximum taken ("max") element-wise over
    the ranks; `gather(x_N2)`: every rank's rows of a small CPU tensor concatenated in rank order,
    and where this rank's begin (None, None: one process). What the ranks exchange is 35 KB per
    bisection step (at most about 63 steps, none when nothing is masked), never the tokens (see
    `_m2po_cut`).
    Ties at the cut go by group (`group_B`, numbered over the step), then rank, then row, then
    position: with each group's rows on one rank, in their order, the mask does not depend on how
    the update is split into micro-batches or ranks.
    """
    mask_BT = mask_BT.bool()
    with torch.no_grad():
        m2_N = (old_logp_BT - behav_logp_BT)[mask_BT].double().square()
        group_N = group_B.to(mask_BT.device)[:, None].expand_as(mask_BT)[mask_BT]
        drop_N, metrics = _m2po_cut(m2_N, group_N, tau, reduce, gather)
        new_mask_BT = torch.zeros_like(mask_BT)
        new_mask_BT[mask_BT] = ~drop_N
    return new_mask_BT, {k: v.to(old_logp_BT.dtype) for k, v in metrics.items()}


# Exact sums of doubles, the same on every rank whatever the split: a finite double is
# (hi * 2^26 + lo) * 2^(e - 53) for its frexp exponent e and 53-bit integer mantissa split in two;
# int64 sums per exponent bin (no overflow below 2^36 values) add up in any order, and the bins'
# total is a Fraction. The cut compares such sums with tau exactly: the summation order of
# floats, which differs with the split, cannot move it.
_EXP0, _EXP_BINS, _HALF = 1100, 2200, 26


def _bins(v_N: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    mant_N, exp_N = torch.frexp(v_N)  # v = mant * 2^exp, mant in [0.5, 1)
    m_N = (mant_N * 2.0 ** 53).to(torch.int64)  # exact: an integer in [2^52, 2^53)
    return (exp_N.to(torch.int64) + _EXP0), m_N >> _HALF, m_N & ((1 << _HALF) - 1)


def _binned(where_N: Tensor, bins) -> Tensor:
    """The sums per exponent bin of the values `where_N` picks, and their count (last entry)."""
    bin_N, hi_N, lo_N = (b[where_N] for b in bins)
    out = torch.zeros(2 * _EXP_BINS + 1, dtype=torch.int64, device=bin_N.device)
    out.scatter_add_(0, 2 * bin_N, hi_N)
    out.scatter_add_(0, 2 * bin_N + 1, lo_N)
    out[-1] = bin_N.numel()
    return out.cpu()


def _exact(sums: Tensor) -> tuple[Fraction, int]:
    """A `_binned` table (summed over ranks) as its exact total and count."""
    total = 0
    scale = 53 + _EXP0 + 1100  # every bin's exponent e - 53 is >= -scale
    for b in torch.nonzero(sums[:-1]).flatten().tolist():
        e, part = b // 2, int(sums[b]) << (_HALF if b % 2 == 0 else 0)
        total += part << (e - _EXP0 - 53 + scale)
    return Fraction(total, 1 << scale), int(sums[-1])


def _m2po_cut(m2_N: Tensor, group_N: Tensor, tau: float, reduce, gather) -> tuple[Tensor, dict[str, Tensor]]:
    """The fewest largest values to drop so that the mean of the rest is <= tau, over every rank's
    values together. The rest is always the smallest values: all up to a level L (the largest
    whose values' mean is within tau), then as many copies of the next value u as the bound
    allows. L is found by bisection over the values' bit patterns (ordered as the values are, for
    non-negative doubles), every step one exact sum over the ranks; of the copies of u, those
    dropped are the first in the tie order (group, rank, position). Non-finite values are always
    dropped."""
    if not tau >= 0:
        raise ValueError(f"m2po_tau must be >= 0, got {tau}")
    reduce = reduce or (lambda x, op: x)
    gather = gather or (lambda x: (x, 0))
    tau_q = Fraction(tau) if math.isfinite(tau) else None  # inf: every finite value kept
    finite_N = torch.isfinite(m2_N)
    bits_N = torch.where(finite_N, m2_N, 0.0).view(torch.int64)
    bins = _bins(torch.where(finite_N, m2_N, 0.0))
    counts = reduce(torch.tensor([m2_N.numel(), int(finite_N.sum())], dtype=torch.int64), "sum")
    n, n_finite = int(counts[0]), int(counts[1])
    total, _ = _exact(reduce(_binned(finite_N, bins), "sum"))

    def within(s: Fraction, m: int) -> bool:
        return tau_q is None or s <= tau_q * m

    drop_N = ~finite_N
    if within(total, n_finite):  # every finite value kept
        kept_sum, kept = total, n_finite
    else:
        top = reduce(torch.tensor([int(bits_N[finite_N].max()) if finite_N.any() else -1]), "max")
        lo, hi = -1, int(top[0])  # within(values <= lo), not within(values <= hi)
        lo_sum, lo_count = Fraction(0), 0
        window_N = finite_N.clone()  # this rank's values in (lo, hi]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            below_N = window_N & (bits_N <= mid)
            s, c = _exact(reduce(_binned(below_N, bins), "sum"))
            if within(lo_sum + s, lo_count + c):
                lo, lo_sum, lo_count = mid, lo_sum + s, lo_count + c
                window_N &= ~below_N
            else:
                hi = mid
                window_N = below_N
        # window_N: this rank's copies of u, the smallest value above L (bit pattern hi)
        u = Fraction(float(torch.tensor([hi], dtype=torch.int64).view(torch.float64)[0]))
        copies = int(reduce(torch.tensor([int(window_N.sum())]), "sum")[0])
        keep = min(copies - 1, int((tau_q * lo_count - lo_sum) // (u - tau_q)))  # u > tau: all copies broke it
        kept_sum, kept = lo_sum + keep * u, lo_count + keep
        drop_N = drop_N | (finite_N & (bits_N > hi)) | _first_copies(window_N, group_N, copies - keep, gather)
    metrics = {
        "m2po_m2_before": torch.tensor(float(total / n_finite) if n_finite == n and n else
                                       (float("inf") if n else 0.0), dtype=torch.float64),
        "m2po_m2_after": torch.tensor(float(kept_sum / kept) if kept else 0.0, dtype=torch.float64),
        "m2po_masked_frac": torch.tensor((n - kept) / max(n, 1), dtype=torch.float64),
    }
    return drop_N.to(m2_N.device), metrics


def _first_copies(copy_N: Tensor, group_N: Tensor, count: int, gather) -> Tensor:
    """Of the copies of the cut's value on every rank, the first `count` in the order (group,
    rank, position): this rank's of them. The ranks exchange one (group, copies) pair per group
    holding a copy."""
    where_N = torch.nonzero(copy_N).flatten()
    groups_C = group_N[where_N].to(torch.int64).cpu()
    order_C = torch.sort(groups_C, stable=True).indices  # this rank's copies by group, then position
    uniq, per_group = torch.unique(groups_C, return_counts=True)  # ascending groups
    every, start = gather(torch.stack([uniq, per_group], dim=1))
    by_group = torch.sort(every[:, 0], stable=True).indices  # rank order kept within a group
    before = torch.zeros(len(every), dtype=torch.int64)
    before[by_group] = torch.cumsum(every[by_group, 1], 0) - every[by_group, 1]  # copies ahead of each pair
    first = torch.repeat_interleave(before[start: start + len(uniq)], per_group)  # per copy, by group order
    rank_in_group = torch.arange(len(groups_C)) - torch.repeat_interleave(torch.cumsum(per_group, 0) - per_group,
                                                                          per_group)
    dropped_C = torch.zeros(len(groups_C), dtype=torch.bool)
    dropped_C[order_C] = first + rank_in_group < count
    out = torch.zeros_like(copy_N)
    out[where_N] = dropped_C.to(copy_N.device)
    return out


def opsm_mask(logp_BT: Tensor, behav_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, *, delta: float
              ) -> tuple[Tensor, dict[str, Tensor]]:
    """Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556, Eq. 9; TRL's
    `off_policy_mask_threshold`): a sequence whose mean `log(π_behav / π)` over its tokens
    (`mask_BT`: the whole response's, not a subset another mask left) exceeds `delta` (the policy
    has moved far from what sampled it) keeps none of its tokens with a negative advantage;
    positive ones stay (the paper: learning from one's own mistakes off-policy is what
    destabilises). `logp_BT` is the current policy, detached here. Returns the tokens kept (a
    subset of `mask_BT`) and the fraction of `mask_BT`'s tokens dropped. As in TRL, the trainer
    multiplies the policy term by it (`algorithm.opsm_delta`): the dropped tokens keep their KL
    term and still count in the loss's denominators."""
    if not delta >= 0.0:
        raise ValueError(f"opsm_delta must be >= 0, got {delta}")
    mask_BT = mask_BT.bool()
    with torch.no_grad():
        gap_BT = torch.where(mask_BT, behav_logp_BT - logp_BT.detach(), torch.zeros_like(logp_BT))
        kl_B = gap_BT.sum(dim=1) / mask_BT.sum(dim=1).clamp(min=1)
        drop_BT = mask_BT & (adv_BT < 0) & (kl_B[:, None] > delta)
        dropped = drop_BT.sum() / mask_BT.sum().clamp(min=1)
    return mask_BT & ~drop_BT, {"opsm_masked_frac": dropped.to(logp_BT.dtype)}


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
