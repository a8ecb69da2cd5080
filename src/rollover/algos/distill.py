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


def generalized_jsd(student_logp_NV: Tensor, teacher_logp_NV: Tensor, beta: float) -> Tensor:
    """The generalised Jensen-Shannon divergence of each position's next-token distributions
    [N] (GKD, arXiv 2306.13649, eq. 1, with TRL's ends): `beta = 0` is the forward KL
    `KL(teacher ‖ student)`, `beta = 1` the reverse KL `KL(student ‖ teacher)`, and between
    them `beta · KL(teacher ‖ M) + (1 − beta) · KL(student ‖ M)` with the mixture
    `M = beta · teacher + (1 − beta) · student`. Both arguments are log-probabilities over the
    vocabulary [N, V]; the gradient flows into the student's. A token either side gives no
    probability to (-inf) adds nothing where its weight is 0."""
    import math

    import torch

    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta} must lie in [0, 1]")
    if student_logp_NV.shape != teacher_logp_NV.shape:
        raise ValueError(f"teacher_logp_NV {tuple(teacher_logp_NV.shape)} must match student_logp_NV "
                         f"{tuple(student_logp_NV.shape)}")

    # a token left out (-inf: a head's banned ids) held at a floor where exp() is 0 and no
    # difference or gradient is inf or nan
    student_logp_NV, teacher_logp_NV = student_logp_NV.clamp(min=-1e9), teacher_logp_NV.clamp(min=-1e9)

    def kl(p_log: Tensor, q_log: Tensor) -> Tensor:  # KL(p ‖ q) of each row
        return (p_log.exp() * (p_log - q_log)).sum(-1)

    if beta == 0.0:
        return kl(teacher_logp_NV, student_logp_NV)
    if beta == 1.0:
        return kl(student_logp_NV, teacher_logp_NV)
    mixture = torch.logaddexp(student_logp_NV + math.log(1.0 - beta), teacher_logp_NV + math.log(beta))
    return beta * kl(teacher_logp_NV, mixture) + (1.0 - beta) * kl(student_logp_NV, mixture)
