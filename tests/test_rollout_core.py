"""The rollout core with episodes: partial rollouts inside episodes (APRIL and async), live
episodes in checkpoints, and the same trajectories whichever schedule drives them."""

from __future__ import annotations

import asyncio
import json
import pickle
import threading
import time
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from rollover.rollout.inputs import RolloutInputs
from rollover.envs.episode import episode_seed, run_episode
from rollover.envs.render import ChatRenderer
from rollover.loops.build import build_run
from rollover.loops.sync import train_sync
from rollover.rollout.april import AprilCollector
from rollover.rollout.core import SampleDriver, run_groups
from rollover.rollout.groups import sample_seed, sampling_from
from rollover.testing import save_tiny_model
from test_env_training import env_cfg as base_env_cfg, rows


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama", seed=21))


def env_cfg(model_dir, run_dir, **over):
    """test_env_training's guess_number config, with longer turns and four steps."""
    return base_env_cfg(model_dir, run_dir, **{"steps": 4, "rollout.max_new_tokens": 10, "rollout.max_rows": 6, **over})


def straight_trajectories(run, groups, sampling):
    """The same episodes run uninterrupted by the asyncio runner (same seeds)."""
    renderer = ChatRenderer(run.tokenizer)
    e = run.cfg.env

    async def all_episodes():
        out = {}
        for g in groups:
            envs = run.env_builder.make_group(g.prompt, g.n)
            base = sample_seed(run.cfg.seed, g.serial, 0)
            for j, env in enumerate(envs):
                sp = replace(sampling, seed=episode_seed(base, j))
                out[(g.id, j)] = await run_episode(run.engine, env, renderer, sp, max_turns=e.max_turns,
                                                   max_total_tokens=e.max_total_tokens,
                                                   step_timeout_s=e.step_timeout_s, request_id=f"{g.id}/{j}")
        return out

    return asyncio.run(all_episodes())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_episode_aborted_mid_turn_and_resumed_equals_the_uninterrupted_one(model_dir, tmp_path, temperature):
    run = build_run(env_cfg(model_dir, tmp_path))
    try:
        sampling = replace(sampling_from(run.cfg), temperature=temperature)  # 0: greedy
        groups = run.next_groups(2, version=0)
        lock = threading.RLock()
        finished, aborted = [], []
        driver = SampleDriver(RolloutInputs.of(run), lock, on_finished=lambda g, j: finished.append((g.id, j)),
                              on_aborted=lambda g, j: aborted.append((g.id, j)), on_error=pytest.fail,
                              on_done_callback=lambda c: _locked(lock, driver.completed, c))
        with lock:
            driver.start(groups, sampling, run.cfg.seed)
        # stop the engine once some episode is past its first turn and mid-way through another
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with lock:
                mid = [r for r, ref in driver.routes.items() if ref.group.episodes[ref.j].turn > 1]
            lengths = run.engine.lengths()
            if any(lengths.get(r, 0) >= 2 for r in mid):
                run.engine.pause()
                if any(0 < n for r, n in run.engine.lengths().items() if r in mid):
                    break
                run.engine.resume()
            time.sleep(0.001)
        else:
            pytest.fail("no episode reached a second turn")
        with lock:
            driver.hold = True
        driver.abort_all()
        run.engine.resume()
        with lock:
            mid_turn = [(g.id, j) for g in groups for j, ep in g.episodes.items() if ep.partial is not None and ep.turn > 1]
            assert mid_turn, "no episode was cut inside a later turn"
            assert set(mid_turn) <= set(aborted)
            saved = pickle.loads(pickle.dumps(groups))  # what a checkpoint holds (no environment objects)
            assert all(ep.env is None for g in saved for ep in g.episodes.values())
        # resume the saved copies: environments rebuilt by replaying their action logs
        left = threading.Event()
        with lock:
            driver.hold = False
            driver.on_finished = lambda g, j: left.set() if all(x.complete for x in saved) else None
            driver.start(saved, sampling, run.cfg.seed)
        assert left.wait(60)
        straight = straight_trajectories(run, groups, sampling)
        for g in saved:
            for j in range(g.n):
                got, want = g.done[j], straight[(g.id, j)]
                assert got.tokens_T == want.tokens_T, (g.id, j)
                assert got.loss_mask_T == want.loss_mask_T and got.finish == want.finish
                assert got.turn_rewards == want.turn_rewards
                lp = [(a, b) for a, b in zip(got.logprobs_T, want.logprobs_T) if a is not None]
                assert [a for a, _ in lp] == pytest.approx([b for _, b in lp], abs=1e-4)
    finally:
        run.close()


