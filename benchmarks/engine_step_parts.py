"""Where a TorchEngine decode step's time goes with the native kernels: each kernel timed from
Python (the GEMM by weight shape, with its GFLOP/s), against the whole `EngineCore.step`, on the
main thread. SmolLM2-135M-Instruct, fp32, 64 chat prompts decoding together (`rollover bench
engine`'s workload).

    PYTHONPATH=src python benchmarks/engine_step_parts.py [--rows 64] [--warm 60] [--steps 10]

Figures: ms per step, the mean over `--steps` steps after `--warm` unmeasured ones (by then each
row holds about 30 prompt tokens plus `--warm` generated ones).
"""

import argparse
import collections
import time

import torch

from rollover.bench.engine import bench_prompts
from rollover.engine.core import EngineCore
from rollover.engine.model_runner import ModelRunner
from rollover.models import load_hf_model, load_tokenizer
from rollover.types import Request, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--warm", type=int, default=60)
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    model, tok = load_hf_model("smollm2-135m-instruct"), load_tokenizer("smollm2-135m-instruct")
    prompts = bench_prompts(tok, a.rows)
    runner = ModelRunner(model.config, model.state_dict(), max_rows=a.rows, max_len=max(map(len, prompts)) + a.warm + a.steps + 2)
    if runner.kernels is None:
        raise SystemExit("the native kernels did not build here (the log says why)")
    core = EngineCore(runner, eos_token_ids=(), seed=0)
    for i, ids in enumerate(prompts):
        sp = SamplingParams(temperature=1.0, max_new_tokens=a.warm + a.steps + 1, ignore_eos=True, seed=i)
        core.add(Request(id=str(i), prompt_ids=ids, sampling=sp))
    seconds, flops = collections.defaultdict(float), collections.defaultdict(float)
    kernels = runner.kernels

    def timed(name, fn, flop=None):
        def call(*args, **kw):
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            key = name(*args) if callable(name) else name
            seconds[key] += time.perf_counter() - t0
            if flop:
                flops[key] += flop(*args)
            return out
        return call

    kernels.linear = timed(lambda x, w, *_: f"gemm [{w.k} -> {w.n}]", kernels.linear, lambda x, w, *_: 2 * x.shape[0] * w.n * w.k)
    for name in ("attention", "add_rms_norm", "silu_mul", "sample"):
        setattr(kernels, name, timed(name, getattr(kernels, name)))
    with torch.inference_mode():
        for _ in range(a.warm + 1):  # the first step prefills
            core.step()
        seconds.clear()
        flops.clear()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            core.step()
        step = (time.perf_counter() - t0) / a.steps
    print(f"packing: {runner.packing}; {a.rows} rows; engine step {step * 1e3:.1f} ms")
    for key, s in sorted(seconds.items()):
        rate = f"  {flops[key] / s / 1e9:.0f} GFLOP/s" if key in flops else ""
        print(f"  {key:24s} {s / a.steps * 1e3:7.2f} ms{rate}")
    print(f"  {'outside the kernels':24s} {(step - sum(seconds.values()) / a.steps) * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
