"""`reward`: the reward functions and how their calls are run."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollover.config.base import RewardSpecEntry, Section


class RewardConfig(Section):
    functions: list[RewardSpecEntry] = Field(["numeric"], min_length=1)
    """Reward functions: built-in names (math, numeric, exact, em, format, countdown, code,
    reward_model: a learned reward model, {fn: reward_model, kwargs: {path: ...}}; judge: an LLM
    behind an OpenAI-compatible endpoint, {fn: judge, kwargs: {url: ..., model: ...}}),
    `module:function` or `file.py:function`, or {fn, weight, kwargs, name, isolate, reasoning}
    mappings (weight: a number; reasoning: drop scores what follows a thinking model's </think>).
    The first one decides accuracy (see `correct_threshold`). Not called in a multi-turn run
    (env.name): its environments give the rewards."""
    timeout_s: float = Field(10.0, gt=0, le=1e6)
    """Per-call timeout; a call past it counts as an error. (A reward worker's wait overflows past
    ~24 days, hence the bound.)"""
    on_error: Literal["raise", "zero", "skip"] = "raise"
    """A raising or hanging reward: stop the run, score 0 (counted and reported), or skip the sample."""
    workers: int = Field(4, ge=1)
    """Worker processes for isolated rewards (built-in `math`, and functions marked `isolate`),
    started on first use; a call past `timeout_s` is killed with its worker, which is replaced."""
    correct_threshold: float = 1.0
    """A sample counts as correct (accuracy metrics) when its first reward function scores at least this."""
