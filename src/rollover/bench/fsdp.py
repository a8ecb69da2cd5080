"""`rollover bench fsdp`: the sharded trainer at several world sizes on this machine.

For each world size N (`--ranks 1 2 4`) the trainer's N rank processes (`train.parallel=fsdp`,
gloo on a CPU) train the same synthetic batch (8 groups x 4 samples, prompts of ~40 tokens,
responses of ~38, as `benchmarks/train_step.py`) for one unmeasured and `--steps` measured
steps, then one more with its collectives timed (FSDP's all-gathers and reduce-scatters made
synchronous, each call clocked: that step may run a little slower than the others). Reported
per world size: the measured steps' seconds (as the driver waits for them), and per rank the
bytes of weights, gradients and AdamW state it holds (against 1/N of world size 1's: FSDP's
promise), its resident high-water mark over all the steps, and the share of the timed step
spent inside collectives. Default model: a ~0.5B Llama with random weights
(`rollover bench memory`'s); the ranks split this machine's cores between them.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path


def synthetic_batch(seed: int = 0):
    from rollover.train.batch import TrainBatch
    from rollover.types import Rollout

    rng = random.Random(seed)
    rolls, adv = [], []
    for g in range(8):
        prompt = [rng.randrange(100, 40000) for _ in range(38 + g % 4)]
        for j in range(4):
            n = min(48, max(8, int(rng.gauss(38, 8))))
            rolls.append(Rollout(group_id=f"g{g}", prompt_ids=prompt, response_ids=[rng.randrange(100, 40000) for _ in range(n)],
                                 logprobs=[-1.0] * n, versions=[0] * n, loss_mask=[1] * n, finish="stop", reward=0.0))
            adv.append(float(j) - 1.5)
    return TrainBatch.from_rollouts(rolls, adv)


def measure(model_path: str, world: int, steps: int, overrides: list[str]) -> dict:
    from transformers import AutoModelForCausalLM

    from rollover.config import load_config
    from rollover.train.ranks import ShardedTrainer

    cfg = load_config(None, [f"model={model_path}", "device=cpu", "data.max_prompt_tokens=64", "rollout.max_new_tokens=48",
                             "train.parallel=fsdp", f"train.ranks={world}", *overrides])
    model = AutoModelForCausalLM.from_pretrained(model_path)
    batch = synthetic_batch()
    t0 = time.perf_counter()
    trainer = ShardedTrainer(model, cfg, pad_id=0)
    started = time.perf_counter() - t0
    del model
    trainer.architecture = trainer.model = None  # no engine here: the driver lets its copy go
    try:
        trainer.train_step(batch)  # unmeasured
        seconds = []
        for _ in range(steps):
            t0 = time.perf_counter()
            trainer.train_step(batch)
            seconds.append(time.perf_counter() - t0)
        trainer.train_step(batch, profile=True)
        ranks = trainer.stats()
    finally:
        trainer.close()
    for r in ranks:
        r["state_bytes"] = r["params"] + r["grads"] + r["optimizer"]
        r["collective_share"] = r["collective_s"] / r["step_s"]
    return {"world": world, "start_s": started, "step_s": seconds, "step_s_median": statistics.median(seconds),
            "ranks": ranks}


def main(args) -> dict:
    from rollover.bench.memory import make_half_b

    model = args.model or str(make_half_b(Path(args.half_b_dir)))
    out = {"model": model, "steps": args.steps, "overrides": list(args.set), "worlds": []}
    from rollover.train.ranks import RankLost

    for world in args.ranks:
        try:
            r = measure(model, world, args.steps, list(args.set))
        except RankLost as e:  # out of memory at this world size, say: the others still count
            out["failed"] = {**out.get("failed", {}), str(world): str(e).splitlines()[0]}
            print(f"  {world} ranks: {str(e).splitlines()[0]}", flush=True)
            continue
        out["worlds"].append(r)
        print(f"  {world} rank{'s' if world > 1 else ''}: step {r['step_s_median']:.2f} s", flush=True)
    one = next((w for w in out["worlds"] if w["world"] == 1), None)
    print(f"\nrollover bench fsdp — {model}, {args.steps} measured steps")
    print(f"  {'ranks':>5s} {'step s':>7s} {'state GB/rank':>14s} {'1/N of 1 rank':>14s} {'peak RSS GB/rank':>17s} "
          f"{'in collectives':>15s}")
    for w in out["worlds"]:
        state = max(r["state_bytes"] for r in w["ranks"]) / 1e9
        line = f"{one['ranks'][0]['state_bytes'] / w['world'] / 1e9:14.2f}" if one else f"{'—':>14s}"
        rss = max(r["peak_rss_gb"] or 0 for r in w["ranks"])
        share = statistics.fmean(r["collective_share"] for r in w["ranks"])
        print(f"  {w['world']:5d} {w['step_s_median']:7.2f} {state:14.2f} {line} {rss:17.2f} {share:14.0%}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


def add_arguments(p) -> None:
    import tempfile

    from rollover.bench import at_least

    p.add_argument("--ranks", type=at_least(1), nargs="+", default=[1, 2, 4], help="world sizes to measure")
    p.add_argument("--model", default=None, help="a model directory (default: the random ~0.5B model)")
    p.add_argument("--half-b-dir", default=str(Path(tempfile.gettempdir()) / "rollover-llama-0.5b"),
                   help="where the random ~0.5B model is saved (reused when present)")
    p.add_argument("--steps", type=at_least(1), default=2, help="measured steps per world size")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides (e.g. train.dtype=autocast_bf16)")
    p.add_argument("--json", default=None, help="write the results here")
