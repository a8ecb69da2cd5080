"""TorchEngine's model runner prefilling prompts of mixed lengths, packed against padded to the
longest (`PACK_PREFILL_ABOVE` forced either way), alternating: seconds per prefill.

    PYTHONPATH=src python benchmarks/prefill_packed.py [--prompts 32] [--rounds 3]

SmolLM2-135M, fp32, prompt lengths 40 + uniform 0..256 (seed 0): APRIL's resumed prefixes, a
prompt plus any part of a response.
"""

from __future__ import annotations

import argparse
import random
import time

from rollover.engine import prefill as prefill_module
from rollover.engine.model_runner import ModelRunner
from rollover.models import load_hf_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    m = load_hf_model("smollm2-135m-instruct")
    runner = ModelRunner(m.config, m.state_dict(), max_rows=args.prompts, max_len=320)
    rng = random.Random(0)
    lens = [40 + rng.randint(0, 256) for _ in range(args.prompts)]
    toks = [[1 + (i * 7 + j) % 4000 for j in range(n)] for i, n in enumerate(lens)]
    print(f"{sum(lens)} tokens, {len(lens) * max(lens)} padded")

    def timed() -> float:
        t0 = time.perf_counter()
        runner.prefill(list(range(args.prompts)), toks)
        return time.perf_counter() - t0

    timed(), timed()  # one-time costs
    for r in range(args.rounds):
        for name, above in (("padded", 1e9), ("packed", 1.1)):
            prefill_module.PACK_PREFILL_ABOVE = above
            print(f"{r} {name}: {timed():.3f} s, {timed():.3f} s", flush=True)


if __name__ == "__main__":
    main()
