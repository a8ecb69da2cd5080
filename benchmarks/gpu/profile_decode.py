"""Where a decode step's time goes on a GPU: TorchEngine's core (bf16, CUDA graphs) decoding N
rows of the 135M model under torch.profiler; prints the host and device time of the top
operations and the wall time per step, and writes the tables to OUT.

    python benchmarks/gpu/profile_decode.py [--rows 128] [--new-tokens 96] [--admit] [--profile-steps 48] [--out FILE]

The model runner and engine core run on this script's own thread, not behind TorchEngine's
engine thread: the profiler's CUDA side must start on the thread that registered it (an H100
run of a version that started it on the engine thread returned no table). `--admit` feeds
requests in as rows free up, with twice as many requests as rows, so that steps admit beside
the graphed decode as under APRIL; `--admit-batch` sets `EngineCore`'s admit_batch there; `--resumed` gives each request part of
its response already (APRIL `resubmit`'s resumed prefixes, of mixed lengths).
The unprofiled timing is printed first (alone with `--profile-steps 0`); the profiler sees only the first `--profile-steps` steps of
a third run (an H100 lease that profiled whole runs of 256 requests spent its 50 s limit in the
profiler's tables and printed nothing).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from rollover.engine.core import EngineCore
from rollover.engine.model_runner import ModelRunner
from rollover.models import load_hf_model
from rollover.types import Request, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--admit", action="store_true", help="2 x rows requests of mixed lengths")
    p.add_argument("--admit-batch", type=int, default=None)
    p.add_argument("--resumed", action="store_true",
                   help="with --admit: each request carries part of its response, as APRIL's resubmit does")
    p.add_argument("--profile-steps", type=int, default=48)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    model = load_hf_model(args.model)
    runner = ModelRunner(model.config, model.state_dict(), max_rows=args.rows, max_len=256, device=args.device,
                         dtype=torch.bfloat16, cuda_graphs=cuda)
    core = EngineCore(runner, eos_token_ids=(), admit_batch=args.admit_batch)
    n = 2 * args.rows if args.admit else args.rows

    def run(tag: str, limit: int | None = None) -> tuple[float, int, int, int]:
        for i in range(n):  # with --admit, budgets from a quarter of new_tokens up to all of it
            budget = args.new_tokens if not args.admit else args.new_tokens // 4 + (i * 37) % max(1, 3 * args.new_tokens // 4)
            carried = (i * 53) % budget if args.resumed else 0  # mixed lengths: the prefill packs them
            core.add(Request(id=f"{tag}{i}", prompt_ids=[1, 2, 3 + i % 50] * 14,
                             sampling=SamplingParams(max_new_tokens=budget, seed=i, ignore_eos=True),
                             response_ids=[5 + (i + j) % 90 for j in range(carried)],
                             response_logprobs=[-1.0] * carried, response_versions=[0] * carried))
        steps0, admits0, prefilled0 = core.stats.decode_steps, core.stats.admission_steps, core.stats.prefill_tokens
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        while core.has_work() and (limit is None or core.stats.decode_steps - steps0 < limit):
            core.step()
        if cuda:
            torch.cuda.synchronize()
        s = core.stats
        return time.perf_counter() - t0, s.decode_steps - steps0, s.admission_steps - admits0, s.prefill_tokens - prefilled0

    run("warm")  # records the graphs of every bucket this run meets
    seconds, steps, admits, prefilled = run("plain")
    head = (f"rows {args.rows}, {n} requests{' (admitting as rows free)' if args.admit else ''}, admit_batch "
            f"{core.admit_batch}: {seconds:.3f} s unprofiled, {steps} decode steps, {1e3 * seconds / max(1, steps):.2f} ms "
            f"per step, {admits} of them admitting, {prefilled} tokens prefilled")
    print(head, flush=True)
    write(args.out, head)
    if args.profile_steps == 0:  # the timing alone
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        seconds, steps, admits, _ = run("prof", limit=args.profile_steps)
    while core.has_work():
        core.step()
    text = "\n".join([head, f"profiled: the first {steps} steps of another run ({admits} admitting, {seconds:.3f} s)",
                      prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25),
                      prof.key_averages().table(sort_by="self_device_time_total" if cuda else "cpu_time_total",
                                                row_limit=15)])
    print(text)
    write(args.out, text)


def write(path: str | None, text: str) -> None:
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
