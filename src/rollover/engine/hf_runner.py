"""The generic decoder pass: any Hugging Face causal LM through its own forward, over the same
row-indexed KV cache `ModelRunner` keeps.

`ModelRunner` writes the forward of the Llama / Mistral / Qwen2 / Qwen3 family by hand (fused
projections, native CPU kernels, CUDA graphs). Every other decoder-only model transformers can
load (Gemma, Phi-3, OLMo-2, GPT-2, Granite, Qwen3-MoE, ...) runs here instead: the model's own
`forward` (a module built from the model's config, holding the weights it is given), with a
cache of rollover's in place of transformers' own, so continuous batching, abort and resume
from tokens, weight updates and the K/V kept across them work as with the fast path.

How the model is driven:
- The cache (a `transformers.Cache`, `_row_cache_class`) holds per layer `[max_rows, kv heads,
  max_len, head dim]`, allocated at the first forward with the shapes the attention gives it.
  The model calls `update(keys, values, layer)` from each attention layer; the cache writes the
  new keys where the pass says and returns what the layer attends to.
- A decode step feeds rows 0..B-1 one token each, at each row's own position (`position_ids`),
  with an additive 4-D mask over the attended length that hides each row's positions past its
  own. The model takes a 4-D mask as given (transformers' mask builders step aside).
- A prefill packs the new sequences into one row of tokens, positions restarting at 0 for
  each, under a block-diagonal causal mask; the cache copies each sequence's keys into its
  row, and `logits_to_keep` keeps the logits of each sequence's last token only.
- Models with several kinds of layers (`config.layer_types`: Gemma 2/3, Qwen2 with sliding
  layers) take one mask per kind; a sliding-window layer's mask also hides keys more than
  `config.sliding_window` behind the query. A model whose layers are not attention over a
  K/V cache (linear attention, state-space layers, chunked attention) is refused with its name.

What it does not do: fused kernels, packed weights, CUDA graphs, int8, `torch.compile` (the fast
path's options; asking for them here is an error). Its speed is the model's eager forward plus
a per-step Python cost, measured in docs/benchmarks.md.
"""

from __future__ import annotations

import copy
import inspect

import torch

from rollover.engine.held_weights import check_named, free_storage, lend_views, restore_storage, same_memory
from rollover.data.media import placeholder_ids, rope_index_of, rope_positions
from rollover.engine.model_runner import SUPPORTED
from rollover.models import auto_model_class, is_vision_language, text_config

# the attention kinds of `config.layer_types` this runner masks
LAYER_KINDS = ("full_attention", "sliding_attention")


def check_generic(config, max_len: int) -> None:
    """Refuse, before any weights are copied, a model the generic pass cannot drive."""
    name = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"TorchEngine runs decoder-only models; {name!r} is an encoder-decoder")
    text = text_config(config)
    kinds = set(getattr(text, "layer_types", None) or ())
    if kinds - set(LAYER_KINDS):
        raise ValueError(
            f"TorchEngine's generic pass masks {', '.join(LAYER_KINDS)} layers; {name!r} also has "
            f"{', '.join(sorted(kinds - set(LAYER_KINDS)))} (use rollout.engine: vllm)")
    rope = dict(getattr(text, "rope_parameters", None) or {})
    original = rope.get("original_max_position_embeddings") or getattr(text, "original_max_position_embeddings", None)
    if rope.get("rope_type") in ("longrope", "dynamic") and original and max_len > original:
        # their frequencies follow the longest position of the batch: cached keys of shorter rows (and of a row
        # before it grew past the original length) were rotated with other ones
        raise ValueError(f"{name!r} uses {rope['rope_type']} rotary scaling, whose frequencies change past "
                         f"{original} positions: TorchEngine's cache holds it to max_len <= {original} (got {max_len})")


def _row_cache_class():
    from transformers.cache_utils import Cache

    class _RowCache(Cache):
        """The runner's K/V as a transformers cache. The runner sets `plan` before each forward:
        ("decode", positions [B], attended length) or ("prefill", [(row, start, length)])."""

        def __init__(self, runner: "HFRunner"):
            super().__init__(layers=[])
            self.runner = runner
            self.plan = None
            self.seen: set[int] = set()

        def __len__(self):
            return self.runner.n_layers

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            self.seen.add(layer_idx)
            return self.runner._cache_update(layer_idx, key_states, value_states, self.plan)

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return 0

        def get_max_length(self, layer_idx=None) -> int:
            return self.runner.max_len

    return _RowCache


