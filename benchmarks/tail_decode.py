"""TorchEngine on a long-tailed batch: 64 prompts whose response lengths follow a log-normal
(median 64 tokens, log-sigma 1.0, at most 512; EOS ignored, so every run decodes the same
tokens), SmolLM2-135M-Instruct, fp32, 64 rows. The batch shrinks from 64 rows to a few over the
run, so every decode batch size is timed, as in a generation's tail (APRIL's and evaluation's
workloads); `rollover bench engine` runs 64 rows throughout.

    python benchmarks/tail_decode.py [--repeats 2]

Prints tokens/s per run and the mean; compare two trees by pointing PYTHONPATH at each.
"""

import argparse
import random
import time

import torch

from rollover.bench.engine import bench_prompts
from rollover.engine import TorchEngine
from rollover.models import load_hf_model, load_tokenizer
from rollover.types import Request, SamplingParams


def lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [max(1, min(512, round(64 * rng.lognormvariate(0.0, 1.0)))) for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    model = load_hf_model("smollm2-135m-instruct", dtype=torch.float32, device="cpu").eval()
    prompts = bench_prompts(load_tokenizer("smollm2-135m-instruct"), 64)
    budget = lengths(len(prompts))
    rates = []
    with TorchEngine(model, max_rows=64, max_len=max(map(len, prompts)) + 513, device="cpu") as engine:
        engine.generate([Request(id=f"w{i}", prompt_ids=q, sampling=SamplingParams(max_new_tokens=4))
                         for i, q in enumerate(prompts)])
        for rep in range(args.repeats):
            reqs = [Request(id=f"{rep}-{i}", prompt_ids=q,
                            sampling=SamplingParams(temperature=1.0, max_new_tokens=m, ignore_eos=True, seed=i))
                    for i, (q, m) in enumerate(zip(prompts, budget))]
            t0 = time.perf_counter()
            outs = engine.generate(reqs)
            dt = time.perf_counter() - t0
            rates.append(sum(len(o.response_ids) for o in outs) / dt)
            print(f"run {rep}: {sum(budget)} tokens in {dt:.2f} s, {rates[-1]:.1f} tokens/s", flush=True)
    print(f"mean {sum(rates) / len(rates):.1f} tokens/s")


if __name__ == "__main__":
    main()
