"""fp32 vs bf16 `F.linear` rates (GFLOP/s) at the shapes TorchEngine's decode and the trainer
run for SmolLM2-135M: best of 5 bursts of 20 calls each.

    python benchmarks/gemm_dtypes.py
"""

import time

import torch
import torch.nn.functional as F


def rate(m: int, k: int, n: int, dtype, reps: int = 20) -> float:
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    for _ in range(3):
        F.linear(a, b)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            F.linear(a, b)
        best = min(best, (time.perf_counter() - t0) / reps)
    return 2 * m * k * n / best / 1e9


for shape in [(32, 576, 1728), (64, 576, 3072), (64, 1536, 576), (64, 576, 49152), (256, 576, 3072), (1500, 576, 3072)]:
    print(shape, f"fp32 {rate(*shape, torch.float32):.0f}", f"bf16 {rate(*shape, torch.bfloat16):.0f} GFLOP/s")
