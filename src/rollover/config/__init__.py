"""The run configuration: typed, documented per field, validated when parsed.

A config is YAML (or a dict) with the sections below, plus `key.path=value` overrides from
the command line. Unknown keys are errors that suggest the nearest known name; options that
contradict each other are rejected, never silently repaired.

Every field carries its own range (`Field(ge=..., gt=..., le=...)`), so a value out of range is
reported as `key=value: must be >= 1`; `Config._consistent` (rollover.config.run) holds only
the checks that involve more than one field.

One module per part (`data`, `rollout`, `reward`, `algorithm`, `train` with the critic, the distillation teacher, evaluation,
checkpoint and logging sections, `env`, `schedule`, `ray`), the whole run (`run`), reading and writing (`load`), and the generated reference
(`reference`; `python -m rollover.config docs/config.md` writes docs/config.md). The simulated
cluster, which training never reads, is `rollover simulate`'s own section (rollover.sim.config).
"""

from rollover.config.algorithm import AlgorithmConfig
from rollover.config.base import ConfigError, Section
from rollover.config.data import DataConfig
from rollover.config.env import EnvConfig
from rollover.config.load import RESUME_FREE_KEYS, config_changes, dump_config, load_config, parse_overrides, read_yaml
from rollover.config.ray import RayConfig
from rollover.config.reference import describe, markdown_reference
from rollover.config.reward import RewardConfig
from rollover.config.rollout import PartialRolloutConfig, RolloutConfig
from rollover.config.run import Config
from rollover.config.schedule import AsyncConfig, DownsampleConfig, SelectionConfig
from rollover.config.train import CheckpointConfig, CriticConfig, DistillConfig, EvalConfig, LoggingConfig, TrainConfig

__all__ = [
    "AlgorithmConfig", "AsyncConfig", "CheckpointConfig", "Config", "ConfigError", "CriticConfig", "DataConfig", "DistillConfig", "DownsampleConfig",
    "EnvConfig", "EvalConfig", "LoggingConfig", "PartialRolloutConfig", "RESUME_FREE_KEYS", "RayConfig",
    "RewardConfig", "RolloutConfig", "Section", "SelectionConfig", "TrainConfig", "config_changes", "describe",
    "dump_config", "load_config", "markdown_reference", "parse_overrides", "read_yaml",
]
