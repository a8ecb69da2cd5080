"""Reward shaping and masking for responses that hit the length budget (DAPO §3.4)."""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths_B: Tensor, *, max_len: int, buffer_len: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476, Eq. 13), to *add* to the reward.

    With `start = max_len - buffer_len`: 0 for `|y| <= start`, `-penalty·(|y| - start)/buffer_len`
    inside the buffer, `-penalty` beyond `max_len`. DAPO: `max_len` 20480, `buffer_len` 4096.

    verl (`overlong_buffer.len`, `penalty_factor`) and AReaL keep going linearly past
    `max_len`; OpenRLHF caps like the paper and like us. The engine never returns more than
    `max_len` tokens, so the difference shows only if `max_len` is set below the engine budget.
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"need 0 < buffer_len <= max_len, got buffer_len={buffer_len}, max_len={max_len}")
    if lengths_B.dim() != 1:
        raise ValueError(f"lengths_B must be [B], got {tuple(lengths_B.shape)}")
    dtype = lengths_B.dtype if lengths_B.is_floating_point() else torch.get_default_dtype()
    excess_B = (lengths_B.to(dtype) - (max_len - buffer_len)) / buffer_len
    return -penalty * excess_B.clamp(0.0, 1.0)


def truncated_mask(mask_BT: Tensor, truncated_B: Tensor) -> Tensor:
    """The loss mask with every row of a truncated response (finish reason `length`) zeroed.

    DAPO's alternative to the soft punishment, TRL's `mask_truncated_completions`. The samples
    still count in their group's advantage baseline; only their tokens leave the loss (and the
    caller's `num_tokens` / `num_seqs` should be counted after masking if they are meant to
    drop out of the denominator too).
    """
    if truncated_B.dim() != 1 or truncated_B.shape[0] != mask_BT.shape[0]:
        raise ValueError(f"truncated_B must be [B] = [{mask_BT.shape[0]}], got {tuple(truncated_B.shape)}")
    return mask_BT * ~truncated_B.bool()[:, None]
