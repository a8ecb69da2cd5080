"""Prompt selection over a per-prompt scoring history.

Pure Python; every random choice goes through an explicitly seeded `random.Random`, so a run is
reproducible from its seed and resumable from a checkpoint (`state_dict` / `load_state_dict`).

- `PromptHistory`: per-prompt counts of scored samples and successes, reward moments, and when
  the prompt was last scored. `decay(gamma)` fades old evidence toward the prior (VADE).
- Selection policies (`SelectionPolicy` protocol), which pick k prompt ids out of candidates:
  `UniformPolicy` (plain GRPO: the first k), `ThompsonPolicy` (VADE-style Beta-Bernoulli
  Thompson sampling on the expected group variance), `SkipSaturatedPolicy` (skip prompts that
  are always or never solved, re-probing them now and then).
- `PromptSelection`: a policy and a history wired to a run (`selection.policy`).

Rollout allocation over the same history (DARS, XRPO) is in `rollover.rollout.allocation`.

Nothing here touches the training loop; the caller observes scored groups into the history,
decays it when it wants to, and asks a policy or an allocator what to do next.
"""

from __future__ import annotations

import math
import random
import threading
from collections import deque
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

_STAT_FIELDS = ("attempts", "successes", "reward_sum", "reward_sq_sum", "last_version", "last_step")


@dataclass
class PromptStats:
    """What the history knows about one prompt. `attempts` and `successes` are pseudo-counts
    (floats once `PromptHistory.decay` has scaled them); `reward_sum` and `reward_sq_sum` are
    the first two raw moments of the rewards, scaled alongside them."""

    attempts: float = 0.0
    successes: float = 0.0
    reward_sum: float = 0.0
    reward_sq_sum: float = 0.0
    last_version: int = -1
    last_step: int = -1

    @property
    def success_rate(self) -> float | None:
        """successes / attempts, or None when nothing has been scored."""
        return self.successes / self.attempts if self.attempts > 0 else None

    @property
    def mean_reward(self) -> float | None:
        return self.reward_sum / self.attempts if self.attempts > 0 else None

    def reward_variance(self) -> float | None:
        """Unbiased sample variance (sum r^2 - (sum r)^2 / n) / (n - 1) with n = attempts, clamped
        at 0 against rounding; None when n < 2 (too little evidence for a variance)."""
        n = self.attempts
        if n < 2:
            return None
        return max(0.0, (self.reward_sq_sum - self.reward_sum * self.reward_sum / n) / (n - 1))


class PromptHistory:
    """Per-prompt record of how the policy has fared on each prompt id.

    A sample is a success when the caller says so (typically: its primary score is at or above
    the correct threshold); the reward moments use whatever scalar reward the caller passes.
    """

    def __init__(self) -> None:
        self._stats: dict[str, PromptStats] = {}

    def __contains__(self, prompt_id: str) -> bool:
        return prompt_id in self._stats

    def __len__(self) -> int:
        return len(self._stats)

    def get(self, prompt_id: str) -> PromptStats | None:
        """The prompt's record, or None if it was never observed."""
        return self._stats.get(prompt_id)

    def stats(self, prompt_id: str) -> PromptStats:
        """The prompt's record, or an empty (all-prior) one if it was never observed."""
        return self._stats.get(prompt_id) or PromptStats()

    def observe(self, prompt_id: str, rewards: list[float], successes: list[bool], version: int, step: int) -> None:
        """Add one scored group: `rewards[i]` and `successes[i]` belong to the same sample; the
        prompt's `last_version` and `last_step` become `version` and `step`."""
        if len(rewards) == 0:
            raise ValueError("rewards must hold at least one sample's reward")
        if len(successes) != len(rewards):
            raise ValueError(f"successes has {len(successes)} entries but rewards has {len(rewards)}")
        values = [float(r) for r in rewards]
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"rewards must be finite, got {rewards!r}")
        rec = self._stats.setdefault(prompt_id, PromptStats())
        rec.attempts += float(len(values))
        rec.successes += float(sum(1 for s in successes if s))
        rec.reward_sum += sum(values)
        rec.reward_sq_sum += sum(v * v for v in values)
        rec.last_version = int(version)
        rec.last_step = int(step)

    def decay(self, gamma: float) -> None:
        """Scale every prompt's evidence by `gamma` in (0, 1] (VADE's prior decay: with a Beta
        prior on top, old outcomes fade and the posterior drifts back toward the prior).

        VADE decays the Beta pseudo-counts (attempts and successes here). This also scales the
        reward moments by the same factor, so the mean reward and the mean squared deviation
        stay what they were, only backed by less evidence (the unbiased variance's n - 1
        correction does change); `last_version` and `last_step` are left alone."""
        if not (isinstance(gamma, (int, float)) and 0.0 < gamma <= 1.0):
            raise ValueError(f"gamma must be in (0, 1], got {gamma!r}")
        for rec in self._stats.values():
            rec.attempts *= gamma
            rec.successes *= gamma
            rec.reward_sum *= gamma
            rec.reward_sq_sum *= gamma

    def state_dict(self) -> dict:
        return {"prompts": {pid: dict(vars(rec)) for pid, rec in self._stats.items()}}  # asdict: 5x slower

    def load_state_dict(self, state: dict) -> None:
        prompts = state["prompts"]
        loaded = {}
        for pid, rec in prompts.items():
            missing = [f for f in _STAT_FIELDS if f not in rec]
            if missing:
                raise ValueError(f"state['prompts'][{pid!r}] lacks {missing}")
            loaded[pid] = PromptStats(**{f: rec[f] for f in _STAT_FIELDS})
        self._stats = loaded


