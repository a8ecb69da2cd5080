"""`env`: multi-turn environments."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rollover.config.base import NonEmptyStr, Section


class EnvConfig(Section):
    name: NonEmptyStr | None = None
    """Multi-turn environment (rollover.envs): guess_number, arithmetic_retry, tools, interpreter,
    inline_tools, agent (an
    agent written against an OpenAI-style chat client: options.fn names it), or
    `module:Name` / `path/to/file.py:Name` (a class or factory taking `options` as keyword
    arguments, returning an object with make_group(prompt, n)). Unset: single-turn, scored by
    reward.functions. With an environment, the environment gives the reward (reward.functions
    are not used)."""
    options: dict[str, Any] = {}
    """Keyword arguments for the environment (e.g. {low: 1, high: 8, max_guesses: 4})."""
    max_turns: int = Field(8, ge=1)
    """Sampled turns per episode at most (rollout.max_new_tokens bounds each turn)."""
    max_total_tokens: int = Field(512, ge=2)
    """Bound on an episode's whole token sequence (the opening, every turn, every insertion);
    training rows default to this length."""
    step_timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    """An environment call past this fails its episode (counted, reported; never scored 0)."""
    resample_failed: int = Field(0, ge=0)
    """Failed episodes (the environment raised or timed out) run again, up to this many per
    group: the same task in a fresh environment, with another sampling seed, so the group trains
    at full size. Each is logged and counted (`rollout/env/resampled`; `rollout/env/failed`
    counts the failures past the limit). The replacement's environment is what the builder makes
    for its place: its make_one(prompt, n, j) where it has one, else make_group(prompt, n)[j] (a
    costly builder without make_one pays a group's worth per resample). 0: a failed episode leaves
    its group, which trains on the others."""
    tasks: int = Field(2000, ge=1)
    """With data.train: env, how many tasks the environment's own generator makes."""
    dynamic_turns: bool = False
    """DART dynamic trajectory length: a task solved in at least dynamic_turns_threshold of its
    last group's episodes gets one turn more than its longest success used (at least
    min_turns); other tasks keep max_turns."""
    dynamic_turns_threshold: float = Field(0.5, gt=0, le=1)
    """Success rate from which a task counts as easy for dynamic_turns."""
    min_turns: int = Field(1, ge=1)
    """dynamic_turns: the fewest turns a task is given."""
    max_concurrent: int = Field(64, ge=1)
    """Environment calls running at once across all episodes (the environment cluster's size);
    more wait for a slot (the wait does not count against step_timeout_s)."""
    credit: Literal["episode", "reward_to_go", "gigpo"] = "episode"
    """How an episode's advantage reaches its turns. episode: every token of the episode gets its
    advantage (the estimator over episode rewards). reward_to_go: a turn's tokens get the return
    that follows them less the group's baseline, `A + G_t - G_0` with `G_t` the (discounted,
    env.gamma) sum of the rewards of turn t and after and `A` the advantage of `G_0` by
    algorithm.advantage (drgrpo or rloo: a baseline, no scaling), so a turn is not credited with
    rewards earned before it (REINFORCE's causality); with rewards only at the last turn and gamma
    1 it is `episode`. gigpo (GiGPO): a turn's tokens get `A + env.step_weight * A_step`, where
    `A_step` is algorithm.advantage over the turns of the group that start from the same state
    (the same opening, or the same state left by the step before: `StepResult.state`, else the
    whole conversation before the turn), each valued by its (discounted) return from there; `A`
    is algorithm.advantage over the episodes' undiscounted returns. With algorithm.advantage=gae
    (PPO with a critic), reward_to_go puts each turn's reward on its last trained token and the
    critic's GAE carries it back (per token: algorithm.gamma, lam); episode puts the episode's
    reward on its last token."""
    gamma: float = Field(1.0, gt=0, le=1)
    """env.credit=reward_to_go or gigpo: the discount per turn."""
    step_weight: float = Field(1.0, ge=0)
    """env.credit=gigpo: the weight of a turn's advantage within its state's group (GiGPO's ω)."""
    inline: bool = False
    """Run environment calls on the engine's thread between decode steps instead of on their
    own event loop: the schedule then depends on the seeds alone (APRIL runs resume bit-exactly;
    in async mode when the trainer takes a batch still depends on timing), but decoding stops
    while an environment works. For fast environments (games); off for tools, sandboxes and
    anything slow. The calls share one event loop, kept for the run."""
