"""BAPO's adaptive ratio bounds (Xi et al., arXiv 2510.18927): the candidate grid, the two
tables a batch contributes (sums over tokens, so the parts of a split batch add up), and the
search over them. The loss itself is `rollover.algos.policy.bapo`."""

from __future__ import annotations

import torch
from torch import Tensor


BAPO_GRID = ("low_start", "low_max", "high_start", "high_max", "step", "target_pos_share")


def bapo_grid(
    low_start: float, low_max: float, high_start: float, high_max: float, step: float, target_pos_share: float
) -> tuple[list[float], list[float]]:
    """BAPO's candidate bounds, in search order: `start + i·step` clamped to the max (not repeated
    addition, so they hit the max exactly); `(lows, highs)`."""
    ordered = 0.0 < low_start <= low_max <= 1.0 <= high_start <= high_max
    if not (ordered and step > 0 and 0.0 <= target_pos_share <= 1.0):
        raise ValueError(
            "BAPO needs 0 < low_start <= low_max <= 1 <= high_start <= high_max, step > 0, "
            f"0 <= target_pos_share <= 1; got {low_start=}, {low_max=}, {high_start=}, {high_max=}, "
            f"{step=}, {target_pos_share=}"
        )

    def grid(start: float, top: float) -> list[float]:
        out = [start]
        while out[-1] < top:
            out.append(min(start + len(out) * step, top))
        return out

    return grid(low_start, low_max), grid(high_start, high_max)


def bapo_tables(
    ratio_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    *,
    low_start: float = 0.6,
    low_max: float = 0.9,
    high_start: float = 1.2,
    high_max: float = 3.0,
    step: float = 0.05,
    target_pos_share: float = 0.5,
) -> tuple[Tensor, Tensor]:
    """What `bapo_bounds`' search reads of a batch: `(P_K, N_K)`, float64 on the CPU, with
    `P_K[j] = Σ r·A` over `A > 0, r <= highs[j]` and `N_K[i] = Σ r·|A|` over `A < 0, r >= lows[i]`
    (masked), for each candidate bound in search order. They are sums over tokens: the tables of
    parts of a batch (micro-batches, ranks) add up to the whole batch's, which `bapo_search`
    turns into its bounds. Ratios are compared with the bounds in their own dtype."""
    lows, highs = bapo_grid(low_start, low_max, high_start, high_max, step, target_pos_share)
    with torch.no_grad():
        mask_BT = mask_BT.bool()
        r_BT = ratio_BT.detach()
        pos, neg = mask_BT & (adv_BT > 0), mask_BT & (adv_BT < 0)
        r_pos_N, r_neg_N = r_BT[pos], r_BT[neg]
        pos_N = r_pos_N.double() * adv_BT[pos].double()
        neg_N = -r_neg_N.double() * adv_BT[neg].double()
        P_K = torch.stack([torch.where(r_pos_N <= c, pos_N, 0.0).sum() for c in highs])
        N_K = torch.stack([torch.where(r_neg_N >= c, neg_N, 0.0).sum() for c in lows])
    return P_K.cpu(), N_K.cpu()


def bapo_search(
    P_K: Tensor,
    N_K: Tensor,
    *,
    low_start: float = 0.6,
    low_max: float = 0.9,
    high_start: float = 1.2,
    high_max: float = 3.0,
    step: float = 0.05,
    target_pos_share: float = 0.5,
) -> tuple[float, float, float]:
    """`bapo_bounds`' search over tables from `bapo_tables` (summed over the parts of a batch):
    `(c_low, c_high, positive_share)`. Raise `c_low` while the share `P / (P + N)` is below the
    target, then `c_high`; with `P + N = 0` the share counts as 1."""
    lows, highs = bapo_grid(low_start, low_max, high_start, high_max, step, target_pos_share)
    if P_K.shape != (len(highs),) or N_K.shape != (len(lows),):
        raise ValueError(f"BAPO tables of {len(highs)} and {len(lows)} candidates expected, got "
                         f"{tuple(P_K.shape)} and {tuple(N_K.shape)}")
    P, N = P_K.tolist(), N_K.tolist()

    def share(i: int, j: int) -> float:
        return 1.0 if P[j] + N[i] == 0 else P[j] / (P[j] + N[i])

    i = j = 0
    s = share(i, j)
    while s < target_pos_share and i < len(lows) - 1:
        i += 1
        s = share(i, j)
    while s < target_pos_share and j < len(highs) - 1:
        j += 1
        s = share(i, j)
    return lows[i], highs[j], s


def bapo_bounds(
    ratio_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    *,
    low_start: float = 0.6,
    low_max: float = 0.9,
    high_start: float = 1.2,
    high_max: float = 3.0,
    step: float = 0.05,
    target_pos_share: float = 0.5,
) -> tuple[float, float, float]:
    """BAPO's adaptive ratio bounds: `(c_low, c_high, positive_share)`.

    The positive share is `P / (P + N)` over tokens whose gradient survives the clip:
    `P = Σ r·A` over `A > 0, r <= c_high`, `N = Σ r·|A|` over `A < 0, r >= c_low`.
    Raise `c_low` by `step` up to `low_max` until the share reaches `target_pos_share`, then
    `c_high` up to `high_max`. With `P + N = 0` the share counts as 1 (nothing to rebalance).
    It is `bapo_search(*bapo_tables(...))`: over a batch split into parts, sum the parts' tables.

    Departure: the authors' verl recipe measures `min(r, c_high)·A` and `max(r, c_low)·|A|`
    over all tokens, under which raising `c_low` can only lower the share; we count gradient-
    carrying tokens, which is what raising `c_low` is meant to change. The recipe's
    `adv_ratio_target` is on `P/N` (1.0 there is our share 0.5).
    """
    grid = dict(low_start=low_start, low_max=low_max, high_start=high_start, high_max=high_max, step=step,
                target_pos_share=target_pos_share)
    return bapo_search(*bapo_tables(ratio_BT, adv_BT, mask_BT, **grid), **grid)
