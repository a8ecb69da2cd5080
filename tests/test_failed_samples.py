"""Failures cost what failed: a failed sample leaves its group, which trains on the rest (its
baseline over the survivors); a group left with fewer than two is skipped; a collection with
nothing trainable is counted and collected again, and only `train.max_bad_steps` of them in a
row stop the run, with a checkpoint. In sync, APRIL and async mode alike."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from rollover.config import ConfigError, load_config
from rollover.loops.async_ import train_async
from rollover.loops.batch import ledger_rows, train_batch_from
from rollover.rollout.stops import TooManyEmptyCollections
from rollover.loops.sync import train_sync
from rollover.rollout.groups import group_advantages, keep_group
from rollover.testing import save_tiny_model
from rollover.types import Group, Prompt, Rollout
from test_env_training import env_cfg, rows


def _group(rewards: list[float | None]) -> Group:
    rollouts = [Rollout(group_id="g0", prompt_ids=[1], response_ids=[2, 3], logprobs=[-0.5, -0.5], versions=[0, 0],
                        loss_mask=[1, 1], finish="stop", reward=r, scores={} if r is None else {"env": r})
                for r in rewards]
    return Group(id="g0", prompt=Prompt(id="p0", text="x"), prompt_ids=[1], rollouts=rollouts)


def test_a_failed_sample_leaves_its_group_which_trains_on_the_rest():
    cfg = load_config(None, ["algorithm.advantage=grpo"])
    group, m = _group([1.0, 0.0, None, 0.5]), Counter()
    assert keep_group(group, cfg, m)
    assert [r.reward for r in group.rollouts] == [1.0, 0.0, 0.5] and group.dropped == 1
    assert m == {"dropped_samples": 1}
    # baseline over the three: mean 0.5, unbiased std sqrt((0.25 + 0.25 + 0) / 2) = 0.5
    adv, _ = group_advantages([group], cfg)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0]), atol=1e-5)
    batch, _ = train_batch_from([group], cfg)
    assert len(batch) == 3
    assert ledger_rows([group])[0]["samples"] == 3 and ledger_rows([group])[0]["dropped"] == 1


def test_a_group_left_with_one_sample_is_skipped_but_a_group_of_one_trains():
    cfg = load_config(None, ["algorithm.advantage=grpo"])
    m = Counter()
    assert not keep_group(_group([None, 1.0, None, None]), cfg, m)
    assert m == {"dropped_samples": 3, "skipped_groups": 1}
    assert not keep_group(_group([None]), cfg, m)
    one = load_config(None, ["algorithm.advantage=reinforce_pp", "rollout.samples_per_prompt=1"])
    assert keep_group(_group([0.5]), one, Counter())


def test_dynamic_sampling_with_gdpo_keeps_a_group_whose_functions_differ_though_its_totals_do_not():
    """Two functions weighted alike that swap between the samples: every total is 1 (GRPO has no
    signal, the group is filtered), but each function's scores differ (GDPO learns from them)."""
    def group():
        g = _group([1.0, 1.0])
        for r, (a, b) in zip(g.rollouts, [(1.0, 0.0), (0.0, 1.0)]):
            r.scores = {"numeric": a, "format": b}
        return g

    funcs = "reward.functions=[numeric, format]"
    for advantage, kept in (("grpo", False), ("gdpo", True)):
        cfg = load_config(None, [funcs, "algorithm.dynamic_sampling=true", f"algorithm.advantage={advantage}"])
        m = Counter()
        assert keep_group(group(), cfg, m) is kept, advantage
        assert m.get("filtered_groups", 0) == (not kept)
    one_absent = group()  # a function that scored one sample only has no spread in the group
    one_absent.rollouts[1].scores = {"numeric": 1.0}
    one_absent.rollouts[0].scores = {"numeric": 1.0, "format": 0.0}
    gdpo = load_config(None, [funcs, "algorithm.dynamic_sampling=true", "algorithm.advantage=gdpo"])
    assert not keep_group(one_absent, gdpo, Counter())


