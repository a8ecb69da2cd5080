"""Host time of TorchEngine's decode step: the part that stays on the CPU whatever the device
(on the H200, a CUDA-graph decode step of 128 rows took 5 ms, the GPU's own work a fraction).

    PYTHONPATH=src python benchmarks/engine_host.py [--rows 128] [--vocab 512] [--steps 500] [--threads 1] [--native]

Two figures, medians after a warm-up: one `Sampler.sample` call, and one whole `EngineCore.step`
over a stub runner whose forward passes cost nothing (the logits are there at once), so what is
left is sampling, bookkeeping and the tensors the step builds. Rows are seeded (as in
training), temperature 1; a small vocabulary keeps arithmetic out of the figures. Compare two
trees by pointing PYTHONPATH at each, in turn.
"""

import argparse
import statistics
import time

import torch

from rollover.engine.core import EngineCore
from rollover.engine.sampler import Sampler
from rollover.types import Request, SamplingParams


class StubRunner:
    """A runner whose kernels take no time."""

    device = torch.device("cpu")
    separate_admission = False
    kernels = None

    def __init__(self, rows: int, vocab: int):
        self.max_rows, self.max_len, self.vocab_size = rows, 1 << 20, vocab
        self.logits = torch.randn(2 * rows, vocab)

    def decode(self, tokens, positions, max_position=None):
        return self.logits[: tokens.shape[0]]

    def prefill(self, rows, token_ids):
        return self.logits[: len(rows)]

    def mixed(self, tokens, positions, rows, token_ids):
        return self.logits[: tokens.shape[0] + len(rows)]

    def copy_prefix(self, src, dst, length):
        pass

    def move_row(self, src, dst, length):
        pass


def median_ms(times: list[float]) -> float:
    return statistics.median(times[len(times) // 6:]) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--native", action="store_true", help="sample with the native kernels (rollover.engine.cpu.native)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kernels = None
    if args.native:
        from rollover.engine.cpu.native import load

        kernels = StubRunner.kernels = load()
    sampler = Sampler(torch.device("cpu"), kernels=kernels)
    logits = torch.randn(args.rows, args.vocab)
    params = [SamplingParams(max_new_tokens=10**6, ignore_eos=True, seed=i) for i in range(args.rows)]
    sample = []
    for k in range(args.steps):
        t0 = time.perf_counter()
        sampler.sample(logits, params, [k] * args.rows)
        sample.append(time.perf_counter() - t0)
    core = EngineCore(StubRunner(args.rows, args.vocab), eos_token_ids=(), seed=0)
    for i, sp in enumerate(params):
        core.add(Request(id=f"r{i}", prompt_ids=list(range(3, 40)), sampling=sp))
    core.step()  # admission
    step = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        core.step()
        step.append(time.perf_counter() - t0)
    print(f"{args.rows} seeded rows, vocabulary {args.vocab}, {args.threads} threads{', native' if args.native else ''}: sample() {median_ms(sample):.3f} ms, "
          f"decode step on a stub runner {median_ms(step):.3f} ms (medians)")


if __name__ == "__main__":
    main()
