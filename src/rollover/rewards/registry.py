"""Naming reward functions from config, and telling the two signatures apart.

A reward is referenced by a built-in name (`math`, `numeric`, `exact`, `format`, `countdown`),
by `package.module:function`, or by `path/to/file.py:function`.

Two signatures are accepted, told apart by parameter names:

- per sample (rollover, verifiers): `f(completion, answer, **fields) -> float | dict | None`,
  called once per completion;
- batched (TRL): any function with a parameter named `completions`:
  `f(prompts, completions, **kw) -> list[float | dict | None]`, called once per batch.

Dataset fields reach a function as keyword arguments: all of them if it takes `**kwargs`, else
only those it names (a field it names but the sample lacks is a call error, reported by the
runner).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rollover.rewards.builtins import BUILTINS


@dataclass(frozen=True)
class RewardSpec:
    """A reward as config names it."""

    fn: str  # built-in name, "module:function" or "path/to/file.py:function"
    weight: float = 1.0
    kwargs: dict = field(default_factory=dict)  # bound to the function, e.g. {"pattern": ...}
    name: str | None = None  # how it is reported; default: the built-in or function name

    def build(self) -> Reward:
        fn = resolve_reward_fn(self.fn)
        if self.kwargs:
            fn = functools.partial(fn, **self.kwargs)
        return Reward(self.name or self.fn.rpartition(":")[2], fn, self.weight)


@dataclass(frozen=True)
class Reward:
    """A resolved reward function with its weight in the total."""

    name: str
    fn: Callable
    weight: float = 1.0

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"reward {self.name!r}: {self.fn!r} is not callable")
        _check_signature(self.name, self.fn)

    @functools.cached_property
    def batched(self) -> bool:
        """True for the TRL signature (a parameter named `completions`)."""
        return "completions" in self._params

    def call_one(self, completion: str, answer: object, fields: dict) -> object:
        """Per-sample signature: f(completion, answer, **accepted fields)."""
        positional = [
            name
            for name, p in self._params.items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ][:2]
        kwargs = {k: v for k, v in self._accepted(fields).items() if k not in positional}
        return self.fn(completion, answer, **kwargs)

    def call_batch(
        self,
        prompts: list,
        completions: list[str],
        answers: list,
        fields: list[dict],
        completion_ids: list[list[int]] | None,
    ) -> object:
        """TRL signature: f(prompts=..., completions=..., answer=..., <column>=[...], ...).

        Every field becomes a per-sample list. `answer` is the list of `Prompt.answer`s, and so
        is `solution` unless a field has that name, since TRL's own rewards read it.
        """
        keys = dict.fromkeys(key for f in fields for key in f)
        columns = {key: [f.get(key) for f in fields] for key in keys}
        available = {**columns, "answer": answers}
        available.setdefault("solution", answers)
        available.update(prompts=prompts, completions=completions)
        if completion_ids is not None:
            available["completion_ids"] = completion_ids
        return self.fn(**self._accepted(available))

    @functools.cached_property
    def _params(self) -> dict[str, inspect.Parameter]:
        return dict(inspect.signature(self.fn).parameters)

    def _accepted(self, available: dict) -> dict:
        """The entries of `available` the function takes as keyword arguments (never the
        ones already bound with `kwargs`)."""
        bound = self.fn.keywords if isinstance(self.fn, functools.partial) else {}
        if any(p.kind is p.VAR_KEYWORD for p in self._params.values()):
            return {k: v for k, v in available.items() if k not in bound}
        accepted = {
            name
            for name, p in self._params.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name not in bound
        }
        return {k: v for k, v in available.items() if k in accepted}


def build_rewards(specs: list[RewardSpec | dict | str]) -> list[Reward]:
    """Rewards from config entries: a spec, a dict of RewardSpec fields, or a bare name."""
    rewards = []
    for spec in specs:
        if isinstance(spec, str):
            spec = RewardSpec(spec)
        elif isinstance(spec, dict):
            spec = RewardSpec(**spec)
        rewards.append(spec.build())
    names = [r.name for r in rewards]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"reward names must be unique; give `name` to tell apart {duplicates}")
    return rewards


def resolve_reward_fn(ref: str) -> Callable:
    """The function a reference names; raises naming what could not be found."""
    if ref in BUILTINS:
        return BUILTINS[ref]
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(
            f"unknown reward {ref!r}: expected a built-in ({sorted(BUILTINS)}), "
            "'module:function' or 'path/to/file.py:function'"
        )
    module = _load_file(target) if target.endswith(".py") else importlib.import_module(target)
    if not hasattr(module, attr):
        raise AttributeError(f"reward {ref!r}: {target} has no attribute {attr!r}")
    return getattr(module, attr)


def _load_file(path_text: str):
    path = Path(path_text).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"reward file not found: {path}")
    # A name unique to the path, so two files called rewards.py do not collide.
    name = f"rollover_user_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_signature(name: str, fn: Callable) -> None:
    params = inspect.signature(fn).parameters
    if "completions" in params:
        return
    positional = [
        p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    has_varargs = any(p.kind is p.VAR_POSITIONAL for p in params.values())
    if len(positional) < 2 and not has_varargs:
        raise TypeError(
            f"reward {name!r} must take (completion, answer, **fields) or, TRL-style, "
            f"(prompts, completions, **kwargs); its signature is {inspect.signature(fn)}"
        )
