"""A decode step's attention over the KV cache: write each row's new key and value, then attend
its query heads over the row's cached keys.

Two implementations, with the same inputs and results:

- **torch** (any device and dtype): the new keys and values go in with one `index_copy_` each;
  scores by `baddbmm` over `cache[:B, :, :Lk]` with a bias that masks keys past a row's
  position, softmax, and `bmm` with the values.
- **triton** (`rollover.engine.triton_attention`, CUDA, `rollout.engine_options: {attention:
  triton}`): the new keys and values go in as for torch, then one kernel attends each row over
  its own keys only (no bias, no bucket of masked keys).
- **native** (`rollover.engine.cpu.native`, CPU, fp32; the default there): one C loop over (row,
  kv head). Each row reads its own keys only up to its position, its g query heads share one
  pass over the keys and one over the values, and the new key and value are written in the same
  loop, rotated there when the caller passes the rotary tables. Why: at decode sizes MKL's
  batched GEMMs spend more on the call for each small [g, head_dim] x [head_dim, Lk] product
  than on the arithmetic, and the bias and the scattered cache writes are passes of their own.
  Measured on the 2-core Intel host, SmolLM2-135M's shapes (64 rows, 3 kv heads of 3 query
  heads, 116 cached tokens, 30 layers): 15.3 ms a step against 28.8 ms, cache writes included;
  the K/V it must read take 11.8 ms at the machine's streaming rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rollover.engine.cpu.native import Kernels


@dataclass
class Setup:
    """What every layer's attention in one decode step shares."""

    positions: torch.Tensor  # [B] each row's position (where its new key goes)
    Lk: int  # keys 0..Lk-1 are attended (masked per row past its position)
    slot: torch.Tensor | None = None  # torch: flat cache index of each (row, kv head)'s new key
    bias: torch.Tensor | None = None  # torch: [B * KV, 1, Lk], -inf past each row's position
    scratch: torch.Tensor | None = None  # native: room for the scores


class DecodeAttention:
    """One layer's decode attention for a runner's shapes; `native` is the kernel or None;
    `impl` "torch" or "triton" (where `native` is None)."""

    def __init__(self, n_heads: int, n_kv: int, head_dim: int, max_len: int, dtype: torch.dtype, native: Kernels | None = None,
                 impl: str = "torch"):
        self.n_heads, self.n_kv, self.head_dim, self.max_len, self.dtype = n_heads, n_kv, head_dim, max_len, dtype
        self.native = native
        self.impl = impl
        self._triton = None
        if impl == "triton":
            from rollover.engine import triton_attention

            triton_attention.check_shape(n_heads, n_kv, head_dim)
            self._triton = triton_attention.decode_attention

    def setup(self, positions: torch.Tensor, Lk: int | None = None) -> Setup:
        B, KV, dev = positions.shape[0], self.n_kv, positions.device
        if self._triton is not None:  # each row's length comes from its position, on the device: no read-back
            Lk = Lk or self.max_len
        Lk = Lk or int(positions.max()) + 1
        if self.native is not None:
            if Lk > self.max_len:
                raise ValueError(f"a decode position ({Lk - 1}) is past the cache's {self.max_len} tokens")
            return Setup(positions.contiguous(), Lk, scratch=torch.empty(B * self.n_heads * Lk, dtype=torch.float32))
        # flat cache index of (row b, kv head h, position p): (b * KV + h) * max_len + p
        slot = ((torch.arange(B, device=dev)[:, None] * KV + torch.arange(KV, device=dev)[None, :]) * self.max_len
                + positions[:, None]).reshape(-1)
        if self._triton is not None:  # each row's length comes from its position, on the device
            return Setup(positions, Lk, slot=slot)
        keymask = torch.arange(Lk, device=dev)[None, :] <= positions[:, None]  # [B, Lk]
        bias = torch.zeros((B, Lk), dtype=self.dtype, device=dev).masked_fill_(~keymask, float("-inf"))
        bias = bias[:, None, None, :].expand(B, KV, 1, Lk).reshape(B * KV, 1, Lk)
        return Setup(positions, Lk, slot=slot, bias=bias)

    def __call__(self, kc: torch.Tensor, vc: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 setup: Setup, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Write k, v [B, KV, D] at each row's position in one layer's cache kc, vc [rows, KV,
        max_len, D]; attend q [B, H, D] over the row's keys. Returns [B, H * D]. `rope`: the
        runner's (cos, sin_signed) tables, for q and k not yet rotated (native only)."""
        B, KV, D = q.shape[0], self.n_kv, self.head_dim
        if self.native is not None:
            q, k, v = (t if t.stride(-1) == 1 and t.stride(-2) == D else t.contiguous() for t in (q, k, v))
            return self.native.attention(q, k, v, rope, kc, vc, setup.positions, setup.scratch, setup.Lk, self.max_len, 1.0 / math.sqrt(D))
        if rope is not None:
            raise ValueError("torch's decode attention takes q and k rotated already")
        Lk = setup.Lk
        kc.view(-1, D).index_copy_(0, setup.slot, k.reshape(B * KV, D))
        vc.view(-1, D).index_copy_(0, setup.slot, v.reshape(B * KV, D))
        if self._triton is not None:
            return self._triton(q, kc, vc, setup.positions)
        K = kc[:B, :, :Lk].reshape(B * KV, Lk, D)  # views: rows and heads are adjacent in the cache
        V = vc[:B, :, :Lk].reshape(B * KV, Lk, D)
        qg = q.reshape(B * KV, self.n_heads // KV, D)  # the g query heads sharing each kv head
        s = torch.baddbmm(setup.bias, qg, K.transpose(1, 2), alpha=1.0 / math.sqrt(D))  # [B*KV, g, Lk]
        return torch.bmm(torch.softmax(s, dim=-1), V).reshape(B, -1)
