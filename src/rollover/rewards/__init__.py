"""Reward functions, how config names them, and the runner that scores batches with them.
See docs/data_and_rewards.md."""

from rollover.rewards.builtins import (
    BUILTINS,
    exact_reward,
    format_reward,
    math_reward,
    numeric_reward,
)
from rollover.rewards.countdown import countdown_reward
from rollover.rewards.extract import extract_boxed, final_answer
from rollover.rewards.pool import RewardTimeout, WorkerDied, WorkerStartError
from rollover.rewards.registry import Reward, RewardSpec, TrainerState, build_rewards, resolve_reward_fn
from rollover.rewards.runner import (
    BatchRewards,
    RewardFailed,
    RewardFailure,
    RewardRunner,
    SampleReward,
)

__all__ = [
    "BUILTINS",
    "BatchRewards",
    "Reward",
    "RewardFailed",
    "RewardFailure",
    "RewardRunner",
    "RewardSpec",
    "RewardTimeout",
    "SampleReward",
    "TrainerState",
    "WorkerDied",
    "WorkerStartError",
    "build_rewards",
    "countdown_reward",
    "exact_reward",
    "extract_boxed",
    "final_answer",
    "format_reward",
    "math_reward",
    "numeric_reward",
    "resolve_reward_fn",
]