def _locked(lock, fn, *args):
    with lock:
        fn(*args)


def test_sync_core_episodes_equal_the_asyncio_runner(model_dir, tmp_path):
    run = build_run(env_cfg(model_dir, tmp_path))
    try:
        sampling = sampling_from(run.cfg)
        groups = run.next_groups(2, version=0)
        run_groups(RolloutInputs.of(run), groups, sampling, run.cfg.seed, "test")
        straight = straight_trajectories(run, groups, sampling)
        for g in groups:
            for j in range(g.n):
                assert g.done[j].tokens_T == straight[(g.id, j)].tokens_T
                assert g.done[j].loss_mask_T == straight[(g.id, j)].loss_mask_T
    finally:
        run.close()


APRIL = {"partial_rollout.enabled": True, "partial_rollout.oversample": 2.0, "partial_rollout.max_carry_steps": 100,
         "env.inline": True}


def test_multi_turn_april_carries_episodes_mid_turn_and_loses_nothing(model_dir, tmp_path):
    cfg = env_cfg(model_dir, tmp_path, **APRIL)
    run = build_run(cfg)
    col = AprilCollector(RolloutInputs.of(run))
    trained, mid_turn = {}, 0
    try:
        for step in range(4):
            groups, m = col.collect(step)
            assert m["discarded_tokens"] == 0 and len(groups) == cfg.rollout.prompts_per_step
            for g in groups:
                assert g.id not in trained
                trained[g.id] = g
                for r in g.rollouts:  # only sampled tokens train; inserted ones carry version -1
                    assert all(v >= 0 for v, k in zip(r.versions, r.loss_mask) if k)
            mid_turn += sum(ep.partial is not None and ep.turn > 1 for pg in col.buffer for ep in pg.episodes.values())
            state = pickle.loads(pickle.dumps(col.state_dict()))
            assert all(ep.env is None for pg in state["buffer"] for ep in (pg.episodes or {}).values())
            run.engine.update_weights(run.trainer.named_weights(), version=step + 1)
        drawn = {f"g{i}" for i in range(run.serial)}
        carried = {g.id for g in col.buffer} | {g.id for g in col.ready_carry}
        assert set(trained) | carried == drawn and not (set(trained) & carried)
        assert mid_turn > 0, "no episode was carried from inside a later turn"
        spanned = sum(len({v for v in r.versions if v >= 0}) > 1 for g in trained.values() for r in g.rollouts)
        assert spanned > 0  # an episode continued across a weight update
    finally:
        run.close()


@pytest.mark.parametrize("seed", range(2))
def test_multi_turn_april_with_slow_threaded_environments_loses_nothing(model_dir, tmp_path, monkeypatch, seed):
    """env.inline off (the default): environment answers land at any time, during a step and
    after its stop (the stop does not wait for them); every step still ends, and every drawn
    group is trained or carried once."""
    import random

    from rollover.envs.games import GuessNumberEnv

    rng, step_fn = random.Random(seed), GuessNumberEnv.step

    async def slow_step(self, action):
        await asyncio.sleep(rng.uniform(0.01, 0.3))
        return await step_fn(self, action)

    monkeypatch.setattr(GuessNumberEnv, "step", slow_step)
    cfg = env_cfg(model_dir, tmp_path, seed=seed, **{**APRIL, "env.inline": False, "env.step_timeout_s": 5.0,
                                                     "rollout.stall_timeout_s": 30.0})
    run = build_run(cfg)
    col = AprilCollector(RolloutInputs.of(run))
    trained, out_at_stop = {}, 0
    try:
        for step in range(5):
            groups, m = col.collect(step)
            assert m["discarded_tokens"] == 0 and len(groups) == cfg.rollout.prompts_per_step
            assert not col.driver.routes  # every request is back; environment calls may still be out
            out_at_stop += col.driver.env_calls
            for g in groups:
                assert g.id not in trained
                trained[g.id] = g
            run.weights.push(run.trainer.named_weights(), version=step + 1)
        assert out_at_stop > 0, "no step ended with an environment call out"
        col._land_env_calls()
        assert col.driver.idle
        drawn = {f"g{i}" for i in range(run.serial)}
        carried = {g.id for g in col.buffer} | {g.id for g in col.ready_carry}
        assert set(trained) | carried == drawn and not (set(trained) & carried)
    finally:
        run.close()


