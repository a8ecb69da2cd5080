"""APRIL partial rollouts: nothing lost or duplicated, budgets and provenance kept, exact resume."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from rollover.rollout.inputs import RolloutInputs
from rollover.config import ConfigError, load_config
from rollover.loops.build import build_run
from rollover.loops.sync import train_sync
from rollover.rollout.april import AprilCollector
from rollover.testing import assert_provenance, save_tiny_model, tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama", seed=11))


def april_cfg(model_dir, run_dir, **over):
    base = {
        "device": "cpu", "model": model_dir, "run_dir": str(run_dir), "steps": 4, "seed": 3, "resume": "never",
        "data.train": "gen:arithmetic?n=200", "data.eval_size": 4, "data.max_prompt_tokens": 64,
        "rollout.prompts_per_step": 3, "rollout.samples_per_prompt": 2, "rollout.max_new_tokens": 12,
        "rollout.max_rows": 6, "reward.functions": ["numeric", {"fn": "format", "weight": 0.5, "kwargs": {"pattern": "[0-9]"}}],
        "partial_rollout.enabled": True, "partial_rollout.oversample": 2.0, "partial_rollout.max_carry_steps": 100,
        "partial_rollout.carry": "resubmit",  # the keep_kv tests and the auto test set theirs
        "train.lr": 1e-3, "eval.every": 0, "eval.at_start": False, "eval.samples_per_prompt": 1,
        "checkpoint.every": 2, "logging.progress": False, "logging.tensorboard": False,
    }
    base.update(over)
    return load_config(**base)


def with_random_budgets(run, rng, cap):
    """Give every drawn group per-sample budgets from a long-tailed mix (EOS ignored)."""
    draw = run.next_groups

    def next_groups(k, version):
        groups = draw(k, version)
        for g in groups:
            g.budgets = [cap if rng.random() < 0.3 else rng.randint(1, cap) for _ in range(g.n)]
        return groups

    run.next_groups = next_groups


@pytest.mark.parametrize("seed", range(6))
def test_no_sample_lost_or_duplicated_and_budgets_hold(model_dir, tmp_path, seed):
    rng = random.Random(seed)
    n = rng.choice([1, 2, 3])
    cfg = april_cfg(model_dir, tmp_path, seed=seed, **{
        "rollout.samples_per_prompt": n, "rollout.prompts_per_step": rng.choice([1, 2, 3]),
        "rollout.max_rows": rng.choice([2, 4, 7]), "partial_rollout.oversample": rng.choice([1.0, 1.5, 2.0, 3.0]),
        "rollout.ignore_eos": True, "algorithm.advantage": "reinforce_pp"})
    run = build_run(cfg)
    with_random_budgets(run, rng, cfg.rollout.max_new_tokens)
    col = AprilCollector(RolloutInputs.of(run))
    trained: dict[str, list] = {}
    budgets: dict[str, list[int]] = {}
    try:
        for step in range(6):
            groups, m = col.collect(step)
            assert len(groups) == cfg.rollout.prompts_per_step
            assert m["discarded_tokens"] == 0
            for g in groups:
                assert g.id not in trained, "a group trained twice"
                assert len(g.rollouts) == n
                trained[g.id] = g.rollouts
            for g in col.buffer:
                budgets[g.id] = g.budgets
                for j, c in g.partial.items():
                    assert c.finish == "abort" and j not in g.done
                    assert len(c.response_ids) < g.budgets[j]
            # a new weights version at every step, as in training (the values stay: nothing trains here)
            run.engine.update_weights(run.trainer.named_weights(), version=step + 1)
        drawn = {f"g{i}" for i in range(run.serial)}
        carried = {g.id for g in col.buffer} | {g.id for g in col.ready_carry}
        assert set(trained) | carried == drawn  # nothing lost
        assert not (set(trained) & carried)  # nothing both trained and carried
        for rollouts in trained.values():
            for r in rollouts:
                assert 1 <= len(r.response_ids) <= cfg.rollout.max_new_tokens
                assert len(r.logprobs) == len(r.versions) == len(r.response_ids)
                assert r.versions == sorted(r.versions)  # tokens appended in version order
    finally:
        run.close()


def test_versions_and_logprobs_are_those_of_the_producing_weights(model_dir, tmp_path):
    cfg = april_cfg(model_dir, tmp_path, **{"rollout.ignore_eos": True, "rollout.max_new_tokens": 16,
                                            "rollout.max_rows": 4, "partial_rollout.oversample": 3.0})
    run = build_run(cfg)
    rng = random.Random(0)
    with_random_budgets(run, rng, cfg.rollout.max_new_tokens)
    models = {0: tiny_model("llama", seed=11)}
    col = AprilCollector(RolloutInputs.of(run))
    seen_resumed = 0
    try:
        for step in range(5):
            groups, m = col.collect(step)
            for g in groups:
                for r in g.rollouts:
                    seen_resumed += assert_provenance(r, models)
            models[step + 1] = tiny_model("llama", seed=100 + step)
            run.engine.update_weights(models[step + 1].state_dict().items(), version=step + 1)
    finally:
        run.close()
    assert seen_resumed > 0  # some samples really spanned several policy versions


def test_stale_prefixes_masked_or_regenerated(model_dir, tmp_path):
    for mode in ("mask", "regenerate"):
        cfg = april_cfg(model_dir, tmp_path / mode, **{"rollout.ignore_eos": True, "rollout.max_new_tokens": 16,
                                                        "partial_rollout.max_carry_steps": 0, "partial_rollout.score_lag": 0,
                                                        "partial_rollout.on_stale": mode,
                                                        "partial_rollout.oversample": 3.0, "rollout.max_rows": 4})
        run = build_run(cfg)
        with_random_budgets(run, random.Random(1), 16)
        col = AprilCollector(RolloutInputs.of(run))
        regenerated = 0
        try:
            for step in range(5):
                version = run.engine.version
                groups, m = col.collect(step)
                regenerated += m["regenerated_tokens"]
                for g in groups:
                    for r in g.rollouts:
                        for mk, v in zip(r.loss_mask, r.versions):
                            if mode == "mask":
                                assert mk == (1 if v == version else 0)
                            else:
                                assert v == version  # nothing older than 0 steps survives
                run.engine.update_weights(run.trainer.named_weights(), version=step + 1)
        finally:
            run.close()
        if mode == "regenerate":
            assert regenerated > 0


def test_remax_groups_keep_their_greedy_answer_through_carries_and_regeneration(model_dir, tmp_path):
    """algorithm.advantage=remax under APRIL: a group carried over steps, or started again for
    being stale, still brings its greedy answer (decoded at temperature 0) beside its n samples."""
    cfg = april_cfg(model_dir, tmp_path, **{"rollout.ignore_eos": True, "rollout.max_new_tokens": 16,
                                            "partial_rollout.max_carry_steps": 0, "partial_rollout.score_lag": 0,
                                            "partial_rollout.on_stale": "regenerate", "algorithm.advantage": "remax",
                                            "partial_rollout.oversample": 3.0, "rollout.max_rows": 4})
    run = build_run(cfg)
    with_random_budgets(run, random.Random(1), 16)
    sent = []
    submit = run.engine.submit_many

    def spy(requests, *a, **kw):
        requests = list(requests)
        sent.extend(requests)
        return submit(requests, *a, **kw)

    run.engine.submit_many = spy
    col = AprilCollector(RolloutInputs.of(run))
    regenerated = carried = 0
    try:
        for step in range(4):
            groups, m = col.collect(step)
            regenerated += m["regenerated_tokens"]
            for g in groups:
                assert len(g.rollouts) == 2 and g.greedy is not None and g.greedy.reward is not None
            assert all(pg.greedy_first and pg.n == 3 for pg in col.buffer)  # carried
            carried += len(col.buffer)
            run.engine.update_weights(run.trainer.named_weights(), version=step + 1)
        stale = groups[0]  # a complete group carried past max_carry_steps starts again, its greedy answer too
        col.buffer = []
        assert col._fresh_enough([stale], version=stale.start_version + 5, m=Counter()) == []
        assert [(pg.id, pg.n, pg.greedy_first) for pg in col.buffer] == [(stale.id, 3, True)]
    finally:
        run.close()
    assert regenerated > 0 and carried > 0
    temperature = {r.id: r.sampling.temperature for r in sent}
    assert {t for rid, t in temperature.items() if rid.endswith("/0")} == {0.0}
    assert {t for rid, t in temperature.items() if not rid.endswith("/0")} == {cfg.rollout.temperature}


def test_april_keeps_rows_busier_than_sync(model_dir, tmp_path):
    """The point of APRIL: with a long tail, the engine's rows stay occupied."""
    occ = {}
    for enabled in (False, True):
        cfg = april_cfg(model_dir, tmp_path / str(enabled), **{
            "partial_rollout.enabled": enabled, "rollout.ignore_eos": True, "rollout.max_new_tokens": 24,
            "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2, "rollout.max_rows": 8,
            "partial_rollout.oversample": 2.0})
        run = build_run(cfg)
        with_random_budgets(run, random.Random(5), 24)
        from rollover.loops.sync import make_collector

        col = make_collector(run)
        run.engine.reset_stats()
        for step in range(6):
            col.collect(step)
        occ[enabled] = run.engine.stats().occupancy
        run.close()
    assert occ[True] > occ[False] + 0.2


