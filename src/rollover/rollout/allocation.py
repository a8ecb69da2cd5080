"""Rollout allocation over a per-prompt history (`rollover.rollout.selection.PromptHistory`):
how many samples each prompt gets.

- `dars_extra_samples`: DARS's second-stage extra samples for one prompt, as its released
  schedules compute them.
- `dars_extra_rollouts`: a fixed budget of extra samples split over prompts by difficulty.
- `xrpo_allocation`: XRPO-style greedy split of a step's samples by how much one more sample
  shrinks the standard error of the prompt's mean reward.

`xrpo_allocation` sizes the groups of every draw with `selection.allocation: xrpo` (in sync,
APRIL and async mode, through `Run.next_groups`). The DARS functions are not wired into the
loops yet (a second generation stage inside a step).
"""

from __future__ import annotations

import heapq
import math
from fractions import Fraction

from rollover.rollout.selection import PromptHistory, PromptStats



def _check_prompt_ids(prompt_ids: list[str]) -> None:
    if len(set(prompt_ids)) != len(prompt_ids):
        raise ValueError("prompt_ids holds duplicate prompt ids")


def _check_count(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def difficulty(rec: PromptStats) -> Fraction:
    """1 - success rate as an exact fraction of the stored floats; 1/2 for an unseen prompt."""
    if rec.attempts <= 0:
        return Fraction(1, 2)
    return (Fraction(rec.attempts) - Fraction(rec.successes)) / Fraction(rec.attempts)


def dars_extra_rollouts(history: PromptHistory, prompt_ids: list[str], budget: int, base_n: int,
                        schedule: str = "equal") -> dict[str, int]:
    """DARS's second stage: split `budget` extra samples over prompts by difficulty.

    difficulty d = 1 - successes / attempts (1/2 for a prompt with no history); prompts with
    d == 0 get nothing.
    - "equal" (DARS's equal treatment): every prompt with d > 0 gets budget // m extras (m such
      prompts); the budget % m left over goes one each to the hardest prompts (ties in prompt
      order).
    - "hardest" (DARS's hardness weighting): quotas budget * d_i / sum(d), floored, with the
      samples left by flooring going one each to the largest fractional parts (ties: harder
      first, then prompt order) -- largest-remainder rounding.
    The extras add to at most `budget` (exactly `budget` unless every difficulty is 0).
    Difficulties are computed as exact fractions, so equal success rates get equal shares.

    Departure from DARS: DARS gives each prompt its own count from its accuracy and the
    first-stage group size (`dars_extra_samples`, its released schedules), uncapped in total;
    this splits a fixed budget instead, so a step's cost is known up front. `base_n` is the
    first-stage group size the extras come on top of; it is validated (an int >= 1) but the
    split itself does not depend on it.
    """
    _check_prompt_ids(prompt_ids)
    _check_count("budget", budget, 0)
    _check_count("base_n", base_n, 1)
    if schedule not in ("equal", "hardest"):
        raise ValueError(f"schedule must be 'equal' or 'hardest', got {schedule!r}")
    diffs = [difficulty(history.stats(pid)) for pid in prompt_ids]
    extra = {pid: 0 for pid in prompt_ids}
    hard = [i for i, d in enumerate(diffs) if d > 0]
    if not hard or budget == 0:
        return extra
    if schedule == "equal":
        each, rest = divmod(budget, len(hard))
        bonus = set(sorted(hard, key=lambda i: (-diffs[i], i))[:rest])
        for i in hard:
            extra[prompt_ids[i]] = each + (1 if i in bonus else 0)
        return extra
    total = sum(diffs[i] for i in hard)
    quotas = {i: budget * diffs[i] / total for i in hard}
    floors = {i: math.floor(q) for i, q in quotas.items()}
    left = budget - sum(floors.values())
    by_remainder = sorted(hard, key=lambda i: (-(quotas[i] - floors[i]), -diffs[i], i))
    for i in by_remainder[:left]:
        floors[i] += 1
    for i in hard:
        extra[prompt_ids[i]] = floors[i]
    return extra


def reward_variance_estimate(rec: PromptStats) -> float:
    """The reward variance XRPO's allocator uses: the sample variance once there are at least
    2 attempts, else the Bernoulli variance p * (1 - p) of the Beta(1, 1)-smoothed success rate
    p = (successes + 1) / (attempts + 2) (1/4 for an unseen prompt)."""
    var = rec.reward_variance()
    if var is not None:
        return var
    p = (rec.successes + 1.0) / (rec.attempts + 2.0)
    return p * (1.0 - p)


def dars_extra_samples(accuracy: float, n: int, schedule: str = "equal", n_max: int | None = None) -> int:
    """DARS's second-stage extra samples for one prompt, as its released code computes them
    (`schedule_ET` / `schedule_HW` of the DARS repository, per this project's reference notes).

    With first-stage group size N and group accuracy a (a = 0 counts as 0.5 / N; a >= 0.5 gets
    nothing), S = 2a(1 - a) and A = N / 2:
        "equal" (equal treatment):      dn = ceil((A - N S) / S)
        "hardest" (hardness-weighted):  dn = ceil((2 (1 - a) A - N S) / S)
    never below 0 and capped at n_max - N, with DARS's defaults n_max = 32 ("equal") and 64
    ("hardest"). The variant of DARS that measures advantage by its standard deviation
    (S = 2 sqrt(a(1 - a)), A = N) is not here.
    """
    if not (isinstance(accuracy, (int, float)) and 0.0 <= accuracy <= 1.0):
        raise ValueError(f"accuracy must be in [0, 1], got {accuracy!r}")
    _check_count("n", n, 1)
    if schedule not in ("equal", "hardest"):
        raise ValueError(f"schedule must be 'equal' or 'hardest', got {schedule!r}")
    cap = (n_max if n_max is not None else (32 if schedule == "equal" else 64)) - n
    a = 0.5 / n if accuracy == 0 else float(accuracy)
    if a >= 0.5 or cap <= 0:
        return 0
    S, A = 2 * a * (1 - a), n / 2
    target = A if schedule == "equal" else 2 * (1 - a) * A
    return max(0, min(cap, math.ceil((target - n * S) / S - 1e-9)))


def xrpo_allocation(history: PromptHistory, prompt_ids: list[str], budget: int, min_n: int = 2) -> dict[str, int]:
    """XRPO-style split of a step's `budget` samples over `prompt_ids`.

    Every prompt first gets `min_n` (budget < min_n * len(prompt_ids) is an error). Each
    remaining sample then goes to the prompt whose standard error of the mean reward shrinks the
    most from one more sample: with variance estimate s2 (`reward_variance_estimate`) and count
    n = history attempts + samples allocated so far, the gain is
        s2 / n - s2 / (n + 1) = s2 / (n * (n + 1)),
    infinite when n == 0 (no estimate of the mean at all). Ties go to the prompt with fewer
    samples allocated so far, then to the earlier one in `prompt_ids` (so prompts whose
    rewards never varied, all gain 0, share the extras evenly instead of the first taking
    them all). The counts add to exactly `budget`. s2 is held fixed over the step (the new
    samples are not scored yet).

    Departures from XRPO: XRPO (per secondary sources; this project has not confirmed it in the
    paper) scores a prompt by how much one more sample narrows a 95% confidence interval,
    h(n) - h(n + 1) with h(n) = t(0.975, n - 1) s / sqrt(n), plus an exploration bonus
    lambda sqrt(log(1 + T) / n), and allocates in rounds; this keeps the narrowing of the
    standard error (no t quantile, no bonus), one sample at a time.
    """
    _check_prompt_ids(prompt_ids)
    _check_count("budget", budget, 0)
    _check_count("min_n", min_n, 0)
    if budget < min_n * len(prompt_ids):
        raise ValueError(f"budget={budget} is less than min_n * len(prompt_ids) = "
                         f"{min_n} * {len(prompt_ids)}")
    alloc = {pid: min_n for pid in prompt_ids}
    s2 = [reward_variance_estimate(history.stats(pid)) for pid in prompt_ids]
    seen = [history.stats(pid).attempts for pid in prompt_ids]

    def gain(i: int) -> float:
        n = seen[i] + alloc[prompt_ids[i]]
        return math.inf if n <= 0 else s2[i] / (n * (n + 1.0))

    heap = [(-gain(i), min_n, i) for i in range(len(prompt_ids))]
    heapq.heapify(heap)
    for _ in range(budget - min_n * len(prompt_ids)):
        _, _, i = heapq.heappop(heap)
        alloc[prompt_ids[i]] += 1
        heapq.heappush(heap, (-gain(i), alloc[prompt_ids[i]], i))
    return alloc
