"""Carve a held-out evaluation set out of training prompts, deterministically and without overlap.

Prompts are grouped by content (the rendered question, not the id), so a question that occurs
several times, which is common in generated data, lands wholly on one side. A seeded shuffle of
the distinct questions picks `ceil(fraction * distinct)` of them for the held-out side, which
holds each once (its first occurrence): an evaluation of N held-out prompts asks N questions.
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
    """(train, held_out): both keep the input order; no question appears on both sides, and the
    held-out side has each of its questions once. `fraction` is of the distinct questions."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"held-out fraction must be in (0, 1), got {fraction}")
    # a question's place in the shuffle: its first occurrence's own form (a text prompt and the
    # same question as one user message are one question, ordered as the first of them)
    first: dict[str, str] = {}
    keys = [first.setdefault(content_key(p), _form_key(p)) for p in prompts]
    distinct = sorted(set(keys))
    if len(distinct) < 2:
        raise ValueError(f"cannot split {len(distinct)} distinct prompt(s) into train and held-out")
    random.Random(f"holdout:{seed}").shuffle(distinct)
    n_held = min(len(distinct) - 1, math.ceil(fraction * len(distinct)))
    held_keys = set(distinct[:n_held])
    train = [p for p, k in zip(prompts, keys) if k not in held_keys]
    held, seen = [], set()
    for p, k in zip(prompts, keys):
        if k in held_keys and k not in seen:
            seen.add(k)
            held.append(p)
    return train, held


def distinct_questions(prompts: Sequence[Prompt]) -> int:
    """How many different questions `prompts` ask (by content, as `split_holdout` counts them)."""
    return len({content_key(p) for p in prompts})


def content_key(prompt: Prompt) -> str:
    """What makes two prompts the same question: their messages (a text prompt is the one user
    message it is rendered as) and their images, not their ids."""
    messages = [{"role": "user", "content": prompt.text}] if prompt.messages is None else prompt.messages
    images = image_keys(prompt)
    return json.dumps([messages, *([images] if images else [])], sort_keys=True)


def _form_key(prompt: Prompt) -> str:
    """A prompt's content as given (text or messages) and its images."""
    images = image_keys(prompt)
    return json.dumps([prompt.text, prompt.messages, *([images] if images else [])], sort_keys=True)


def image_keys(prompt: Prompt) -> list[str]:
    """`image_key` of each of the prompt's images (none for a text prompt)."""
    return [image_key(x) for x in prompt.images] if prompt.images else []


def image_key(image) -> str:
    """What tells one of a prompt's images from another: a path as given (data files' are made
    absolute), the bytes' or pixels' digest otherwise."""
    import hashlib

    if isinstance(image, str) or hasattr(image, "__fspath__"):
        return str(image)
    if isinstance(image, (bytes, bytearray)):
        return hashlib.sha1(image).hexdigest()
    if hasattr(image, "tobytes"):  # a PIL image
        return f"{image.mode}:{image.size}:{hashlib.sha1(image.tobytes()).hexdigest()}"
    return repr(image)
