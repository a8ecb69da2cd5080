"""The optimal token baseline (OTB, arXiv 2602.07078; verl's `optimal_token_baseline`): each
token's advantage is its return minus a baseline of its own position, the group's returns
weighted by how much uncertainty each sample's path has gathered up to there.

At a sampled token the squared norm of the score's logit gradient is `‖e_y − π‖² = 1 − 2π(y) +
Σπ²`, read off the forward's distribution with no backward pass (computed as `(1 − π(y))² +
Σ_{v≠y} π_v²`). Its running sum along a response
is the path's realised energy `W_t`, and the baseline at position t of a group is

    B_t = Σ_i G_i W_{i,t} / (Σ_i W_{i,t} + ε)

over the samples whose response reaches t (`G_i`: a sample's return; with one reward per sample
the same at every position). The advantage is `G_i − B_t`. A path that has been near-certain
carries little gradient, so its reward weighs little in its peers' baseline.

Weights are each token's importance weight squared when importance sampling corrects the loss
(OTB's baseline under truncated IS). As the group estimators of `rollover.algos.advantages`,
a group of one sample or of equal rewards gets advantage exactly 0 (verl gives a lone sample
its return).

A group's sums are kept apart from the advantages (`group_sums`, `merge`) so that the sharded
trainer, whose ranks may hold parts of one group, adds its ranks' sums before any advantage.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class GroupSums(NamedTuple):
    """One group's part of the baseline, over its samples in hand."""

    count: int
    low: float  # the smallest and largest return (equal: no signal)
    high: float
    weighted_T: Tensor  # Σ_i G_i W_{i,t} over positions t
    energy_T: Tensor  # Σ_i W_{i,t}


def path_energy(logp_BT: Tensor, others_sq_BT: Tensor, mask_BT: Tensor, weight_BT: Tensor | None = None) -> Tensor:
    """W [B, T]: each path's energy up to and including each token, summed over its trained
    tokens (`mask_BT`); `logp_BT` the sampled tokens' logprobs, `others_sq_BT` Σπ² over each
    position's other ids, `weight_BT` each token's importance weight (squared into its term;
    None: 1). The term is `1 − 2π + Σπ²` written as `(1 − π)² + Σ_{v≠y} π_v²`, which keeps its
    digits where π is near 1 (the first form rounds to 0 there in float32)."""
    term = torch.expm1(logp_BT).square() + others_sq_BT
    if weight_BT is not None:
        term = term * weight_BT.square()
    return (term * mask_BT).cumsum(dim=1)


def group_sums(returns_B: Tensor, group_ids_B: Tensor, energy_BT: Tensor, mask_BT: Tensor) -> dict[int, GroupSums]:
    """Each group's sums (keyed by its id) over the samples given."""
    m = mask_BT.to(energy_BT.dtype)
    out: dict[int, GroupSums] = {}
    for g in group_ids_B.unique().tolist():
        rows = group_ids_B == g
        r = returns_B[rows]
        w = energy_BT[rows] * m[rows]
        out[g] = GroupSums(int(rows.sum()), float(r.min()), float(r.max()),
                           (r[:, None].to(w.dtype) * w).sum(0), w.sum(0))
    return out


def merge(parts: list[dict[int, GroupSums]]) -> dict[int, GroupSums]:
    """Several holders' sums of the same groups as one (positions padded to the longest)."""
    out: dict[int, GroupSums] = {}
    for part in parts:
        for g, s in part.items():
            if g not in out:
                out[g] = s
                continue
            o = out[g]
            T = max(len(o.energy_T), len(s.energy_T))
            out[g] = GroupSums(o.count + s.count, min(o.low, s.low), max(o.high, s.high),
                               _pad(o.weighted_T, T) + _pad(s.weighted_T, T), _pad(o.energy_T, T) + _pad(s.energy_T, T))
    return out


def _pad(x: Tensor, T: int) -> Tensor:
    return torch.nn.functional.pad(x, (0, T - len(x)))


def token_advantages(returns_B: Tensor, group_ids_B: Tensor, mask_BT: Tensor, sums: dict[int, GroupSums],
                     eps: float = 1e-8) -> tuple[Tensor, dict]:
    """adv [B, T] (0 outside `mask_BT`) from each group's whole `sums`, and the baselines' sum
    and count over the tokens given a baseline (those of groups with a signal)."""
    B, T = mask_BT.shape
    adv = torch.zeros(B, T, dtype=torch.float32, device=mask_BT.device)
    baseline_sum, baseline_tokens = 0.0, 0.0
    for g in group_ids_B.unique().tolist():
        s = sums[g]
        if s.count < 2 or s.low == s.high:  # no comparison to make: no signal
            continue
        rows = group_ids_B == g
        base_T = _pad(s.weighted_T / (s.energy_T + eps), T)[:T].to(adv)
        m = mask_BT[rows].to(adv.dtype)
        adv[rows] = (returns_B[rows, None].to(adv) - base_T) * m
        baseline_sum += float((base_T * m).sum())
        baseline_tokens += float(m.sum())
    return adv, {"baseline_sum": baseline_sum, "baseline_tokens": baseline_tokens}
