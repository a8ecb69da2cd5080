"""Config parsing: typed, documented, unknown keys suggested, conflicts rejected."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollover.cli import main
from rollover.config import Config, ConfigError, describe, load_config

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_parse(path):
    cfg = load_config(path)
    assert cfg.model == "smollm2-135m-instruct"


def test_overrides_and_types():
    cfg = load_config(EXAMPLES[0], ["rollout.temperature=0.7", "train.lr=3e-6", "reward.functions=[math, numeric]"])
    assert cfg.rollout.temperature == 0.7 and cfg.train.lr == 3e-6 and cfg.reward.functions == ["math", "numeric"]
    with pytest.raises(ConfigError, match="steps: Input should be a valid integer"):
        load_config(overrides=["steps=abc"])
    with pytest.raises(ConfigError, match="must look like key.path=value"):
        load_config(overrides=["steps"])


@pytest.mark.parametrize("key, hint", [("rollout.temprature=1", "did you mean 'temperature'"),
                                       ("trian.lr=1", "did you mean 'train'"),
                                       ("algorithm.eps_hihg=0.3", "did you mean 'eps_high'")])
def test_unknown_keys_suggest_the_nearest(key, hint):
    with pytest.raises(ConfigError, match=hint):
        load_config(overrides=[key])


@pytest.mark.parametrize("over, match", [
    (["algorithm.loss=gspo"], "seq-mean-token-mean"),
    (["rollout.samples_per_prompt=1"], "samples_per_prompt must be >= 2"),
    (["algorithm.dynamic_sampling=true", "rollout.samples_per_prompt=1", "algorithm.advantage=reinforce_pp_baseline"], "dynamic_sampling"),
    (["rollout.temperature=0"], "temperature must be > 0"),
    (["async.max_staleness=2"], "mode is sync"),
    (["mode=async", "partial_rollout.enabled=true"], "applies to sync mode"),
    (["partial_rollout.enabled=true", "partial_rollout.on_stale=is"], "decoupled_ppo or algorithm.tis_cap"),
    (["train.pack_length=64", "data.max_prompt_tokens=64"], "must hold the longest sequence"),
    (["algorithm.overlong_buffer=300"], "overlong_buffer"),
])
def test_conflicts_rejected_not_repaired(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=over)


def test_loss_default_follows_mode():
    assert load_config().algorithm.loss == "ppo"
    assert load_config(mode="async").algorithm.loss == "decoupled_ppo"


def test_every_field_is_documented():
    from pydantic import BaseModel

    def walk(model):
        for name, f in model.model_fields.items():
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
                yield from walk(f.annotation)
            else:
                yield f"{model.__name__}.{name}", f.description

    undocumented = [name for name, doc in walk(Config) if not doc]
    assert undocumented == []
    assert "max_staleness" in describe()


def test_cli_reports_config_errors(capsys):
    assert main(["train", "rollout.temprature=1"]) == 2
    assert "did you mean 'temperature'" in capsys.readouterr().err
