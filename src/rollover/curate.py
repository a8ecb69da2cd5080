"""`rollover filter`: the training prompts' pass rates under a model, and the rows whose rate
lies in a band, written as a dataset to train on.

Before RL, practitioners drop the prompts a model always or never solves (DAPO, Polaris,
Skywork-OR1): under GRPO a group whose samples all score alike has no advantage and trains
nothing, so such prompts cost generation and teach nothing. `rollover filter CONFIG --samples 8
--out kept.jsonl` samples each training prompt of CONFIG `samples` times with its model (or
`--checkpoint DIR`), at `rollout.temperature` and `rollout.max_new_tokens`, scores the samples
as training would, and writes every prompt whose pass rate lies in the band: by default neither
0 nor 1, with `--keep LOW:HIGH` between the two, inclusive. A pass rate is the share of a
prompt's scored samples that the first reward function scores at least
`reward.correct_threshold` (an episode: its environment's reward), as `eval/accuracy` counts;
a prompt none of whose samples could be scored (its reward failed under `reward.on_error:
skip`) has none and is not written. A row holds the dataset's other columns, the prompt under
`data.prompt_key` and the answer under `data.answer_key` (`answer` by default), and
`pass_rate`, so the file is a `data.train` of the same config as it is; with several named
training sources (`data.train: {name: source}`) each row also says which under `source`, for
splitting the file back.
"""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path

log = logging.getLogger("rollover")

CHUNK = 256  # prompts sampled at a time: progress is reported between chunks


def pass_rates(run, prompts: list, samples: int, temperature: float) -> tuple[list[float | None], int]:
    """Each prompt's share of its scored samples that are correct (None: none was scored), and the
    samples whose first reward function failed (episodes: failed episodes): under
    reward.on_error=zero those were scored 0, so counted as wrong."""
    from rollover.rollout.episodes import to_group
    from rollover.rollout.groups import correct, eval_metrics
    from rollover.rollout.inputs import RolloutInputs

    rates, failed = [], 0
    for start in range(0, len(prompts), CHUNK):
        pending = run.sample(prompts[start:start + CHUNK], samples, temperature, f"filter-{start}", first=start)
        if run.env_builder is not None:  # episodes as rollouts scored `env` (a failed one unscored)
            groups = [to_group(g, [g.done[j] for j in range(g.n)]) for g in pending]
            failed += sum(not g.done[j].ok for g in pending for j in range(g.n))
        else:
            metrics, groups = eval_metrics(pending, RolloutInputs.of(run))
            failed += metrics[f"eval/rewards/{run.primary_reward}/errors"]  # the function the rates are read from
        scored = [[correct(r, run.cfg, run.primary_reward) for r in g.rollouts if r.reward is not None] for g in groups]
        rates += [sum(s) / len(s) if s else None for s in scored]
        log.info("filter: %d of %d prompts sampled", min(start + CHUNK, len(prompts)), len(prompts))
    return rates, failed


def rows_of(prompts: list, prompt_key: str, answer_key: str | None, sources: bool = False) -> list[dict]:
    """Each prompt as the dataset row it came from: its other columns, then the prompt and the
    answer under the keys the config reads them from (a dotted key as nested mappings), its images
    under `images`, and with
    `sources` (several named training sources) the name of its source under `source` (unless a
    column has that name). Checked to be JSON now, before any sampling: a column JSON cannot
    hold is named."""
    rows = []
    for p in prompts:
        row = dict(p.fields)
        if sources:  # a named source's prompt ids lead with its name
            row.setdefault("source", p.id.split("/", 1)[0])
        _put(row, prompt_key, p.messages if p.messages is not None else p.text)
        if p.images:  # as the loader reads them back: paths (made absolute), other images as data URLs
            row["images"] = [x if isinstance(x, str) else "data:image;base64," + base64.b64encode(x).decode()
                             for x in p.images]
        if p.answer is not None:  # a row kept without one (data.require_answer: false) stays without one
            _put(row, answer_key or "answer", p.answer)
        try:
            json.dumps(row, ensure_ascii=False)
        except TypeError as e:
            bad = [k for k, v in row.items() if not _writable(v)]
            raise ValueError(f"prompt {p.id}: column {', '.join(map(repr, bad)) or '?'} cannot be written as JSON "
                             f"({e})") from None
        rows.append(row)
    return rows


def _writable(value) -> bool:
    try:
        json.dumps(value, ensure_ascii=False)
    except TypeError:
        return False
    return True


def write_kept(path: str | Path, rows: list[dict], rates: list[float | None], low: float | None,
               high: float | None) -> int:
    """The rows whose rate lies in the band (None: 0 < rate < 1; else [low, high]) with their
    `pass_rate`, as JSON lines written whole then renamed; returns how many."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    kept = 0
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for row, rate in zip(rows, rates):
                if rate is None or not (0 < rate < 1 if low is None else low <= rate <= high):
                    continue
                f.write(json.dumps({**row, "pass_rate": rate}, ensure_ascii=False) + "\n")
                kept += 1
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return kept


def histogram(rates: list[float | None], bins: int = 5) -> str:
    """`never solved: 12 | (0, 0.2): 3 | ... | always solved: 4`, and the unscored when any."""
    scored = [r for r in rates if r is not None]
    never, always = sum(r == 0 for r in scored), sum(r == 1 for r in scored)
    inner = [r for r in scored if 0 < r < 1]
    counts = [sum(k / bins <= r < (k + 1) / bins for r in inner) for k in range(bins)]
    middle = " | ".join(f"{'(' if k == 0 else '['}{k / bins:g}, {(k + 1) / bins:g}): {c}" for k, c in enumerate(counts))
    unscored = len(rates) - len(scored)
    return f"never solved: {never} | {middle} | always solved: {always}" + (f" | unscored: {unscored}" if unscored else "")


def _put(row: dict, key: str, value) -> None:
    *outer, last = key.split(".")
    for part in outer:
        if not isinstance(row.get(part), dict):
            row[part] = {}
        row = row[part]
    row[last] = value
