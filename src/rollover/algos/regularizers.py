"""Per-token regularisers to add to a policy loss before aggregation.

    loss_BT = out.loss_BT + kl_coef * kl_penalty(logp_BT, ref_logp_BT, "k3")
              + entropy_bonus(entropy_from_logits(logits_BTV), ent_coef)
    loss = aggregate(loss_BT, out.mask_BT, ...)

Adding per token and aggregating once is the same as aggregating each term with the same mode
and adding (every mode is linear), which is what verl and TRL do.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rollover.algos.offpolicy import MAX_LOG_RATIO

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(logp_BT: Tensor, ref_logp_BT: Tensor, estimator: str = "k3", *, k2_grad: bool = False) -> Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from tokens sampled from π (Schulman,
    joschu.net/blog/kl-approx.html), with `x = ref_logp - logp`:

    - `k1 = -x` (unbiased, can be negative)
    - `k2 = x² / 2` (biased, low variance; its gradient is the true KL gradient's estimate)
    - `k3 = exp(x) - x - 1` (unbiased, >= 0; verl `low_var_kl`, TRL's only estimator)

    `k2_grad=True` returns the chosen estimator's value with k2's gradient (verl's `k3+`).
    Departures: `x` is clamped to ±20 for k3, as verl does, and for k2 (whose gradient is then 0 past
    it: a token e^20 times likelier under one policy), so a padded position's -inf or nan gives a
    gradient of 0, not nan, once the mask drops its value; verl also clamps k3 to [-10, 10], which
    silences the gradient of tokens far from the reference — we do not.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; known: {', '.join(KL_ESTIMATORS)}")
    if logp_BT.shape != ref_logp_BT.shape:
        raise ValueError(f"logp_BT {tuple(logp_BT.shape)} and ref_logp_BT {tuple(ref_logp_BT.shape)} differ")
    x_BT = ref_logp_BT.detach() - logp_BT
    clamped_BT = x_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # (its gradient is 0 at nan and past the bounds)
    if estimator == "k1":
        kl_BT = -x_BT
    elif estimator == "k2":
        kl_BT = 0.5 * clamped_BT.square()
    else:
        kl_BT = clamped_BT.exp() - clamped_BT - 1
    if k2_grad:
        k2_BT = 0.5 * clamped_BT.square()
        kl_BT = k2_BT + (kl_BT - k2_BT).detach()
    return kl_BT


class _ChunkedEntropy(torch.autograd.Function):
    """Entropy of softmax rows, computed and differentiated one block of positions at a time.

    Blocks are `logits[b, t0:t1]`, views of the input whatever its strides, so a sliced
    `[B, T, V]` (response positions cut out of the full sequence) is never copied. Forward
    keeps only the logits (alive anyway) and the `[B, T]` entropies; backward recomputes the
    softmax per block: `dH/dz = -p · (log p + H)`. Extra memory is a few `[chunk, V]` float32
    temporaries, where autograd through `log_softmax` would keep `[B, T, V]` ones.
    """

    @staticmethod
    def forward(ctx, logits_BTV: Tensor, chunk_size: int) -> Tensor:
        dtype = torch.promote_types(logits_BTV.dtype, torch.float32)
        ent_BT = torch.empty(logits_BTV.shape[:2], dtype=dtype, device=logits_BTV.device)
        for b, t0, t1 in _blocks(logits_BTV, chunk_size):
            logp_CV = torch.log_softmax(logits_BTV[b, t0:t1].to(dtype), dim=-1)
            ent_BT[b, t0:t1] = -_p_log_p(logp_CV).sum(dim=-1)
        ctx.save_for_backward(logits_BTV, ent_BT)
        ctx.chunk_size = chunk_size
        return ent_BT

    @staticmethod
    def backward(ctx, grad_BT: Tensor) -> tuple[Tensor, None]:
        logits_BTV, ent_BT = ctx.saved_tensors
        grad_BTV = torch.empty(logits_BTV.shape, dtype=logits_BTV.dtype, device=logits_BTV.device)
        for b, t0, t1 in _blocks(logits_BTV, ctx.chunk_size):
            logp_CV = torch.log_softmax(logits_BTV[b, t0:t1].to(ent_BT.dtype), dim=-1)
            # -p·(log p + H) = -(p log p) - p·H; p log p is 0 where p is 0 (masked vocab).
            d_CV = -_p_log_p(logp_CV) - logp_CV.exp() * ent_BT[b, t0:t1, None]
            grad_BTV[b, t0:t1] = (d_CV * grad_BT[b, t0:t1, None]).to(logits_BTV.dtype)
        return grad_BTV, None


def _blocks(logits_BTV: Tensor, chunk_size: int):
    B, T, _ = logits_BTV.shape
    for b in range(B):
        for t0 in range(0, T, chunk_size):
            yield b, t0, min(t0 + chunk_size, T)


def _p_log_p(logp: Tensor) -> Tensor:
    p = logp.exp()
    return torch.where(p > 0, p * logp, torch.zeros_like(p))


def entropy_from_logits(logits_BTV: Tensor, *, chunk_size: int = 1024) -> Tensor:
    """Entropy `H = -Σ_v p_v log p_v` of each position's next-token distribution, `[B, T, V]
    -> [B, T]`, differentiable, in float32 at least (bf16 logits are upcast a block at a time).

    Pass the logits the tokens were sampled from, already divided by the sampling temperature.
    `-inf` logits (masked vocabulary) are fine. Memory: see `_ChunkedEntropy`; `chunk_size`
    is the number of positions per block.
    """
    if logits_BTV.dim() != 3:
        raise ValueError(f"logits_BTV must be [B, T, V], got {tuple(logits_BTV.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _ChunkedEntropy.apply(logits_BTV, chunk_size)


def entropy_bonus(entropy_BT: Tensor, coef: float) -> Tensor:
    """Per-token loss term that *rewards* entropy: `-coef · H` (to be minimised with the rest).

    verl subtracts `entropy_coeff · agg(H)` from the loss (default 0 in recent versions).
    """
    return -coef * entropy_BT


def top_entropy_mask(entropy_BT: Tensor, mask_BT: Tensor, quantile: float, gather=None) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss tokens whose entropy is among the top `quantile` fraction ("Beyond the 80/20
    Rule", Wang et al., arXiv 2506.01939: train on the high-entropy "forking" tokens only).

    The threshold is the `1 - quantile` quantile of the entropies of every loss token, linearly
    interpolated between order statistics as `torch.quantile` does (TRL's rule), and a token is
    kept when its entropy is at least that. `gather(x_N)`: every rank's values concatenated and
    where this rank's begin (None: one process), so ranks share one threshold. Returns the kept
    tokens (a subset of `mask_BT`) and the threshold and kept fraction over all ranks.
    """
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {quantile}")
    mask_BT = mask_BT.bool()
    with torch.no_grad():
        local_N = entropy_BT.detach()[mask_BT].double().cpu()
        all_N = local_N if gather is None else gather(local_N)[0]
        if all_N.numel() == 0:
            return mask_BT.clone(), {}
        x_N = all_N.sort().values  # no torch.quantile: it refuses inputs over 16M elements
        pos = (1.0 - quantile) * (len(x_N) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(x_N) - 1)
        threshold = x_N[lo] + (pos - lo) * (x_N[hi] - x_N[lo])
        keep_BT = mask_BT & (entropy_BT.detach().double() >= threshold.to(entropy_BT.device))
        metrics = {"entropy_threshold": threshold.float(), "entropy_kept_frac": (all_N >= threshold).float().mean()}
    return keep_BT, metrics
