"""What the rollout side takes from a run, and nothing more.

Collectors (sync, APRIL, the async rollout service and data manager), the sample driver and
the scoring helpers take a `RolloutInputs`: the config, the engine, the tokenizer, the scorer of
single-turn samples, the prompt source, and the parts a run may have (environments, prompt
selection, turn budgets). They never see the trainer, the logger, checkpoints or the data
iterator's state: the prompt source (`next_groups`) is the one door to the run's data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from rollover.config import Config
    from rollover.rewards import RewardRunner
    from rollover.rollout.groups import PendingGroup


@dataclass(frozen=True)
class RolloutInputs:
    cfg: Config
    engine: Any  # the engine contract (rollover.engine.Engine)
    tokenizer: Any
    rewards: RewardRunner  # scores single-turn samples
    primary_reward: str  # the reward accuracy is counted by ("env" for episodes)
    next_groups: Callable[..., list[PendingGroup]]  # (k, version) -> the next k prompts as pending groups
    env_builder: Any = None  # multi-turn runs: makes each group's environments
    env_runner: Any = None  # where environment calls run
    selection: Any = None  # selection.policy's per-prompt history (observes scored groups)
    turn_budget: Any = None  # env.dynamic_turns (observes finished episodes)
    processor: Any = None  # episodes with a vision-language model: renders the images in their messages

    @classmethod
    def of(cls, run) -> "RolloutInputs":
        """The inputs of a built run (`rollover.loops.common.Run`), once its parts are attached."""
        return cls(cfg=run.cfg, engine=run.engine, tokenizer=run.tokenizer, rewards=run.rewards,
                   primary_reward=run.primary_reward, next_groups=run.next_groups, env_builder=run.env_builder,
                   env_runner=run.env_runner, selection=run.selection, turn_budget=run.turn_budget,
                   processor=run.env_processor)
