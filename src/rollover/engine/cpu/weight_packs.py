"""MKL-packed copies of the weight matrices for TorchEngine's decode steps on a CPU.

MKL's fp32 GEMM repacks the weight matrix on every call, which at decode batch sizes costs as
much as the multiply. On CPUs with MKL the runner packs the weights for a decode batch size and
pads a decode batch up to the pack's size (the padding rows are free rows, whose cache entries
are overwritten before use). A pack serves one size best, so there is a ladder of them,
`max_rows` times 1, 3/4, 1/2, 3/8, 1/4 and 1/8, and a batch uses the smallest that takes it (its
snug pack). Measured on the 2-core Intel host, SmolLM2-135M, one decode step: 64 rows 104 ms
packed against 126 plain; 48 rows 86 ms on the 48-row pack against 100 plain and 105 padded to
64; 24 rows 60 against 73; 8 rows 42 against 63. One to three rows stay plain: MKL multiplies
them at the weights' streaming speed (28-33 ms), which no pack beats. A pack takes about 0.8
times the weights' memory for SmolLM2-135M and 0.13-0.15 s to build, so only one is held: it is
built at the first decode step that needs it after a weight update or `ModelRunner.drop_packs()`
(the synchronous loop drops it while it trains, when the engine is idle). A batch is padded up
to a pack only where that beats the plain GEMM by the figures above: fewer than a third more
rows, or than 8 (so a batch further below the lowest rung of a large `max_rows` runs plain).
When the batch size moves to another rung, the held pack stays in use for `PACK_SWITCH_STEPS`
steps (padded up to where that pays, else plain) and is replaced by the snug one only if the
batch has stayed there, so sizes that hover around a rung's edge do not rebuild a pack every
step. Prefill uses the plain GEMM.
"""

from __future__ import annotations

import torch

from rollover.train.memory import release as release_heap

PACK_SWITCH_STEPS = 8  # steps a batch of another rung uses the held pack (or plain) before the snug one replaces it
PACK_RUNGS = (1, 3 / 4, 1 / 2, 3 / 8, 1 / 4, 1 / 8)  # pack sizes as fractions of max_rows (module docstring)
PLAIN_ROWS_AT_MOST = 3  # batches this small multiply plainly (MKL's matrix-vector speed)


def _pads_well(n: int, m: int) -> bool:
    """Whether a batch of n rows runs faster padded to an m-row pack than plainly: fewer than a
    third more rows, or than 8 (small batches' plain GEMM is the slow one); measured, module
    docstring (48 rows: 104.6 ms padded to 64, 100.3 plain)."""
    return m < max(4 * n / 3, n + 8)


class WeightPacks:
    """The packs a `ModelRunner` decodes with: the ladder of sizes, the one pack held, and the
    rule that picks a batch's pack. `max_rows` 0: no packs (every batch plain)."""

    def __init__(self, max_rows: int):
        self.sizes = sorted({int(max_rows * f) for f in PACK_RUNGS} - set(range(PLAIN_ROWS_AT_MOST + 1)))
        self.held: dict[int, dict[int, torch.Tensor]] = {}  # batch size -> {id(matrix): its pack}, one size at most
        self._off_held = 0  # consecutive decode steps whose snug pack was not the held one

    def drop(self) -> None:
        """Free the held pack (stale after a weight update) until a step needs one."""
        self.held = {}

    def size_for(self, n: int) -> int | None:
        """The pack a decode batch of `n` rows runs on (None: the plain GEMM). One pack is held at
        a time; while batches fall on another rung, the held pack serves for PACK_SWITCH_STEPS
        steps (padded up to where that pays, `_pads_well`, else plain), then the snug one replaces
        it."""
        if n <= PLAIN_ROWS_AT_MOST:
            return None  # the held pack, if any, is kept for the batches after
        snug = next((m for m in self.sizes if n <= m), None)
        if snug is not None and not _pads_well(n, snug):
            snug = None  # below the lowest rung of a large max_rows: plain
        held = next(iter(self.held), None)
        if snug is None or held is None or held == snug:
            self._off_held = 0
            return snug
        self._off_held += 1
        if self._off_held < PACK_SWITCH_STEPS:
            return held if n <= held and _pads_well(n, held) else None
        self._off_held = 0
        self.drop()
        release_heap()  # the old pack's pages go back before the new one is built: one pack's memory at a time
        return snug

    def ensure(self, m: int, matrices: list[torch.Tensor]) -> None:
        """The pack of `matrices` for decode batches of `m` rows, built the first time one is
        needed (only the sizes a workload uses take memory)."""
        if m not in self.held:
            self.held[m] = {id(w): torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in matrices}
