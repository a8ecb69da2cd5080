"""Decode attention as one Triton kernel (`rollout.engine_options: {attention: triton}`, CUDA).

torch's decode attention (`rollover.engine.decode_attention`) attends every row over the step's
attended length, a power of two from 64 (`rollover.engine.cuda_graphs` records one graph per
bucket), with the keys past each row's position masked: a row reads every key of the bucket,
and the scores go through memory between three kernels (scores, softmax, values). At decode
sizes the step's attention is bound by reading the K/V cache, so the keys a row does not need
are time lost: up to half of the bucket's at its boundary, more where the rows' lengths differ.

This kernel reads each row's own keys only (positions 0..p for a row at position p, read from
the device, so a CUDA graph replays it for any lengths), in blocks of `BLOCK_N` keys, with an
online softmax (running maximum and sum) in fp32; one program per (row, KV head) computes the
outputs of the g query heads that share that KV head (padded to 16 for `tl.dot`) in one pass
over the keys and one over the values; in fp32 the products are true fp32 (not TF32). The
result equals the torch path's to float rounding (tests/test_engine.py, through Triton's
interpreter on a CPU in fp32 and fp16: the interpreter's bf16 products are wrong, so bf16 is
checked on a GPU, tests/test_cuda.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_attention_kernel(Q, K, V, POS, OUT, scale,
                             stride_qb, stride_qh,
                             stride_kr, stride_kh, stride_kn,
                             stride_ob, stride_oh,
                             G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                             FP32: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)  # 64-bit offsets: a layer's cache may pass 2**31 elements
    kv = tl.program_id(1).to(tl.int64)
    length = tl.load(POS + b) + 1  # keys 0..position
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    heads = kv * G + g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=(g < G)[:, None], other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    k_row = K + b * stride_kr + kv * stride_kh
    v_row = V + b * stride_kr + kv * stride_kh
    for start in range(0, length, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        inside = n < length
        k = tl.load(k_row + n[:, None] * stride_kn + d[None, :], mask=inside[:, None], other=0.0)
        if FP32:  # true fp32 products, not TF32: an fp32 engine's logprobs track the fp32 trainer's
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_G, BLOCK_N]
        else:
            scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        scores = tl.where(inside[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        s = s * alpha + tl.sum(p, 1)
        v = tl.load(v_row + n[:, None] * stride_kn + d[None, :], mask=inside[:, None], other=0.0)
        if FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m = m_new
    out = acc / s[:, None]
    tl.store(OUT + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(OUT.dtype.element_ty),
             mask=(g < G)[:, None])


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     block_n: int = 64) -> torch.Tensor:
    """q [B, H, D] over one layer's cache k_cache, v_cache [rows, KV, max_len, D] (the step's keys
    and values already written), row b attending keys 0..positions[b]. Returns [B, H * D] in q's
    dtype."""
    B, H, D = q.shape
    KV = k_cache.shape[1]
    check_shape(H, KV, D)
    G = H // KV
    q = q if q.stride(-1) == 1 else q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("triton decode attention: the K and V caches must be laid out alike, head dim innermost")
    out = torch.empty((B, H, D), dtype=q.dtype, device=q.device)
    _decode_attention_kernel[(B, KV)](
        q, k_cache, v_cache, positions, out, 1.0 / math.sqrt(D),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1),
        G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), D=D, BLOCK_N=block_n, FP32=q.dtype == torch.float32,
        num_warps=4, num_stages=2)  # two stages: an fp32 engine's K and V tiles at head dim 128 are 32 KiB each
    return out.reshape(B, H * D)


def check_shape(n_heads: int, n_kv: int, head_dim: int) -> None:
    """Refuse, when an engine is built, a model the kernel cannot serve."""
    if n_heads % n_kv or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"attention='triton' needs query heads a multiple of KV heads and a power-of-two head dim "
                         f"of at least 16 (the model has {n_heads} heads, {n_kv} KV heads, head dim {head_dim})")
