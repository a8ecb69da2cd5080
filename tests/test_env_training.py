"""Multi-turn episodes through the synchronous loop (env.name): tokens trained are exactly the
sampled ones, failing environments are counted and isolated, resume is exact."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollover.rollout.inputs import RolloutInputs
from rollover.config import ConfigError, load_config
from rollover.loops.sync import train_sync
from rollover.testing import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama", seed=21))


def env_cfg(model_dir, run_dir, **over):
    base = {
        "device": "cpu", "model": model_dir, "run_dir": str(run_dir), "steps": 2, "seed": 3, "resume": "auto",
        "data.train": "env", "data.eval_size": 2, "data.max_prompt_tokens": 256,
        "env.name": "guess_number", "env.options": {"low": 1, "high": 8, "max_guesses": 3},
        "env.max_total_tokens": 400, "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2,
        "rollout.max_new_tokens": 6, "rollout.max_rows": 8, "train.lr": 1e-3, "eval.every": 0,
        "eval.at_start": False, "eval.samples_per_prompt": 2, "checkpoint.every": 1,
        "logging.progress": False, "logging.tensorboard": False,
    }
    base.update(over)
    return load_config(**base)


def rows(run_dir, kind="train"):
    return [r for r in map(json.loads, open(run_dir / "metrics.jsonl")) if r["kind"] == kind]


def test_datas_prompt_settings_under_an_environment_are_warned_unused_and_change_nothing(model_dir, tmp_path, caplog):
    """The environment writes each opening: data.system_prompt, instruction and chat_template=false
    neither reach it nor fail the run (the prompts' lengths are checked as the template renders them)."""
    from rollover.loops.build import build_run

    plain = build_run(env_cfg(model_dir, tmp_path / "a"), record=False)
    try:
        want = plain.prompt_ids
    finally:
        plain.close()
    with caplog.at_level(logging.WARNING, logger="rollover"):
        run = build_run(env_cfg(model_dir, tmp_path / "b", **{"data.system_prompt": "Be brief.", "data.instruction": "Go.",
                                                              "data.chat_template": False}))
    try:
        assert run.prompt_ids == want
    finally:
        run.close()
    assert "data.system_prompt, data.instruction, data.chat_template unused: env.name=guess_number" in caplog.text


def test_episodes_train_on_exactly_the_sampled_tokens(model_dir, tmp_path):
    train_sync(env_cfg(model_dir, tmp_path))
    got = rows(tmp_path)
    assert [r["step"] for r in got] == [1, 2]
    for r in got:
        assert r["rollout/env/episodes"] == 4 and r["rollout/env/failed"] == 0
        assert r["rollout/env/turns_mean"] >= 1
        assert 1 <= r["rollout/env/info/guesses"] <= 3 and 0 <= r["rollout/env/info/solved"] <= 1  # GuessNumber's info
        # only sampled tokens carry loss; the environment's (rendered feedback) do not
        assert r["actor/loss_tokens"] == r["rollout/generated_tokens"]
        assert r["response_length/mean"] > r["rollout/generated_tokens"] / 4  # inserted tokens are in the rows
        assert r["rollout/repetition_frac"] == 0.0  # turns of 6 tokens: only the last turn is read, none loops
    # step 1 trains on the engine's own samples: the trainer's forward over the interleaved
    # sequence reproduces the behaviour logprobs (nothing re-tokenised between turns)
    assert got[0]["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert got[0]["actor/approx_kl"] < 1e-6
    ev = rows(tmp_path, "eval")
    assert ev[-1]["eval/samples"] == 4 and "eval/turns_mean" in ev[-1] and ev[-1]["eval/repetition_frac"] == 0.0
    assert 1 <= ev[-1]["eval/info/guesses"] <= 3 and 0 <= ev[-1]["eval/info/solved"] <= 1  # held out too
    assert "eval/info/no_number" in ev[-1]
    # 2 prompts x 2 samples: a prompt with one of its two solved counts whole
    assert ev[-1]["eval/accuracy"] <= ev[-1]["eval/pass_at_k"] <= min(1.0, 2 * ev[-1]["eval/accuracy"])
    groups = [json.loads(x) for x in open(tmp_path / "trained_groups.jsonl")]
    assert [len(g["groups"]) for g in groups] == [2, 2]


def test_episode_run_killed_and_resumed_is_exact(model_dir, tmp_path):
    # the tiny random model never finds a number in 1-8: in 1-2, with four episodes a game, it
    # wins some and loses some, so the steps train and the weights compared below move
    over = {"env.options": {"low": 1, "high": 2, "max_guesses": 3}, "rollout.samples_per_prompt": 4}
    straight_and_resumed(model_dir, tmp_path, over)
    assert any(r["actor/grad_norm"] > 0 for r in rows(tmp_path / "resumed")[1:])  # the resumed steps trained


def straight_and_resumed(model_dir, tmp_path, over) -> list[dict]:
    """Three steps straight, and one step then two more resumed from its checkpoint: the same
    weights bit for bit and the same rewards. Returns the straight run's training rows."""
    train_sync(env_cfg(model_dir, tmp_path / "straight", steps=3, **over))
    train_sync(env_cfg(model_dir, tmp_path / "resumed", steps=1, **over))
    train_sync(env_cfg(model_dir, tmp_path / "resumed", steps=3, **over))  # resume: auto, from step 1
    a = load_file(str(tmp_path / "straight" / "checkpoints" / "step_000003" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "checkpoints" / "step_000003" / "model" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    straight = rows(tmp_path / "straight")
    assert [r["reward/mean"] for r in straight] == [r["reward/mean"] for r in rows(tmp_path / "resumed")]
    return straight


def test_remax_episodes_play_the_greedy_one_at_temperature_0_in_every_turn(model_dir, tmp_path, monkeypatch):
    """algorithm.advantage=remax with an environment: each group's episode 0 samples every turn
    greedily; its reward is the baseline, it is logged apart and never trained."""
    from rollover.engine.torch_engine import TorchEngine

    sent = []
    real = TorchEngine.submit_many

    def spy(self, requests, *a, **kw):
        requests = list(requests)
        sent.extend(requests)
        return real(self, requests, *a, **kw)

    monkeypatch.setattr(TorchEngine, "submit_many", spy)
    train_sync(env_cfg(model_dir, tmp_path, **{"algorithm.advantage": "remax", "rollout.samples_per_prompt": 1,
                                               "logging.samples": 1}))
    assert [r["step"] for r in rows(tmp_path)] == [1, 2]
    training = [r for r in sent if r.id.startswith("g")]  # the final evaluation's ids start with "eval"
    greedy = [r for r in training if r.id.split("/")[1] == "0"]
    assert any(not r.id.endswith("/turn1") for r in greedy)  # later turns of the greedy episode were sent too
    assert all(r.sampling.temperature == 0.0 for r in greedy)
    assert all(r.sampling.temperature == 1.0 for r in training if r.id.split("/")[1] == "1")
    samples = [json.loads(x) for x in open(tmp_path / "samples" / "step_000002.jsonl")][1:]
    assert [(r["sample"], r["trained"]) for r in samples] == [(0, True), ("greedy", False)] * 2
    assert all("turns" in r for r in samples)


FLAKY_ENV = '''
from rollover.envs.base import StepResult
from rollover.types import Prompt


class Flaky:
    """Odd tasks' environments raise on their first step; even tasks' end with reward 1."""

    def prompts(self, n, seed=0):
        return [Prompt(id=f"flaky-{seed}-{i}", text="Say something.", answer=i) for i in range(n)]

    def make_group(self, prompt, n):
        return [FlakyEnv(int(prompt.answer)) for _ in range(n)]


class FlakyEnv:
    def __init__(self, k):
        self.k = k

    async def initial_observation(self):
        return [{"role": "user", "content": "Say something."}]

    async def step(self, action):
        if self.k % 2:
            raise RuntimeError(f"simulator crashed on task {self.k}")
        return StepResult([], float(len(action.text) % 2), done=True)
'''


def test_a_raising_environment_fails_only_its_group_and_is_counted(model_dir, tmp_path):
    path = tmp_path / "flaky_env.py"
    path.write_text(FLAKY_ENV)
    cfg = env_cfg(model_dir, tmp_path / "run", steps=3, **{"env.name": f"{path}:Flaky", "env.options": {},
                                                            "data.shuffle": False, "rollout.prompts_per_step": 4})
    train_sync(cfg)
    got = rows(tmp_path / "run")
    assert [r["step"] for r in got] == [1, 2, 3]
    for r in got:  # in order, tasks alternate even / odd: half the groups fail every step
        assert r["rollout/env/failed"] == 4 and r["rollout/skipped_groups"] == 2 and r["groups"] == 2


LONG_OPENING_ENV = '''
from rollover.envs.base import StepResult
from rollover.types import Prompt


class LongOpening:
    """Odd tasks open with a message longer than any episode allows; even tasks end at their
    first step with reward 1."""

    def prompts(self, n, seed=0):
        return [Prompt(id=f"long-{seed}-{i}", text="Say something.", answer=i) for i in range(n)]

    def make_group(self, prompt, n):
        return [LongEnv(int(prompt.answer)) for _ in range(n)]


class LongEnv:
    def __init__(self, k):
        self.k = k

    async def initial_observation(self):
        return [{"role": "user", "content": "Say something. " * (200 if self.k % 2 else 1)}]

    async def step(self, action):
        return StepResult([], 1.0, done=True)
'''


def test_a_task_whose_opening_leaves_no_room_fails_its_episodes_not_the_run(model_dir, tmp_path, caplog):
    path = tmp_path / "long_env.py"
    path.write_text(LONG_OPENING_ENV)
    cfg = env_cfg(model_dir, tmp_path / "run", steps=2, **{"env.name": f"{path}:LongOpening", "env.options": {},
                                                            "data.shuffle": False, "rollout.prompts_per_step": 4})
    with caplog.at_level(logging.WARNING, logger="rollover"):
        train_sync(cfg)
    got = rows(tmp_path / "run")
    assert [r["step"] for r in got] == [1, 2]
    for r in got:  # tasks alternate even / odd: the odd groups' episodes fail at their opening
        assert r["rollout/env/failed"] == 4 and r["rollout/skipped_groups"] == 2 and r["groups"] == 2
    assert re.search(r"failed: initial_observation: OpeningTooLong: episode \S+: the initial observation is \d+ tokens, "
                     r"max_total_tokens=400 leaves no room to generate \(raise env.max_total_tokens", caplog.text)


FLAKY_ONCE_ENV = '''
from rollover.envs.base import StepResult
from rollover.types import Prompt


class FlakyOnce:
    """Odd tasks: the first environment made for the task is broken (every step it takes
    raises); every other works, and its episode ends at its first step, reward 1 or 0 by the
    reply's length. An episode run again in the broken environment would fail again."""

    def __init__(self):
        self.made = set()  # tasks that already have their first environment

    def prompts(self, n, seed=0):
        return [Prompt(id=f"once-{seed}-{i}", text="Say something.", answer=i) for i in range(n)]

    def make_group(self, prompt, n):
        k = int(prompt.answer)
        envs = [OnceEnv(k, broken=k % 2 == 1 and j == 0 and k not in self.made) for j in range(n)]
        self.made.add(k)
        return envs


class FlakyOnceOne(FlakyOnce):
    """FlakyOnce with make_one: it writes a line to `log` for every group and every single
    environment it makes."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def make_group(self, prompt, n):
        with open(self.log, "a") as f:
            f.write("group\\n")
        return super().make_group(prompt, n)

    def make_one(self, prompt, n, j):
        with open(self.log, "a") as f:
            f.write("one\\n")
        k = int(prompt.answer)
        env = OnceEnv(k, broken=k % 2 == 1 and j == 0 and k not in self.made)
        self.made.add(k)
        return env


class OnceEnv:
    def __init__(self, k, broken):
        self.k, self.broken = k, broken

    async def initial_observation(self):
        return [{"role": "user", "content": "Say something."}]

    async def step(self, action):
        if self.broken:
            raise RuntimeError(f"simulator crashed on task {self.k}")
        return StepResult([], float(len(action.text) % 2), done=True)
'''


@pytest.mark.parametrize("mode", ["sync", "april", "async"])
def test_failed_episodes_run_again_so_their_groups_train_at_full_size(model_dir, tmp_path, mode):
    """env.resample_failed: an episode whose environment is broken runs again in a fresh
    environment of the same task (the broken one would fail it again), in every schedule; its
    group trains with all its episodes and the failure is counted as resampled, not failed."""
    from rollover.loops.async_ import train_async

    path = tmp_path / "once_env.py"
    path.write_text(FLAKY_ONCE_ENV)
    over = {"sync": {}, "april": {"partial_rollout.enabled": True},
            "async": {"mode": "async", "async.max_staleness": 1}}[mode]
    cfg = env_cfg(model_dir, tmp_path / "run", steps=2, **{
        "env.name": f"{path}:FlakyOnce", "env.options": {}, "data.shuffle": False, "rollout.prompts_per_step": 4,
        "env.resample_failed": 1, "checkpoint.every": 0}, **over)
    (train_async if mode == "async" else train_sync)(cfg)
    got = rows(tmp_path / "run")
    assert [r["step"] for r in got] == [1, 2]
    # (a step whose groups all finished in an earlier one (APRIL's carry) completed no episode: no counts)
    assert sum(r.get("rollout/env/resampled", 0) for r in got) >= 2  # the odd tasks of the steps' groups
    for r in got:
        assert r.get("rollout/env/failed", 0) == 0 and r.get("rollout/skipped_groups", 0) == 0
        assert r.get("rollout/dropped_samples", 0) == 0 and r["groups"] == 4
    groups = [g for line in open(tmp_path / "run" / "trained_groups.jsonl") for g in json.loads(line)["groups"]]
    assert all(g["dropped"] == 0 for g in groups)


def test_a_builder_with_make_one_makes_one_environment_per_resample(model_dir, tmp_path):
    """A builder's make_one(prompt, n, j) replaces one failed episode: one environment made, not a
    group's worth."""
    path = tmp_path / "once_env.py"
    path.write_text(FLAKY_ONCE_ENV)
    log = tmp_path / "made.log"
    cfg = env_cfg(model_dir, tmp_path / "run", steps=2, **{
        "env.name": f"{path}:FlakyOnceOne", "env.options": {"log": str(log)}, "data.shuffle": False,
        "rollout.prompts_per_step": 4, "env.resample_failed": 1, "checkpoint.every": 0})
    train_sync(cfg)
    made = log.read_text().split()
    resampled = sum(r.get("rollout/env/resampled", 0) for r in rows(tmp_path / "run"))
    assert resampled >= 2
    assert made.count("one") == resampled + sum(r["eval/resampled"] for r in rows(tmp_path / "run", "eval"))
    assert made.count("group") == 2 * 4 + 2  # each step's groups, and the held-out evaluation's two


PICKY_ENV = '''
from rollover.envs.base import StepResult
from rollover.types import Prompt


class Picky:
    """A deterministic environment that fails on some replies: its answer depends on the task and
    the actions alone, so a checkpoint's replay rebuilds it exactly."""

    def prompts(self, n, seed=0):
        return [Prompt(id=f"picky-{seed}-{i}", text="Say something.", answer=i) for i in range(n)]

    def make_group(self, prompt, n):
        return [PickyEnv() for _ in range(n)]


class PickyEnv:
    async def initial_observation(self):
        return [{"role": "user", "content": "Say something."}]

    async def step(self, action):
        if len(action.text) % 5 == 0:
            raise RuntimeError("cannot parse a reply of a length divisible by 5")
        return StepResult([{"role": "user", "content": "Again."}], float(len(action.text) % 2),
                          done=len(action.text) % 2 == 0)
'''


def test_april_with_resampled_episodes_resumes_exactly(model_dir, tmp_path):
    """APRIL carries episodes across steps, replacements included; with env.inline a run killed
    after step 1 and resumed from its checkpoint ends with the straight run's weights, and
    episodes were resampled on the way."""
    path = tmp_path / "picky_env.py"
    path.write_text(PICKY_ENV)
    over = {"env.name": f"{path}:Picky", "env.options": {}, "env.inline": True, "env.resample_failed": 3,
            "partial_rollout.enabled": True, "partial_rollout.oversample": 4.0, "rollout.samples_per_prompt": 4,
            "rollout.prompts_per_step": 2, "rollout.max_rows": 32, "rollout.max_new_tokens": 12, "checkpoint.keep": 3}
    straight = straight_and_resumed(model_dir, tmp_path, over)
    assert sum(r.get("rollout/env/resampled", 0) for r in straight) > 0  # failures happened and were run again
    # the checkpoint the resumed run started from carried replacements (request ids "g/j~k") mid-episode
    state = torch.load(tmp_path / "resumed" / "checkpoints" / "step_000001" / "state.pt", weights_only=False)
    carried = [ep for g in state["collector"]["buffer"] for ep in (g.episodes or {}).values()]
    assert any("~" in ep.request_id and not ep.finished and ep.replaced >= 1 for ep in carried)


def test_resampling_stops_at_its_limit_and_the_failure_stands(model_dir, tmp_path):
    """An environment that always crashes: its group runs env.resample_failed more episodes, which
    fail too; then the group is skipped as without resampling, every failure counted."""
    path = tmp_path / "flaky_env.py"
    path.write_text(FLAKY_ENV)
    cfg = env_cfg(model_dir, tmp_path / "run", steps=2, **{"env.name": f"{path}:Flaky", "env.options": {},
                                                            "data.shuffle": False, "rollout.prompts_per_step": 4,
                                                            "env.resample_failed": 1, "checkpoint.every": 0})
    train_sync(cfg)
    for r in rows(tmp_path / "run"):  # two odd groups a step: one resample each, then both episodes failed
        assert r["rollout/env/resampled"] == 2 and r["rollout/env/failed"] == 4
        assert r["rollout/skipped_groups"] == 2 and r["groups"] == 2
    ev = rows(tmp_path / "run", "eval")  # held-out episodes are run again too, and said so
    assert ev and all(e["eval/resampled"] == e["eval/failed"] / 2 for e in ev)


def test_tools_for_a_chat_template_that_ignores_them_are_refused_before_the_run(model_dir, tmp_path):
    cfg = env_cfg(model_dir, tmp_path / "run", **{"env.name": "tools", "data.train": "gen:arithmetic?n=20",
                                                   "env.options": {"tools": ["calculator"], "tools_in": "template"}})
    with pytest.raises(ConfigError, match="the chat template ignores tools= .*env.options.tools_in: system"):
        train_sync(cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("over,message", [
    ({"partial_rollout.enabled": True, "partial_rollout.carry": "keep_kv"}, "carry=keep_kv keeps single-turn"),
    ({"partial_rollout.enabled": True, "partial_rollout.on_stale": "regenerate"}, "regenerate restarts single-turn"),
    ({"env.name": None}, "data.train: env needs env.name"),
    ({"env.max_total_tokens": 100}, "env.max_total_tokens=100 leaves no room"),
    ({"env.name": None, "data.train": "gen:arithmetic?n=50", "env.resample_failed": 1},
     "env.resample_failed runs failed episodes again: it needs an environment"),
    ({"env.name": None, "data.train": "gen:arithmetic?n=50", "env.dynamic_turns": True},
     r"env.dynamic_turns sets each task's limit on an episode's turns: it needs a multi-turn run \(env.name\)"),
    ({"env.name": None, "data.train": "gen:arithmetic?n=50", "env.credit": "reward_to_go"},
     "env.credit, env.gamma and env.step_weight give the turns of episodes their credit: they need env.name"),
    ({"env.credit": "reward_to_go"}, r"with algorithm.advantage=grpo: .* \(it divides by the spread .* set "
                                     "algorithm.advantage=drgrpo, rloo or gae"),
    ({"env.credit": "reward_to_go", "algorithm.advantage": "remax"},
     r"remax does not fit \(its baseline is not the group's mean"),
    ({"env.credit": "reward_to_go", "algorithm.advantage": "rloo", "algorithm.loss": "gspo",
      "algorithm.aggregation": "seq-mean-token-mean"}, "use gspo_token"),
    ({"env.credit": "reward_to_go", "algorithm.advantage": "drgrpo", "downsample.keep": 2,
      "rollout.samples_per_prompt": 4}, "not combined yet"),
    ({"env.gamma": 0.9}, "with credit=episode it would do nothing"),
    ({"env.credit": "gigpo", "algorithm.advantage": "gae"}, "env.credit=gigpo gives each turn one from its state's group"),
    ({"env.credit": "reward_to_go", "algorithm.advantage": "gae", "env.gamma": 0.9},
     r"env.gamma=0.9 discounts per turn; with algorithm.advantage=gae the critic discounts per token"),
    ({"env.step_weight": 0.5}, "env.step_weight=0.5 weighs GiGPO's .* it needs env.credit=gigpo"),
    ({"env.credit": "gigpo", "algorithm.loss": "gspo", "algorithm.aggregation": "seq-mean-token-mean"},
     "env.credit=gigpo gives each turn its own advantage; .* use gspo_token"),
])
def test_env_config_conflicts_are_refused(model_dir, tmp_path, over, message):
    with pytest.raises(ConfigError, match=message):
        env_cfg(model_dir, tmp_path, **over)


def test_an_environment_without_data_train_is_refused_naming_what_to_set(model_dir, tmp_path):
    # the default data.train (single-turn arithmetic prompts) is never handed to an environment silently
    with pytest.raises(ConfigError, match=r"env.name='guess_number' with data.train unset.*set data.train: env"):
        load_config(model=model_dir, run_dir=str(tmp_path), **{"env.name": "guess_number"})
    assert load_config(model=model_dir, run_dir=str(tmp_path), **{"env.name": "arithmetic_retry",
                       "data.train": "gen:arithmetic?n=50"}).data.train == "gen:arithmetic?n=50"  # a dataset, named


def test_an_environments_tasks_that_are_not_prompts_are_refused_naming_the_generator(model_dir, tmp_path):
    from rollover.loops.build import build_run

    name = f"{Path(__file__).with_name('env_fixtures.py')}:DictTasks"
    with pytest.raises(ConfigError, match=r"prompts\(8, seed=3\) returned dict \{'text': 'hi'.* as item 0, not a "
                                          r"rollover.types.Prompt"):
        build_run(env_cfg(model_dir, tmp_path, **{"env.name": name, "env.options": {}, "env.tasks": 8}))


def test_a_stalled_engine_ends_the_episode_step_with_an_error_naming_it(model_dir, tmp_path):
    import time

    from rollover.loops.build import build_run
    from rollover.rollout.stops import Stalled
    from rollover.rollout.sync_collect import SyncCollector

    run = build_run(env_cfg(model_dir, tmp_path, **{"rollout.stall_timeout_s": 2, "env.step_timeout_s": 1}))
    try:
        run.engine.pause()  # alive, but never steps: nothing moves
        t0 = time.monotonic()
        with pytest.raises(Stalled, match="sync collector waited 2 s for 2 groups from the engine and environments"):
            SyncCollector(RolloutInputs.of(run)).collect(0)
        assert time.monotonic() - t0 < 30
        deadline = time.monotonic() + 10
        while run.engine.num_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run.engine.num_unfinished() == 0  # the stalled episodes' requests were aborted
    finally:
        run.close()
    with pytest.raises(ConfigError, match="env.step_timeout_s=30 must be below rollout.stall_timeout_s=20"):
        env_cfg(model_dir, tmp_path, **{"rollout.stall_timeout_s": 20})


def test_reward_to_go_equals_episode_credit_when_only_the_last_turn_is_rewarded(model_dir, tmp_path):
    """guess_number rewards the final guess only: with gamma 1 every turn's reward-to-go is the
    episode's return, so the run ends with the episode-credit run's weights bit for bit."""
    over = {"env.options": {"low": 1, "high": 2, "max_guesses": 3}, "rollout.samples_per_prompt": 4, "env.inline": True,
            "algorithm.advantage": "rloo"}
    for credit in ("episode", "reward_to_go"):
        train_sync(env_cfg(model_dir, tmp_path / credit, **over, **{"env.credit": credit}))
    a, b = (load_file(str(tmp_path / c / "checkpoints" / "step_000002" / "model" / "model.safetensors"))
            for c in ("episode", "reward_to_go"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(r["actor/grad_norm"] > 0 for r in rows(tmp_path / "episode"))  # the steps moved the weights


def test_reward_to_go_gives_each_turn_the_advantage_of_what_follows_it(model_dir, tmp_path):
    """An environment that rewards every turn: each turn's tokens train with A + G_t - G_0 (A:
    Dr.GRPO's G_0 - mean over the group's discounted returns), read back from the samples log,
    and the step's first loss (ratio 1, token mean) is minus their mean."""
    from pathlib import Path

    from rollover.metrics.samples import samples_path

    fixtures = Path(__file__).with_name("env_fixtures.py")
    gamma = 0.5
    cfg = env_cfg(model_dir, tmp_path, steps=1, **{
        "env.name": f"{fixtures}:Shaped", "env.options": {}, "env.credit": "reward_to_go", "env.gamma": gamma,
        "rollout.samples_per_prompt": 4, "rollout.max_new_tokens": 4, "logging.samples": 1, "env.inline": True,
        "algorithm.advantage": "drgrpo", "algorithm.aggregation": "token-mean", "algorithm.kl_coef": 0.0,
        "algorithm.entropy_coef": 0.0})
    train_sync(cfg)
    samples = [json.loads(x) for x in open(samples_path(tmp_path, 1))][1:]
    by_group: dict[str, list[dict]] = {}
    for s in samples:
        by_group.setdefault(s["group"], []).append(s)
    loss_sum, loss_tokens, varied = 0.0, 0, 0
    for group in by_group.values():
        returns = []
        for s in group:
            g = 0.0
            for turn in reversed(s["turns"]):
                g = turn["reward"] + gamma * g
            returns.append(g)
        mean = sum(returns) / len(returns)
        for s, g0 in zip(group, returns):
            assert s["advantage"] == pytest.approx(g0 - mean, abs=1e-5)
            to_go = 0.0
            expected = []
            for turn in reversed(s["turns"]):
                to_go = turn["reward"] + gamma * to_go
                expected.append(s["advantage"] + to_go - g0)
            expected.reverse()
            assert [t["advantage"] for t in s["turns"]] == pytest.approx(expected, abs=1e-5)
            varied += len({round(a, 6) for a in expected}) > 1
            trained = {k for a, b in s["loss_mask"] for k in range(a, b)}
            for turn, adv in zip(s["turns"], expected):
                n = len(trained & set(range(*turn["span"])))
                loss_sum += adv * n
                loss_tokens += n
    assert varied > 0  # some episode's turns had different advantages
    assert rows(tmp_path)[0]["actor/pg_loss"] == pytest.approx(-loss_sum / loss_tokens, abs=1e-5)


def _turns(rewards: list[float], states: list) -> list[dict]:
    out, at = [], 0
    for r, s in zip(rewards, states):
        out.append({"reward": r, "state": s, "span": [at, at + 2]})
        at += 3  # two sampled tokens, one inserted
    return out


def test_gigpo_compares_each_turn_with_the_turns_of_its_group_from_the_same_state():
    """env.credit=gigpo by hand: two groups (the second's episodes must not join the first's
    states), Dr.GRPO's baselines (no scaling), gamma 0.5, step weight 2."""
    from types import SimpleNamespace

    from rollover.rollout.episodes import gigpo_credit
    from rollover.types import Group, Prompt, Rollout

    def episode(rewards, states):
        n = 3 * len(rewards)
        return Rollout(group_id="g", prompt_ids=[1], response_ids=[5] * n, logprobs=[0.0] * n, versions=[0] * n,
                       loss_mask=[1] * n, finish="stop", reward=sum(rewards), turns=_turns(rewards, states))

    first = [episode([0.0, 1.0], ["a", "x"]), episode([0.0, 0.0, 1.0], ["a", "b", "x"]), episode([1.0], ["x"])]
    second = [episode([0.0, 1.0], ["a", "x"]), episode([0.0, 0.0], ["a", "b"])]
    groups = [Group(id=f"g{i}", prompt=Prompt(id=f"p{i}", text="t"), prompt_ids=[1], rollouts=rs)
              for i, rs in enumerate([first, second])]
    cfg = SimpleNamespace(algorithm=SimpleNamespace(advantage="drgrpo"), env=SimpleNamespace(gamma=0.5, step_weight=2.0))
    adv, per_token, info = gigpo_credit(groups, cfg)
    # returns from each turn: first group [0.5, 1], [0.25, 0.5, 1], [1]; second [0.5, 1], [0, 0]
    # the episodes' (undiscounted) returns: 1, 1, 1 in the first group (no advantage), 1 and 0 in the second
    assert adv.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.5, -0.5])
    # returns from each turn: first group [0.5, 1], [0.25, 0.5, 1], [1]; second [0.5, 1], [0, 0]. The
    # first group's turns: opening {0.5, 0.25, 1} (mean 7/12), after "a" {1, 0.5} (mean 0.75), after
    # "b" alone; the second group's: opening {0.5, 0}, after "a" {1, 0}
    step = [[0.5 - 7 / 12, 0.25], [0.25 - 7 / 12, -0.25, 0.0], [1 - 7 / 12], [0.25, 0.5], [-0.25, -0.5]]
    for b, (a, turns) in enumerate(zip(adv.tolist(), step)):
        want = [a + 2.0 * s for s in turns]
        assert [groups[b // 3].rollouts[b % 3].turns[t]["advantage"] for t in range(len(turns))] == pytest.approx(want)
        assert per_token[b] == pytest.approx(sum(([w, w, a] for w in want), []))  # inserted tokens: the episode's
    assert info["step_groups"] == 5 and info["step_singleton_turns"] == 1  # 3 states in the first group, 2 in the second


def test_without_a_named_state_turns_are_grouped_by_the_whole_conversation_before_them():
    from rollover.envs.base import Trajectory, Turn
    from rollover.rollout.episodes import _state

    def episode(tokens, states=(None, None)):
        # opening [1, 2]; turn 1 samples tokens[2:4], the environment inserts tokens[4]; turn 2 samples the rest
        turns = [Turn(2, 4, "stop", "x", state=states[0]), Turn(5, len(tokens), "stop", "y", state=states[1])]
        return Trajectory("e", 2, tokens, [0] * len(tokens), [None] * len(tokens), [0] * len(tokens), turns, "done")

    same, other_reply, other_action = episode([1, 2, 7, 8, 9, 3]), episode([1, 2, 7, 8, 5, 3]), episode([1, 2, 6, 8, 9, 3])
    assert _state(same, 0) == _state(episode([1, 2, 7, 8, 9, 4]), 0)  # what follows does not count
    assert len({_state(e, 0) for e in (same, other_reply, other_action)}) == 3
    named = [episode([1, 2, 7, 8, 9, 3], ("s", None)), episode([1, 2, 6, 8, 5, 3], ("s", None))]
    assert _state(named[0], 0) == _state(named[1], 0) != _state(same, 0)  # a named state stands for the tokens


def test_gigpo_trains_each_turn_on_its_state_groups_advantage(model_dir, tmp_path):
    """A run with env.credit=gigpo on an environment that names its states: each turn's logged
    advantage is GRPO's over its group's episodes plus GRPO's over the group's turns from the
    same state (worked out here from the turns' own texts), and the step's first loss (ratio 1,
    token mean) is minus their mean over the trained tokens."""
    from pathlib import Path

    from rollover.metrics.samples import samples_path

    def grpo(values: list[float]) -> list[float]:
        mean = sum(values) / len(values)
        if len(values) < 2 or max(values) == min(values):
            return [0.0] * len(values)
        std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
        return [(v - mean) / (std + 1e-6) for v in values]

    fixtures = Path(__file__).with_name("env_fixtures.py")
    train_sync(env_cfg(model_dir, tmp_path, steps=1, **{
        "env.name": f"{fixtures}:ShapedStates", "env.options": {}, "env.credit": "gigpo", "rollout.samples_per_prompt": 4,
        "rollout.max_new_tokens": 4, "logging.samples": 1, "env.inline": True, "algorithm.aggregation": "token-mean",
        "algorithm.kl_coef": 0.0, "algorithm.entropy_coef": 0.0}))
    samples = [json.loads(x) for x in open(samples_path(tmp_path, 1))][1:]
    groups: dict[str, list[dict]] = {}
    for s in samples:
        groups.setdefault(s["group"], []).append(s)
    loss_sum, loss_tokens, shared, states = 0.0, 0, 0, 0
    for group in groups.values():
        to_go = []
        for s in group:
            g, out = 0.0, []
            for turn in reversed(s["turns"]):
                g = turn["reward"] + g
                out.append(g)
            to_go.append(out[::-1])
        episode = grpo([g[0] for g in to_go])
        by_state: dict = {}
        for b, s in enumerate(group):
            for t, turn in enumerate(s["turns"]):
                state = None if t == 0 else (t, "7" in s["turns"][t - 1]["messages"][0]["content"])
                by_state.setdefault(state, []).append((b, t))
        step, states = {}, states + len(by_state)
        for members in by_state.values():
            shared += len(members) > 1
            step.update(zip(members, grpo([to_go[b][t] for b, t in members])))
        for b, s in enumerate(group):
            expected = [episode[b] + step[(b, t)] for t in range(len(s["turns"]))]
            assert [t["advantage"] for t in s["turns"]] == pytest.approx(expected, abs=1e-4)
            trained = {k for a, c in s["loss_mask"] for k in range(a, c)}
            for turn, adv in zip(s["turns"], expected):
                n = len(trained & set(range(*turn["span"])))
                loss_sum += adv * n
                loss_tokens += n
    assert shared > len(groups)  # states after the opening were shared too
    row = rows(tmp_path)[0]
    assert row["actor/pg_loss"] == pytest.approx(-loss_sum / loss_tokens, abs=1e-4)
    assert row["adv/step_groups"] == states


def test_tasks_from_the_environment_with_held_out_tasks_from_a_file(model_dir, tmp_path):
    """data.train: env with data.eval a file (one source or several by name): the held-out tasks
    are the file's rows."""
    from rollover.loops.build import build_run

    path = tmp_path / "games.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": "Guess my number.", "answer": k}) for k in (1, 2)))
    for held in (str(path), {"games": str(path)}):
        run = build_run(env_cfg(model_dir, tmp_path / "run", **{"data.eval": held}), record=False)
        try:
            assert len(run.eval_prompts) == 2 and run.evaluate(0)["eval/samples"] == 4
        finally:
            run.close()


def test_held_out_episodes_that_all_failed_have_no_mean_reward_and_count_as_wrong():
    """Accuracy counts a failed episode as wrong; the means are over scored episodes, NaN (not
    0) when none was scored; a checkpoint without a value is never the best."""
    import math
    from types import SimpleNamespace

    from rollover.config import load_config
    from rollover.rollout.episodes import episode_eval_metrics
    from rollover.types import Prompt

    def traj(ok, reward=None):
        return SimpleNamespace(ok=ok, reward=reward, tokens_T=[1, 2, 3], prompt_len=1, versions_T=[0, 0, 0],
                               turns=[None], info={})

    cfg = load_config()
    failed = [SimpleNamespace(n=2, done={0: traj(False), 1: traj(False)}, prompt=Prompt(id="p", text="t"))]
    m = episode_eval_metrics(failed, cfg)
    assert m["eval/accuracy"] == 0 and m["eval/failed"] == 2 and math.isnan(m["eval/reward_mean"])
    half = [SimpleNamespace(n=2, done={0: traj(True, 1.0), 1: traj(False)}, prompt=Prompt(id="q", text="t"))]
    m = episode_eval_metrics(half, cfg)
    assert m["eval/accuracy"] == 0.5 and m["eval/reward_mean"] == 1.0


def test_a_checkpoint_whose_metric_is_nan_is_never_the_best(tmp_path):
    import json

    from rollover.train.checkpoint import best_checkpoint, checkpoint_dir

    for step, value in ((1, float("nan")), (2, 0.25), (3, 0.5), (4, float("nan"))):
        d = checkpoint_dir(tmp_path) / f"step_{step:06d}"
        d.mkdir(parents=True)
        (d / "DONE").touch()
        (d / "eval.json").write_text(json.dumps({"eval/reward_mean": value}))
    assert best_checkpoint(tmp_path, "eval/reward_mean").name == "step_000003"
    assert best_checkpoint(tmp_path, "eval/reward_mean", "min").name == "step_000002"
