"""One TorchEngine decode step per batch size, on the plain GEMM and on each MKL weight pack that
could take it (SmolLM2-135M-Instruct, fp32, 64 rows, 60 cached tokens a row); plus the packed
GEMM's rate with its weights streamed from memory against the same matrix again from cache,
memory read bandwidth, and the sampler's row maximum by `max` against `amax`. The figures behind
the pack ladder in `rollover.engine.cpu.weight_packs` (docs/benchmarks.md, "Packed weights on a
ladder of batch sizes").

    PYTHONPATH=src python benchmarks/pack_rungs.py

Each cell: the mean of 6 steps after 2 unmeasured ones, ms.
"""

import time

import torch
import torch.nn.functional as F

from rollover.engine.model_runner import ModelRunner
from rollover.models import load_hf_model

ROWS = (1, 3, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64)
PACKS = (8, 16, 24, 32, 48, 64)


def step_ms(runner: ModelRunner, n: int, pack: int | None, reps: int = 6) -> float:
    tokens, positions = torch.randint(0, runner.vocab_size, (n,)), torch.full((n,), 60)

    def step():
        if pack is None:
            return runner._decode(tokens, positions)
        runner._pack_for = pack
        try:
            return runner._decode(F.pad(tokens, (0, pack - n)), F.pad(positions, (0, pack - n)))
        finally:
            runner._pack_for = None

    with torch.inference_mode():
        for _ in range(2):
            step()
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
    return (time.perf_counter() - t0) / reps * 1e3


def gemm_rates() -> None:
    ws = [torch.randn(1536, 576) for _ in range(200)]  # 700 MB: more than any cache
    x = torch.randn(64, 576)
    packs = [torch.ops.mkl._mkl_reorder_linear_weight(w, 64) for w in ws]
    flop = 2 * 64 * 576 * 1536

    def rate(pairs) -> float:
        for p, w in pairs:
            torch.ops.mkl._mkl_linear(x, p, w, None, 64)
        t0 = time.perf_counter()
        for p, w in pairs:
            torch.ops.mkl._mkl_linear(x, p, w, None, 64)
        return len(pairs) * flop / (time.perf_counter() - t0) / 1e9

    print(f"packed GEMM 64x576x1536: {rate(list(zip(packs, ws))):.0f} GFLOP/s streamed, "
          f"{rate([(packs[0], ws[0])] * 200):.0f} from cache")
    a = torch.randn(135_000_000)
    a.sum()
    t0 = time.perf_counter()
    a.sum()
    print(f"memory read: {a.numel() * 4 / (time.perf_counter() - t0) / 1e9:.1f} GB/s")
    z = torch.randn(64, 49152)
    for name, fn in (("max", lambda: z.max(-1, keepdim=True).values), ("amax", lambda: z.amax(-1, keepdim=True))):
        fn()
        t0 = time.perf_counter()
        for _ in range(100):
            fn()
        print(f"row maximum of 64 x 49,152 by {name}: {(time.perf_counter() - t0) * 10:.2f} ms")


def main() -> None:
    model = load_hf_model("smollm2-135m-instruct", dtype=torch.float32, device="cpu").eval()
    # MKL's ladder (the native GEMM, where it runs, needs no ladder: docs/benchmarks.md)
    runner = ModelRunner(model.config, model.state_dict(), max_rows=64, max_len=160, native_kernels=False)
    cells = {n: {"plain": step_ms(runner, n, None)} for n in ROWS}
    for m in PACKS:
        runner.drop_packs()
        runner.packs.ensure(m, runner._matrices())
        for n in ROWS:
            if n <= m:
                cells[n][m] = step_ms(runner, n, m)
    print("rows  " + "  ".join(f"{c:>6}" for c in ("plain", *PACKS)))
    for n in ROWS:
        print(f"{n:4d}  " + "  ".join(f"{cells[n][c]:6.1f}" if c in cells[n] else " " * 6 for c in ("plain", *PACKS)))
    gemm_rates()


if __name__ == "__main__":
    main()
