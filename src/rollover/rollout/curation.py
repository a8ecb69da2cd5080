"""DART-style data curation for the asynchronous data manager.

- `ExperiencePool`: for a group whose samples all failed, substitute the prompt's most recent
  successful trajectory for one sample, so the group carries a learning signal. A pooled
  trajectory is used only while it is fresh enough for the staleness bound (its oldest sampled
  token at most `max_staleness` versions behind the version that will train it; an episode's
  environment tokens were not sampled and carry no version); substitutions are counted in the
  metrics.
- `dynamic_samples`: fewer samples for prompts the policy already solves (DART's
  `n = max(min_n, int(9 / success_rate - 7))` when the last success rate reaches the
  threshold, else the configured n).
- `top_entropy_mask`: train only on the highest-entropy fraction of steps (a single-turn
  sample, or one turn of an episode). The engine reports no entropy, so a step's entropy is
  estimated by the mean negative log-probability of its sampled tokens (a one-sample Monte
  Carlo estimate of the per-token entropy).
- `TurnBudget`: per-task turn limits for episodes from how easily the task was solved
  (dynamic trajectory length).
"""

from __future__ import annotations

import copy
from dataclasses import replace

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
        sampled = [v for v in pooled.versions if v >= 0] if pooled is not None else []  # not an environment's (-1)
        if not sampled or train_version - min(sampled) > max_staleness:
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


def top_entropy_mask(groups: list[Group], fraction: float) -> tuple[list[Group], int]:
    """The groups with the loss mask zeroed on all but the top `fraction` of steps by estimated
    entropy (new groups and rollouts; the inputs are left as they were), and how many steps
    were masked. A step is a maximal run of trained tokens (loss mask 1): the whole response of
    a single-turn sample, one sampled turn of an episode (the environment's tokens between turns
    have mask 0), so the choice is per turn. A step's entropy is estimated by the mean negative
    log-probability of its sampled tokens."""
    if fraction >= 1.0:
        return groups, 0
    masks = {id(r): list(r.loss_mask) for g in groups for r in g.rollouts}
    steps = []  # (entropy estimate, order, rollout, start, end)
    for r in (r for g in groups for r in g.rollouts):
        for start, end in _trained_runs(r.loss_mask):
            lps = r.logprobs[start:end]
            steps.append((-sum(lps) / len(lps), len(steps), r, start, end))
    keep = max(1, round(fraction * len(steps)))
    dropped = sorted(steps, key=lambda x: (-x[0], x[1]))[keep:]
    for _, _, r, start, end in dropped:
        masks[id(r)][start:end] = [0] * (end - start)
    out = [replace(g, rollouts=[replace(r, loss_mask=masks[id(r)]) for r in g.rollouts]) for g in groups]
    return out, len(dropped)


def _trained_runs(mask: list[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


class TurnBudget:
    """Dynamic trajectory length (DART's idea; its released code keeps the limit fixed, so this
    rule is rollover's): a task the policy solved in at least `threshold` of its last group's
    episodes gets at most one turn more than its longest successful episode used (never fewer
    than `min_turns`); any other task gets the configured `env.max_turns`. Easy tasks stop
    spending turns on wandering; hard ones keep the full budget."""

    def __init__(self, max_turns: int, min_turns: int, threshold: float, correct: float):
        self.max_turns, self.min_turns, self.threshold, self.correct = max_turns, min_turns, threshold, correct
        self.seen: dict[str, tuple[float, int]] = {}  # task id -> (success rate, turns of the longest success)

    def observe(self, task_id: str, trajectories) -> None:
        ok = [t for t in trajectories if t.ok and t.reward >= self.correct]
        rate = len(ok) / max(len(trajectories), 1)
        self.seen[task_id] = (rate, max((len(t.turns) for t in ok), default=0))

    def limit(self, task_id: str) -> int:
        rate, turns = self.seen.get(task_id, (0.0, 0))
        if rate < self.threshold or turns == 0:
            return self.max_turns
        return max(self.min_turns, min(self.max_turns, turns + 1))

    def state_dict(self) -> dict:
        return {"seen": dict(self.seen)}

    def load_state_dict(self, state: dict) -> None:
        self.seen = dict(state["seen"])