@pytest.mark.parametrize("extra", [{}, {"algorithm.dynamic_sampling": True, "partial_rollout.adaptive": True},
                                   {"partial_rollout.carry": "keep_kv", "eval.every": 1},
                                   {"algorithm.advantage": "remax"}])
def test_april_training_resume_is_exact(model_dir, tmp_path, extra):
    over = {"resume": "auto", "rollout.max_rows": 4, **extra}
    straight = tmp_path / "straight"
    train_sync(april_cfg(model_dir, straight, steps=4, **over))
    split = tmp_path / "split"
    train_sync(april_cfg(model_dir, split, steps=2, **over))
    train_sync(april_cfg(model_dir, split, steps=4, **over))
    a = load_file(str(straight / "checkpoints" / "step_000004" / "model" / "model.safetensors"))
    b = load_file(str(split / "checkpoints" / "step_000004" / "model" / "model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_carry_auto_keeps_kv_where_the_engine_can_and_the_objective_corrects(model_dir, tmp_path):
    def carry(**over):
        return load_config(**{"model": model_dir, "run_dir": str(tmp_path), "partial_rollout.enabled": True, **over})

    # APRIL's default objective is decoupled PPO (as async mode's): TorchEngine keeps K/V
    default = carry()
    assert default.algorithm.loss == "decoupled_ppo" and default.partial_rollout.carry == "auto"
    mode, why = default.april_carry
    assert mode == "keep_kv" and "algorithm.loss=decoupled_ppo" in why
    assert carry(**{"algorithm.loss": "ppo", "algorithm.tis_cap": 2.0}).april_carry[0] == "keep_kv"
    for opts in ({"is_level": "token", "is_cap": 2.0}, {"m2po_tau": 0.04}):  # the same corrections in loss_options
        mode, why = carry(**{"algorithm.loss": "ppo", "algorithm.loss_options": opts}).april_carry
        assert mode == "keep_kv" and f"algorithm.loss_options.{next(iter(opts))} corrects" in why
    # importance weights in loss_options weigh stale tokens (on_stale=is); M2PO's mask weighs none
    carry(**{"algorithm.loss": "ppo", "algorithm.loss_options": {"is_level": "token"}, "partial_rollout.on_stale": "is"})
    with pytest.raises(ConfigError, match="on_stale=is weights stale tokens"):
        carry(**{"algorithm.loss": "ppo", "algorithm.loss_options": {"m2po_tau": 0.04}, "partial_rollout.on_stale": "is"})
    mode, why = carry(**{"algorithm.loss": "ppo"}).april_carry  # nothing corrects older tokens
    assert mode == "resubmit" and "does not correct" in why
    mode, why = carry(**{"rollout.engine": "vllm"}).april_carry  # vLLM keeps K/V too (pause mode "keep")
    assert mode == "keep_kv" and why.startswith("vLLM keeps K/V")
    episodes = carry(**{"rollout.engine": "vllm", "env.name": "guess_number", "data.train": "env"})
    assert episodes.april_carry[0] == "resubmit"
    assert carry(**{"partial_rollout.carry": "resubmit"}).april_carry == ("resubmit", "partial_rollout.carry=resubmit in the config")
    assert load_config(model=model_dir, run_dir=str(tmp_path)).algorithm.loss == "ppo"  # sync without APRIL: unchanged
    # in a run: the metrics say which mode ran
    from rollover.metrics import read_metrics

    train_sync(april_cfg(model_dir, tmp_path / "run", steps=2, **{"partial_rollout.carry": "auto"}))
    rows = read_metrics(tmp_path / "run", kind="train")
    assert [r["rollout/carry_keep_kv"] for r in rows] == [1, 1]
    # APRIL's throughput figure reaches the row: the tokens kept over the collection's wall time
    assert all(0 < r["perf/useful_tokens_per_s"] <= r["rollout/useful_tokens"] / r["timing_s/generate"] for r in rows)


def test_an_evaluation_leaves_the_carried_requests_to_the_next_step(model_dir, tmp_path):
    """carry=keep_kv: an evaluation resumes the engine, which would run every live request to its
    end under the new weights; the next steps would then train those and generate nothing. Set
    aside first, they go on in the step after it, as without the evaluation."""
    from rollover.metrics import read_metrics

    over = {"partial_rollout.carry": "keep_kv", "rollout.max_new_tokens": 40, "rollout.max_rows": 4,
            "partial_rollout.oversample": 3.0, "checkpoint.every": 0, "steps": 5}
    train_sync(april_cfg(model_dir, tmp_path / "eval", **{**over, "eval.every": 1}))
    rows = read_metrics(tmp_path / "eval", kind="train")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["rollout/generated_tokens"] > 0 for r in rows), [r["rollout/generated_tokens"] for r in rows]


@pytest.mark.parametrize("carry", ["keep_kv", "resubmit"])
def test_the_carry_metrics_count_what_they_name(model_dir, tmp_path, carry):
    """useful_tokens are those that train (stale ones masked out are not); samples holding tokens
    are counted whether live in the engine (keep_kv) or aborted into their groups, and requests
    queued in the engine holding none are counted apart."""
    from rollover.metrics import read_metrics

    train_sync(april_cfg(model_dir, tmp_path, **{
        "partial_rollout.carry": carry, "partial_rollout.max_carry_steps": 0, "partial_rollout.score_lag": 0,
        "rollout.max_new_tokens": 40, "rollout.max_rows": 4, "partial_rollout.oversample": 3.0, "checkpoint.every": 0}))
    rows = read_metrics(tmp_path, kind="train")
    assert [r["rollout/useful_tokens"] for r in rows] == [r["actor/loss_tokens"] for r in rows]
    assert any(r["rollout/carried_partial_samples"] for r in rows)
    for r in rows:
        assert r["rollout/carried_live_samples"] <= r["rollout/carried_partial_samples"]
        assert r["rollout/carried_groups"] + r["rollout/carried_unstarted_groups"] >= 1
        if carry == "resubmit":  # nothing stays in the engine
            assert r["rollout/carried_live_samples"] == r["rollout/carried_queued_samples"] == 0
    if carry == "keep_kv":
        assert any(r["rollout/carried_live_samples"] for r in rows) and any(r["rollout/carried_queued_samples"] for r in rows)


@pytest.mark.parametrize("seed", range(3))
def test_keep_kv_carry_loses_nothing_and_keeps_provenance(model_dir, tmp_path, seed):
    """carry=keep_kv: unfinished samples stay in the paused engine across weight updates."""
    rng = random.Random(seed)
    cfg = april_cfg(model_dir, tmp_path, seed=seed, **{
        "partial_rollout.carry": "keep_kv", "rollout.ignore_eos": True, "rollout.max_new_tokens": 16,
        "rollout.max_rows": rng.choice([4, 6]), "partial_rollout.oversample": rng.choice([1.5, 2.0, 3.0])})
    run = build_run(cfg)
    with_random_budgets(run, rng, 16)
    models = {0: tiny_model("llama", seed=11)}
    col = AprilCollector(RolloutInputs.of(run))
    trained = {}
    try:
        for step in range(5):
            groups, m = col.collect(step)
            assert m["discarded_tokens"] == 0 and len(groups) == cfg.rollout.prompts_per_step
            for g in groups:
                assert g.id not in trained
                trained[g.id] = g
            if step == 2:
                col.state_dict()  # a checkpoint aborts live requests into the buffer
                assert not col.pending_ids
            models[step + 1] = tiny_model("llama", seed=200 + step)
            run.engine.update_weights(models[step + 1].state_dict().items(), version=step + 1, inflight=col.inflight_mode)
        drawn = {f"g{i}" for i in range(run.serial)}
        carried = {g.id for g in col.buffer} | set(col.inflight) | {g.id for g in col.ready_carry}
        assert set(trained) | carried == drawn and not (set(trained) & carried)
        spanned = 0
        for g in trained.values():
            for r in g.rollouts:
                assert len(r.response_ids) <= 16 and r.versions == sorted(r.versions)
                spanned += len(set(r.versions)) > 1
        assert spanned > 0
    finally:
        run.close()


@pytest.mark.parametrize("lag", [0, 4])
def test_a_slow_judge_overlaps_decoding_unless_score_lag_is_zero(model_dir, tmp_path, lag):
    """score_lag > 0: groups are scored on their own thread and the engine keeps decoding
    meanwhile; score_lag 0: the engine's callback scores and decoding waits."""
    import time as _time

    run = build_run(april_cfg(model_dir, tmp_path, **{"partial_rollout.score_lag": lag, "rollout.ignore_eos": True}))
    score, overlapped = run.rewards.score, []

    def slow_score(*args, **kw):
        before = run.engine.core.stats.generated_tokens  # a plain read: never waits for the engine
        _time.sleep(0.2)  # long beside a decode step of the tiny model, even on a loaded 2-core host
        overlapped.append(run.engine.core.stats.generated_tokens > before)
        return score(*args, **kw)

    run.rewards.score = slow_score
    col = AprilCollector(RolloutInputs.of(run))
    try:
        for step in range(2):
            groups, m = col.collect(step)
            assert len(groups) == 3 and m["discarded_tokens"] == 0
    finally:
        run.close()
    assert overlapped and (any(overlapped) if lag else not any(overlapped))


def test_a_score_that_never_comes_ends_the_step_with_an_error_naming_the_group(model_dir, tmp_path):
    import time as _time

    from rollover.rollout.stops import Stalled

    run = build_run(april_cfg(model_dir, tmp_path, **{"rollout.stall_timeout_s": 1}))
    score = run.rewards.score

    def stuck(*args, **kw):
        _time.sleep(3)
        return score(*args, **kw)

    run.rewards.score = stuck
    col = AprilCollector(RolloutInputs.of(run))
    try:
        with pytest.raises(Stalled, match=r"waited 1 s for the score of group g\d+"):
            col.collect(0)
    finally:
        col.close()
        run.close()