# ---------------------------------------------------------------------------------------------
# Selection policies


@runtime_checkable
class SelectionPolicy(Protocol):
    """Picks `k` distinct prompt ids out of `candidates` (distinct ids) given the history and the
    current training step; k > len(candidates) is an error. A policy's only state is its random
    generator, saved by `state_dict` (picklable, not necessarily JSON) and restored by
    `load_state_dict`."""

    def choose(self, candidates: list[str], k: int, history: PromptHistory, step: int) -> list[str]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def _check_choose_args(candidates: list[str], k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be a non-negative int, got {k!r}")
    if k > len(candidates):
        raise ValueError(f"k={k} exceeds the {len(candidates)} candidates")
    if len(set(candidates)) != len(candidates):
        raise ValueError("candidates holds duplicate prompt ids")


def _rng_state(rng: random.Random) -> dict:
    return {"rng": rng.getstate()}


def _set_rng_state(rng: random.Random, state: dict) -> None:
    """Restore a `random.Random.getstate()` tuple, accepting lists in place of tuples (in case a
    serializer turned them into lists)."""
    version, internal, gauss_next = state["rng"]
    rng.setstate((version, tuple(internal), gauss_next))


class UniformPolicy:
    """The plain GRPO baseline: the first k candidates in the order given (the caller's data
    iterator has already shuffled them). No randomness of its own."""

    def choose(self, candidates: list[str], k: int, history: PromptHistory, step: int) -> list[str]:
        _check_choose_args(candidates, k)
        return list(candidates[:k])

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class ThompsonPolicy:
    """VADE-style Thompson sampling for prompts whose groups will carry a GRPO signal.

    For each candidate, in the order given, one draw
        p ~ Beta(alpha0 + successes, beta0 + failures),  failures = attempts - successes,
    is taken with `self.rng.betavariate(alpha, beta)` (exactly one call per candidate, nothing
    else consumes the generator). The candidate's score is p * (1 - p): the variance of a
    Bernoulli reward with success probability p, which is what a group needs for a non-zero
    GRPO advantage (it vanishes for prompts that are always or never solved). The k best scores
    are returned best first; equal scores keep candidate order.

    Departures from VADE (known to this project from its abstract only): the score is the plain
    Bernoulli variance of one posterior draw, not VADE's information gain; ranking by the largest
    p(1 - p) = 1/4 - (p - 1/2)^2 is ranking by the smallest (p - 1/2)^2, the rule of verl's
    MoPPS recipe with target 1/2. Decay is one factor on the counts (`PromptHistory.decay`,
    which `PromptSelection` applies once per round), not VADE's two-scale decay, and the policy
    never decays the history itself. The policy is pure apart from its RNG.
    """

    def __init__(self, seed: int = 0, alpha0: float = 1.0, beta0: float = 1.0):
        if not (isinstance(alpha0, (int, float)) and alpha0 > 0):
            raise ValueError(f"alpha0 must be > 0, got {alpha0!r}")
        if not (isinstance(beta0, (int, float)) and beta0 > 0):
            raise ValueError(f"beta0 must be > 0, got {beta0!r}")
        self.alpha0 = float(alpha0)
        self.beta0 = float(beta0)
        self.rng = random.Random(seed)

    def scores(self, candidates: list[str], history: PromptHistory) -> list[float]:
        """One posterior draw per candidate (in order), mapped to p * (1 - p)."""
        out = []
        for pid in candidates:
            rec = history.stats(pid)
            failures = max(0.0, rec.attempts - rec.successes)
            p = self.rng.betavariate(self.alpha0 + rec.successes, self.beta0 + failures)
            out.append(p * (1.0 - p))
        return out

    def choose(self, candidates: list[str], k: int, history: PromptHistory, step: int) -> list[str]:
        _check_choose_args(candidates, k)
        scores = self.scores(candidates, history)
        order = sorted(range(len(candidates)), key=lambda i: (-scores[i], i))
        return [candidates[i] for i in order[:k]]

    def state_dict(self) -> dict:
        return _rng_state(self.rng)

    def load_state_dict(self, state: dict) -> None:
        _set_rng_state(self.rng, state)


class SkipSaturatedPolicy:
    """Wraps another policy and hides prompts the history shows to be saturated.

    A prompt is saturated when attempts >= min_attempts and its success rate is <= low or
    >= high (by default: never or always solved over at least 8 samples). A saturated prompt
    the data brings is skipped until it has been skipped `reprobe_every` times since it last
    trained; the next time it is offered to the inner policy again, so a prompt the policy has
    since learned (or forgotten) is found again. Counted in times met, not steps: the data
    brings a prompt back once an epoch, so a step count would re-probe every saturated prompt
    of a dataset whose epoch is longer than it. The inner policy chooses among the offered
    prompts; when fewer than k are offered, all of them are taken (in the inner policy's
    order) and the rest are filled with the skipped prompts seen least recently (smallest
    last_step, ties in candidate order), so k ids always come back. A prompt chosen starts
    its count over.
    """

    def __init__(self, inner: SelectionPolicy, min_attempts: float = 8, low: float = 0.0, high: float = 1.0,
                 reprobe_every: int = 10):
        if not (isinstance(min_attempts, (int, float)) and min_attempts >= 0):
            raise ValueError(f"min_attempts must be >= 0, got {min_attempts!r}")
        if not (isinstance(low, (int, float)) and isinstance(high, (int, float)) and 0.0 <= low < high <= 1.0):
            raise ValueError(f"low and high must satisfy 0 <= low < high <= 1, got low={low!r}, high={high!r}")
        if isinstance(reprobe_every, bool) or not isinstance(reprobe_every, int) or reprobe_every < 1:
            raise ValueError(f"reprobe_every must be an int >= 1, got {reprobe_every!r}")
        self.inner = inner
        self.min_attempts = min_attempts
        self.low = float(low)
        self.high = float(high)
        self.reprobe_every = reprobe_every
        self.skips: dict[str, int] = {}  # prompt id -> times skipped since it last trained

    def is_saturated(self, rec: PromptStats) -> bool:
        rate = rec.success_rate
        return rate is not None and rec.attempts >= self.min_attempts and (rate <= self.low or rate >= self.high)

    def choose(self, candidates: list[str], k: int, history: PromptHistory, step: int) -> list[str]:
        _check_choose_args(candidates, k)
        offered, skipped = [], []
        for i, pid in enumerate(candidates):
            rec = history.stats(pid)
            if self.is_saturated(rec) and self.skips.get(pid, 0) < self.reprobe_every:
                skipped.append((rec.last_step, i, pid))
            else:
                offered.append(pid)
        picked = self.inner.choose(offered, min(k, len(offered)), history, step)
        skipped.sort()
        chosen = picked + [pid for _, _, pid in skipped[: k - len(picked)]]
        for pid in chosen:
            self.skips.pop(pid, None)
        for _, _, pid in skipped[k - len(picked):]:
            self.skips[pid] = self.skips.get(pid, 0) + 1
        return chosen

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "skips": dict(self.skips)}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        self.skips = dict(state.get("skips", {}))  # absent from checkpoints written before the count


