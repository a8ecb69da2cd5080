"""CUDA-graph decode for `ModelRunner` (`cuda_graphs=True`, the default on CUDA).

On a GPU a small model's decode step is bound by kernel launches, not arithmetic: a 30-layer
model issues several hundred small kernels per token. `DecodeGraphs` records each decode step
shape once as a CUDA graph and replays it. Shapes come in buckets: the batch is padded up to a
power of two (at most `max_rows`; the padding rows are free rows, written at position 0 and
rewritten before use, as for the CPU's packs) and the attended length up to a power of two
from 64 (at most `max_len`; the extra keys are masked, so they weigh exactly 0). A bucket's
first step runs eagerly on a side stream, then is captured; later steps of that bucket replay
it. Every graph writes its logits into one shared buffer and shares one memory pool, so the
graphs cost little memory beyond the cache. Weight updates copy in place and keep the graphs
valid; the runner's `drop_cache` drops them. If a capture fails, the step's eager result
stands and the runner decodes eagerly from then on (logged).

With `compile_decode` the graphs record the runner's compiled step instead (inductor's fused
kernels: RMSNorm, rotary and SiLU-and-multiply each become one kernel instead of several, so a
step launches fewer, larger kernels). A bucket's first step, run outside the capture, compiles
it for the bucket's shape where the compiled graph does not cover it yet and tunes its kernels,
so nothing compiles or benchmarks while a graph records.

A step that admits new sequences while others decode runs the decode through its graph and the
prefill eagerly after it (the runner's `separate_admission`): with APRIL's steady refills most
steps admit something (measured on an H200 before that split: APRIL's decode time 2.6x sync's,
its steps almost all eager; on an H100 with the split, APRIL `keep_kv` still at 0.87x sync,
about 33 ms per 256-row step). So `EngineCore` batches such admissions (`admit_batch`, by
default max_rows / 8 where admission is separate): on an H100 that took APRIL `keep_kv` to
1.61-1.67x sync (docs/benchmarks.md, "APRIL on a GPU").
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def bucket(n: int, start: int, cap: int) -> int:
    """The smallest start * 2**k that is at least n, at most cap."""
    b = start
    while b < n:
        b *= 2
    return min(b, cap)


class DecodeGraphs:
    """The recorded decode steps of one runner, by (rows, attended length)."""

    def __init__(self, runner):
        self.runner = runner
        self.entries: dict[tuple[int, int], tuple] = {}  # (rows, attended length) -> (graph, tokens, positions)
        self.pool = None
        self.logits: torch.Tensor | None = None  # [max_rows, vocab] float32, written by every graph
        self.side: torch.cuda.Stream | None = None  # where a bucket's first step runs before its capture

    def drop(self) -> None:
        """Forget every graph (the cache they address is going)."""
        self.entries, self.pool, self.logits = {}, None, None

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, max_position: int) -> torch.Tensor:
        """The runner's `_decode` through the graph of the step's bucket; logits [n, V]."""
        r, n = self.runner, tokens.shape[0]
        # a compiled step specialises a batch of one (a second compile): its smallest bucket is two rows
        B = bucket(n, 2 if r.compiled is not None and r.max_rows > 1 else 1, r.max_rows)
        # the triton attention reads each row's length from its position: one graph serves every length
        Lk = r.max_len if r.attention.impl == "triton" else bucket(max_position + 1, 64, r.max_len)
        entry = self.entries.get((B, Lk))
        if entry is None:
            return self._capture(B, Lk, tokens, positions)
        graph, tok_buf, pos_buf = entry
        tok_buf[:n].copy_(tokens)
        tok_buf[n:].zero_()
        pos_buf[:n].copy_(positions)
        pos_buf[n:].zero_()
        graph.replay()
        return self.logits[:n].clone()

    def _capture(self, B: int, Lk: int, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run this step eagerly at the bucket's shape (on a side stream, which also warms the
        kernels up), then record the bucket's graph. Returns the step's logits [n, V]."""
        r, n = self.runner, tokens.shape[0]
        _ = r.k_cache, r.v_cache  # allocated before capture: the graph addresses them
        if self.logits is None:
            self.logits = torch.empty((r.max_rows, r.vocab_size), dtype=torch.float32, device=r.device)
        tok_buf = F.pad(tokens, (0, B - n))
        pos_buf = F.pad(positions, (0, B - n))
        if self.side is None:
            self.side = torch.cuda.Stream(r.device)
        self.side.wait_stream(torch.cuda.current_stream(r.device))
        step = r.compiled or r._decode
        with torch.cuda.stream(self.side):
            out = step(tok_buf, pos_buf, Lk)[:n].clone()
        torch.cuda.current_stream(r.device).wait_stream(self.side)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: another thread (an async trainer) may use the GPU while this one captures
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self.logits[:B].copy_(step(tok_buf, pos_buf, Lk))
        except RuntimeError as e:  # the step's result stands; later steps run eagerly
            log.warning("TorchEngine: CUDA graph capture failed (%s); decoding without CUDA graphs", e)
            r.cuda_graphs = r.separate_admission = False  # eager decode: admit in the fused pass again
            return out
        self.pool = graph.pool()
        self.entries[(B, Lk)] = (graph, tok_buf, pos_buf)
        return out
