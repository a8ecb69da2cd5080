"""DART-style data curation for the asynchronous data manager.

- `ExperiencePool`: for a group whose samples all failed, substitute the prompt's most recent
  successful trajectory for one sample, so the group carries a learning signal. A pooled
  trajectory is used only while it is fresh enough for the staleness bound (its oldest token
  at most `max_staleness` versions behind the version that will train it); substitutions are
  flagged in the metrics.
- `dynamic_samples`: fewer samples for prompts the policy already solves (DART's
  `n = max(min_n, int(9 / success_rate - 7))` when the last success rate reaches the
  threshold, else the configured n).
- `top_entropy_mask`: train only on the highest-entropy fraction of samples. The engine
  reports no entropy, so a sample's entropy is estimated by the mean negative log-probability
  of its sampled tokens (a one-sample Monte Carlo estimate of the per-token entropy).
"""

from __future__ import annotations

import copy

from rollover.types import Group, Rollout


class ExperiencePool:
    def __init__(self, threshold: float, primary: str):
        self.threshold = threshold
        self.primary = primary
        self.best: dict[str, Rollout] = {}  # prompt id -> latest successful rollout

    def _success(self, r: Rollout) -> bool:
        return (r.scores.get(self.primary) or 0.0) >= self.threshold

    def observe_and_fill(self, group: Group, train_version: int, max_staleness: int) -> bool:
        """Remember successes; fill an all-fail group from the pool. True if substituted."""
        winners = [r for r in group.rollouts if self._success(r)]
        if winners:
            self.best[group.prompt.id] = copy.deepcopy(winners[-1])
            return False
        pooled = self.best.get(group.prompt.id)
        if pooled is None or not pooled.versions or train_version - min(pooled.versions) > max_staleness:
            return False
        worst = min(range(len(group.rollouts)), key=lambda j: (group.rollouts[j].reward, j))
        sub = copy.deepcopy(pooled)
        sub.group_id = group.id
        group.rollouts[worst] = sub
        return True

    def state_dict(self) -> dict:
        return {"best": dict(self.best)}

    def load_state_dict(self, state: dict) -> None:
        self.best = dict(state["best"])


def dynamic_samples(success_rate: float | None, default_n: int, min_n: int, threshold: float = 1.0) -> int:
    """DART's samples-per-prompt rule from the prompt's last observed success rate."""
    if success_rate is None or success_rate < threshold or success_rate <= 0:
        return default_n
    return max(min_n, min(default_n, int(9 / success_rate - 7)))


def top_entropy_mask(groups: list[Group], fraction: float) -> int:
    """Zero the loss mask of all but the top `fraction` of samples by estimated entropy.
    Returns how many samples were masked."""
    if fraction >= 1.0:
        return 0
    flat = [r for g in groups for r in g.rollouts]
    est = [(-sum(r.logprobs) / max(len(r.logprobs), 1), i) for i, r in enumerate(flat)]
    keep = max(1, round(fraction * len(flat)))
    kept = {i for _, i in sorted(est, key=lambda x: (-x[0], x[1]))[:keep]}
    masked = 0
    for i, r in enumerate(flat):
        if i not in kept:
            r.loss_mask = [0] * len(r.loss_mask)
            masked += 1
    return masked
