"""On-policy distillation's per-token term: how far each sampled token is from the teacher.

The policy samples an answer; a teacher model scores each of its tokens. With `s_t` the
sampler's logprob of token t and `q_t` the teacher's, `s_t - q_t` is a one-sample estimate of
the reverse KL `KL(π ‖ π_teacher)` at that position, and `q_t - s_t` is the token's advantage
in the policy-gradient form of on-policy distillation (GKD, arXiv 2306.13649, with the
reverse KL; Thinking Machines' on-policy distillation, which trains it with discount 0: each
token answers for its own term, not the ones after it). Added to a reward's advantage, it
gives each token a dense signal the sequence's one reward does not.
"""

from __future__ import annotations

from torch import Tensor


def teacher_advantages(adv_BT: Tensor, mask_BT: Tensor, behav_logp_BT: Tensor, teacher_logp_BT: Tensor, *,
                       weight: float = 1.0, outcome_weight: float = 1.0) -> tuple[Tensor, Tensor]:
    """Each token's advantage `outcome_weight · A + weight · (q - s)` over the loss tokens
    (`mask_BT`; 0 elsewhere), and the per-token reverse-KL estimates `s - q` there (0 elsewhere).

    `adv_BT`: the reward's advantage of each token (a sequence's broadcast over its tokens);
    `behav_logp_BT`: the sampler's logprobs `s`; `teacher_logp_BT`: the teacher's `q` of the same
    tokens, at the same temperature."""
    for name, t in (("mask_BT", mask_BT), ("behav_logp_BT", behav_logp_BT), ("teacher_logp_BT", teacher_logp_BT)):
        if t.shape != adv_BT.shape:
            raise ValueError(f"{name} {tuple(t.shape)} must match adv_BT {tuple(adv_BT.shape)}")
    mask = mask_BT.bool()
    kl_BT = (behav_logp_BT - teacher_logp_BT).masked_fill(~mask, 0.0)
    return (outcome_weight * adv_BT - weight * kl_BT).masked_fill(~mask, 0.0), kl_BT