def test_dynamic_sampling_by_accuracy_drops_an_all_wrong_group_whose_format_scores_differ():
    """dynamic_sampling_metric=accuracy (DAPO's, verl's filter_groups.metric=acc): right or not by
    the first function and reward.correct_threshold; by reward, the format scores' spread keeps it."""
    def group(numeric):
        g = _group([n + 0.5 * f for n, f in zip(numeric, (1.0, 0.0))])
        for r, n, f in zip(g.rollouts, numeric, (1.0, 0.0)):
            r.scores = {"numeric": n, "format": f}
        return g

    base = ["reward.functions=[numeric, {fn: format, weight: 0.5}]", "algorithm.dynamic_sampling=true"]
    by_reward, by_accuracy = load_config(None, base), load_config(None, [*base, "algorithm.dynamic_sampling_metric=accuracy"])
    assert keep_group(group([0.0, 0.0]), by_reward, Counter(), primary="numeric")
    m = Counter()
    assert not keep_group(group([0.0, 0.0]), by_accuracy, m, primary="numeric") and m["filtered_groups"] == 1
    assert keep_group(group([1.0, 0.0]), by_accuracy, Counter(), primary="numeric")
    assert not keep_group(group([1.0, 1.0]), by_accuracy, Counter(), primary="numeric")
    with pytest.raises(ConfigError, match="dynamic_sampling_metric=accuracy says what dynamic sampling compares: set "
                                          "algorithm.dynamic_sampling: true too"):
        load_config(None, ["model=m", "run_dir=r", "algorithm.dynamic_sampling_metric=accuracy"])


def test_dynamic_sampling_filters_on_the_answers_not_on_their_overlong_shaping():
    """DAPO filters a group whose answers are all right (or all wrong), whatever their lengths: the
    overlong penalty (algorithm.overlong_buffer) makes the rewards differ, and such a group was
    kept, to train on its lengths alone. Its shaped rewards still train a group that is kept."""
    from types import SimpleNamespace

    from rollover.rollout.groups import score_groups

    cfg = load_config(None, ["algorithm.dynamic_sampling=true", "rollout.max_new_tokens=8",
                             "algorithm.overlong_buffer=4"])

    class Runner:  # every answer scores its given value
        def __init__(self, values):
            self.values = values

        def score(self, prompts, texts, **kw):
            return SimpleNamespace(samples=[SimpleNamespace(scores={"numeric": v}, extras={}, total=v)
                                            for v in self.values])

    def scored(values, lengths):
        g = _group(values)
        for r, n in zip(g.rollouts, lengths):
            r.response_ids = [2] * n
        score_groups([g], Runner(values), cfg)
        return g

    right = scored([1.0, 1.0], [3, 8])  # the second ends in the buffer: penalised
    assert right.rollouts[0].reward == 1.0 and right.rollouts[1].reward < 1.0
    m = Counter()
    assert not keep_group(right, cfg, m) and m["filtered_groups"] == 1
    mixed = scored([1.0, 0.0], [3, 8])
    assert keep_group(mixed, cfg, Counter()) and mixed.rollouts[1].reward < 0.0  # trained on the shaped rewards


def test_a_remax_group_without_its_greedy_answer_is_skipped_and_dynamic_sampling_counts_it():
    """ReMax's baseline is its greedy answer: a group whose greedy answer failed (or that has
    none) cannot train; with dynamic sampling, samples that agree with each other but not with
    their greedy answer keep the group, even one sample a prompt."""
    cfg = load_config(None, ["algorithm.advantage=remax", "algorithm.dynamic_sampling=true",
                             "rollout.samples_per_prompt=1"])
    failed, m = _group([1.0]), Counter()
    failed.greedy = _group([None]).rollouts[0]
    assert not keep_group(failed, cfg, m) and m == {"skipped_groups": 1}
    assert not keep_group(_group([1.0]), cfg, Counter())  # no greedy answer at all
    agree, beaten = _group([1.0]), _group([1.0])
    agree.greedy, beaten.greedy = _group([1.0]).rollouts[0], _group([0.0]).rollouts[0]
    m = Counter()
    assert not keep_group(agree, cfg, m) and m == {"filtered_groups": 1, "filtered_tokens": 2}
    assert keep_group(beaten, cfg, Counter())
    adv, info = group_advantages([beaten], cfg)
    assert adv.tolist() == [1.0] and info["singleton_groups"] == 1