class HFRunner:
    """`ModelRunner`'s interface over a Hugging Face module's own forward (module docstring)."""

    cuda_graphs = False
    separate_admission = False  # admit at every step (`mixed`: the decode, then the prefill; no graphs to batch for)
    kernels = None
    graphs = None
    packing = None
    pack_sizes: list = []
    _graphs: dict = {}
    arch = "generic"

    def __init__(self, config, state_dict: dict[str, torch.Tensor], *, max_rows: int, max_len: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 max_prefill_tokens: int = 2048):
        from transformers.initialization import no_init_weights

        check_generic(config, max_len)
        config = copy.deepcopy(config)  # building the module sets its attention and dtype on the config: not the caller's
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_rows, self.max_len = max_rows, max_len
        text = text_config(config)
        self.vocab_size = text.vocab_size
        self.max_prefill_tokens = max_prefill_tokens
        # the module of the config, its weights left uninitialised (all of them are loaded next); its buffers
        # (rotary tables) are computed as it is built. Flash / flex attention take no 4-D mask: SDPA stands in
        impl = getattr(config, "_attn_implementation", None)
        with self.device, no_init_weights():
            self.module = auto_model_class(config).from_config(config, dtype=dtype, attn_implementation=impl if impl in ("eager", "sdpa") else "sdpa")
        self.module.tie_weights()
        self.module.eval().requires_grad_(False)
        self.n_layers = text.num_hidden_layers
        self.layer_kinds = _layer_kinds(text)  # empty: one mask for every layer
        self.window = sliding_window(text)
        self.views: dict[str, torch.Tensor] = {k: v.data if isinstance(v, torch.nn.Parameter) else v
                                               for k, v in self.module.state_dict(keep_vars=True).items()}
        self._lent = False  # a trainer's parameters are views of these weights (`lend_weights`)
        self._released: list[tuple[torch.Tensor, int]] | None = None  # (tensor, bytes) while released
        self.missing = {n for n, _ in self.module.named_parameters(remove_duplicate=False)}  # none loaded yet
        self.load_weights(state_dict.items())
        self._check_weights()
        self._keep_arg = "logits_to_keep" in inspect.signature(self.module.forward).parameters
        self._k: list[torch.Tensor | None] = [None] * self.n_layers  # per layer [max_rows, kv heads, max_len, head dim]
        self._v: list[torch.Tensor | None] = [None] * self.n_layers
        self.cache = _row_cache_class()(self)
        self._neg = torch.finfo(dtype).min
        # a vision-language model with 3-D rotary positions: each row's text runs at its index plus an
        # offset its images set (`rollover.data.media.rope_positions`), which decoding adds
        self.rope_3d = rope_index_of(self.module) is not None
        self.delta = torch.zeros(max_rows, dtype=torch.long, device=self.device)
        self.takes_media = is_vision_language(config)
        self.banned = placeholder_ids(config) if self.takes_media else []  # image placeholders: never sampled
        self._check_positions()
        self._probe()

    def _check_positions(self) -> None:
        """Refuse a cache longer than a learned position table (GPT-2's `wpe`, OPT's positions):
        the first sequence past it would stop the engine."""
        inputs = self.module.get_input_embeddings()
        for name, m in self.module.get_decoder().named_modules():  # a vision tower's patch positions are its own
            if isinstance(m, torch.nn.Embedding) and m is not inputs and ("pos" in name or name.endswith("wpe")):
                room = m.num_embeddings - int(getattr(m, "offset", 0))
                if room < self.max_len:
                    raise ValueError(f"{type(self.module).__name__} learned {room} positions ({name}); max_len is "
                                     f"{self.max_len}: shorten the run's prompts or rollout.max_new_tokens")

    @torch.inference_mode()
    def _probe(self) -> None:
        """A few tokens through this runner and through the model's own forward, which must agree: a
        model that cannot run over this cache (another cache layout, its own masks) is refused
        here, by name, not at its first request. The sequence runs past a short sliding window,
        so a window the masks would miss shows too."""
        n = min(self.max_len, self.window + 3 if self.window and self.window < 256 else 24)
        toks = [(7 * i + 3) % self.vocab_size for i in range(n)]
        name = type(self.module).__name__
        try:
            got = self.prefill([0], [toks])[0]
        except Exception as e:
            raise ValueError(f"TorchEngine cannot run {name} through transformers' forward over its cache "
                             f"({type(e).__name__}: {e}); use rollout.engine: vllm") from e
        ref = self.module(input_ids=torch.tensor([toks], device=self.device), use_cache=False).logits[0, -1].float()
        ref[self.banned] = float("-inf")
        got, ref = got[ref.isfinite()], ref[ref.isfinite()]
        tol = (1e-3 if self.dtype == torch.float32 else 5e-2) * max(1.0, ref.abs().max().item())
        gap = (got - ref).abs().max().item()
        if not gap <= tol:
            raise ValueError(f"TorchEngine's pass over its cache gives {name} logits {gap:.3g} away from the model's own "
                             "forward (its attention masks or positions differ); use rollout.engine: vllm")

    # ---------------------------------------------------------------- weights
    def load_weights(self, named_tensors) -> int:
        """Copy named tensors (HF names) into the module; returns how many. Unknown names and shape
        mismatches raise ValueError before anything is modified."""
        items = check_named(self.views, named_tensors)
        if self._released is not None:
            restore_storage(self._released)
            self._released = None
        with torch.no_grad():
            for name, t in items:
                dst = self.views[name]
                if not same_memory(dst, t):
                    dst.copy_(t.detach())
        self.missing.difference_update(name for name, _ in items)
        if self.missing:  # a tied head is loaded with the embedding it shares its memory with
            loaded = {self.views[n].data_ptr() for n in self.views if n not in self.missing}
            self.missing = {n for n in self.missing if self.views[n].data_ptr() not in loaded}
        return len(items)

    def _weight_tensors(self) -> list[torch.Tensor]:
        seen, out = set(), []
        for p in self.module.parameters():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                out.append(p.data)
        return out

    def weight_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._weight_tensors())

    def release_weights(self) -> int:
        if self._lent:
            raise RuntimeError("release_weights: a trainer's parameters are views of these weights (lend_weights)")
        if self._released is not None:
            return 0
        self._released = free_storage(self._weight_tensors())
        names = {n for n, p in self.module.named_parameters(remove_duplicate=False)}
        self.missing = names & set(self.views)
        return sum(n for _, n in self._released)

    def _check_weights(self) -> None:
        if self.missing:
            raise RuntimeError(f"{len(self.missing)} of the engine's weights are not loaded (at start-up, or again after "
                               f"release_weights), e.g. {min(self.missing)!r}: load every weight before generating")

    def lend_weights(self, model) -> int:
        """As `ModelRunner.lend_weights`: `model`'s parameters become this module's tensors."""
        saved = lend_views(self.views, model, self.missing)
        self._lent = True
        return saved

    def drop_packs(self) -> None:
        """Nothing packed here (the fast path's interface)."""

    # ---------------------------------------------------------------- cache
    def _cache_update(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan):
        if self._k[layer] is None:  # keys and values each as the layer shapes them (MLA: other head sizes)
            with torch.inference_mode(False):
                self._k[layer] = torch.zeros((self.max_rows, k.shape[1], self.max_len, k.shape[3]), device=self.device,
                                             dtype=k.dtype)
                self._v[layer] = torch.zeros((self.max_rows, v.shape[1], self.max_len, v.shape[3]), device=self.device,
                                             dtype=v.dtype)
        K, V = self._k[layer], self._v[layer]
        if plan[0] == "decode":
            _, positions, lk = plan
            b = k.shape[0]
            rows = torch.arange(b, device=k.device)
            K[rows, :, positions] = k[:, :, 0]
            V[rows, :, positions] = v[:, :, 0]
            return K[:b, :, :lk], V[:b, :, :lk]
        if plan[0] == "chunk":  # a part of one long sequence: it attends to the row's keys up to its end
            _, row, start, end = plan
            K[row, :, start:end] = k[0]
            V[row, :, start:end] = v[0]
            return K[row:row + 1, :, :end], V[row:row + 1, :, :end]
        for row, start, n in plan[1]:
            K[row, :, :n] = k[0, :, start : start + n]
            V[row, :, :n] = v[0, :, start : start + n]
        return k, v  # the packed sequences attend among themselves, under the block-diagonal mask

    def drop_cache(self) -> None:
        self._k = [None] * self.n_layers
        self._v = [None] * self.n_layers

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.delta[dst] = self.delta[src]
        for K, V in zip(self._k, self._v):
            if K is not None:
                K[dst, :, :length] = K[src, :, :length]
                V[dst, :, :length] = V[src, :, :length]

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        self.move_row(src, dst, length)

    # ---------------------------------------------------------------- masks
    def _masks(self, q: torch.Tensor, k: torch.Tensor, same: torch.Tensor | None = None):
        """The model's attention_mask argument for queries at positions `q` over keys at positions
        `k` (broadcast to [..., Q, K]; `same`: which pairs may see each other at all, the packed
        sequences' blocks): causal, and for sliding-window layers also no further back than the
        window; one additive 4-D mask, or one per layer kind."""
        allowed = k <= q if same is None else (k <= q) & same

        def additive(ok):
            m = torch.zeros(ok.shape, device=self.device, dtype=self.dtype)
            return m.masked_fill_(~ok, self._neg)[(None,) * (4 - ok.dim())]

        windowed = additive(allowed & (k > q - self.window)) if self.window else None
        full = additive(allowed)
        if not self.layer_kinds:
            return windowed if windowed is not None else full
        out = {"full_attention": full}
        if "sliding_attention" in self.layer_kinds:
            out["sliding_attention"] = windowed if windowed is not None else full
        return out

    def _forward(self, input_ids, position_ids, mask, plan, keep, cache_position, media: dict | None = None):
        self.cache.plan, self.cache.seen = plan, set()
        kw = {"logits_to_keep": keep} if self._keep_arg else {}
        out = self.module(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                          past_key_values=self.cache, use_cache=True, cache_position=cache_position, **kw,
                          **(media or {}))
        if len(self.cache.seen) != self.n_layers:
            raise ValueError(f"{type(self.module).__name__} did not read its K/V through the cache in "
                             f"{self.n_layers - len(self.cache.seen)} of {self.n_layers} layers")
        if self.banned:
            out.logits[..., self.banned] = float("-inf")
        return out.logits

    # ---------------------------------------------------------------- passes
    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, max_position: int | None = None) -> torch.Tensor:
        """One token for each of rows 0..B-1 at the given positions; logits [B, V]."""
        self._check_weights()
        if max_position is None:
            max_position = int(positions.max())
        lk = max_position + 1
        keys = torch.arange(lk, device=self.device)
        rope = positions + self.delta[: len(positions)] if self.rope_3d else positions  # the cache index stays
        # masks [B, 1, 1, lk]; cache_position: one entry per input position (one here), the furthest row's
        logits = self._forward(tokens[:, None], rope[:, None], self._masks(positions[:, None, None, None], keys),
                               ("decode", positions, lk), 1, keys[-1:])
        return logits[:, -1].float()

    @torch.inference_mode()
    def prefill(self, rows: list[int], token_ids: list[list[int]], media: list | None = None) -> torch.Tensor:
        """Run full sequences into cache rows (positions 0..len-1); logits of each last token [N, V].
        Sequences are packed into passes of at most `max_prefill_tokens` tokens (one longer
        sequence is a pass alone); `media[i]`: sequence i's images (`Media`), a pass alone."""
        self._check_weights()
        media = media or [None] * len(rows)
        if any(m is not None for m in media) and not self.takes_media:
            raise ValueError(f"{type(self.module).__name__} takes no images")
        self.delta[rows] = 0
        out, batch, size = [], [], 0
        for row, toks, m in zip(rows, token_ids, media):
            if batch and (m is not None or size + len(toks) > self.max_prefill_tokens):
                out.append(self._prefill_packed(batch))
                batch, size = [], 0
            if m is not None:  # with its images, in one pass
                out.append(self._prefill_media(row, toks, m))
                continue
            if len(toks) > self.max_prefill_tokens:  # alone, in parts: masks of [part, row so far], not [T, T]
                out.append(self._prefill_chunked(row, toks))
                continue
            batch.append((row, toks))
            size += len(toks)
        if batch:
            out.append(self._prefill_packed(batch))
        return torch.cat(out)

    def _prefill_chunked(self, row: int, toks: list[int]) -> torch.Tensor:
        """One sequence longer than `max_prefill_tokens`, in parts of that size, each attending to
        the row's keys written so far; the logits of its last token [1, V]."""
        dev, step = self.device, self.max_prefill_tokens
        for start in range(0, len(toks), step):
            end = min(start + step, len(toks))
            pos = torch.arange(start, end, device=dev)
            ids = torch.tensor([toks[start:end]], dtype=torch.long, device=dev)
            logits = self._forward(ids, pos[None], self._masks(pos[:, None], torch.arange(end, device=dev)),
                                   ("chunk", row, start, end), 1, pos)
        return logits[:, -1].float()

    def _prefill_media(self, row: int, toks: list[int], media) -> torch.Tensor:
        """One sequence with its images (the model's forward puts them in at their placeholders);
        the logits of its last token [1, V]."""
        dev, n = self.device, len(toks)
        index = torch.arange(n, device=dev)
        pos = index[None]
        if self.rope_3d:
            rope, delta = rope_positions(self.module, self.config, toks, media)
            pos = rope[:, None].to(dev)
            self.delta[row] = delta
        ids = torch.tensor([toks], dtype=torch.long, device=dev)
        logits = self._forward(ids, pos, self._masks(index[:, None], index), ("prefill", [(row, 0, n)]),
                               1, index, media.to(dev, self.dtype))
        return logits[:, -1].float()

    def _prefill_packed(self, batch: list[tuple[int, list[int]]]) -> torch.Tensor:
        dev = self.device
        flat = [t for _, toks in batch for t in toks]
        segs, start = [], 0
        for row, toks in batch:
            segs.append((row, start, len(toks)))
            start += len(toks)
        T = len(flat)
        ids = torch.tensor([flat], dtype=torch.long, device=dev)
        pos = torch.cat([torch.arange(n, device=dev) for _, _, n in segs])[None]
        seg = torch.repeat_interleave(torch.arange(len(segs), device=dev), torch.tensor([n for *_, n in segs], device=dev))
        index = torch.arange(T, device=dev)  # within one sequence, packed distances are its own
        last = torch.tensor([s + n - 1 for _, s, n in segs], device=dev)
        keep = last if self._keep_arg else 0
        logits = self._forward(ids, pos, self._masks(index[:, None], index, seg[:, None] == seg[None, :]),
                               ("prefill", segs), keep, pos[0])
        logits = logits[0] if self._keep_arg else logits[0, last]
        return logits.float()

    def mixed(self, tokens: torch.Tensor, positions: torch.Tensor, rows: list[int],
              token_ids: list[list[int]], media: list | None = None) -> torch.Tensor:
        """Decode rows 0..B-1, then prefill new sequences into `rows`; logits [B + len(rows), V]."""
        return torch.cat([self.decode(tokens, positions), self.prefill(rows, token_ids, media)])



