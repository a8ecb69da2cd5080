"""Host time of one `Sampler.sample` call: the part of a decode step that stays on the CPU
whatever the device (on the H200, a CUDA-graph decode step took 5 ms, most of it host work).

    PYTHONPATH=src python benchmarks/sampler_host.py [--rows 128] [--vocab 512] [--calls 300]

Rows are seeded (as in training), temperature 1; a small vocabulary keeps the arithmetic out of
the figure. Compare two trees by pointing PYTHONPATH at each, in turn.
"""

import argparse
import statistics
import time

import torch

from rollover.engine.sampler import Sampler
from rollover.types import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args()
    torch.set_num_threads(1)
    sampler = Sampler(torch.device("cpu"))
    logits = torch.randn(args.rows, args.vocab)
    params = [SamplingParams(max_new_tokens=10**6, ignore_eos=True, seed=i) for i in range(args.rows)]
    times = []
    for k in range(args.calls):
        t0 = time.perf_counter()
        sampler.sample(logits, params, [k] * args.rows)
        times.append(time.perf_counter() - t0)
    warm = times[args.calls // 6:]
    print(f"sample() of {args.rows} seeded rows, vocabulary {args.vocab}: median {statistics.median(warm) * 1e3:.3f} ms "
          f"(min {min(warm) * 1e3:.3f}, {len(warm)} calls after {args.calls - len(warm)} warm-up)")


if __name__ == "__main__":
    main()
