"""Time `Trainer.train_step` alone on a synthetic batch shaped like `rollover bench train`'s
(8 groups x 4 samples, prompts of 38-41 tokens, responses of ~38), SmolLM2-135M-Instruct.

    python benchmarks/train_step.py [--repeats 3] [--profile] [VARIANT ...]

A VARIANT is a comma-separated list of config overrides (`""` = the defaults), e.g.
`train.shared_prefix=false` or `train.dtype=autocast_bf16`, and `dense_embedding_grad` (torch's
own embedding backward instead of the trainer's row-wise one); variants alternate in one
process, each step timed after one unmeasured step, with the seconds its optimizer step took. `--profile` prints torch.profiler's table for one
step of the first variant instead.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from rollover.bench.fsdp import synthetic_batch  # the workload, shared with bench fsdp
from rollover.bench.train import WORKLOAD
from rollover.config import load_config
from rollover.models import load_hf_model
from rollover.train.trainer import Trainer


@contextlib.contextmanager
def rows_off(off: bool):
    """The trainer's row-wise embedding gradient off (torch's dense one) while `off`."""
    from rollover.train import trainer

    real = trainer.row_grad_applies
    if off:
        trainer.row_grad_applies = lambda embedding: False
    try:
        yield
    finally:
        trainer.row_grad_applies = real


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="*", default=[""])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    batch, model = synthetic_batch(), load_hf_model("smollm2-135m-instruct")
    trainers, dense = {}, {}
    for v in args.variants:
        opts = [o for o in v.split(",") if o]
        dense[v] = "dense_embedding_grad" in opts
        cfg = load_config(None, ["model=smollm2-135m-instruct", "run_dir=/tmp/rollover-train-step", *WORKLOAD,
                                 *[o for o in opts if o != "dense_embedding_grad"]])
        trainers[v] = Trainer(model, cfg, device=torch.device("cpu"))
        with rows_off(dense[v]):
            trainers[v].train_step(batch)  # unmeasured
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainers[args.variants[0]].train_step(batch)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        return
    optimizer_s = {v: time_optimizer(tr) for v, tr in trainers.items()}
    for rep in range(args.repeats):
        for v, tr in trainers.items():
            t0 = time.perf_counter()
            with rows_off(dense[v]):
                m = tr.train_step(batch)
            print(f"{rep} {v or 'defaults':40s} {time.perf_counter() - t0:6.2f} s  micro-batches "
                  f"{m['actor/micro_batches']:.0f}  optimizer step {sum(optimizer_s[v]):.2f} s", flush=True)
            optimizer_s[v].clear()


def time_optimizer(trainer) -> list[float]:
    """Seconds of each `optimizer.step()` the trainer makes from now on (appended to the list)."""
    import warnings

    warnings.filterwarnings("ignore", message=".*optimizer.step.*has been overridden")  # the scheduler's notice
    spent, step = [], trainer.optimizer.step

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return step(*a, **k)
        finally:
            spent.append(time.perf_counter() - t0)

    trainer.optimizer.step = timed
    return spent


if __name__ == "__main__":
    main()
