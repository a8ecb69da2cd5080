"""`rollover filter`: the training prompts' pass rates under a model, and the rows whose rate
lies in a range, written as a dataset to train on.

Before RL, practitioners drop the prompts a model always or never solves (DAPO, Polaris,
Skywork-OR1): under GRPO a group whose samples all score alike has no advantage and trains
nothing, so such prompts cost generation and teach nothing. `rollover filter CONFIG --samples 8
--keep 0.05:0.95 --out kept.jsonl` samples each training prompt of CONFIG `samples` times with
its model (or `--checkpoint DIR`), at `rollout.temperature` and `rollout.max_new_tokens`, scores
the samples as training would, and writes every prompt whose pass rate (the share of samples
the first reward function scores at least `reward.correct_threshold`; an episode's reward for
an environment) lies in the range, inclusive. A row holds the prompt under `data.prompt_key`
(text, or chat messages), `answer`, the dataset's other columns, and `pass_rate`, so the file
is a `data.train` as it is, and the rates can be read for other cuts. Nothing else is written.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger("rollover")

CHUNK = 256  # prompts sampled at a time: progress is reported between chunks


def pass_rates(run, prompts: list, samples: int, temperature: float) -> list[float]:
    """Each prompt's share of `samples` samples that are correct (the first reward function at
    least `reward.correct_threshold`; an episode's own reward for an environment)."""
    from rollover.rollout.groups import correct, eval_metrics
    from rollover.rollout.inputs import RolloutInputs

    cfg, rates = run.cfg, []
    for start in range(0, len(prompts), CHUNK):
        pending = run.sample(prompts[start:start + CHUNK], samples, temperature, f"filter-{start}")
        if run.env_builder is not None:
            threshold = cfg.reward.correct_threshold
            rates += [sum(t.ok and t.reward >= threshold for t in (g.done[j] for j in range(g.n))) / g.n for g in pending]
        else:
            _, groups = eval_metrics(pending, RolloutInputs.of(run))
            rates += [sum(correct(r, cfg, run.primary_reward) for r in g.rollouts) / len(g.rollouts) for g in groups]
        log.info("filter: %d of %d prompts sampled", min(start + CHUNK, len(prompts)), len(prompts))
    return rates


def write_kept(path: str | Path, prompts: list, rates: list[float], low: float, high: float, prompt_key: str) -> int:
    """The prompts whose rate lies in [low, high] as JSONL rows (see the module docstring),
    written whole then renamed; returns how many."""
    path = Path(path)
    kept = [(p, r) for p, r in zip(prompts, rates) if low <= r <= high]
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for p, r in kept:
            row = {prompt_key: p.messages if p.messages is not None else p.text, "answer": p.answer, **p.fields,
                   "pass_rate": r}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return len(kept)


def histogram(rates: list[float], bins: int = 5) -> str:
    """`[0, 0.2): 12 | ... | [0.8, 1]: 3`, with the prompts never and always solved apart."""
    never, always = sum(r == 0 for r in rates), sum(r == 1 for r in rates)
    inner = [r for r in rates if 0 < r < 1]
    counts = [sum(k / bins <= r < (k + 1) / bins for r in inner) for k in range(bins)]
    middle = " | ".join(f"({k / bins:g}, {(k + 1) / bins:g}): {c}" if k == 0 else
                        f"[{k / bins:g}, {(k + 1) / bins:g}): {c}" for k, c in enumerate(counts))
    return f"never solved: {never} | {middle} | always solved: {always}"