FLAKY_ENV = '''
from rollover.envs.base import StepResult
from rollover.types import Prompt


class Flaky:
    """Task k's episode j raises in step() when 4k + j is 3 mod `every` (10: one episode in
    ten, never two of one group of four; 0: never); every episode of the tasks in `broken`
    raises."""

    def __init__(self, broken=(), every=10):
        self.broken, self.every = set(broken), every

    def prompts(self, n, seed=0):
        return [Prompt(id=f"flaky-{seed}-{i}", text="Say something.", answer=i) for i in range(n)]

    def make_group(self, prompt, n):
        k = int(prompt.answer)
        return [FlakyEnv(k in self.broken or bool(self.every) and (4 * k + j) % self.every == 3) for j in range(n)]


class FlakyEnv:
    def __init__(self, fails):
        self.fails = fails

    async def initial_observation(self):
        return [{"role": "user", "content": "Say something."}]

    async def step(self, action):
        import os
        import signal

        once = os.environ.get("FLAKY_SIGTERM_ONCE")  # a file: its first failing step stops the run as a signal does
        if self.fails and once and os.path.exists(once):
            os.remove(once)
            os.kill(os.getpid(), signal.SIGTERM)
        if self.fails:
            raise RuntimeError("simulator crashed")
        return StepResult([], float(len(action.text) % 2), done=True)
'''

