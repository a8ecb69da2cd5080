"""A decode step's attention over 30 layers' caches, torch ops against the native kernel
(rollover.engine.decode_attention), K/V writes included; SmolLM2-135M's shapes by default.

    PYTHONPATH=src python benchmarks/decode_attention.py [--rows 64] [--context 60 116 170]

Each layer has its own cache (so the K/V come from memory, as in a real step); the figure is the
median of 9 passes over the 30 layers after one warm-up pass, torch and native alternating.
"""

import argparse
import statistics
import time

import torch

from rollover.engine.decode_attention import DecodeAttention
from rollover.engine.cpu.native import load


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--context", type=int, nargs="+", default=[60, 116, 170])
    a = p.parse_args()
    B, H, KV, D, max_len = a.rows, a.heads, a.kv_heads, a.head_dim, max(a.context) + 1
    caches = [(torch.randn(B, KV, max_len, D), torch.randn(B, KV, max_len, D)) for _ in range(a.layers)]
    qkv = torch.randn(B, (H + 2 * KV) * D)
    q = qkv[:, : H * D].unflatten(-1, (H, D))
    k = qkv[:, H * D : (H + KV) * D].unflatten(-1, (KV, D))
    v = qkv[:, (H + KV) * D :].unflatten(-1, (KV, D))
    impls = {"torch": DecodeAttention(H, KV, D, max_len, torch.float32, None),
             "native": DecodeAttention(H, KV, D, max_len, torch.float32, load())}
    for Lk in a.context:
        positions = torch.randint(max(Lk - 20, 0), Lk, (B,))
        positions[0] = Lk - 1
        times = {name: [] for name in impls}
        with torch.inference_mode():
            for rep in range(10):
                for name, att in impls.items():
                    setup = att.setup(positions)
                    t0 = time.perf_counter()
                    for kc, vc in caches:
                        att(kc, vc, q, k, v, setup)
                    if rep:
                        times[name].append(time.perf_counter() - t0)
        print(f"{B} rows, {Lk} cached tokens, {a.layers} layers: "
              + ", ".join(f"{n} {statistics.median(t) * 1e3:.1f} ms" for n, t in times.items()))


if __name__ == "__main__":
    main()
