"""Reduce a per-token loss `[B, T]` to the scalar that is back-propagated.

Every mode is a *sum* over the tokens it is given divided by a denominator that the caller can
fix for the whole optimizer step. A trainer that splits a step into micro-batches passes the
step's global counts (`num_tokens`, `num_seqs`, `max_len`) to every micro-batch call; the
micro-batch losses then add up to the full-batch loss, and so do their gradients, with no
`1 / grad_accum` factor. Left as `None`, the counts are taken from the tensors given, which is
right only when those tensors are the whole step.

| mode                  | value                                          | used by            |
| --------------------- | ---------------------------------------------- | ------------------ |
| `token-mean`          | `Σ_it m·ℓ / num_tokens`                        | DAPO, TRL `dapo`   |
| `seq-mean-token-mean` | `Σ_i (Σ_t m·ℓ / Σ_t m) / num_seqs`             | GRPO paper, GSPO   |
| `seq-mean-token-sum`  | `Σ_it m·ℓ / num_seqs`                          | verl               |
| `drgrpo`              | `Σ_it m·ℓ / (num_seqs · max_len)`              | Dr.GRPO, TRL       |

`num_seqs` counts the sequences with at least one loss token, as verl's `agg_loss` does: a
response whose mask is all zeros (stale-masked, truncation-masked, entropy-masked) is not a
sample of the step, and counting it would shrink the other sequences' weight by the share of
masked ones. Count it over the step's mask, `int(mask_BT.any(dim=1).sum())`; it contributes 0
to every sum, so the micro-batch losses still add up to the step's exactly.

Departures:
- `drgrpo` divides by `num_seqs · max_len` like the Dr.GRPO paper and verl's current
  `seq-mean-token-sum-norm` (with `loss_scale_factor = max_len`). TRL's `dr_grpo` counts every
  row, fully masked ones included; older verl divided by the horizon alone (`num_seqs=1`).
- verl's legacy actor and TRL's `grpo`/`bnpo` use micro-batch-local denominators times
  `1/grad_accum`; that makes the loss depend on how the step is split. Here it does not.
  TRL's `grpo` also averages over every row, fully masked ones included.
- A batch with no loss tokens at all gives 0 under the local defaults rather than NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "drgrpo")


def aggregate(
    loss_BT: Tensor,
    mask_BT: Tensor,
    mode: str = "token-mean",
    *,
    num_tokens: int | Tensor | None = None,
    num_seqs: int | Tensor | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Scalar loss from a per-token loss; see the module docstring for the modes.

    `num_tokens`: loss tokens in the whole step (`token-mean`); `num_seqs`: sequences with at
    least one loss token in the whole step (the `seq-*` modes and `drgrpo`); `max_len`: the
    generation budget (`drgrpo`, required, since a padded micro-batch length would change with
    the split). Counts left as None are taken from `mask_BT`.
    """
    if loss_BT.shape != mask_BT.shape or loss_BT.dim() != 2:
        raise ValueError(f"loss_BT {tuple(loss_BT.shape)} and mask_BT {tuple(mask_BT.shape)} must be the same [B, T]")
    mask_BT = mask_BT.bool()
    masked_BT = torch.where(mask_BT, loss_BT, torch.zeros_like(loss_BT))
    if mode == "token-mean":
        denom = mask_BT.sum().clamp(min=1) if num_tokens is None else _positive(num_tokens, "num_tokens")
        return masked_BT.sum() / denom
    denom = mask_BT.any(dim=1).sum().clamp(min=1) if num_seqs is None else _positive(num_seqs, "num_seqs")
    if mode == "seq-mean-token-mean":
        len_B = mask_BT.sum(dim=1).clamp(min=1)
        return (masked_BT.sum(dim=1) / len_B).sum() / denom
    if mode == "seq-mean-token-sum":
        return masked_BT.sum() / denom
    if mode == "drgrpo":
        if max_len is None:
            raise ValueError("mode 'drgrpo' needs max_len (the generation budget, e.g. max_new_tokens)")
        return masked_BT.sum() / (denom * _positive(max_len, "max_len"))
    raise ValueError(f"unknown aggregation mode {mode!r}; known: {', '.join(AGGREGATIONS)}")


def _positive(value: int | Tensor, name: str) -> int | Tensor:
    """A zero denominator gives a NaN loss that is hard to trace back; an empty step is a caller
    bug. Tensors are trusted as given, to avoid a device sync per micro-batch."""
    if not isinstance(value, Tensor) and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def masked_mean(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Mean of `x` over the masked-in entries; 0 when there are none."""
    mask_BT = mask_BT.bool()
    total = torch.where(mask_BT, x_BT, torch.zeros_like(x_BT)).sum()
    return total / mask_BT.sum().clamp(min=1)


def masked_max(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Max of `x` over the masked-in entries; 0 when there are none."""
    mask_BT = mask_BT.bool()
    if x_BT.numel() == 0:  # no entries at all (a sharded trainer's stand-in pass)
        return x_BT.new_zeros(())
    best = torch.where(mask_BT, x_BT, torch.full_like(x_BT, float("-inf"))).amax()
    return torch.where(mask_BT.any(), best, torch.zeros_like(best))
