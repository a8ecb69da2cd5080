"""A linear layer at decode sizes: MKL's plain GEMM, MKL's GEMM on weights packed for the batch
size, and the native packed GEMM (rollover.engine.cpu.native), in GFLOP/s; SmolLM2-135M's shapes by
default, each over 30 layers' own weights (so they stream from memory, as in a decode step).

    PYTHONPATH=src python benchmarks/decode_gemm.py [--rows 1 8 16 32 64 128 512] [--threads 2]

Each figure: the best of 3 bursts of 0.3 s over the 30 matrices, after one unmeasured pass.
"""

import argparse
import time

import torch
import torch.nn.functional as F

from rollover.engine.cpu.native import load

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}


def rate(f, layers: int, flops: float) -> float:
    for i in range(layers):
        f(i)
    best = 0.0
    for _ in range(3):
        t0, reps = time.perf_counter(), 0
        while time.perf_counter() - t0 < 0.3:
            for i in range(layers):
                f(i)
            reps += layers
        best = max(best, flops * reps / (time.perf_counter() - t0))
    return best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 512])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    native = load()
    mkl = torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    print(f"native GEMM: {native.gemm_vector_bits}-bit vectors, panels of {native.gemm_panel} columns; {a.threads} threads")
    print(f"{'shape':18s} {'rows':>5s} {'MKL plain':>10s} {'MKL packed':>11s} {'native':>8s}")
    for name in a.shapes:
        k, n = SHAPES[name]
        ws = [torch.randn(n, k) for _ in range(a.layers)]
        packs = [native.pack(w) for w in ws]
        for m in a.rows:
            x = torch.randn(m, k)
            flops = 2 * m * k * n
            plain = rate(lambda i: F.linear(x, ws[i]), a.layers, flops)
            packed = float("nan")
            if mkl and m > 1:
                mk = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in ws]
                packed = rate(lambda i: torch.ops.mkl._mkl_linear(x, mk[i], ws[i], None, m), a.layers, flops)
                del mk
            nat = rate(lambda i: native.linear(x, packs[i]), a.layers, flops)
            print(f"{name + f' {k}x{n}':18s} {m:5d} {plain:10.0f} {packed:11.0f} {nat:8.0f}")


if __name__ == "__main__":
    main()
