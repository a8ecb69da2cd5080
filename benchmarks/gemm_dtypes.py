"""fp32 vs bf16 `F.linear` rates (GFLOP/s) at the shapes TorchEngine's decode and the trainer
run for SmolLM2-135M, and the int8 weight kernel TorchEngine's `quantize="int8"` uses
(`torch._weight_int8pack_mm`, with bf16 and with fp32 activations): best of 5 bursts of 20
calls each (3 for the slow fp32-activation int8 path).

    python benchmarks/gemm_dtypes.py
"""

import time

import torch
import torch.nn.functional as F


def best_seconds(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def rate(m: int, k: int, n: int, dtype, reps: int = 20) -> float:
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    return 2 * m * k * n / best_seconds(lambda: F.linear(a, b), reps) / 1e9


def int8_rate(m: int, k: int, n: int, dtype, reps: int = 20) -> float:
    a, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k)
    scale = w.abs().amax(1) / 127
    rows = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    scale = scale.to(dtype)
    return 2 * m * k * n / best_seconds(lambda: torch._weight_int8pack_mm(a, rows, scale), reps) / 1e9


for shape in [(1, 576, 1536), (8, 576, 1536), (32, 576, 1728), (64, 576, 3072), (64, 1536, 576), (64, 576, 49152),
              (256, 576, 3072), (1500, 576, 3072)]:
    slow = 3 if shape[0] * shape[2] > 100_000 else 20
    print(shape, f"fp32 {rate(*shape, torch.float32):.0f}", f"bf16 {rate(*shape, torch.bfloat16):.0f}",
          f"int8 (bf16 act.) {int8_rate(*shape, torch.bfloat16):.0f}",
          f"int8 (fp32 act.) {int8_rate(*shape, torch.float32, slow):.1f} GFLOP/s", flush=True)
