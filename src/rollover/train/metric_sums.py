"""An update's loss metrics, summed over its micro-batches (and ranks) so that each is what one
pass over the whole update would report, whatever the split.

`policy_loss` reports, per micro-batch, means over three different sets of tokens and a few
maxima: `masked_frac` and `opsm_masked_frac` over the loss tokens given to the step; the importance-sampling
statistics (`is_ratio_mean`, `is_ratio_max`, `is_clip_frac`) over the tokens the IS correction looks at (after
M2PO's mask); every other mean over the tokens that carry the loss (after IS masking). A mean is
kept as (sum, tokens) over its own set and divided at the end; a `*_max` as the largest. Neither
is reported by an update with no token in its set.
FSDPTrainer reduces the sums over the ranks (sums add, `*_max` take the largest).
"""

from __future__ import annotations

OVER_IS_TOKENS = frozenset({"is_ratio_mean", "is_ratio_max", "is_clip_frac"})  # over the tokens IS looks at
OVER_GIVEN_TOKENS = frozenset({"masked_frac", "opsm_masked_frac"})  # over the loss tokens given


def add_metrics(sums: dict[str, float], metrics: dict, tokens: dict[str, float]) -> None:
    """Add one micro-batch's `metrics` into `sums`. `tokens`: the micro-batch's token counts,
    under "masked_frac" (the loss tokens given), "is" (what IS looks at) and "" (the rest)."""
    for k, v in metrics.items():
        n = tokens["masked_frac"] if k in OVER_GIVEN_TOKENS else tokens["is"] if k in OVER_IS_TOKENS else tokens[""]
        if k.endswith("_max"):
            if n:  # a max over no token is a stand-in 0, not a value
                sums[k] = max(sums.get(k, float("-inf")), float(v))
            continue
        sums[k] = sums.get(k, 0.0) + n * float(v)
        sums["#" + k] = sums.get("#" + k, 0.0) + n


def reduce_sums(parts: list[dict[str, float]]) -> dict[str, float]:
    """The ranks' `sums` as one: added, except `*_max`, the largest."""
    keys = list(dict.fromkeys(k for s in parts for k in s))
    return {k: max(s[k] for s in parts if k in s) if k.endswith("_max") else sum(s.get(k, 0.0) for s in parts)
            for k in keys}


def mean_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The update's metrics from its sums: each mean over its own tokens, maxima as they are; a
    mean over no token is not reported (it has no value; a 0 would read as one)."""
    return {k: v if k.endswith("_max") else v / sums["#" + k]
            for k, v in sums.items() if not k.startswith("#") and (k.endswith("_max") or sums["#" + k] > 0)}