def test_environment_calls_landing_right_after_a_step_lose_no_group_and_count_every_episode(
        model_dir, tmp_path, monkeypatch):
    """The worst moment for a call the stop left out: just after the step's bookkeeping
    released its lock. The groups those calls complete are carried (not lost), and their
    episodes are counted in the next step's metrics."""
    import random
    import time as _time

    from rollover.envs.games import GuessNumberEnv

    rng, step_fn = random.Random(3), GuessNumberEnv.step

    async def slow_step(self, action):
        await asyncio.sleep(rng.uniform(0.01, 0.3))
        return await step_fn(self, action)

    monkeypatch.setattr(GuessNumberEnv, "step", slow_step)
    cfg = env_cfg(model_dir, tmp_path, seed=3, **{**APRIL, "env.inline": False, "env.step_timeout_s": 5.0,
                                                  "rollout.stall_timeout_s": 30.0})
    run = build_run(cfg)
    col = AprilCollector(RolloutInputs.of(run))
    mask_stale, landed_late = col._mask_stale, []

    def land_first(groups, version):  # runs right after collect's locked section
        while col.driver.env_calls:
            _time.sleep(0.005)
        landed_late.append(len(col._late_trajectories))
        return mask_stale(groups, version)

    col._mask_stale = land_first
    trained, counted = {}, 0
    try:
        # a step ends with a group's last call out only by chance of timing (rarer on a loaded machine,
        # where generation is slower): go on until that has happened, within a bound
        for step in range(16):
            groups, m = col.collect(step)
            counted += m["env/episodes"]
            trained.update({g.id: g for g in groups})
            run.weights.push(run.trainer.named_weights(), version=step + 1)
            if step >= 4 and any(landed_late):
                break
        assert any(landed_late), "no call completed a group between steps"
        drawn = {f"g{i}" for i in range(run.serial)}
        carried = {g.id for g in col.buffer} | {g.id for g in col.ready_carry}
        assert set(trained) | carried == drawn and not (set(trained) & carried)
        n = cfg.rollout.samples_per_prompt
        assert counted + len(col._late_trajectories) == n * (len(trained) + len(col.ready_carry))
    finally:
        run.close()


