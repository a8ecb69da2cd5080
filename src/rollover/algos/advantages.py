"""Outcome advantages from one scalar reward per sample, computed per group (one prompt's samples).

Every estimator takes `rewards_B` (float) and `group_ids_B` (LongTensor, any ids: equal id = same
prompt) and returns `(adv_B, info)`. `info` counts the groups that carry no learning signal:

- `singleton_groups`: groups of one sample;
- `zero_std_groups`: groups of two or more samples whose rewards are all equal;
- `num_groups`.

Both kinds get advantage exactly 0 under every estimator but `reinforce_pp` (no group
baseline: it compares each sample with the batch) and `remax` (its baseline is the greedy
answer's reward, not the group's). This departs from verl, where a
singleton GRPO group gets mean 0 and std 1 (so `A = r`) and where REINFORCE++-baseline's batch
whitening shifts all-equal groups away from 0; and from floating point, where `r - mean(r)` of
equal rewards need not be exactly 0.

Rewards must be finite: a NaN reward is a reward function's failure to report, not a 0.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
from torch import Tensor

AdvantageFn = Callable[..., tuple[Tensor, dict]]


class _Groups(NamedTuple):
    idx_B: Tensor  # [B] group index 0..G-1 of each sample
    count_G: Tensor  # [G]
    mean_G: Tensor  # [G]
    std_G: Tensor  # [G] unbiased (Bessel), 0 for singletons
    degenerate_B: Tensor  # [B] bool: sample is in a singleton or all-equal group
    info: dict


def _groups(rewards_B: Tensor, group_ids_B: Tensor) -> _Groups:
    if rewards_B.dim() != 1 or group_ids_B.shape != rewards_B.shape:
        raise ValueError(
            f"rewards_B {tuple(rewards_B.shape)} and group_ids_B {tuple(group_ids_B.shape)} must be the same [B]"
        )
    if not rewards_B.is_floating_point():
        raise TypeError(f"rewards_B must be a floating-point tensor, got {rewards_B.dtype}")
    if not bool(torch.isfinite(rewards_B).all()):
        bad = torch.nonzero(~torch.isfinite(rewards_B)).flatten().tolist()
        raise ValueError(f"rewards_B has non-finite values at positions {bad}")
    _, idx_B, count_G = torch.unique(group_ids_B, return_inverse=True, return_counts=True)
    num_groups = count_G.numel()
    zeros_G = rewards_B.new_zeros(num_groups)
    mean_G = zeros_G.index_add(0, idx_B, rewards_B) / count_G
    centered_B = rewards_B - mean_G[idx_B]
    var_G = zeros_G.index_add(0, idx_B, centered_B.square()) / (count_G - 1).clamp(min=1)
    max_G = zeros_G.scatter_reduce(0, idx_B, rewards_B, "amax", include_self=False)
    min_G = zeros_G.scatter_reduce(0, idx_B, rewards_B, "amin", include_self=False)
    singleton_G = count_G == 1
    flat_G = (max_G == min_G) & ~singleton_G
    info = {
        "num_groups": num_groups,
        "singleton_groups": int(singleton_G.sum()),
        "zero_std_groups": int(flat_G.sum()),
    }
    return _Groups(idx_B, count_G, mean_G, var_G.sqrt(), (singleton_G | flat_G)[idx_B], info)


def _zero_degenerate(adv_B: Tensor, groups: _Groups) -> Tensor:
    return torch.where(groups.degenerate_B, torch.zeros_like(adv_B), adv_B)


def grpo(rewards_B: Tensor, group_ids_B: Tensor, *, eps: float = 1e-6) -> tuple[Tensor, dict]:
    """GRPO (DeepSeekMath, arXiv 2402.03300): `A = (r - mean_g) / (std_g + eps)`.

    `std_g` is the unbiased group std. `eps` differs across libraries: verl 1e-6 (default here),
    TRL 1e-4, AReaL 1e-5, OpenRLHF 1e-9; it only matters for groups with tiny spread.
    """
    g = _groups(rewards_B, group_ids_B)
    adv_B = (rewards_B - g.mean_G[g.idx_B]) / (g.std_G[g.idx_B] + eps)
    return _zero_degenerate(adv_B, g), g.info


def grpo_batch_std(rewards_B: Tensor, group_ids_B: Tensor, *, eps: float = 1e-6) -> tuple[Tensor, dict]:
    """GRPO's group baseline scaled by the spread of the whole step's rewards:
    `A = (r - mean_g) / (std_batch + eps)`, `std_batch` the unbiased std over every sample of
    the step (TRL's `scale_rewards="batch"`; the "group mean, batch std" normalisation of Lite
    PPO). A group with a small spread is not blown up by its own std."""
    g = _groups(rewards_B, group_ids_B)
    std = rewards_B.std(unbiased=True) if rewards_B.numel() > 1 else rewards_B.new_zeros(())
    adv_B = (rewards_B - g.mean_G[g.idx_B]) / (std + eps)
    return _zero_degenerate(adv_B, g), g.info


def drgrpo(rewards_B: Tensor, group_ids_B: Tensor) -> tuple[Tensor, dict]:
    """Dr.GRPO (Liu et al., arXiv 2503.20783): `A = r - mean_g`, no std normalisation.

    Pair it with the `drgrpo` aggregation (constant normaliser) for the paper's objective;
    verl's `norm_adv_by_std_in_grpo=False`, TRL's `scale_rewards="none"`.
    """
    g = _groups(rewards_B, group_ids_B)
    return _zero_degenerate(rewards_B - g.mean_G[g.idx_B], g), g.info


def rloo(rewards_B: Tensor, group_ids_B: Tensor) -> tuple[Tensor, dict]:
    """RLOO (Ahmadian et al., arXiv 2402.14740): baseline = mean of the *other* samples.

    `A = r - (Σ_g r - r)/(n - 1) = n/(n-1) · (r - mean_g)`, as in verl and TRL.
    """
    g = _groups(rewards_B, group_ids_B)
    n_B = g.count_G[g.idx_B].to(rewards_B.dtype)
    adv_B = n_B / (n_B - 1).clamp(min=1) * (rewards_B - g.mean_G[g.idx_B])
    return _zero_degenerate(adv_B, g), g.info


def reinforce_pp_baseline(rewards_B: Tensor, group_ids_B: Tensor, *, eps: float = 1e-8) -> tuple[Tensor, dict]:
    """REINFORCE++ with baseline (Hu, arXiv 2501.03262): subtract the group mean, then whiten
    over the batch: `x = r - mean_g`, `A = (x - mean(x)) / sqrt(var(x) + eps)`, unbiased var.

    Departure: statistics are over sequences; verl whitens the `[B, T]` token-broadcast
    advantages, so its batch mean and variance weight long responses more.
    """
    g = _groups(rewards_B, group_ids_B)
    x_B = rewards_B - g.mean_G[g.idx_B]
    if x_B.numel() < 2:
        return torch.zeros_like(x_B), g.info
    adv_B = (x_B - x_B.mean()) * torch.rsqrt(x_B.var(unbiased=True) + eps)
    return _zero_degenerate(adv_B, g), g.info


def reinforce_pp(rewards_B: Tensor, group_ids_B: Tensor, *, eps: float = 1e-8) -> tuple[Tensor, dict]:
    """REINFORCE++ (Hu, arXiv 2501.03262; verl's `reinforce_plus_plus`, OpenRLHF's
    `reinforce`): no per-prompt baseline, the rewards whitened over the batch,
    `A = (r - mean(r)) / sqrt(var(r) + eps)`, unbiased var. Made for one sample per prompt.

    The one estimator here that does not zero singleton or all-equal groups: without a group
    baseline, a prompt's samples are compared with the whole batch. Departures: statistics are
    over sequences (verl whitens the token-broadcast returns, weighting long responses more);
    verl's discount `gamma` and KL-in-reward are not here (its default: gamma 1, no KL), so
    every token of a response gets its sequence's advantage.
    """
    g = _groups(rewards_B, group_ids_B)
    if rewards_B.numel() < 2:
        return torch.zeros_like(rewards_B), g.info
    return (rewards_B - rewards_B.mean()) * torch.rsqrt(rewards_B.var(unbiased=True) + eps), g.info


def opo(rewards_B: Tensor, group_ids_B: Tensor, *, lengths_B: Tensor) -> tuple[Tensor, dict]:
    """OPO (On-Policy RL with Optimal reward baseline, arXiv 2505.23585; verl's `opo`): the
    group's baseline is its rewards' mean weighted by response length,
    `A = r - Σ_g(l·r) / Σ_g l`. The length stands in for the squared norm of a response's
    gradient, which grows with its tokens; the optimal baseline weights each reward by it.

    `lengths_B`: the tokens each sample trains on. A group whose lengths are all 0 (every
    token masked) falls back to the plain mean; verl gives such a group `r - 0/0`."""
    g = _groups(rewards_B, group_ids_B)
    if lengths_B.shape != rewards_B.shape:
        raise ValueError(f"lengths_B {tuple(lengths_B.shape)} must be [B] like rewards_B {tuple(rewards_B.shape)}")
    if bool((lengths_B < 0).any()):
        raise ValueError(f"lengths_B must be >= 0, got {lengths_B.tolist()}")
    l_B = lengths_B.to(rewards_B.dtype)
    zeros_G = rewards_B.new_zeros(g.count_G.numel())
    weight_G = zeros_G.index_add(0, g.idx_B, l_B)
    weighted_G = zeros_G.index_add(0, g.idx_B, l_B * rewards_B) / weight_G.clamp(min=1e-12)
    base_G = torch.where(weight_G > 0, weighted_G, g.mean_G)
    return _zero_degenerate(rewards_B - base_G[g.idx_B], g), g.info


def gpg(rewards_B: Tensor, group_ids_B: Tensor) -> tuple[Tensor, dict]:
    """GPG (Group Policy Gradient, arXiv 2504.02546; verl's `gpg`): the group-mean baseline with
    no std, scaled up by how sparse the step's signal is, `A = α · (r - mean_g)`,
    `α = B / max(1, #samples whose reward is not 0)` over the whole step. Pair it with
    `algorithm.loss: reinforce` for the paper's objective (no ratio, no clip)."""
    g = _groups(rewards_B, group_ids_B)
    alpha = rewards_B.numel() / max(1, int((rewards_B != 0).sum()))
    return _zero_degenerate(alpha * (rewards_B - g.mean_G[g.idx_B]), g), g.info


def grpo_passk(rewards_B: Tensor, group_ids_B: Tensor, *, eps: float = 1e-6) -> tuple[Tensor, dict]:
    """Pass@k training (verl's `grpo_passk`, after arXiv 2503.19595): only each group's best
    sample learns, by how far it beats the group's second best, `A = (r_max - r_2nd) / (std_g +
    eps)`; every other sample gets 0. A group maximises the best of its k answers rather than
    their mean. Ties for the best give 0 (the best does not beat the second); the first of tied
    samples is the group's best, as in verl. Groups of one sample get 0 (verl refuses them)."""
    g = _groups(rewards_B, group_ids_B)
    adv_B = torch.zeros_like(rewards_B)
    for gi in range(g.count_G.numel()):  # groups are small; a loop reads better than a padded top-2
        members = torch.nonzero(g.idx_B == gi).flatten()
        if members.numel() < 2:
            continue
        top = torch.topk(rewards_B[members], 2)
        best = members[int(top.indices[0])]
        adv_B[best] = (top.values[0] - top.values[1]) / (g.std_G[gi] + eps)
    return _zero_degenerate(adv_B, g), g.info


def remax(rewards_B: Tensor, group_ids_B: Tensor, *, baselines_B: Tensor) -> tuple[Tensor, dict]:
    """ReMax (Li et al., arXiv 2310.10505; verl's `remax`): `A = r - b`, `b` the reward of the
    prompt's greedy response, which the run generates beside the samples and does not train on.

    The baseline comes from outside the group, so a group of one sample learns (the paper's
    setting), and so does a group whose samples agree with each other but not with the greedy
    answer; `zero_std_groups` counts the groups of two or more whose every sample equals their
    baseline."""
    if baselines_B.shape != rewards_B.shape:
        raise ValueError(f"baselines_B {tuple(baselines_B.shape)} must be [B] like rewards_B {tuple(rewards_B.shape)}")
    if not bool(torch.isfinite(baselines_B).all()):
        raise ValueError(f"baselines_B has non-finite values at positions "
                         f"{torch.nonzero(~torch.isfinite(baselines_B)).flatten().tolist()}")
    g = _groups(rewards_B, group_ids_B)
    adv_B = rewards_B - baselines_B.to(rewards_B.dtype)
    moved_G = torch.zeros_like(g.count_G, dtype=torch.bool)
    moved_G[g.idx_B[adv_B != 0]] = True
    return adv_B, {**g.info, "zero_std_groups": int((~moved_G & (g.count_G > 1)).sum())}


def gae_rewards(rewards_B: Tensor, group_ids_B: Tensor) -> tuple[Tensor, dict]:
    """`algorithm.advantage: gae` (PPO with a critic): the rewards themselves, which the trainer's
    critic turns into each token's advantage (`rollover.algos.gae`); no group baseline, so no
    group is degenerate."""
    g = _groups(rewards_B, group_ids_B)
    return rewards_B.clone(), {**g.info, "zero_std_groups": 0}


def otb_returns(rewards_B: Tensor, group_ids_B: Tensor) -> tuple[Tensor, dict]:
    """`algorithm.advantage: otb` (the optimal token baseline): the rewards themselves, which the
    trainer turns into each token's advantage from the policy's distributions
    (`rollover.algos.token_baseline`); its groups with no signal are those of every estimator."""
    g = _groups(rewards_B, group_ids_B)
    return rewards_B.clone(), g.info


def gapo(rewards_B: Tensor, group_ids_B: Tensor, *, coverage: float = 0.5, eps: float = 1e-6) -> tuple[Tensor, dict]:
    """GAPO (arXiv 2510.21830): a robust group baseline for noisy or skewed rewards.

    Sort the group's rewards, take the shortest window of `k = ceil(coverage · n)` consecutive
    sorted rewards (the first one on ties) and let `Q` be its median (mean of the two middle
    values for even `k`). Then `A = (r - Q) / (sqrt(Σ_g (r - Q)² / (n - 1)) + eps)`.

    As in the authors' verl fork, the window is the highest-density one; the paper speaks of
    the highest signal-to-noise interval.
    """
    if not 0.0 < coverage <= 1.0:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}")
    g = _groups(rewards_B, group_ids_B)
    q_G = torch.empty_like(g.mean_G)
    for gi in range(q_G.numel()):  # groups are small; a loop reads better than a padded sort
        sorted_n = torch.sort(rewards_B[g.idx_B == gi]).values
        k = math.ceil(coverage * sorted_n.numel())
        widths = sorted_n[k - 1 :] - sorted_n[: sorted_n.numel() - k + 1]
        start = int(torch.argmin(widths))  # argmin returns the first minimum
        q_G[gi] = torch.quantile(sorted_n[start : start + k], 0.5)  # midpoint median
    dev_B = rewards_B - q_G[g.idx_B]
    n_G = g.count_G.to(rewards_B.dtype)
    scale_G = (dev_B.new_zeros(n_G.numel()).index_add(0, g.idx_B, dev_B.square()) / (n_G - 1).clamp(min=1)).sqrt()
    return _zero_degenerate(dev_B / (scale_G[g.idx_B] + eps), g), g.info


def gdpo(scores_BK: Tensor, weights_K: Tensor, group_ids_B: Tensor, *, eps: float = 1e-6) -> tuple[Tensor, dict]:
    """GDPO (arXiv 2601.05242; TRL's `multi_objective_aggregation="normalize_then_sum"`): with
    several reward functions, normalise each one within the group before they are added, so a
    function with a wide range does not drown the others; then normalise the sum over the batch.

    `scores_BK`: each sample's score from each of K functions, NaN where a function abstained.
    Per function k, `z_k = (s_k - mean_g(s_k)) / (std_g(s_k) + eps)` over the group's samples it
    scored (unbiased std; 0 where it abstained or its scores in the group are all equal);
    `x = Σ_k w_k z_k`; `A = (x - mean(x)) / (std(x) + eps)` over the batch.

    As every estimator here, a group that carries no signal (a singleton, or every function flat
    in it) gets exactly 0; TRL leaves such samples at the batch-normalised value of 0.
    """
    if scores_BK.dim() != 2 or weights_K.shape != scores_BK.shape[1:] or group_ids_B.shape != scores_BK.shape[:1]:
        raise ValueError(f"scores_BK {tuple(scores_BK.shape)}, weights_K {tuple(weights_K.shape)} and group_ids_B "
                         f"{tuple(group_ids_B.shape)} must be [B, K], [K] and [B]")
    if bool(torch.isinf(scores_BK).any()):
        raise ValueError("scores_BK has infinite values (NaN marks an abstention)")
    x_B = scores_BK.new_zeros(scores_BK.shape[0])
    flat_B = torch.ones_like(x_B, dtype=torch.bool)  # every function flat (or absent) in the sample's group
    for k in range(scores_BK.shape[1]):
        present_B = ~torch.isnan(scores_BK[:, k])
        if not present_B.any():
            continue
        s_B = scores_BK[present_B, k]
        g = _groups(s_B, group_ids_B[present_B])
        z_B = _zero_degenerate((s_B - g.mean_G[g.idx_B]) / (g.std_G[g.idx_B] + eps), g)
        x_B[present_B] += weights_K[k] * z_B
        flat_B[present_B] &= g.degenerate_B
    g = _groups(x_B, group_ids_B)
    moved_G = torch.zeros_like(g.count_G, dtype=torch.bool)
    moved_G[g.idx_B[~flat_B]] = True  # some function moved within the group
    degenerate_B = ~moved_G[g.idx_B]
    info = {**g.info, "zero_std_groups": int((~moved_G & (g.count_G > 1)).sum())}
    if x_B.numel() < 2:
        return torch.zeros_like(x_B), info
    adv_B = (x_B - x_B.mean()) / (x_B.std(unbiased=True) + eps)
    return torch.where(degenerate_B, torch.zeros_like(adv_B), adv_B), info


ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": grpo,
    "grpo_batch_std": grpo_batch_std,
    "drgrpo": drgrpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "gapo": gapo,
    "opo": opo,
    "gpg": gpg,
    "grpo_passk": grpo_passk,
    "remax": remax,
    "gae": gae_rewards,
    "otb": otb_returns,
}


def compute_advantages(name: str, rewards_B: Tensor, group_ids_B: Tensor, **opts) -> tuple[Tensor, dict]:
    """Run the advantage estimator registered as `name` (see `ADVANTAGES`)."""
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {', '.join(ADVANTAGES)}")
    return ADVANTAGES[name](rewards_B, group_ids_B, **opts)


def turn_advantages(adv: float, turn_rewards: list[float], gamma: float = 1.0) -> list[float]:
    """Each turn's advantage under reward-to-go credit: `adv + G_t - G_0`, `G_t` the rewards of
    turn t and after, discounted by `gamma` per turn; `adv` is the episode's advantage of `G_0`
    by an estimator that subtracts a baseline and does not scale (Dr.GRPO, RLOO), so this is
    `G_t` less the same baseline. A turn is not credited with rewards earned before it."""
    to_go, g = [0.0] * len(turn_rewards), 0.0
    for t in range(len(turn_rewards) - 1, -1, -1):
        g = turn_rewards[t] + gamma * g
        to_go[t] = g
    return [adv + (g_t - to_go[0]) for g_t in to_go]  # exactly adv where nothing came before
