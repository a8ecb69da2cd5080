"""Ulysses sequence parallelism for the sharded trainer (`train.sequence_parallel`; DeepSpeed-Ulysses,
arXiv 2309.14509; verl's `ulysses_sequence_parallel_size`).

N consecutive ranks (a sequence-parallel group) take the same micro-batches, and each runs the
model on 1/N of every packed row's positions: embeddings, MLPs, norms and the LM head see only
the rank's own slice, so its activations are 1/N of the row's. Attention needs the whole row: an
all-to-all before it trades the rank's slice of every head for every position of 1/N of the heads
(`_seq_to_heads`), attention runs over the whole row with those heads and the row's mask, and a
second all-to-all trades back (`_heads_to_seq`). Both go through autograd, so the backward pass
exchanges the gradients the same way.

The rank's logprobs (and entropies) of the response tokens it predicts are then gathered into the
micro-batch's order (`gather_tokens`), so every rank of the group computes the micro-batch's loss
whole and the trainer's losses, masks and metrics are unchanged. Each rank's loss being the same
number, the gather's backward keeps the rank's own part of the gradient without any exchange.

The attention runs as torch's scaled-dot-product attention with the row's boolean mask (block
diagonal from the position ids, or the shared-prefix packing's own mask), registered with
transformers as the attention implementation `rollover_ulysses`; outside a sequence-parallel
pass that implementation is plain sdpa.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTENTION = "rollover_ulysses"

_current: "Pass | None" = None  # module-wide, not per thread: on CUDA the backward pass (and the layers
# gradient checkpointing recomputes in it) runs on autograd's own device thread
_registered = False


@dataclass
class Pass:
    """The sequence-parallel pass being run: its group, this rank's place in it, and the whole
    rows' boolean attention mask [R, 1, L, L] (True: attend)."""

    group: object
    size: int
    index: int
    mask: torch.Tensor


def register() -> None:
    """Make `rollover_ulysses` an attention implementation transformers' models can be set to."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, attention)
    _registered = True


def check(model_config, size: int) -> None:
    """ValueError unless a model's attention splits over `size` ranks."""
    from rollover.engine.hf_runner import sliding_window

    heads = getattr(model_config, "num_attention_heads", None)
    if heads is None or heads % size:
        raise ValueError(f"train.sequence_parallel={size}: the model's {heads} attention heads do not split evenly "
                         f"over {size} ranks")
    if sliding_window(model_config) is not None:
        raise ValueError(f"train.sequence_parallel={size}: models with sliding-window attention are not supported yet")
    from rollover.models import stateful_layers

    if stateful := stateful_layers(model_config):
        raise ValueError(f"train.sequence_parallel={size}: the model's {', '.join(stateful)} layers run along the whole "
                         "row (no mask divides it), which sequence parallelism splits over ranks: not supported")


def use(model, size: int) -> None:
    """Switch a model's attention to Ulysses over `size` ranks (checked first): on every config
    its modules read, which is not always the model's own (`train.disable_dropout` gives the
    inner modules a copy; a vision-language model has one per tower)."""
    from rollover.models import text_config

    top = model.get_base_model() if hasattr(model, "get_base_model") else model
    check(text_config(top.config), size)
    register()
    configs = {id(c): c for m in model.modules() for c in [getattr(m, "config", None)]
               if c is not None and hasattr(c, "_attn_implementation")}
    for c in [top.config, *configs.values()]:
        c._attn_implementation = ATTENTION


def set_pass(p: Pass | None) -> None:
    """The pass the attention layers run in. It stays set after the forward (until the next one):
    layers recomputed in the backward pass (gradient checkpointing) read it again."""
    global _current
    _current = p


def row_mask(position_ids: torch.Tensor, allow: torch.Tensor | None) -> torch.Tensor:
    """[R, 1, L, L] boolean mask of packed rows: `allow` as given (shared-prefix packing), else
    causal within each sequence, a new sequence wherever the position does not follow the one
    before (as transformers reads packed position ids)."""
    if allow is not None:
        return allow[:, None]
    first = position_ids[:, :1] - 1
    seq = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)  # [R, L]
    L = position_ids.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=position_ids.device).tril()
    return ((seq[:, :, None] == seq[:, None, :]) & causal)[:, None]


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-interface signature: query [B, H, l, D], key and value [B, KV, l, D]
    (l: this rank's slice of the row); returns ([B, l, H, D], None)."""
    p = _current
    if p is None:  # not in a sequence-parallel pass: the model's plain sdpa
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    heads, kv = query.shape[1], key.shape[1]
    if kv % p.size:  # too few K/V heads to split: each rank takes the copies its query heads read
        key = key.repeat_interleave(heads // kv, dim=1)
        value = value.repeat_interleave(heads // kv, dim=1)
    q, k, v = (_seq_to_heads(t, p) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask, dropout_p=dropout, scale=scaling,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return _heads_to_seq(out, p).transpose(1, 2).contiguous(), None


class _AllToAll(torch.autograd.Function):
    """x[k] (dim 0 of size N) to rank k of the group, out[k] from rank k; the gradient goes back
    the same way."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, ctx.group), None


def _all_to_all(x: torch.Tensor, p: Pass) -> torch.Tensor:
    return _AllToAll.apply(x, p.group)


def _seq_to_heads(x: torch.Tensor, p: Pass) -> torch.Tensor:
    """[B, h, l, D] (all heads, this rank's slice) -> [B, h/N, N*l, D] (its heads, the whole row)."""
    B, h, l, D = x.shape
    parts = x.view(B, p.size, h // p.size, l, D).transpose(0, 1)  # [N: head group, B, h/N, l, D]
    got = _all_to_all(parts, p)  # [N: row slice, B, h/N, l, D]
    return got.permute(1, 2, 0, 3, 4).reshape(B, h // p.size, p.size * l, D)


def _heads_to_seq(x: torch.Tensor, p: Pass) -> torch.Tensor:
    """[B, h/N, N*l, D] -> [B, h, l, D]: the inverse of `_seq_to_heads`."""
    B, hn, L, D = x.shape
    l = L // p.size
    parts = x.view(B, hn, p.size, l, D).permute(2, 0, 1, 3, 4)  # [N: row slice, B, h/N, l, D]
    got = _all_to_all(parts, p)  # [N: head group, B, h/N, l, D]
    return got.transpose(0, 1).reshape(B, p.size * hn, l, D)


class _Gather(torch.autograd.Function):
    """Each rank's values of its own tokens -> every token's, in the micro-batch's order."""

    @staticmethod
    def forward(ctx, mine, owner, p: Pass):
        import torch.distributed as dist

        counts = torch.bincount(owner, minlength=p.size).tolist()
        width = max(max(counts), 1)
        padded = torch.zeros(width, dtype=mine.dtype, device=mine.device)
        padded[: len(mine)] = mine.detach()
        parts = [torch.empty_like(padded) for _ in range(p.size)]
        dist.all_gather(parts, padded, group=p.group)
        out = mine.new_empty(len(owner))
        for k in range(p.size):
            out[owner == k] = parts[k][: counts[k]]
        ctx.save_for_backward(owner == p.index)
        return out

    @staticmethod
    def backward(ctx, grad):
        (own,) = ctx.saved_tensors
        return grad[own], None, None  # every rank's loss is the same: its gradient of its own tokens is the one


def gather_tokens(mine: torch.Tensor, owner: torch.Tensor, p: Pass) -> torch.Tensor:
    """`mine`: values of the tokens this rank predicts (those with `owner == p.index`, in order);
    returns [len(owner)] with every rank's, as `_Gather` explains."""
    return _Gather.apply(mine, owner, p)