def sliding_window(config) -> int | None:
    """The window of the model's sliding-window layers, if it has any (Mistral's config window
    applies to every layer, whatever its `layer_types` say; Qwen2 / Qwen3 / Gemma name their
    sliding layers in `layer_types`)."""
    config = text_config(config)
    window = getattr(config, "sliding_window", None)
    kinds = _layer_kinds(config)
    if kinds:
        return window if "sliding_attention" in kinds else None
    return window if getattr(config, "use_sliding_window", True) else None


def _layer_kinds(config) -> list[str]:
    """The attention kind of each layer, for models that take one mask per kind; empty for one
    mask for every layer (Mistral carries `layer_types` but reads a single mask)."""
    if getattr(config, "model_type", None) == "mistral":
        return []
    return list(getattr(config, "layer_types", None) or ())


def fast_path(config, max_len: int | None = None) -> bool:
    """Whether `ModelRunner`'s hand-written forward serves this architecture (for sequences up to
    `max_len`: it has no sliding window, so a window shorter than that leaves it to the model's
    own forward). It computes SiLU MLPs without biases and attention whose only biases are
    q/k/v's (Qwen2's): a config that asks for more (`attention_bias`, which biases o_proj too,
    `mlp_bias`, another `hidden_act`) goes to the model's own forward, which has them."""
    archs = getattr(config, "architectures", None) or []
    known = any(a in SUPPORTED for a in archs) or getattr(config, "model_type", None) in ("llama", "mistral", "qwen2", "qwen3")
    window = sliding_window(config)
    return known and not unserved(config) and (window is None or (max_len is not None and window >= max_len))


def unserved(config) -> list[str]:
    """What of the config `ModelRunner`'s forward does not compute (empty: it serves it)."""
    out = [f"{k}=True" for k in ("attention_bias", "mlp_bias") if getattr(config, k, False)]
    act = getattr(config, "hidden_act", "silu")
    return out + ([f"hidden_act={act!r}"] if act not in ("silu", "swish") else [])
