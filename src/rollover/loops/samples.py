"""A step's samples as rows for `RUN_DIR/samples/` (`logging.samples`; the file format, the
reading and `rollover show` live in `rollover.metrics.samples`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollover.metrics.samples import mask_spans
from rollover.metrics.samples import _number as number
from rollover.rollout.groups import DROP_COUNTS, group_advantages

if TYPE_CHECKING:
    from rollover.config import Config
    from rollover.loops.common import Run
    from rollover.train.batch import TrainBatch
    from rollover.types import Group


# the collector's step figures that say what it produced and did not train
DROP_KEYS = (*DROP_COUNTS, "regenerated_tokens", "empty_collections")


def log_samples(run: Run, step: int, groups: list[Group], batch: TrainBatch, collected: dict | None = None,
                kept: list[list[int]] | None = None) -> None:
    """Every `logging.samples`-th step, write the samples of `groups` as `batch` trained them.
    `collected`: the collector's step figures (sync and APRIL), for the header's `dropped`;
    `kept`: each group's samples D3S down-sampling kept (None: all)."""
    every = run.cfg.logging.samples
    if not every or step % every:
        return
    dropped = None if collected is None else {k: collected[k] for k in DROP_KEYS if k in collected}
    run.logger.log_samples(step, sample_rows(step, groups, batch, run.tokenizer, run.cfg, dropped, kept))


def sample_rows(step: int, groups: list[Group], batch: TrainBatch, tokenizer, cfg: Config,
                dropped: dict | None = None, kept: list[list[int]] | None = None) -> list[dict]:
    """The header and one row per sample of `groups` (see the module docstring)."""
    rows_of, advantages = _batch_rows(groups, batch, cfg, kept)
    header = {"kind": "step", "step": step, "samples": len(rows_of), "trained_samples": len(batch),
              "groups": [{"group": g.id, "prompt_id": g.prompt.id, "samples": len(g.rollouts),
                          "failed_samples": g.dropped} for g in groups]}
    if dropped is not None:
        header["dropped"] = dropped
    out, i = [header], 0
    for g in groups:
        prompt = tokenizer.decode(g.prompt_ids, skip_special_tokens=False)
        for j, r in enumerate(g.rollouts):
            b = rows_of[i]
            mask = r.loss_mask if b is None else batch.mask_BT[b, : len(r.response_ids)].tolist()
            out.append(_row(step, g, j, r, prompt, tokenizer, trained=b is not None,
                            dropped=None if b is not None else "downsample", advantage=advantages[i], mask=mask))
            i += 1
        if g.greedy is not None:  # ReMax's baseline: scored, never trained
            out.append(_row(step, g, "greedy", g.greedy, prompt, tokenizer, trained=False, dropped="greedy",
                            advantage=None, mask=[0] * len(g.greedy.response_ids)))
    return out


def _row(step: int, g: Group, j: int | str, r, prompt: str, tokenizer, *, trained: bool, dropped: str | None,
         advantage: float | None, mask: list[int]) -> dict:
    sampled = [k for k, v in enumerate(r.versions) if v >= 0]  # an episode's inserted tokens carry -1
    logprobs = [r.logprobs[k] for k in sampled]
    row = {
        "kind": "sample", "step": step, "group": g.id, "prompt_id": g.prompt.id, "sample": j,
        "trained": trained, "dropped": dropped,
        "reward": number(r.reward), "scores": {k: number(v) for k, v in r.scores.items()},
        "advantage": number(advantage), "finish": r.finish,
        "logprob_mean": number(sum(logprobs) / len(logprobs)) if logprobs else None,
        "logprob_min": number(min(logprobs)) if logprobs else None,
        "version_min": min(r.versions[k] for k in sampled) if sampled else None,
        "version_max": max(r.versions[k] for k in sampled) if sampled else None,
        "loss_mask": mask_spans(mask),
        "prompt": prompt,
        "response": tokenizer.decode(r.response_ids, skip_special_tokens=False),
        "prompt_ids": list(r.prompt_ids), "response_ids": list(r.response_ids),
    }
    if r.extras:
        row["extras"] = {k: number(v) for k, v in r.extras.items()}
    if r.turns is not None:
        row["turns"] = r.turns
    return row


def eval_sample_rows(step: int, groups: list[Group], tokenizer, cfg: Config, primary: str,
                     sources: dict[str, str]) -> list[dict]:
    """The header and one row per sample of an evaluation's first `logging.eval_samples` groups:
    the training rows' fields (never trained, no advantage), with `correct` (by the first reward
    function, `reward.correct_threshold`) and the prompt's held-out `source`."""
    from rollover.rollout.groups import correct

    groups = groups[: cfg.logging.eval_samples]
    header = {"kind": "eval", "step": step, "samples": sum(len(g.rollouts) for g in groups),
              "groups": [{"group": g.id, "prompt_id": g.prompt.id, "samples": len(g.rollouts),
                          "failed_samples": sum(r.reward is None for r in g.rollouts)} for g in groups]}
    out = [header]
    for g in groups:
        prompt = tokenizer.decode(g.prompt_ids, skip_special_tokens=False)
        for j, r in enumerate(g.rollouts):
            row = _row(step, g, j, r, prompt, tokenizer, trained=False, dropped="eval", advantage=None,
                       mask=[0] * len(r.response_ids))
            row.update(correct=r.reward is not None and correct(r, cfg, primary), source=sources.get(g.prompt.id))
            out.append(row)
    return out


def _batch_rows(groups: list[Group], batch: TrainBatch, cfg: Config,
                kept: list[list[int]] | None) -> tuple[list[int | None], list[float | None]]:
    """Each sample's row in `batch` (None: D3S sample-level down-sampling left it out) and its
    advantage, in group order. The batch keeps every sample in order unless `downsample.keep`
    cut groups down to `kept`."""
    n = sum(len(g.rollouts) for g in groups)
    if len(batch) == n:  # gae, otb: the trainer gives each token its own (adv_B holds the rewards)
        return list(range(n)), [None] * n if cfg.algorithm.advantage in ("gae", "otb") else batch.adv_B.tolist()
    if kept is None or len(kept) != len(groups):
        raise AssertionError(f"samples log: {len(batch)} rows in the batch for {n} samples, and no record of "
                             "which samples down-sampling kept")
    rows: list[int | None] = []
    b = 0
    for g, idx in zip(groups, kept):
        chosen = set(idx)
        for k in range(len(g.rollouts)):
            rows.append(b if k in chosen else None)
            b += k in chosen
    if b != len(batch):
        raise AssertionError(f"samples log: {len(batch)} rows in the batch, {b} samples kept by down-sampling")
    return rows, group_advantages(groups, cfg)[0].tolist()
