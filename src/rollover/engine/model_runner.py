"""The decoder forward pass used for generation, over a row-indexed KV cache.

Supports the Llama / Qwen2 / Qwen3 family (RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU MLP; Qwen2 adds q/k/v biases, Qwen3 adds per-head q/k RMSNorm). Weights are
taken by their Hugging Face names, so `load_weights` accepts a trainer's `named_parameters()`
directly.

Packed weights (CPU, fp32). With the native kernels on a CPU with 512-bit vectors, every linear
layer of 3 to 512 rows (`NATIVE_GEMM_ROWS`: decode steps, small prefills) multiplies by one
packed copy of each weight (`Kernels.pack`), made at its first use after a weight update; it
serves every batch size. Elsewhere, on CPUs with MKL, the linear layers of a decode step
multiply by weights packed for the step's batch size, from a ladder of sizes
(`rollover.engine.cpu.weight_packs`).

int8 (`quantize="int8"`, `rollout.quantize: int8`). Every weight matrix is also held as int8
rows with one float scale per row (symmetric, rounded to nearest; a quarter of the fp32 bytes),
made at its first use after each weight update, and every linear layer multiplies by those
(`torch._weight_int8pack_mm`); the embedding lookup, norms and attention stay in the runner's
dtype. The engine's logits then differ from the trainer's: `actor/rollout_kl` measures it and
`algorithm.tis_cap` corrects it, as for any rollout-training mismatch.

Native kernels (`rollover.engine.cpu.native`, CPU, fp32, where a C compiler builds them; the default
there). A decode step's attention (`rollover.engine.decode_attention`) is one C loop that rotates
and writes each row's new key and value and attends its query heads over the row's own keys;
RMSNorm (fused with the residual add before it in a decode step) and SwiGLU's SiLU-and-multiply
are one pass each, in decode and prefill. Elsewhere, and with `native_kernels=False`, torch's ops.

CUDA graphs (CUDA, `cuda_graphs=True`, the default there): decode steps are recorded once per
shape bucket and replayed (`rollover.engine.cuda_graphs`); a step that admits new sequences
while others decode then runs the graphed decode and a separate prefill (`separate_admission`)
instead of the fused eager `mixed` pass the CPU uses.

Layout. The cache holds one row per running sequence: `k_cache[layer]` is
`[max_rows, kv_heads, max_len, head_dim]`. The engine keeps running sequences in rows
`0..B-1` (it moves the last row into a freed one), so a decode step reads `cache[:B]` as a view
with no gather. q/k/v and gate/up projections are fused into single matmuls; the per-name
parameters are views into the fused tensors, so loading a named tensor updates the fused one.
The passes over prompts, `prefill` and `mixed`, are in `rollover.engine.prefill`.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from rollover.engine import prefill
from rollover.engine.cuda_graphs import DecodeGraphs, bucket
from rollover.engine.decode_attention import DecodeAttention
from rollover.engine.cpu.native import PackedWeight, kernels_for
from rollover.engine.cpu.weight_packs import WeightPacks
from rollover.engine.held_weights import check_named, free_storage, lend_views, restore_storage, same_memory

# rows from which and up to which the native GEMM multiplies (elsewhere: MKL's plain GEMM, which
# reads a weight at memory speed for one or two rows). Measured on the 2-core Intel host, each
# shape over 30 layers' weights (benchmarks/decode_gemm.py), GFLOP/s native / MKL plain: gate_up
# [576, 3072] at 1 row 21/21, 3 rows 53/38, 64 rows 282/187, 512 rows 321/304; down [1536, 576]
# at 1 row 21/26, 2 rows 40/51; MKL's pack for the batch size: 255 at 64 rows, 334 at 512
NATIVE_GEMM_ROWS = (3, 512)

SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def architecture_of(config) -> str:
    archs = getattr(config, "architectures", None) or []
    for a in archs:
        if a in SUPPORTED:
            return SUPPORTED[a]
    mt = getattr(config, "model_type", None)
    if mt in ("llama", "mistral", "qwen2", "qwen3"):
        return "llama" if mt == "mistral" else mt
    raise ValueError(
        f"TorchEngine does not support architecture {archs or mt!r}; supported: "
        f"{', '.join(sorted(SUPPORTED))} (rollout.engine_options: {{forward: transformers}} runs others)"
    )


def _rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv.float(), float(scale)


def _check_attention(attention: str, device, compile_decode: bool, native_kernels: bool | None) -> None:
    """Refuse a decode attention the runner cannot use with the rest of its options."""
    if attention not in ("torch", "triton"):
        raise ValueError(f"attention must be 'torch' or 'triton', got {attention!r}")
    if attention == "torch":
        return
    if compile_decode:  # not yet tried together on a GPU
        raise ValueError("attention='triton' does not yet go with compile_decode: choose one")
    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention='triton' runs on CUDA (on a CPU only under TRITON_INTERPRET=1, for tests)")
    if native_kernels:
        raise ValueError("attention='triton' and native_kernels are two decode attentions: choose one")


class ModelRunner:
    def __init__(
        self,
        config,
        state_dict: dict[str, torch.Tensor],
        *,
        max_rows: int,
        max_len: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        pack_weights: bool = True,
        quantize: str | None = None,
        cuda_graphs: bool = True,
        compile_decode: bool = False,
        native_kernels: bool | None = None,
        attention: str = "torch",
    ):
        _check_attention(attention, device, compile_decode, native_kernels)
        if quantize not in (None, "int8"):
            raise ValueError(f"quantize must be None or 'int8', got {quantize!r}")
        if compile_decode and quantize is not None:
            raise ValueError("compile_decode runs the float decode step; it does not take quantize='int8'")
        self.quantize = quantize
        self.arch = architecture_of(config)
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_rows, self.max_len = max_rows, max_len
        self.n_layers = config.num_hidden_layers
        self.n_heads = config.num_attention_heads
        self.n_kv = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.hidden = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // self.n_heads
        self.eps = config.rms_norm_eps
        self.vocab_size = config.vocab_size
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self._build_params(state_dict)
        self._lent = False  # a trainer's parameters are views of these weights (`lend_weights`)
        self._released: list[tuple[torch.Tensor, int]] | None = None  # (tensor, bytes) while released
        self.missing: set[str] = set()  # weights released and not loaded again (`release_weights`)
        inv_freq, scale = _rope_inv_freq(config, self.head_dim)
        pos = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * scale).to(self.device, dtype)  # [max_len, D]
        self.sin = (emb.sin() * scale).to(self.device, dtype)
        # rotate_half(x) * sin == swap_halves(x) * sin_signed, with the first half of sin negated
        half = self.head_dim // 2
        self.sin_signed = torch.cat([-self.sin[:, :half], self.sin[:, half:]], dim=-1)
        self._cache_shape = (max_rows, self.n_kv, max_len, self.head_dim)
        self._k: torch.Tensor | None = None  # [layers, rows, kv heads, max_len, head dim], at first use (k_cache)
        self._v: torch.Tensor | None = None
        self._k_layers: list[torch.Tensor] | None = None  # its per-layer views
        self._v_layers: list[torch.Tensor] | None = None
        self._int8: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(matrix) -> (int8 matrix, row scales)
        self._pack_for: int | None = None  # the decode batch size in flight, when MKL-packed
        self.cuda_graphs = bool(cuda_graphs and self.device.type == "cuda" and quantize is None)
        # a step that admits sequences while others decode: one fused eager pass (`mixed`, cheaper
        # on a CPU), or the decode through its graph and a separate prefill (with CUDA graphs)
        self.separate_admission = self.cuda_graphs
        self.graphs = DecodeGraphs(self) if self.cuda_graphs else None
        # the decode step compiled by torch.compile (inductor), for every batch size and attended
        # length in one graph: element-wise work fused, Python and dispatch gone; the first step
        # compiles (a minute or two on a CPU). With CUDA graphs each bucket's graph records the
        # compiled step (its first step, outside the capture, compiles and warms the kernels up).
        self.compiled = torch.compile(self._decode, dynamic=True) if compile_decode else None
        # the native kernels (`rollover.engine.cpu.native`) on a CPU in fp32 where they build; torch's
        # ops elsewhere and where the step is compiled (inductor cannot trace a C call)
        if native_kernels and (compile_decode or quantize is not None):
            raise ValueError("native_kernels serve the eager float forward: not with compile_decode or quantize")
        self.kernels = None
        if not compile_decode and quantize is None and attention == "torch":
            self.kernels = kernels_for(self.device, dtype, native_kernels, self.n_heads // self.n_kv, self.head_dim)
        self.attention = DecodeAttention(self.n_heads, self.n_kv, self.head_dim, max_len, dtype, self.kernels,
                                         impl=attention)
        # packed weights (module docstring): the native GEMM's where the kernels run with 512-bit
        # vectors (where it was measured), else MKL's ladder of packs for decode batch sizes
        self.native_gemm = bool(pack_weights and self.kernels is not None and self.kernels.gemm_vector_bits >= 512)
        self._native_packs: dict[int, PackedWeight] = {}  # id(matrix) -> its pack
        can_pack = (pack_weights and not self.native_gemm and not compile_decode and quantize is None
                    and self.device.type == "cpu" and dtype == torch.float32
                    and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"))
        self.packs = WeightPacks(max_rows if can_pack else 0)

    # ---------------------------------------------------------------- weights
    def _build_params(self, sd: dict[str, torch.Tensor]) -> None:
        sd = {k.removeprefix("_orig_mod."): v for k, v in sd.items()}
        dev, dt = self.device, self.dtype

        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise ValueError(f"weight {name!r} missing from the model's state dict")
            return sd[name].detach().to(dev, dt)

        self.views: dict[str, torch.Tensor] = {}  # HF name -> tensor (view) to copy into
        self.embed = take("model.embed_tokens.weight").clone()
        self.views["model.embed_tokens.weight"] = self.embed
        self.final_norm = take("model.norm.weight").clone()
        self.views["model.norm.weight"] = self.final_norm
        if self.tied or "lm_head.weight" not in sd:
            self.lm_head = self.embed
        else:
            self.lm_head = take("lm_head.weight").clone()
            self.views["lm_head.weight"] = self.lm_head
        self.layers = []
        qd, kd = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = torch.cat([take(a + f"{n}_proj.weight") for n in "qkv"], 0).contiguous()
            gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], 0).contiguous()
            L = {
                "in_norm": take(p + "input_layernorm.weight").clone(),
                "post_norm": take(p + "post_attention_layernorm.weight").clone(),
                "qkv": qkv,
                "o": take(a + "o_proj.weight").clone(),
                "gate_up": gate_up,
                "down": take(p + "mlp.down_proj.weight").clone(),
                "qkv_bias": None,
                "q_norm": None,
                "k_norm": None,
            }
            self.views[p + "input_layernorm.weight"] = L["in_norm"]
            self.views[p + "post_attention_layernorm.weight"] = L["post_norm"]
            self.views[a + "q_proj.weight"] = qkv[:qd]
            self.views[a + "k_proj.weight"] = qkv[qd : qd + kd]
            self.views[a + "v_proj.weight"] = qkv[qd + kd :]
            self.views[a + "o_proj.weight"] = L["o"]
            inter = gate_up.shape[0] // 2
            self.views[p + "mlp.gate_proj.weight"] = gate_up[:inter]
            self.views[p + "mlp.up_proj.weight"] = gate_up[inter:]
            self.views[p + "mlp.down_proj.weight"] = L["down"]
            if a + "q_proj.bias" in sd:
                bias = torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"], 0).contiguous()
                L["qkv_bias"] = bias
                self.views[a + "q_proj.bias"] = bias[:qd]
                self.views[a + "k_proj.bias"] = bias[qd : qd + kd]
                self.views[a + "v_proj.bias"] = bias[qd + kd :]
            if a + "q_norm.weight" in sd:
                L["q_norm"] = take(a + "q_norm.weight").clone()
                L["k_norm"] = take(a + "k_norm.weight").clone()
                self.views[a + "q_norm.weight"] = L["q_norm"]
                self.views[a + "k_norm.weight"] = L["k_norm"]
            self.layers.append(L)

    def load_weights(self, named_tensors) -> int:
        """Copy named tensors (HF names) into the running weights; returns how many.

        Unknown names and shape mismatches raise ValueError before anything is modified.
        """
        tied = ("lm_head.weight",) if self.lm_head is self.embed else ()
        items = check_named(self.views, named_tensors, skip=tied)
        if self._released is not None:  # back from `release_weights`: room first, the values follow
            restore_storage(self._released)
            self._released = None
        with torch.no_grad():
            for name, t in items:
                dst = self.views.get(name)
                if dst is not None and not same_memory(dst, t):  # a lent weight is already there
                    dst.copy_(t.detach())
        self.missing.difference_update(name for name, _ in items)
        self.drop_packs()
        return len(items)

    def _weight_tensors(self) -> list[torch.Tensor]:
        """The tensors that own the weights' memory (every entry of `views` is one of them or a
        view into one)."""
        out = [self.embed, self.final_norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        return out + [t for L in self.layers for t in L.values() if t is not None]

    def weight_bytes(self) -> int:
        """Bytes the weights hold now (0 while released)."""
        return sum(t.untyped_storage().nbytes() for t in self._weight_tensors())

    def release_weights(self) -> int:
        """Free the weights' memory until `load_weights` brings every weight back (colocated
        engines while their ranks train: the weights come back with the next update anyway).
        Until then a forward pass raises, naming a weight still missing. The tensors stay (their
        storage shrinks to nothing), so the fused layout and the views survive; the decode
        graphs, which address the old memory, are dropped. Returns the bytes freed."""
        if self._lent:
            raise RuntimeError("release_weights: a trainer's parameters are views of these weights (lend_weights)")
        if self._released is not None:
            return 0
        self._released = free_storage(self._weight_tensors())
        freed = sum(n for _, n in self._released)
        self.missing = set(self.views)
        self.drop_packs()
        if self.graphs is not None:
            self.graphs.drop()
        return freed

    def _check_weights(self) -> None:
        if self.missing:
            raise RuntimeError(f"the engine's weights were released (release_weights) and {len(self.missing)} are not "
                               f"loaded again yet, e.g. {min(self.missing)!r}: load every weight before generating")

    def lend_weights(self, model) -> int:
        """Make `model`'s parameters views of this runner's weights, which must hold the same
        values: the runner keeps its fused layout, the model's own copies are freed, and an
        optimizer that updates the parameters in place updates these weights with no copy. Only
        for a trainer in this process that never steps while this runner generates (the
        synchronous loop); `load_weights` then skips the tensors already in place. Returns the
        bytes no longer held twice."""
        saved = lend_views(self.views, model, self.missing)
        self._lent = True
        return saved

    def _matrices(self) -> list[torch.Tensor]:
        return [L[k] for L in self.layers for k in ("qkv", "o", "gate_up", "down")] + [self.lm_head]

    @property
    def k_cache(self) -> list[torch.Tensor]:
        """Per layer [max_rows, kv_heads, max_len, head_dim]: views of one [layers, ...] tensor
        (`move_row` copies a row of every layer at once); allocated at first use after start-up
        or `drop_cache`."""
        if self._k is None:
            self._new_cache()
        return self._k_layers

    @property
    def v_cache(self) -> list[torch.Tensor]:
        if self._v is None:
            self._new_cache()
        return self._v_layers

    def _new_cache(self) -> None:
        with torch.inference_mode(False):  # normal tensors, even when first touched inside a step
            self._k, self._v = (torch.zeros((self.n_layers, *self._cache_shape), device=self.device, dtype=self.dtype)
                                for _ in range(2))
            self._k_layers, self._v_layers = list(self._k.unbind(0)), list(self._v.unbind(0))

    def drop_cache(self) -> None:
        """Free the KV cache; only when no sequence holds a row (the engine checks). The CUDA
        graphs, which address the cache, go with it."""
        self._k = self._v = self._k_layers = self._v_layers = None
        if self.graphs is not None:
            self.graphs.drop()

    @property
    def pack_sizes(self) -> list[int]:
        """The decode batch sizes of MKL's packs (empty with the native GEMM, whose pack serves all)."""
        return self.packs.sizes

    @property
    def packing(self) -> str | None:
        """Which packed weights the linear layers use: "native", "mkl" or None (plain GEMMs)."""
        return "native" if self.native_gemm else "mkl" if self.packs.sizes else None

    @property
    def _packs(self) -> dict:
        """The packed weights held: MKL's pack by batch size (at most one), or the native packs by
        matrix."""
        return self.packs.held or self._native_packs

    def drop_packs(self) -> None:
        """Free the packed (or int8) weights, stale after a weight update, until a step needs them."""
        self.packs.drop()
        self._native_packs = {}
        self._int8 = {}

    def _quantized(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`w` as int8 rows and one scale per row (symmetric, round to nearest), made at its first
        use after a weight update."""
        q = self._int8.get(id(w))
        if q is None:
            scale = (w.detach().abs().amax(dim=1).float() / 127.0).clamp_min(1e-12)
            rows = torch.round(w.detach().float() / scale[:, None]).clamp_(-127, 127).to(torch.int8)
            q = self._int8[id(w)] = (rows, scale.to(self.dtype))
        return q

    def _linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.quantize == "int8":
            rows, scale = self._quantized(w)
            y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).contiguous(), rows, scale)
            y = y.reshape(*x.shape[:-1], -1)
            return y + bias if bias is not None else y
        lo, hi = NATIVE_GEMM_ROWS
        if self.native_gemm and lo * x.shape[-1] <= x.numel() <= hi * x.shape[-1]:
            p = self._native_packs.get(id(w))
            if p is None:
                p = self._native_packs[id(w)] = self.kernels.pack(w)
            rows = x.reshape(-1, x.shape[-1])
            rows = rows if rows.stride(-1) == 1 else rows.contiguous()
            return self.kernels.linear(rows, p, bias).view(*x.shape[:-1], -1)
        m = self._pack_for
        if m is not None and x.shape[0] == m:
            return torch.ops.mkl._mkl_linear(x, self.packs.held[m][id(w)], w, bias, m)
        return F.linear(x, w, bias)

    # ---------------------------------------------------------------- forward
    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """HF's RMSNorm: normalised in fp32, rounded to the model's dtype, then scaled by w. The
        fp32 part is one fused op, so bf16 costs 4 kernels rather than 8 (most of a graphed
        decode step's device time on a GPU is its ~1,000 small kernels)."""
        if x.dtype == torch.float32:
            if self.kernels is not None and x.stride(-1) == 1:
                return self.kernels.add_rms_norm(x.reshape(-1, x.shape[-1]), None, w, self.eps).view(x.shape)
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        return w * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """x * cos + rotate_half(x) * sin, as x * cos + swap_halves(x) * sin_signed (3 ops)."""
        half = x.shape[-1] // 2
        return torch.addcmul(x * cos, torch.cat([x[..., half:], x[..., :half]], dim=-1), sin_signed)

    def _qkv(self, L: dict, h: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor):
        """h [..., hidden] -> q [..., H, D], k, v [..., KV, D] with rope applied."""
        qkv = self._linear(h, L["qkv"], L["qkv_bias"])
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        v = qkv[..., (H + KV) * D :].unflatten(-1, (KV, D))
        cos, sin_signed = cos.unsqueeze(-2), sin_signed.unsqueeze(-2)  # broadcast over heads
        if L["q_norm"] is None:  # q and k rotated together
            qk = self._rope(qkv[..., : (H + KV) * D].unflatten(-1, (H + KV, D)), cos, sin_signed)
            return qk[..., :H, :], qk[..., H:, :], v
        q = self._norm(qkv[..., : H * D].unflatten(-1, (H, D)), L["q_norm"])
        k = self._norm(qkv[..., H * D : (H + KV) * D].unflatten(-1, (KV, D)), L["k_norm"])
        return self._rope(q, cos, sin_signed), self._rope(k, cos, sin_signed), v

    def _mlp(self, L: dict, x: torch.Tensor) -> torch.Tensor:
        h = self._norm(x, L["post_norm"])
        gu = self._linear(h, L["gate_up"])
        if self.kernels is not None:
            return x + self._linear(self.kernels.silu_mul(gu.reshape(-1, gu.shape[-1])).view(*gu.shape[:-1], -1), L["down"])
        g, u = gu.chunk(2, dim=-1)
        return x + self._linear(F.silu(g) * u, L["down"])

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self._linear(self._norm(h, self.final_norm), self.lm_head).float()

    def prefill(self, rows: list[int], token_ids: list[list[int]]) -> torch.Tensor:
        """Run full sequences into cache rows (positions 0..len-1); logits of each last token [N, V]
        (`rollover.engine.prefill`)."""
        self._check_weights()
        return prefill.prefill(self, rows, token_ids)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, max_position: int | None = None) -> torch.Tensor:
        """One token for each of rows 0..B-1 at the given positions; logits [B, V]. A caller that
        knows the largest position passes it as `max_position`, which spares a GPU a wait for
        the device to read it back."""
        self._check_weights()
        n = tokens.shape[0]
        if max_position is None:
            max_position = int(positions.max())
        if self.cuda_graphs:
            return self.graphs.decode(tokens, positions, max_position)
        if self.compiled is not None:  # the attended length as a number: no data-dependent shape inside
            lk = max_position + 1
            if n == 1 and self.max_rows > 1:  # one row would compile a second graph (size 1 is specialised):
                # a free row at position 0 rides along; its cache is rewritten before use
                return self.compiled(F.pad(tokens, (0, 1)), F.pad(positions, (0, 1)), lk)[:1]
            if not tokens.is_inference():  # the graph's guards check the inputs' kind: a tensor made outside
                # inference mode against the padded ones above would compile the step a second time
                tokens, positions = tokens.clone(), positions.clone()
            return self.compiled(tokens, positions, lk)
        pad_to = self.packs.size_for(n)
        if pad_to is None:
            return self._decode(tokens, positions, max_position + 1)
        pad = pad_to - n  # free rows 0-filled at position 0: their cache is rewritten before use
        self.packs.ensure(pad_to, self._matrices())
        self._pack_for = pad_to
        try:
            return self._decode(F.pad(tokens, (0, pad)), F.pad(positions, (0, pad)), max_position + 1)[:n]
        finally:
            self._pack_for = None

    _bucket = staticmethod(bucket)

    @property
    def _graphs(self) -> dict:
        """The recorded decode graphs by (rows, attended length); empty without CUDA graphs."""
        return self.graphs.entries if self.graphs is not None else {}

    def _decode(self, tokens: torch.Tensor, positions: torch.Tensor, Lk: int | None = None) -> torch.Tensor:
        if self.kernels is not None:
            return self._decode_native(tokens, positions, Lk)
        x = F.embedding(tokens, self.embed)  # [B, hidden]
        cos, sin = self.cos[positions], self.sin_signed[positions]
        setup = self.attention.setup(positions, Lk)
        for li, L in enumerate(self.layers):
            h = self._norm(x, L["in_norm"])
            q, k, v = self._qkv(L, h, cos, sin)  # q [B, H, D]; k, v [B, KV, D]
            x = x + self._linear(self.attention(self.k_cache[li], self.v_cache[li], q, k, v, setup), L["o"])
            x = self._mlp(L, x)
        return self.logits(x)

    def _decode_native(self, tokens: torch.Tensor, positions: torch.Tensor, Lk: int | None = None) -> torch.Tensor:
        """`_decode` through the native kernels: the rotary embedding inside the attention (where
        no q/k norm comes between), and each residual add fused with the RMSNorm after it."""
        K, eps = self.kernels, self.eps
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        x = F.embedding(tokens, self.embed)  # [B, hidden], the residual stream, added to in place
        setup = self.attention.setup(positions, Lk)
        # with a q/k norm between projection and rotation (Qwen3) torch rotates: the rows' tables, once a step
        rows_rope = (self.cos[positions], self.sin_signed[positions]) if self.layers[0]["q_norm"] is not None else None
        h = K.add_rms_norm(x, None, self.layers[0]["in_norm"], eps)
        for li, L in enumerate(self.layers):
            if rows_rope is None:  # q and k go to the kernel as projected; it rotates them
                qkv = self._linear(h, L["qkv"], L["qkv_bias"]).unflatten(-1, (H + 2 * KV, D))
                q, k, v, rope = qkv[:, :H], qkv[:, H : H + KV], qkv[:, H + KV :], (self.cos, self.sin_signed)
            else:
                (q, k, v), rope = self._qkv(L, h, *rows_rope), None
            o = self._linear(self.attention(self.k_cache[li], self.v_cache[li], q, k, v, setup, rope), L["o"])
            h = K.add_rms_norm(x, o, L["post_norm"], eps)
            d = self._linear(K.silu_mul(self._linear(h, L["gate_up"])), L["down"])
            h = K.add_rms_norm(x, d, self.layers[li + 1]["in_norm"] if li + 1 < self.n_layers else self.final_norm, eps)
        return self._linear(h, self.lm_head)

    def mixed(self, tokens: torch.Tensor, positions: torch.Tensor, rows: list[int],
              token_ids: list[list[int]]) -> torch.Tensor:
        """Decode rows 0..B-1 and prefill new sequences into `rows` in one forward pass; logits
        [B + len(rows), V] (`rollover.engine.prefill`)."""
        self._check_weights()
        return prefill.mixed(self, tokens, positions, rows, token_ids)

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy a sequence's cache from row src to row dst (compaction after a row frees): one
        copy for the keys of every layer and one for the values (a launch each on a GPU)."""
        if self._k is None:
            self._new_cache()
        self._k[:, dst, :, :length] = self._k[:, src, :, :length]
        self._v[:, dst, :, :length] = self._v[:, src, :, :length]

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        self.move_row(src, dst, length)
