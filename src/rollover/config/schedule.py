"""`async` (the asynchronous loop), `selection` (which prompts, how many samples) and `downsample` (D3S)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field

from rollover.config.base import Section


def _off(value):
    """YAML 1.1 reads an unquoted off as false: `dars: off` means "off"."""
    return "off" if value is False else value


class AsyncConfig(Section):
    max_staleness: int = Field(1, ge=0)
    """eta: no sample is trained more than this many policy versions after the version that
    started it (0 = synchronous)."""
    experience_pool: bool = False
    """DART: replace an all-fail group's worst sample with the prompt's latest success, while that
    success's sampled tokens are at most max_staleness versions older than the version the group
    trains at. The data brings a prompt back once an epoch, so the pool fills groups only where an
    epoch takes about max_staleness steps or fewer (a small task set, as DART's agents train on,
    or a raised max_staleness); rollout/experience_pool_substitutions counts them."""
    dynamic_samples: bool = False
    """DART: fewer samples for prompts the policy solved every time last round."""
    min_samples: int = Field(2, ge=2)
    """DART dynamic samples: the fewest samples a prompt gets (a group of 1 has no baseline)."""
    top_entropy_fraction: float = Field(1.0, gt=0, le=1)
    """Train only on this fraction of highest-entropy steps (a sample, or a turn of an episode;
    1 = all); rollout/entropy_masked_samples counts the steps masked out."""


class SelectionConfig(Section):
    policy: Literal["uniform", "thompson", "skip_saturated", "thompson_skip_saturated"] = "uniform"
    """Which prompts a step trains on (rollover.rollout.selection): uniform (the data order,
    plain GRPO), thompson (VADE-style: prompts whose sampled success rate promises reward
    variance), skip_saturated (skip prompts always or never solved, offered again after
    reprobe_every skips), or both. Not uniform: each draw takes candidates x k prompts from
    the data and keeps k (the others are passed over for this epoch)."""
    candidates: float = Field(4.0, ge=1)
    """Prompts drawn from the data per prompt kept (not uniform)."""
    decay: float = Field(1.0, gt=0, le=1)
    """Every prompt's history is scaled by this once per training step (VADE's decay toward the prior)."""
    alpha0: float = Field(1.0, gt=0, allow_inf_nan=False)
    """Beta prior of a prompt's success rate (thompson): pseudo-successes."""
    beta0: float = Field(1.0, gt=0, allow_inf_nan=False)
    """Beta prior of a prompt's success rate (thompson): pseudo-failures."""
    min_attempts: int = Field(8, ge=1)
    """skip_saturated: samples seen before a prompt can count as always / never solved."""
    reprobe_every: int = Field(10, ge=1)
    """skip_saturated: times a saturated prompt the data brings is skipped before it is offered
    again (counted in times met: the data brings a prompt once an epoch)."""
    allocation: Literal["fixed", "xrpo"] = "fixed"
    """Samples per group: fixed (rollout.samples_per_prompt each) or xrpo (the draw's
    prompts_per_step x samples_per_prompt samples split by how much one more sample narrows
    each prompt's reward estimate, at least min_samples each; rollover.rollout.allocation)."""
    min_samples: int = Field(2, ge=2)
    """allocation=xrpo: the fewest samples a group gets (2: a group baseline needs two)."""
    dars: Annotated[Literal["off", "equal", "hardest"], BeforeValidator(_off)] = "off"
    """DARS's second stage (sync mode): once a step's groups are scored, each prompt solved by
    fewer than half its samples gets extra samples in the same step, by DARS's equal-treatment
    or hardness-weighted schedule (rollover.rollout.allocation.dars_extra_samples), merged into
    its group before advantages."""
    dars_max_samples: int | None = Field(None, ge=2)
    """DARS: a group's size after the second stage at most (unset: DARS's 32 for equal, 64 for hardest)."""


class DownsampleConfig(Section):
    """D3S (dynamic dual-level down-sampling): generate many samples, train on the most
    informative (rollover.rollout.downsample). Advantages come from the whole group first."""

    keep: int = Field(0, ge=0)
    """Samples trained per group, the subset with the largest variance of advantages (D3S's
    sample level, PODS's max-variance rule); 0 trains every sample. Must be >= 2 and below
    rollout.samples_per_prompt."""
    token_fraction: float = Field(1.0, gt=0, le=1)
    """Fraction of the step's trained response tokens kept, those with the largest |advantage| x
    entropy (D3S's token level; entropy estimated by the sampled token's negative
    log-probability); 1 keeps all. The value reached after anneal_steps."""
    token_fraction_start: float | None = Field(None, gt=0, le=1)
    """D3S's curriculum from aggressive to relaxed: the token fraction at step 1, moving linearly
    to token_fraction over anneal_steps steps (unset: token_fraction throughout)."""
    anneal_steps: int = Field(0, ge=0)
    """Steps over which the token fraction moves from token_fraction_start to token_fraction."""
