"""The asynchronous loop: staleness bound, equivalence with sync at eta=0, resume, failures."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollover.config import load_config
from rollover.loops.async_ import train_async
from rollover.loops.sync import train_sync
from rollover.rewards import RewardFailed
from rollover.rollout.curation import ExperiencePool, dynamic_samples, top_entropy_mask
from rollover.testing import save_tiny_model
from rollover.types import Group, Prompt, Rollout


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama", seed=21))


def async_cfg(model_dir, run_dir, **over):
    base = {
        "device": "cpu", "model": model_dir, "run_dir": str(run_dir), "steps": 4, "seed": 5, "resume": "auto", "mode": "async",
        "data.train": "gen:arithmetic?n=200", "data.eval_size": 4, "data.max_prompt_tokens": 64,
        "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2, "rollout.max_new_tokens": 8,
        "rollout.max_rows": 4, "reward.functions": ["numeric", {"fn": "format", "weight": 0.5, "kwargs": {"pattern": "[0-9]"}}],
        "train.lr": 1e-3, "eval.every": 0, "eval.at_start": False, "eval.samples_per_prompt": 1,
        "checkpoint.every": 2, "logging.progress": False, "logging.tensorboard": False,
    }
    base.update(over)
    return load_config(**base)


def rows(run_dir, kind="train"):
    return [json.loads(x) for x in open(run_dir / "metrics.jsonl") if json.loads(x)["kind"] == kind]


def slow_reward_module(tmp_path, seed):
    """A reward with random delays, to randomise the interleaving of the components."""
    path = tmp_path / f"slow_reward_{seed}.py"
    path.write_text(
        "import random, time\n"
        f"_rng = random.Random({seed})\n"
        "def slow(completion, answer, **kw):\n"
        "    time.sleep(_rng.random() * 0.05)\n"
        "    return float(any(c.isdigit() for c in completion))\n"
    )
    return f"{path}:slow"


@pytest.mark.parametrize("seed,eta", [(0, 0), (1, 1), (2, 2), (3, 1), (4, 3)])
def test_staleness_never_exceeds_eta(model_dir, tmp_path, seed, eta):
    rng = random.Random(seed)
    cfg = async_cfg(model_dir, tmp_path, seed=seed, steps=5, **{
        "async.max_staleness": eta, "reward.functions": [slow_reward_module(tmp_path, seed)],
        "rollout.max_new_tokens": rng.choice([4, 8, 12]), "rollout.max_rows": rng.choice([2, 4, 8]),
        "rollout.inflight_weight_update": rng.choice(["continue", "abort"]),
        "algorithm.dynamic_sampling": rng.random() < 0.5, "checkpoint.every": 0})
    train_async(cfg)
    got = rows(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert all(r["staleness/max"] <= eta for r in got)
    if eta == 0:
        assert all(r["staleness/token_lag_mean"] == 0 for r in got)


@pytest.mark.parametrize("inflight", ["continue", "keep"])
def test_inflight_keep_goes_on_over_old_kv_within_eta(model_dir, tmp_path, inflight):
    """rollout.inflight_weight_update=keep: requests running at a weight update go on over the
    K/V the older weights computed (no token's K/V is computed again, where `continue` recomputes
    them), and eta still bounds every trained group."""
    from rollover.loops.build import build_run

    cfg = async_cfg(model_dir, tmp_path, steps=5, **{
        "async.max_staleness": 1, "rollout.inflight_weight_update": inflight, "rollout.max_new_tokens": 16,
        "rollout.ignore_eos": True, "rollout.max_rows": 8, "checkpoint.every": 0})
    run = build_run(cfg)
    seen, update, step = [], run.engine.update_weights, run.engine.core.step

    def recording(named, version, inflight="continue"):
        running = run.engine.num_unfinished()
        out = update(named, version, inflight)
        seen.append((inflight, running, run.engine.stats().recomputed_tokens))
        return out

    def slow_step():  # generation outlasts a training step, so requests run across updates
        time.sleep(0.01)
        return step()

    run.engine.update_weights = recording
    run.engine.core.step = slow_step
    train_async(cfg, run=run)
    assert len(seen) >= 5 and {m for m, _, _ in seen} == {inflight}
    assert any(running for _, running, _ in seen)  # some update found requests in flight
    recomputed = seen[-1][2]
    assert recomputed == 0 if inflight == "keep" else recomputed > 0
    got = rows(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5] and all(r["staleness/max"] <= 1 for r in got)


def test_eta_zero_reproduces_sync_weights(model_dir, tmp_path):
    """...and a TRL reward function reads the same `trainer_state` in both: the steps done when
    its batch is scored (weight 0: it is logged, not trained on)."""
    curriculum = {"fn": f"{Path(__file__).with_name('reward_fixtures.py')}:curriculum", "weight": 0.0}
    common = {"algorithm.loss": "decoupled_ppo", "checkpoint.every": 0, "eval.every": 0,
              "reward.functions": ["numeric", {"fn": "format", "weight": 0.5, "kwargs": {"pattern": "[0-9]"}}, curriculum]}
    sync = async_cfg(model_dir, tmp_path / "sync", **common, mode="sync")
    train_sync(sync)
    asyn = async_cfg(model_dir, tmp_path / "async", **common, **{"async.max_staleness": 0})
    train_async(asyn)
    a = load_file(str(tmp_path / "sync" / "checkpoints" / "step_000004" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "async" / "checkpoints" / "step_000004" / "model" / "model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert [r["reward/mean"] for r in rows(tmp_path / "sync")] == [r["reward/mean"] for r in rows(tmp_path / "async")]
    assert any(r["actor/grad_norm"] > 0 for r in rows(tmp_path / "sync"))  # the runs trained: equal weights mean something
    for run in ("sync", "async"):
        assert [r["rewards/curriculum/progress/mean"] for r in rows(tmp_path / run)] == [0.0, 0.25, 0.5, 0.75], run
        assert [r["rewards/curriculum/mean"] for r in rows(tmp_path / run)] == [0.0, 1.0, 2.0, 3.0], run
    from rollover.loops.build import build_run

    resumed = build_run(async_cfg(model_dir, tmp_path / "sync", **common, mode="sync", steps=6))
    try:  # a resume reads on from the checkpoint's step
        assert (resumed.rewards.trainer_state.global_step, resumed.rewards.trainer_state.max_steps) == (4, 6)
    finally:
        resumed.close()


def test_kill_and_resume_keeps_staleness_accounting(model_dir, tmp_path, monkeypatch):
    import rollover.loops.async_ as mod

    cfg = async_cfg(model_dir, tmp_path, steps=6, **{"async.max_staleness": 1, "checkpoint.every": 2,
                                                    "rollout.max_new_tokens": 12})
    real = mod.train_batch_from
    calls = {"n": 0}

    def dying(groups, c, step):  # the process "dies" while preparing step 4, after the step-2 checkpoint... and step 3
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt("killed")
        return real(groups, c, step)

    monkeypatch.setattr(mod, "train_batch_from", dying)
    with pytest.raises(KeyboardInterrupt):
        train_async(cfg)
    monkeypatch.setattr(mod, "train_batch_from", real)
    ckpt = torch.load(tmp_path / "checkpoints" / "step_000002" / "state.pt", weights_only=False)
    saved = ckpt["async"]
    alive = len(saved["inflight"]) + sum(len(b) for b in saved["manager"]["batches"]) + len(saved["manager"]["forming"]) \
        + len(saved["manager"]["inbox"]) + sum(g is not None for g in saved["manager"]["resolved"].values())
    assert saved["gate"]["live"] == 2 * 2 + alive  # trained groups + groups alive at the checkpoint
    assert alive > 0  # the checkpoint really carried work in flight
    train_async(cfg)  # resume: auto, from step 2
    got = rows(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert all(r["staleness/max"] <= 1 for r in got)
    assert any(r["staleness/max"] == 1 for r in got[2:])  # carried groups kept their old start versions


def test_reward_error_stops_all_components_and_resume_continues(model_dir, tmp_path):
    bad = tmp_path / "bad_reward.py"
    bad.write_text("def bad(completion, answer, **kw):\n    raise ValueError('judge down')\n")
    cfg = async_cfg(model_dir, tmp_path, **{"reward.functions": [f"{bad}:bad"], "async.max_staleness": 1})
    t0 = time.perf_counter()
    # the reward's own error, as a sync run raises it, saying that the step reached was saved
    with pytest.raises(RewardFailed, match=r"'bad' failed on sample .*judge down.*a checkpoint of step \d+ was saved") as info:
        train_async(cfg)
    assert repr(info.value.__cause__) == "ValueError('judge down')"
    assert time.perf_counter() - t0 < 60
    import threading

    assert not [t for t in threading.enumerate() if t.name in ("rollover-engine", "rollover-data-manager")]
    # the checkpoint holds every accepted group; resuming with on_error=zero finishes the run
    cfg2 = async_cfg(model_dir, tmp_path, **{"reward.functions": [f"{bad}:bad"], "async.max_staleness": 1,
                                             "reward.on_error": "zero"})
    train_async(cfg2)
    got = rows(tmp_path)
    assert got[-1]["step"] == 4 and sum(r["rollout/reward_errors"] for r in got) > 0  # counted per row
    from rollover.rollout.groups import DROP_COUNTS

    assert all(f"rollout/{k}" in r for r in got for k in (*DROP_COUNTS, "rewards/bad/errors"))  # as sync rows, 0s too
    assert not any("rollout/reward_s" in r for r in got)  # seconds, not a count


def test_engine_error_stops_the_run(model_dir, tmp_path, monkeypatch):
    from rollover.engine.model_runner import ModelRunner

    real = ModelRunner.decode
    count = {"n": 0}

    def broken(self, *a, **k):
        count["n"] += 1
        if count["n"] > 10:
            raise RuntimeError("device lost")
        return real(self, *a, **k)

    monkeypatch.setattr(ModelRunner, "decode", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        train_async(async_cfg(model_dir, tmp_path, **{"async.max_staleness": 1}))


def test_trainer_nan_skips_then_stops(model_dir, tmp_path, monkeypatch):
    import rollover.train.trainer as trainer_mod
    from rollover.rollout.stops import TooManyBadSteps

    real = trainer_mod.aggregate
    monkeypatch.setattr(trainer_mod, "aggregate", lambda *a, **k: real(*a, **k) * float("nan"))
    with pytest.warns(RuntimeWarning):
        with pytest.raises(TooManyBadSteps):
            train_async(async_cfg(model_dir, tmp_path, **{"train.max_bad_steps": 2, "async.max_staleness": 1}))
    assert (tmp_path / "checkpoints" / "step_000002" / "DONE").exists()


def _rollout(gid, reward, logprobs, versions=None):
    n = len(logprobs)
    return Rollout(group_id=gid, prompt_ids=[1], response_ids=[5] * n, logprobs=logprobs,
                   versions=versions or [0] * n, loss_mask=[1] * n, finish="stop", reward=reward,
                   scores={"acc": reward})


def test_remax_in_async_mode_sizes_the_samples_and_keeps_the_greedy_answer_apart(model_dir, tmp_path, monkeypatch):
    """algorithm.advantage=remax with async.dynamic_samples: DART's sizing counts the samples, not
    the greedy answer, which every group brings beside them and none trains on."""
    import rollover.rollout.async_rollout as async_rollout

    sizes = []
    real = async_rollout.dynamic_samples
    monkeypatch.setattr(async_rollout, "dynamic_samples", lambda rate, n, low: sizes.append(n) or real(rate, n, low))
    cfg = async_cfg(model_dir, tmp_path, steps=3, **{"algorithm.advantage": "remax", "async.dynamic_samples": True,
                                                    "async.experience_pool": True, "rollout.samples_per_prompt": 3,
                                                    "logging.samples": 1, "checkpoint.every": 0})
    train_async(cfg)
    assert sizes and set(sizes) == {3}
    got = rows(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3] and all("reward/greedy_mean" in r for r in got)
    assert all(r["rollout/experience_pool_substitutions"] >= 0 for r in got)  # written when 0 too
    for step in (1, 2, 3):
        samples = [json.loads(x) for x in open(tmp_path / "samples" / f"step_{step:06d}.jsonl")][1:]
        greedy = [r for r in samples if r["sample"] == "greedy"]
        assert len(greedy) == 2 and not any(r["trained"] for r in greedy)  # one per group of the step
        assert all(r["trained"] for r in samples if r["sample"] != "greedy")


def test_experience_pool_fills_all_fail_groups_with_fresh_successes():
    pool = ExperiencePool(threshold=1.0, primary="acc")
    p = Prompt(id="q1", text="?")
    win = Group(id="g0", prompt=p, prompt_ids=[1], rollouts=[_rollout("g0", 1.0, [-0.1], [3]), _rollout("g0", 0.0, [-0.2], [3])])
    assert not pool.observe_and_fill(win, train_version=3, max_staleness=1)
    fail = Group(id="g1", prompt=p, prompt_ids=[1], rollouts=[_rollout("g1", 0.0, [-0.3], [4]), _rollout("g1", 0.0, [-0.4], [4])])
    assert pool.observe_and_fill(fail, train_version=4, max_staleness=1)
    assert [r.reward for r in fail.rollouts] == [1.0, 0.0] and fail.rollouts[0].group_id == "g1"
    too_old = Group(id="g2", prompt=p, prompt_ids=[1], rollouts=[_rollout("g2", 0.0, [-0.3], [9])])
    assert not pool.observe_and_fill(too_old, train_version=9, max_staleness=1)  # pooled tokens are 6 versions old
    # an episode's success: the environment's tokens carry version -1, the policy's their own
    episode = Group(id="g3", prompt=p, prompt_ids=[1], rollouts=[_rollout("g3", 1.0, [-0.1, 0.0, -0.2], [8, -1, 8])])
    assert not pool.observe_and_fill(episode, train_version=8, max_staleness=1)
    fail = Group(id="g4", prompt=p, prompt_ids=[1], rollouts=[_rollout("g4", 0.0, [-0.3], [9])])
    assert pool.observe_and_fill(fail, train_version=9, max_staleness=1) and fail.rollouts[0].versions == [8, -1, 8]


def test_the_pool_version_bound_counts_every_group_that_trains_before_it():
    """A group resolved before an earlier serial trains after it (batches form in start order):
    the bound counts the forming batch and every earlier serial not yet taken in."""
    import queue
    import threading
    from types import SimpleNamespace

    from rollover.rollout.async_rollout import DataManager

    manager = DataManager.__new__(DataManager)
    manager.inputs, manager.batches, manager.training = SimpleNamespace(engine=SimpleNamespace(version=3)), queue.Queue(), 0
    manager.version_lock, manager.B, manager.forming, manager.next_serial = threading.Lock(), 2, [], 10
    manager.batches.put(["a batch"])
    assert manager._train_version_bound(10) == 4  # the queued batch trains at 3, the next formed one at 4
    assert manager._train_version_bound(11) == 4  # serial 10 and it fill that batch
    assert manager._train_version_bound(12) == 5  # serials 10 and 11 fill it: the one after
    manager.forming = ["g8"]
    assert manager._train_version_bound(11) == 5  # g8, 10 and 11: the batch after the forming one
    manager.training = 1  # the trainer took a batch and trains it at 3: everything a version later
    assert manager._train_version_bound(10) == 5


def test_a_sampled_token_older_than_eta_is_never_trained():
    from rollover.loops.async_ import staleness

    p = Prompt(id="q", text="?")
    fresh = Group(id="g", prompt=p, prompt_ids=[1], rollouts=[_rollout("g", 1.0, [-0.1, -0.2], [4, -1])], start_version=4)
    assert staleness([fresh], 5, 1) == [1]
    pooled = Group(id="g", prompt=p, prompt_ids=[1], rollouts=[_rollout("g", 1.0, [-0.1], [3])], start_version=4)
    with pytest.raises(AssertionError, match="staleness 2 exceeds max_staleness=1 at version 5"):
        staleness([pooled], 5, 1)


def test_dynamic_samples_and_entropy_mask():
    assert dynamic_samples(None, 8, 2) == 8
    assert dynamic_samples(0.5, 8, 2) == 8  # below the threshold: the default
    assert dynamic_samples(1.0, 8, 2) == 2  # int(9 / 1 - 7)
    g = Group(id="g", prompt=Prompt(id="p", text="?"), prompt_ids=[1],
              rollouts=[_rollout("g", 0.0, [-2.0, -2.0]), _rollout("g", 0.0, [-0.1]), _rollout("g", 0.0, [-1.0])])
    (masked_g,), n = top_entropy_mask([g], 2 / 3)
    assert n == 1 and [r.loss_mask for r in masked_g.rollouts] == [[1, 1], [0], [1]]
    assert [r.loss_mask for r in g.rollouts] == [[1, 1], [1], [1]]  # the input is left as it was


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_sigterm_during_the_step_0_eval_then_a_resume_logs_each_row_once(model_dir, tmp_path, monkeypatch, mode):
    """Async mode stops before its first step and checkpoints step 0, after the evaluation was
    logged: the resumed run must not evaluate step 0 again (sync finishes step 1 first)."""
    import os
    import signal

    from rollover.loops.common import Run

    evaluate, sent = Run.evaluate, []

    def sigterm_then_evaluate(self, step):
        if not sent:
            sent.append(step)
            os.kill(os.getpid(), signal.SIGTERM)  # handled at once, in this (the main) thread
        return evaluate(self, step)

    monkeypatch.setattr(Run, "evaluate", sigterm_then_evaluate)
    cfg = async_cfg(model_dir, tmp_path, steps=2, mode=mode, **{"eval.at_start": True, "checkpoint.every": 0})
    train = train_async if mode == "async" else train_sync
    first = train(cfg)
    assert sent == [0] and first["interrupted"] == "SIGTERM"
    assert first["checkpoint"].endswith(f"step_{first['step']:06d}") and first["step"] == (0 if mode == "async" else 1)
    assert train(cfg)["step"] == 2
    keys = [(r["step"], r["kind"]) for r in map(json.loads, open(tmp_path / "metrics.jsonl"))]
    assert sorted(keys) == [(0, "eval"), (1, "train"), (2, "eval"), (2, "train")]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_reward_failing_in_the_evaluation_keeps_the_trained_steps(model_dir, tmp_path, monkeypatch, mode):
    """reward.on_error=raise stopping a run in its evaluation after step 3 (checkpoint.every=0):
    step 3 is trained, so it is saved and the error says so; the resume runs that evaluation
    and trains nothing again."""
    from rollover.loops.common import Run

    evaluate = Run.evaluate

    def down_at_the_end(self, step):
        if step == 3:
            raise RewardFailed("numeric", "eval-3-0/0", "ValueError: judge down")
        return evaluate(self, step)

    monkeypatch.setattr(Run, "evaluate", down_at_the_end)
    cfg = async_cfg(model_dir, tmp_path, steps=3, mode=mode, **{"checkpoint.every": 0})
    with pytest.raises(RewardFailed, match=r"judge down \(a checkpoint of step 3 was saved: a resume continues from it\)"):
        (train_sync if mode == "sync" else train_async)(cfg)
    assert (tmp_path / "checkpoints" / "step_000003" / "DONE").exists()
    monkeypatch.setattr(Run, "evaluate", evaluate)
    (train_sync if mode == "sync" else train_async)(cfg)
    assert [r["step"] for r in rows(tmp_path)] == [1, 2, 3]
    assert [r["step"] for r in rows(tmp_path, "eval")] == [3]