MODES = {
    "sync": {},
    "april": {"partial_rollout.enabled": True, "partial_rollout.oversample": 2.0,
              "partial_rollout.max_carry_steps": 100, "env.inline": True},
    "async": {"mode": "async", "async.max_staleness": 1},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama", seed=21))


def flaky_cfg(model_dir, tmp_path, mode: str, options: dict, **over):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "flaky_env.py"
    path.write_text(FLAKY_ENV)
    return env_cfg(model_dir, tmp_path / "run", **{
        "env.name": f"{path}:Flaky", "env.options": options, "env.tasks": 40, "data.shuffle": False,
        "data.eval_size": 0, "rollout.samples_per_prompt": 4, "rollout.max_new_tokens": 4, "checkpoint.every": 0,
        **MODES[mode], **over})


def train(cfg):
    return train_async(cfg) if cfg.mode == "async" else train_sync(cfg)


def ledger(run_dir):
    return [g for line in open(run_dir / "trained_groups.jsonl") for g in json.loads(line)["groups"]]


@pytest.mark.parametrize("mode", MODES)
def test_one_episode_in_ten_failing_costs_only_those_episodes(model_dir, tmp_path, mode):
    train(flaky_cfg(model_dir, tmp_path, mode, {}, steps=5))
    got = rows(tmp_path / "run")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert all(r["groups"] == 2 and r["rollout/skipped_groups"] == 0 for r in got)
    dropped = sum(r["rollout/dropped_samples"] for r in got)
    assert dropped > 0
    trained = ledger(tmp_path / "run")
    assert all(g["samples"] + g["dropped"] == 4 and g["dropped"] <= 1 for g in trained)
    # APRIL and async also count the groups scored ahead of training (carried, or in the next batch)
    assert 0 < sum(g["dropped"] for g in trained) <= dropped
    if mode == "sync":  # every failed episode is the step's own
        assert sum(g["dropped"] for g in trained) == dropped
        assert [r["rollout/dropped_samples"] for r in got] == [r["rollout/env/failed"] for r in got]
        assert [r["samples"] for r in got] == [8 - r["rollout/dropped_samples"] for r in got]


@pytest.mark.parametrize("mode", MODES)
def test_a_step_whose_groups_all_fail_is_collected_again(model_dir, tmp_path, mode):
    # the tasks of step 2 (2 and 3 in data order) fail every episode
    train(flaky_cfg(model_dir, tmp_path, mode, {"broken": [2, 3], "every": 0}, steps=3))
    got = rows(tmp_path / "run")
    assert [r["step"] for r in got] == [1, 2, 3]
    assert sum(r["rollout/skipped_groups"] for r in got) == 2
    assert sum(r["rollout/dropped_samples"] for r in got) == 8
    assert "flaky-3-2" not in {g["prompt"] for g in ledger(tmp_path / "run")}
    if mode == "sync":  # step 2 came again from tasks 4 and 5, at the same weights
        assert [r["rollout/empty_collections"] for r in got] == [0, 1, 0]
        assert got[1]["rollout/skipped_groups"] == 2 and got[1]["groups"] == 2
        # the empty collection's episodes are counted with the step that trained next
        assert got[1]["rollout/env/failed"] == 8 and got[1]["rollout/env/episodes"] == 16
        assert [g["prompt"] for g in json.loads(open(tmp_path / "run" / "trained_groups.jsonl").readlines()[1])
                ["groups"]] == ["flaky-3-4", "flaky-3-5"]
        assert [r["rollout/rounds"] for r in got] == [1, 2, 1]  # the empty collection's round and tokens too
        assert got[1]["timing_s/step"] >= got[1]["timing_s/generate"] + got[1]["timing_s/train"]  # and its time
        assert got[1]["rollout/generated_tokens"] > max(got[0]["rollout/generated_tokens"], got[2]["rollout/generated_tokens"])
    if mode == "async":  # two groups in a row dropped, in start order: a batch's worth
        assert sum(r["rollout/empty_collections"] for r in got) == 1


def test_a_run_stopped_by_a_signal_after_an_empty_collection_reports_it_after_the_resume(model_dir, tmp_path,
                                                                                       monkeypatch):
    """A signal during a collection that trains nothing saves the step before it; the resumed
    run's next row still counts that collection (its checkpoint keeps the counts), as the
    unstopped run's does."""
    options = {"broken": [2, 3], "every": 0}
    train(flaky_cfg(model_dir, tmp_path / "straight", "sync", options, steps=3))
    (tmp_path / "once").write_text("")
    monkeypatch.setenv("FLAKY_SIGTERM_ONCE", str(tmp_path / "once"))
    stopped = train(flaky_cfg(model_dir, tmp_path / "split", "sync", options, steps=3))
    assert stopped["step"] == 1 and stopped["interrupted"] == "SIGTERM"
    train(flaky_cfg(model_dir, tmp_path / "split", "sync", options, steps=3))

    def counts(run_dir):
        from rollover.loops.batch import EmptyCollections

        kept = {f"rollout/{k}" for k in (*EmptyCollections.FOLDED, "empty_collections") if not k.endswith("_s")}
        return [{k: v for k, v in r.items() if k in kept} for r in rows(run_dir)]

    straight, split = counts(tmp_path / "straight" / "run"), counts(tmp_path / "split" / "run")
    assert split == straight and straight[1]["rollout/empty_collections"] == 1


@pytest.mark.parametrize("mode", MODES)
def test_an_environment_that_always_fails_stops_the_run_with_a_checkpoint(model_dir, tmp_path, mode):
    cfg = flaky_cfg(model_dir, tmp_path, mode, {"broken": list(range(40))}, steps=3, **{"train.max_bad_steps": 2})
    with pytest.raises(TooManyEmptyCollections, match="train.max_bad_steps=2.*stopped at step 0 with a checkpoint"):
        train(cfg)
    assert (tmp_path / "run" / "checkpoints" / "step_000000" / "DONE").exists()


@pytest.mark.parametrize("mode", ["sync", "april"])
def test_a_run_with_failures_resumes_exactly(model_dir, tmp_path, mode):
    from safetensors.torch import load_file

    over = {"steps": 4, "checkpoint.every": 2}
    train(flaky_cfg(model_dir, tmp_path / "straight", mode, {}, **over))
    train(flaky_cfg(model_dir, tmp_path / "split", mode, {}, **{**over, "steps": 2}))
    train(flaky_cfg(model_dir, tmp_path / "split", mode, {}, **over))  # resume: auto, from step 2
    weights = [load_file(str(tmp_path / d / "run" / "checkpoints" / "step_000004" / "model" / "model.safetensors"))
               for d in ("straight", "split")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert ledger(tmp_path / "straight" / "run") == ledger(tmp_path / "split" / "run")


def test_an_empty_collections_counts_reach_the_next_step_per_reward_function_too():
    """The counts of collections that trained nothing are added to the next training step's:
    `reward_errors` and each function's `rewards/<fn>/errors` alike (an average is not)."""
    from types import SimpleNamespace

    from rollover.loops.batch import EmptyCollections

    run = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(max_bad_steps=5)))
    empty = EmptyCollections()
    lost = {"reward_errors": 4, "dropped_samples": 4, "rewards/flaky/errors": 4, "rewards/flaky/mean": 0.5}
    assert empty.add(run, 1, lost) is None and empty.add(run, 1, lost) is None
    out = empty.fold({"reward_errors": 2, "dropped_samples": 2, "rewards/flaky/errors": 2, "rewards/flaky/mean": 0.25})
    assert out["reward_errors"] == out["rewards/flaky/errors"] == out["dropped_samples"] == 10
    assert out["rewards/flaky/mean"] == 0.25 and out["empty_collections"] == 2
    empty.add(run, 1, {"generated_tokens": 30, "rounds": 1, "generate_s": 0.5, "occupancy": 0.9})
    out = empty.fold({"generated_tokens": 20, "rounds": 1, "generate_s": 0.25, "occupancy": 0.7})
    assert out == {"generated_tokens": 50, "rounds": 2, "generate_s": 0.75, "occupancy": 0.7, "empty_collections": 1}
    assert empty.fold({})["empty_collections"] == 0
