"""Simulated multi-turn environments: episodes through the real schedules on the virtual clock."""

from __future__ import annotations

import random

import pytest

from rollover.config import ConfigError
from rollover.sim.config import load_sim_config

# 4 groups of 2 episodes on 2 workers x 8 rows: every episode runs at once, wherever routed. Each turn samples 7
# tokens: a free prefill samples the first, then 6 decode steps of 0.01 s.
BASE = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=64",
        "simulate.pools=[{workers: 2, max_rows: 8}]", "simulate.decode={step_s: 0.01}",
        "simulate.train={step_s: 1.0}", "simulate.sync={latency_s: 0.5}", "simulate.prompt_tokens=16",
        "simulate.prompts=64", "simulate.lengths={kind: empirical, values: [7]}", "logging.progress=false",
        "env.max_turns=3", "env.max_total_tokens=256"]
TURN_S = 6 * 0.01


def simulate(*overrides):
    from rollover.sim.run import simulate as sim

    return sim(load_sim_config(None, BASE + list(overrides)))


def test_an_episode_takes_its_turns_and_its_environment_calls_in_virtual_time():
    # turns drawn with mean 1,000: every episode runs to env.max_turns=3 (three turns, three
    # steps of exactly 0.3 s after an opening of 0.2 s), then 1 s of training and 0.5 s of sync
    r = simulate("steps=2", "simulate.env={turns: 1000, step_s: 0.3, sigma: 0, open_s: 0.2, obs_tokens: 12}")
    assert r["simulated_s"] == pytest.approx(2 * (0.2 + 3 * (TURN_S + 0.3) + 1.5))
    assert r["samples_trained"] == 16
    # a response: three sampled turns and the two insertions between them (12 tokens each)
    assert [row["response_tokens"] for row in r["step_rows"]] == [8 * (3 * 7 + 2 * 12)] * 2
    env = r["env"]
    assert env["calls"] == 2 * 8 * 4 and env["timed_out"] == 0 and env["wait_s"] == 0
    assert env["busy_s"] == pytest.approx(2 * 8 * (0.2 + 3 * 0.3))
    assert env["utilization"] == pytest.approx(env["busy_s"] / (64 * r["simulated_s"]))


def test_a_full_environment_cluster_queues_calls():
    # one slot: the 8 episodes' calls run one at a time, 8 x 3 x 0.3 s of steps a training step
    one = simulate("steps=2", "env.max_concurrent=1", "simulate.env={turns: 1000, step_s: 0.3, sigma: 0}")
    many = simulate("steps=2", "simulate.env={turns: 1000, step_s: 0.3, sigma: 0}")
    assert one["env"]["busy_s"] == pytest.approx(many["env"]["busy_s"]) == pytest.approx(2 * 8 * 3 * 0.3)
    assert one["simulated_s"] >= 2 * (8 * 3 * 0.3 + 1.5) - 1e-9
    assert one["env"]["wait_s"] > 0 and one["env"]["utilization"] > 0.7
    assert many["simulated_s"] == pytest.approx(2 * (3 * (TURN_S + 0.3) + 1.5))


def test_measured_turn_counts_replace_the_geometric_draw():
    r = simulate("steps=2", "simulate.env={turn_values: [2], step_s: 0.3, sigma: 0, obs_tokens: 12}")
    assert r["env"]["calls"] == 2 * 8 * (1 + 2)  # an opening and two steps per episode
    assert [row["response_tokens"] for row in r["step_rows"]] == [8 * (2 * 7 + 12)] * 2
    mixed = simulate("steps=4", "simulate.env={turn_values: [1, 3], step_s: 0.3, sigma: 0}")
    steps = mixed["env"]["calls"] - 4 * 8
    assert 4 * 8 < steps < 4 * 8 * 3  # some episodes drew 1 turn, some 3


def test_a_step_latency_is_clipped_to_its_bounds():
    r = simulate("steps=2", "simulate.env={turns: 1000, step_s: 0.3, sigma: 3.0, min_s: 0.1, max_s: 0.5}")
    steps = r["env"]["calls"] - 2 * 8  # less the openings, which take no time here
    assert steps == 2 * 8 * 3 and 0.1 * steps < r["env"]["busy_s"] < 0.5 * steps
    assert r["env"]["busy_s"] != pytest.approx(0.3 * steps)  # the spread is there, within the bounds
    with pytest.raises(ConfigError, match="max_s=0.1 is below min_s=0.2"):
        simulate("steps=1", "simulate.env={turns: 2, min_s: 0.2, max_s: 0.1}")


def test_an_environment_call_past_the_timeout_fails_its_episode_at_the_timeout():
    r = simulate("steps=1", "env.step_timeout_s=1.0", "simulate.env={turns: 1000, step_s: 5.0, sigma: 0}")
    assert r["env"]["timed_out"] == 8 and r["samples_trained"] == 0  # failed episodes are never scored 0
    assert r["simulated_s"] == pytest.approx(TURN_S + 1.0 + 1.5)  # each waited 1 s, not 5


@pytest.mark.parametrize("mode", [["partial_rollout.enabled=true"],
                                  ["partial_rollout.enabled=true", "env.dynamic_turns=true"],
                                  ["mode=async", "async.max_staleness=1"]])
def test_april_and_async_run_episodes_deterministically_within_the_staleness_bound(mode):
    args = ["steps=5", "simulate.lengths={median: 12, sigma: 1.0}", "env.max_concurrent=4",
            "simulate.env={turns: 2.5, step_s: 0.2, sigma: 0.8, obs_tokens: 10}", *mode]
    r = simulate(*args)
    assert r == simulate(*args)
    assert r["samples_trained"] == 5 * 8 and r["env"]["calls"] > 5 * 8 * 2
    if "mode=async" in mode:
        assert max(int(k) for k in r["staleness"]) <= 1


def test_turns_are_geometric_with_the_given_mean():
    from rollover.sim.envs import _geometric

    rng = random.Random(0)
    draws = [_geometric(rng, 4.0) for _ in range(20000)]
    assert min(draws) == 1 and abs(sum(draws) / len(draws) - 4.0) < 0.1
    assert {_geometric(rng, 1.0) for _ in range(100)} == {1}


def test_environments_the_simulator_cannot_run_are_refused_by_name():
    with pytest.raises(ConfigError, match="describe it in simulate.env"):
        simulate("steps=1", "env.name=guess_number", "data.train=env", "env.max_total_tokens=1024")
    with pytest.raises(ConfigError, match="schedulers' path"):
        simulate("steps=1", "simulate.fast=true", "simulate.env={turns: 2}")
    with pytest.raises(ConfigError, match="leave simulate.reward unset"):
        simulate("steps=1", "simulate.reward={per_group_s: 1.0}", "simulate.env={turns: 2}")
    with pytest.raises(ConfigError, match="no room"):
        simulate("steps=1", "simulate.prompt_tokens=300", "simulate.env={turns: 2}")
    with pytest.raises(ConfigError, match="episodes carry their tokens"):  # as in a real multi-turn run
        load_sim_config(None, BASE + ["simulate.env={turns: 2}", "partial_rollout.enabled=true",
                                      "partial_rollout.carry=keep_kv"])
    with pytest.raises(ConfigError, match="selection.dars"):
        load_sim_config(None, BASE + ["simulate.env={turns: 2}", "selection.dars=equal"])
    with pytest.raises(ConfigError, match="obs_tokens"):
        load_sim_config(None, BASE + ["simulate.env={turns: 2, obs_tokens: 3}"])