def test_multi_turn_april_run_killed_and_resumed_continues_exactly(model_dir, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    train_sync(env_cfg(model_dir, straight, steps=4, **APRIL))
    train_sync(env_cfg(model_dir, split, steps=2, **APRIL))
    train_sync(env_cfg(model_dir, split, steps=4, **APRIL))
    a = load_file(str(straight / "checkpoints" / "step_000004" / "model" / "model.safetensors"))
    b = load_file(str(split / "checkpoints" / "step_000004" / "model" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["reward/mean"] for r in rows(straight)] == [r["reward/mean"] for r in rows(split)]
    assert [r["rollout/carried_partial_samples"] for r in rows(straight)] == \
        [r["rollout/carried_partial_samples"] for r in rows(split)]
    assert any(r["rollout/carried_partial_samples"] for r in rows(straight)[:2])  # step 2's checkpoint held some


def test_async_episodes_train_and_resume_without_loss(model_dir, tmp_path):
    over = {"mode": "async", "async.max_staleness": 1, "steps": 3}
    run_dir = tmp_path / "a"
    train_sync_or_async(env_cfg(model_dir, run_dir, **{**over, "steps": 2}))
    train_sync_or_async(env_cfg(model_dir, run_dir, **over))
    got = rows(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3]
    ledger = [json.loads(x) for x in open(run_dir / "trained_groups.jsonl")]
    ids = [g["group"] for step in ledger for g in step["groups"]]
    assert len(ids) == len(set(ids)) == 6
    for r in got:
        assert r["actor/loss_tokens"] > 0


def train_sync_or_async(cfg):
    from rollover.loops.async_ import train_async

    return train_async(cfg)


def test_entropy_mask_chooses_turns_of_episodes():
    from rollover.rollout.curation import top_entropy_mask
    from rollover.types import Group, Prompt, Rollout

    # one episode: turn 1 (2 tokens, low entropy), 2 inserted tokens, turn 2 (1 token, high)
    ep = Rollout(group_id="g", prompt_ids=[1], response_ids=[5, 6, 7, 8, 9], logprobs=[-0.1, -0.1, 0.0, 0.0, -3.0],
                 versions=[0, 0, -1, -1, 0], loss_mask=[1, 1, 0, 0, 1], finish="stop", reward=1.0)
    single = Rollout(group_id="g", prompt_ids=[1], response_ids=[5, 6], logprobs=[-1.0, -1.0], versions=[0, 0],
                     loss_mask=[1, 1], finish="stop", reward=0.0)
    g = Group(id="g", prompt=Prompt(id="p", text="?"), prompt_ids=[1], rollouts=[ep, single])
    (out,), n = top_entropy_mask([g], 2 / 3)  # three steps, two kept: the low-entropy first turn goes
    assert n == 1 and [r.loss_mask for r in out.rollouts] == [[0, 0, 0, 0, 1], [1, 1]]


def test_turn_budget_shortens_easy_tasks_only():
    from types import SimpleNamespace as NS

    from rollover.rollout.curation import TurnBudget

    b = TurnBudget(max_turns=8, min_turns=2, threshold=0.5, correct=1.0)
    ep = lambda turns, reward: NS(ok=True, reward=reward, turns=[0] * turns)  # noqa: E731
    assert b.limit("new") == 8
    b.observe("easy", [ep(3, 1.0), ep(2, 1.0), ep(8, 0.0), ep(1, 0.0)])  # half solved, longest success 3 turns
    b.observe("hard", [ep(3, 1.0), ep(8, 0.0), ep(8, 0.0), ep(8, 0.0)])  # a quarter solved
    b.observe("trivial", [ep(1, 1.0), ep(1, 1.0)])
    assert (b.limit("easy"), b.limit("hard"), b.limit("trivial")) == (4, 8, 2)
    failed = NS(ok=False, reward=None, turns=[0])
    b.observe("easy", [failed, failed])  # failed episodes count as unsolved: back to the full budget
    assert b.limit("easy") == 8


def test_dynamic_turns_limit_the_episodes_of_easy_tasks(model_dir, tmp_path):
    """A task's turn limit comes from its last group, bounds its episodes, and is checkpointed."""
    from types import SimpleNamespace as NS

    cfg = env_cfg(model_dir, tmp_path, **{"env.dynamic_turns": True, "env.dynamic_turns_threshold": 0.5})
    run = build_run(cfg)
    try:
        groups = run.next_groups(2, version=0)
        assert all(g.max_turns == cfg.env.max_turns for g in groups)
        task = groups[0].prompt.id
        run.turn_budget.observe(task, [NS(ok=True, reward=1.0, turns=[0]), NS(ok=False, reward=None, turns=[])])
        assert run.turn_budget.limit(task) == 2
        g = replace(groups[0], id="gx", episodes=None, done={}, max_turns=1)
        run_groups(RolloutInputs.of(run), [g], sampling_from(cfg), cfg.seed, "test")
        assert all(len(g.done[j].turns) == 1 for j in range(g.n))  # the group's limit, not env.max_turns
        run.save(1)
    finally:
        run.close()
    resumed = build_run(cfg)
    try:
        assert resumed.turn_budget.limit(task) == 2
    finally:
        resumed.close()


def test_replay_restores_an_environment_and_refuses_one_that_diverges():
    """A checkpointed episode's environment comes back by replaying its actions; a replay that
    answers differently is an error naming the episode and the step."""
    from rollover.envs.episode import LiveEpisode
    from rollover.envs.games import GuessNumber, GuessNumberEnv
    from rollover.testing import char_tokenizer
    from rollover.types import Completion, SamplingParams

    tok = char_tokenizer()
    renderer = ChatRenderer(tok)
    game = GuessNumber(low=1, high=8, max_guesses=4)

    def played(secret):
        ep = LiveEpisode("g0/0", SamplingParams(max_new_tokens=8, seed=1), max_turns=4, max_total_tokens=400,
                         env=GuessNumberEnv(game, secret))
        ep.opened(asyncio.run(ep.env.initial_observation()), None, 0.0, renderer)
        for guess in ("2", "3"):
            req = ep.request()
            ids = tok.encode(guess, add_special_tokens=False)
            ep.sampled(Completion(req.id, req.prompt_ids, ids, [-0.5] * len(ids), [0] * len(ids), "length",
                                  req.sampling), renderer)
            ep.stepped(asyncio.run(ep.env.step(ep.action)), None, 0.0, renderer)
        return ep

    ep = played(secret=6)
    saved = pickle.loads(pickle.dumps(ep))
    assert saved.env is None and saved.phase == "generate" and len(saved.traj.turns) == 2
    fresh = GuessNumberEnv(game, 6)
    asyncio.run(saved.replay(fresh, timeout_s=5))
    assert saved.env is fresh and fresh.guesses == 2  # its state: two guesses made
    with pytest.raises(ValueError, match=r"episode g0/0: .* step 1 differently"):
        # secret 1: "2" gets "Lower." where the recorded run heard "Higher."
        asyncio.run(pickle.loads(pickle.dumps(ep)).replay(GuessNumberEnv(game, 1), timeout_s=5))


@pytest.mark.parametrize("inline", [True, False])
def test_environment_calls_share_one_loop_and_a_hung_thread_holds_up_no_call(inline):
    """env.inline ran each call under asyncio.run: a new event loop per call (an environment's
    subprocess, lock or session of the last call was bound to a dead loop), and at the call's end
    a wait for every thread it started, a hung one too. Now the calls share one loop kept for the
    run, and a blocking call left at its timeout delays nothing."""
    from rollover.rollout.core import EnvRunner

    runner = EnvRunner(4, inline=inline)
    release, results = threading.Event(), []
    landed = threading.Semaphore(0)
    held = {}

    def done(*out):
        results.append(out)
        landed.release()

    async def first(pool):
        held["future"] = asyncio.get_running_loop().create_future()
        return ("made",)

    async def second(pool):
        held["future"].set_result("kept")
        return (await held["future"],)

    async def hung(pool):
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.to_thread(release.wait, 60), 0.2)
        except TimeoutError:
            return ("timed out", time.monotonic() - t0)

    try:
        for fn in (first, second, hung):
            t0 = time.monotonic()
            runner.call(fn, done)
            assert landed.acquire(timeout=30)
            assert time.monotonic() - t0 < 10, fn.__name__  # not the 60 s the hung thread sleeps
        assert results[:2] == [("made",), ("kept",)]
        assert results[2][0] == "timed out"
    finally:
        release.set()
        runner.close()


def test_inline_calls_from_two_threads_and_a_close_during_one_are_safe(caplog):
    """async's training episodes step inline on the engine's thread while an evaluation opens
    its own on the trainer's: a call made while another runs gets a loop of its own, and closing
    the runner then neither raises nor takes the running call's loop from under it."""
    from rollover.rollout.core import EnvRunner

    runner = EnvRunner(4, inline=True)
    started, release, results = threading.Event(), threading.Event(), {}

    async def slow(pool):
        started.set()
        await asyncio.to_thread(release.wait, 30)
        return ("slow", id(asyncio.get_running_loop()))

    async def quick(pool):
        return ("quick", id(asyncio.get_running_loop()))

    worker = threading.Thread(target=runner.call, args=(slow, lambda *out: results.setdefault("slow", out)))
    worker.start()
    try:
        assert started.wait(30)
        runner.call(quick, lambda *out: results.setdefault("quick", out))
        assert results["quick"][0] == "quick"
        t0 = time.monotonic()
        runner.close()  # the slow call still runs: nothing to close under it
        assert time.monotonic() - t0 < 10
        assert "an inline environment call still runs 5 s after the run asked to close" in caplog.text
    finally:
        release.set()
        worker.join(30)
    assert results["slow"][0] == "slow" and results["slow"][1] != results["quick"][1]
