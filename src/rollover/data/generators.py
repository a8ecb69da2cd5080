"""Procedural tasks for offline runs: no files, no hub, deterministic from a seed.

Named by a source string `gen:NAME?n=N&seed=S&opt=value...` (what `load_prompts` accepts) or by
calling `generate(NAME, n=N, seed=S, opt=value...)` with the same options, e.g. from a config
dict. `n` is required; `seed` defaults to 0. Item `i` depends only on (seed, options, i), so the
first k prompts are the same for any n >= k.

- `arithmetic`: "What is 3 + 5?" -> "8". Options: `digits` (1; operands are drawn uniformly
  from 0 .. 10**digits - 1), `ops` (a string of operators from "+-*", default "+"; for "-" the
  larger operand comes first, so answers are never negative).
- `countdown`: "Using the numbers [3, 7, 2], ..." -> target "20", with
  `fields["numbers"] = [3, 7, 2]`. Options: `count` (3 numbers), `max_number` (10; numbers are
  drawn from 1 .. max_number). The target is built by folding a random permutation of the
  numbers with + - * / left to right, keeping every intermediate value a positive integer, so
  every instance has a solution that uses each number exactly once. Score it with the
  `countdown` reward.

Questions do not say how to format the answer: `render_prompt(..., instruction=...)` adds that.
"""

from __future__ import annotations

import random
from typing import Callable

from rollover.data.loaders import DataError, _parse_query
from rollover.types import Prompt


def arithmetic(n: int, seed: int = 0, digits: int = 1, ops: str = "+") -> list[Prompt]:
    if digits < 1:
        raise ValueError(f"arithmetic: digits must be >= 1, got {digits}")
    if not ops or set(ops) - set("+-*"):
        raise ValueError(f"arithmetic: ops must be a non-empty string over '+-*', got {ops!r}")
    high = 10**digits - 1
    prompts = []
    for i in range(n):
        rng = _item_rng("arithmetic", seed, i)
        a, b, op = rng.randint(0, high), rng.randint(0, high), rng.choice(ops)
        if op == "-" and b > a:
            a, b = b, a
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        text = f"What is {a} {op} {b}?"
        prompts.append(Prompt(id=f"arithmetic-{seed}-{i}", text=text, answer=str(value)))
    return prompts


def countdown(n: int, seed: int = 0, count: int = 3, max_number: int = 10) -> list[Prompt]:
    if count < 2:
        raise ValueError(f"countdown: count must be >= 2, got {count}")
    if max_number < 1:
        raise ValueError(f"countdown: max_number must be >= 1, got {max_number}")
    prompts = []
    for i in range(n):
        rng = _item_rng("countdown", seed, i)
        numbers = [rng.randint(1, max_number) for _ in range(count)]
        target = _reachable_target(rng, numbers)
        text = (
            f"Using the numbers {numbers}, write an arithmetic expression that equals {target}. "
            "Use each number exactly once, with + - * / and parentheses."
        )
        prompts.append(
            Prompt(
                id=f"countdown-{seed}-{i}",
                text=text,
                answer=str(target),
                fields={"numbers": numbers},
            )
        )
    return prompts


def _reachable_target(rng: random.Random, numbers: list[int]) -> int:
    order = rng.sample(numbers, len(numbers))
    value = order[0]
    for x in order[1:]:
        choices = [value + x, value * x]
        if value - x > 0:
            choices.append(value - x)
        if value % x == 0:
            choices.append(value // x)
        value = rng.choice(choices)
    return value


def _item_rng(name: str, seed: int, index: int) -> random.Random:
    # A string seed is hashed with sha512 by `random`, so this is stable across processes.
    return random.Random(f"{name}:{seed}:{index}")


GENERATORS: dict[str, Callable[..., list[Prompt]]] = {
    "arithmetic": arithmetic,
    "countdown": countdown,
}


def generate(name: str, n: int, seed: int = 0, **options) -> list[Prompt]:
    """`n` prompts from the generator `name` (see the module docstring for options)."""
    if name not in GENERATORS:
        raise DataError(f"unknown generator {name!r} (known: {sorted(GENERATORS)})")
    if n < 1:
        raise DataError(f"generator {name!r}: n must be >= 1, got {n}")
    return GENERATORS[name](n, seed, **options)


def generate_from_spec(spec: str) -> list[Prompt]:
    """Prompts for a source string `gen:NAME?n=...&...`; option values are cast to the type of
    the generator's default for that option."""
    if not spec.startswith("gen:"):
        raise DataError(f"{spec!r}: a generator source starts with 'gen:'")
    name, _, query = spec[4:].partition("?")
    if name not in GENERATORS:
        raise DataError(f"{spec}: unknown generator {name!r} (known: {sorted(GENERATORS)})")
    raw = _parse_query(query, spec)
    if "n" not in raw:
        raise DataError(f"{spec}: option n (the number of prompts) is required")
    defaults = _defaults(GENERATORS[name])
    options = {}
    for key, value in raw.items():
        if key not in defaults:
            raise DataError(f"{spec}: unknown option {key!r} (known: {sorted(defaults)})")
        kind = type(defaults[key]) if defaults[key] is not None else int
        try:
            options[key] = kind(value)
        except ValueError:
            raise DataError(f"{spec}: option {key}={value!r} is not a {kind.__name__}") from None
    return generate(name, **options)


def _defaults(fn: Callable) -> dict[str, object]:
    import inspect

    return {
        name: (None if p.default is inspect.Parameter.empty else p.default)
        for name, p in inspect.signature(fn).parameters.items()
    }
