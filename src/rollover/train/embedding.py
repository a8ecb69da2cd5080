"""The trainer's embedding lookup with a row-wise gradient (`RowGradEmbedding`), used where it
computes what the module itself would (`row_grad_applies`)."""

from __future__ import annotations

import torch


def row_grad_applies(embedding) -> bool:
    """Whether `RowGradEmbedding` computes what this module's own lookup would: a plain
    trainable `nn.Embedding` (no max_norm, no frequency scaling, no sparse gradients)."""
    return (type(embedding) is torch.nn.Embedding and embedding.weight.requires_grad and embedding.max_norm is None
            and not embedding.scale_grad_by_freq and not embedding.sparse)


class RowGradEmbedding(torch.autograd.Function):
    """An embedding lookup whose backward adds each token's gradient into its row of the
    weight's `.grad`, in place, instead of returning a dense [vocab, hidden] gradient: torch's
    own backward zero-fills one per micro-batch and autograd then adds it whole to `.grad` (for
    SmolLM2, 113 MB written and read twice per micro-batch, for the few hundred rows a
    micro-batch touches: 0.8-1.4 s of a 10-12 s step of 8 micro-batches on a 2-core CPU,
    benchmarks/train_step.py). The padding row gets
    no gradient, as in `nn.Embedding`. Gradient accumulation and tied output heads (whose
    gradient autograd adds to the same `.grad`) are unaffected: both add into one tensor."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx):
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return torch.nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        ids, grad = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:
            keep = ids != ctx.padding_idx
            ids, grad = ids[keep], grad[keep]
        with torch.no_grad():
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            weight.grad.index_add_(0, ids, grad.to(weight.grad.dtype))
        return None, None, None