# ---------------------------------------------------------------------------------------------
# The run's prompt selection


class PromptSelection:
    """`selection.policy` wired to a run. Time is counted in policy versions (training steps,
    in every mode): when `next` is first called at a new version the history is scaled by
    `decay` once per version passed; `next` draws `candidates` x k prompts from the data
    iterator and keeps the k the policy picks; every scored group is observed into the history
    (`observe`) with the version as its `last_step`. State (history, policy RNG and skip counts,
    version, xrpo's latest prompts) goes into checkpoints."""

    def __init__(self, cfg, seed: int, correct: float, per_step: int = 0):
        self.cfg, self.correct = cfg, correct
        # allocation=xrpo: the latest prompts sized (a step's worth), the peers a short draw is sized among
        self.recent: deque[str] = deque(maxlen=per_step)
        inner = ThompsonPolicy(seed=seed, alpha0=cfg.alpha0, beta0=cfg.beta0) if "thompson" in cfg.policy \
            else UniformPolicy()
        self.policy = SkipSaturatedPolicy(inner, min_attempts=cfg.min_attempts, reprobe_every=cfg.reprobe_every) \
            if "skip_saturated" in cfg.policy else inner
        self.history = PromptHistory()
        self.version = 0  # the latest version `next` has seen (decay applied up to it)
        self._lock = threading.RLock()  # async mode observes on the data manager's thread

    def next(self, iterator, k: int, version: int) -> list:
        """k prompts for groups started at policy `version`. They are distinct unless fewer than
        k distinct prompts were drawn (a dataset smaller than k, or an epoch boundary inside a
        small draw), when the drawn order is kept as it is."""
        with self._lock:
            if version > self.version:
                if self.cfg.decay < 1.0:
                    self.history.decay(self.cfg.decay ** (version - self.version))
                self.version = version
            if self.cfg.policy == "uniform":  # allocation only: the data order, as without selection
                return iterator.next_batch(k)
            drawn = iterator.next_batch(max(k, math.ceil(self.cfg.candidates * k)))
            by_id = {}
            for p in drawn:
                by_id.setdefault(p.id, p)
            if len(by_id) < k:
                return drawn[:k]
            chosen = self.policy.choose(list(by_id), k, self.history, self.version)
            return [by_id[i] for i in chosen]

    def sizes(self, prompts: list, n: int) -> list[int]:
        """Samples for each of `prompts` (k of them): n each with allocation=fixed; with xrpo,
        split by `xrpo_allocation` over the history so far, n a prompt on average (n each if a
        prompt is drawn twice in one batch: the history cannot tell its two groups apart). A
        draw shorter than a step's prompts (APRIL refills a freed row or two at a time, async
        admits groups one by one) is sized among the latest prompts sized before it, filled up to
        a step's worth: alone, a prompt would get the whole k x n = n whatever its history."""
        ids = [p.id for p in prompts]
        if self.cfg.allocation == "fixed" or len(set(ids)) < len(ids):
            return [n] * len(prompts)
        from rollover.rollout.allocation import xrpo_allocation

        with self._lock:
            peers = [i for i in dict.fromkeys(reversed(self.recent)) if i not in ids]
            among = ids + peers[: max(0, (self.recent.maxlen or 0) - len(ids))]
            alloc = xrpo_allocation(self.history, among, n * len(among), min_n=self.cfg.min_samples)
            self.recent.extend(ids)
        return [alloc[i] for i in ids]

    def observe(self, group, primary: str, version: int) -> None:
        """A scored group's samples (those with a reward) join its prompt's history."""
        scored = [r for r in group.rollouts if r.reward is not None]
        if scored:
            with self._lock:
                self.history.observe(group.prompt.id, [r.reward for r in scored],
                                     [(r.scores.get(primary) or 0.0) >= self.correct for r in scored], version,
                                     max(version, self.version))

    def state_dict(self) -> dict:
        with self._lock:
            return {"history": self.history.state_dict(), "policy": self.policy.state_dict(), "version": self.version,
                    "policy_name": self.cfg.policy, "recent": list(self.recent)}

    def load_state_dict(self, state: dict) -> None:
        self.history.load_state_dict(state["history"])
        self.recent.extend(state.get("recent", []))  # absent from checkpoints written before it
        if state.get("policy_name") == self.cfg.policy:
            self.policy.load_state_dict(state["policy"])
        else:  # resumed under another policy (--allow-config-change): its generator starts afresh
            import logging

            logging.getLogger("rollover").warning("selection.policy changed from %s to %s: the history is kept, the "
                                                  "policy's random state starts afresh", state.get("policy_name"),
                                                  self.cfg.policy)
        self.version = state["version"]
