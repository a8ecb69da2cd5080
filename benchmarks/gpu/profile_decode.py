"""Where a decode step's time goes on a GPU: TorchEngine (bf16, CUDA graphs) decoding N rows of
the 135M model under torch.profiler, started and stopped on the engine's thread (where its steps
run); prints the host and device time of the top operations and the wall time per step, and
writes the tables to OUT.

    python benchmarks/gpu/profile_decode.py [--rows 128] [--new-tokens 96] [--out FILE]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from rollover.engine.torch_engine import TorchEngine
from rollover.models import load_hf_model
from rollover.types import Request, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    model = load_hf_model(args.model)
    cuda = args.device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def reqs(tag: str) -> list[Request]:
        return [Request(id=f"{tag}{i}", prompt_ids=[1, 2, 3 + i % 50] * 14,
                        sampling=SamplingParams(max_new_tokens=args.new_tokens, seed=i, ignore_eos=True))
                for i in range(args.rows)]

    with TorchEngine(model, device=args.device, dtype=torch.bfloat16, max_rows=args.rows, max_len=256,
                     eos_token_ids=[]) as eng:
        eng.generate(reqs("warm"))  # records the graphs of every bucket this run meets
        sync()
        t0 = time.perf_counter()
        eng.generate(reqs("plain"))
        sync()
        plain = time.perf_counter() - t0
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        prof = profile(activities=activities)
        eng._run_or_queue(prof.__enter__, wait=True)  # the engine's steps run on its own thread
        eng.generate(reqs("prof"))
        eng._run_or_queue(lambda: (sync(), prof.__exit__(None, None, None)), wait=True)
    steps = args.new_tokens
    lines = [f"rows {args.rows}, {steps} tokens each: {plain:.3f} s unprofiled, {1e3 * plain / steps:.2f} ms per step, "
             f"{args.rows * steps / plain:,.0f} tokens/s",
             prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25),
             prof.key_averages().table(sort_by="self_device_time_total" if cuda else "cpu_time_total", row_limit=15)]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
