"""TorchEngine with and without packed weights (`pack_weights`), alternating: seconds to
generate N requests of 48 tokens (EOS ignored), SmolLM2-135M, fp32 CPU. The packs are the native
GEMM's where it runs (CPUs with 512-bit vectors), else MKL's (`ModelRunner.packing`).

    python benchmarks/pack_weights.py [--requests 32] [--rounds 3] [--repack]

`--repack` drops the packs before every round, as the synchronous loop's weight update does.
"""

from __future__ import annotations

import argparse
import time

from rollover.engine.torch_engine import TorchEngine
from rollover.models import load_hf_model
from rollover.types import Request, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repack", action="store_true")
    args = p.parse_args()
    model = load_hf_model("smollm2-135m-instruct")

    def reqs(tag: str) -> list[Request]:
        return [Request(id=f"{tag}{i}", prompt_ids=[1, 2, 3 + i // 4] * 13,
                        sampling=SamplingParams(max_new_tokens=48, seed=i, ignore_eos=True))
                for i in range(args.requests)]

    engines = {"packed": TorchEngine(model, max_rows=64, max_len=256),
               "plain": TorchEngine(model, max_rows=64, max_len=256, pack_weights=False)}
    try:
        for e in engines.values():
            e.generate(reqs("warm"))
        for r in range(args.rounds):
            for name, e in engines.items():
                if args.repack:
                    e._run_or_queue(e.core.runner.drop_packs, wait=True)
                t0 = time.perf_counter()
                e.generate(reqs(f"r{r}-"))
                print(f"{r} {name:7s} {time.perf_counter() - t0:6.2f} s", flush=True)
    finally:
        for e in engines.values():
            e.shutdown()


if __name__ == "__main__":
    main()
