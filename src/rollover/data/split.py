"""Carve a held-out evaluation set out of training prompts, deterministically and without overlap.

Prompts are grouped by content (the rendered question, not the id), so a question that occurs
several times, which is common in generated data, lands wholly on one side. A seeded shuffle of
the distinct questions picks `ceil(fraction * distinct)` of them for the held-out side.
"""

from __future__ import annotations

import json
import math
import random
from typing import Sequence

from rollover.types import Prompt


def split_holdout(
    prompts: Sequence[Prompt], fraction: float, seed: int = 0
) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held_out): both keep the input order; no question appears on both sides."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"held-out fraction must be in (0, 1), got {fraction}")
    keys = [_content_key(p) for p in prompts]
    distinct = sorted(set(keys))
    if len(distinct) < 2:
        raise ValueError(f"cannot split {len(distinct)} distinct prompt(s) into train and held-out")
    random.Random(f"holdout:{seed}").shuffle(distinct)
    n_held = min(len(distinct) - 1, math.ceil(fraction * len(distinct)))
    held_keys = set(distinct[:n_held])
    train = [p for p, k in zip(prompts, keys) if k not in held_keys]
    held = [p for p, k in zip(prompts, keys) if k in held_keys]
    return train, held


def _content_key(prompt: Prompt) -> str:
    return json.dumps([prompt.text, prompt.messages], sort_keys=True)
