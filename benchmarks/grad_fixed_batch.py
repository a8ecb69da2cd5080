"""The gradient one GRPO update computes for a fixed batch, saved to compare two versions of the
code: SmolLM2-135M with examples/arith.yaml's settings, 8 groups x 4 samples of random tokens
(36-token prompts, 5-47-token responses, seed 0).

    PYTHONPATH=src python benchmarks/grad_fixed_batch.py new.pt            # this checkout
    PYTHONPATH=/path/to/other/src python benchmarks/grad_fixed_batch.py old.pt
    python benchmarks/grad_fixed_batch.py --compare new.pt old.pt         # worst relative differences
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch


def gradient(out: str) -> None:
    from rollover.config import load_config
    from rollover.models import load_hf_model
    from rollover.train.batch import TrainBatch
    from rollover.train.trainer import Trainer
    from rollover.types import Rollout

    torch.manual_seed(0)
    example = Path(__file__).resolve().parent.parent / "examples" / "arith.yaml"
    cfg = load_config(str(example), ["run_dir=/tmp/grad_fixed_batch", "logging.progress=false"])
    model = load_hf_model(cfg.model)
    trainer = Trainer(model, cfg, device=torch.device("cpu"))
    rng = random.Random(0)
    rolls, advs = [], []
    for g in range(8):
        prompt = [rng.randrange(100, 40000) for _ in range(36)]
        for j in range(4):
            n = rng.randrange(5, 48)
            rolls.append(Rollout(group_id=f"g{g}", prompt_ids=prompt, response_ids=[rng.randrange(100, 40000) for _ in range(n)],
                                 logprobs=[-3.0] * n, versions=[0] * n, loss_mask=[1] * n, finish="stop", reward=float(j % 2)))
            advs.append(float(j % 2) - 0.5)
    seen, step = {}, trainer.optimizer.step

    def record(*a, **kw):  # the accumulated gradient the optimizer sees
        seen.update({k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None})
        return step(*a, **kw)

    trainer.optimizer.step = record
    m = trainer.train_step(TrainBatch.from_rollouts(rolls, advs))
    print({k: v for k, v in m.items() if "loss" in k or "grad_norm" in k})
    torch.save(seen, out)


def compare(a_path: str, b_path: str) -> None:
    a, b = torch.load(a_path), torch.load(b_path)
    if a.keys() != b.keys():
        sys.exit(f"different parameters: {sorted(set(a) ^ set(b))}")
    worst = sorted(((float((a[k] - b[k]).norm() / (b[k].norm() + 1e-30)), k) for k in a), reverse=True)
    for rel, k in worst[:5]:
        print(f"{rel:.3g}  {k}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compare"]:
        compare(sys.argv[2], sys.argv[3])
    else:
        gradient(sys.argv[1])
