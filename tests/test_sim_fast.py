"""The simulator's fast path (`simulate.fast`): the same cluster and policies on arrays. Sync
mode must give the schedulers' path's times exactly (same draws); async mode must keep the
staleness bound and stay close to the schedulers' path; what it does not model is refused."""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest

from rollover.config import ConfigError
from rollover.sim.config import load_sim_config

BASE = ["rollout.prompts_per_step=12", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=512",
        "simulate.pools=[{workers: 4, max_rows: 16}]",
        "simulate.decode={step_s: 0.01, per_row_s: 0.0002, per_context_token_s: 1.0e-7, prefill_s: 0.02, "
        "prefill_per_token_s: 1.0e-5}",
        "simulate.train={step_s: 2.0, per_token_s: 1.0e-4}", "simulate.sync={latency_s: 0.5}",
        "simulate.prompt_tokens=64", "simulate.prompts=200",
        "simulate.lengths={median: 120, sigma: 0.8, prompt_sigma: 0.5}", "logging.progress=false", "steps=8"]


def both(*overrides, draws="exact"):
    """(the schedulers' report, the fast path's report) for one config."""
    from rollover.sim.fast import simulate_fast
    from rollover.sim.run import _with_rows, profile_of, simulate

    cfg = load_sim_config(None, BASE + list(overrides))
    return simulate(cfg), simulate_fast(_with_rows(cfg), profile_of(cfg), draws=draws)


def assert_same(a: dict, b: dict) -> None:
    assert b["samples_trained"] == a["samples_trained"]
    assert b["generated_tokens"] == a["generated_tokens"]
    assert b["staleness"] == a["staleness"]
    assert b["simulated_s"] == pytest.approx(a["simulated_s"], rel=1e-9)
    assert b["row_occupancy"] == pytest.approx(a["row_occupancy"], rel=1e-9)
    assert [r["t_end"] for r in b["step_rows"]] == pytest.approx([r["t_end"] for r in a["step_rows"]], rel=1e-9)
    assert [r["t_train"] for r in b["step_rows"]] == pytest.approx([r["t_train"] for r in a["step_rows"]], rel=1e-9)
    assert b["rollout"].keys() == a["rollout"].keys()
    for name, p in a["rollout"].items():
        assert b["rollout"][name]["generate_s"] == pytest.approx(p["generate_s"], rel=1e-9)
        assert b["rollout"][name]["sync_s"] == pytest.approx(p["sync_s"], rel=1e-9)


@pytest.mark.parametrize("overrides", [
    [],
    # rows bind: a worker's requests queue and enter as rows free
    ["simulate.pools=[{workers: 2, max_rows: 6}]"],
    # a heterogeneous cluster; one pool's step time from measured points; padded prefills
    ["simulate.pools=[{workers: 2, max_rows: 8}, {name: slow, workers: 3, max_rows: 4, decode: "
     "{step_s: 0.03, rows_table: [[1, 0.02], [4, 0.05], [8, 0.06]], prefill_padded: true}}]"],
    # the prefill budget (8,192 tokens a step) holds prompts back
    ["simulate.prompt_tokens=3000", "simulate.pools=[{workers: 2, max_rows: 24}]", "rollout.max_new_tokens=256"],
    # budget-truncated samples, ignore_eos
    ["rollout.max_new_tokens=100"], ["rollout.ignore_eos=true", "rollout.max_new_tokens=90"],
    # eta = 0 admits one batch per version: the synchronous schedule
    ["mode=async", "async.max_staleness=0"],
    # prompts repeat within a step (groups of one prompt apart in a worker's queue prefill it once)
    ["simulate.prompts=5", "simulate.pools=[{workers: 1, max_rows: 16}]"],
    ["simulate.prompts=2", "data.shuffle=false", "rollout.prompts_per_step=4", "simulate.prompt_tokens=2500",
     "rollout.max_new_tokens=256", "simulate.pools=[{workers: 1, max_rows: 16}]"],
    # a graphed engine's mixed steps (a whole prefill beside the decode), admitting at every step
    ["simulate.pools=[{workers: 2, max_rows: 6, admit_batch: 1, decode: {step_s: 0.01, prefill_s: 0.05, "
     "separate_admission: true}}]"],
    # admissions batched as a graphed engine batches them: waiting requests enter once 3 fit, or
    # after 16 steps of waiting
    ["simulate.pools=[{workers: 2, max_rows: 6, admit_batch: 3, decode: {step_s: 0.01, prefill_s: 0.05, "
     "separate_admission: true}}]"],
    # the default batch of a graphed engine (16 rows / 8); a second pool that admits at every step
    ["simulate.pools=[{workers: 2, max_rows: 16, decode: {step_s: 0.01, prefill_s: 0.05, separate_admission: "
     "true}}, {name: eager, workers: 2, max_rows: 8}]", "rollout.max_new_tokens=300"],
    # the prefill budget, not the batch, holds requests back: they enter at the next boundary
    ["simulate.prompt_tokens=3000", "simulate.pools=[{workers: 2, max_rows: 24, admit_batch: 4}]",
     "rollout.max_new_tokens=256"],
    ["mode=async", "async.max_staleness=0", "simulate.pools=[{workers: 2, max_rows: 12, admit_batch: 4}]"],
], ids=["plain", "rows-bind", "heterogeneous", "prefill-budget", "truncated", "ignore-eos", "async-eta0",
        "repeated-prompts", "repeated-prompts-budget", "separate-admission", "admit-batch", "admit-batch-default",
        "admit-batch-budget", "admit-batch-async"])
def test_fast_path_gives_the_schedulers_times_exactly(overrides):
    a, b = both(*overrides)
    assert b["mode"].endswith(" router]") and "[fast path, " in b["mode"]
    assert_same(a, b)


@pytest.mark.parametrize("overrides", [
    ["simulate.pools=[{workers: 4, max_rows: 16, kv_tokens: 1500}]"],
    # one pool with a cache that binds, one without: the ones that fill it preempt, the others never
    ["simulate.pools=[{workers: 2, max_rows: 16, kv_tokens: 1200}, {name: roomy, workers: 2, max_rows: 8}]"],
    # long prompts: admission stops for the cache before the prefill budget
    ["simulate.prompt_tokens=600", "simulate.pools=[{workers: 2, max_rows: 12, kv_tokens: 4000}]",
     "rollout.max_new_tokens=256"],
    ["mode=async", "async.max_staleness=0", "simulate.pools=[{workers: 4, max_rows: 16, kv_tokens: 1500}]"],
    # an update recomputes the running rows' K/V (continue) after preempting what would not fit
    ["mode=async", "async.max_staleness=1", "simulate.pools=[{workers: 8, max_rows: 64, kv_tokens: 1500}]"],
    # admission waits for a batch; a request waiting for K/V room is not held back by the budget
    ["simulate.pools=[{workers: 4, max_rows: 16, kv_tokens: 1500, admit_batch: 4}]"],
], ids=["sync", "heterogeneous", "long-prompts", "async-eta0", "async-continue", "admit-batch"])
def test_fast_path_gives_the_schedulers_times_with_a_kv_cache(overrides):
    """A K/V capacity that binds: sequences preempted (the newest, to the queue's front, their
    tokens recomputed on readmission) at the same boundaries as on the schedulers' path."""
    a, b = both(*overrides)
    assert_same(a, b)
    assert b["preempted"] == a["preempted"] > 0


def test_async_fast_path_is_exact_when_workers_never_run_ahead():
    # with one admission wave per update (the gate binds, rows are plentiful) nothing is admitted
    # inside a window at a worker that ran past the admission: the schedule is the schedulers'
    for over in (["async.max_staleness=1"], ["async.max_staleness=3", "rollout.inflight_weight_update=keep"]):
        a, b = both("mode=async", "simulate.pools=[{workers: 8, max_rows: 64}]", *over)
        assert_same(a, b)


def test_async_fast_path_stays_close_to_the_schedulers():
    # where admissions happen between updates (rows bind), a group can reach a worker that ran
    # past its admission inside a window (a delay of a few decode steps); on a cluster of four
    # workers, two of them three times slower, one routing decision that differs moves every
    # later one, so single runs scatter: unbiased over seeds, each within 10%
    errors = []
    for pools in ("[{workers: 2, max_rows: 12}]", "[{workers: 2, max_rows: 16}, {name: slow, workers: 2, max_rows: 8, "
                                                  "decode: {step_s: 0.03}}]"):
        for eta, inflight in ((1, "continue"), (3, "keep")):
            for seed in (0, 1):
                a, b = both("mode=async", f"simulate.pools={pools}", f"async.max_staleness={eta}",
                            f"rollout.inflight_weight_update={inflight}", "steps=10", f"seed={seed}")
                assert b["samples_trained"] == a["samples_trained"]
                assert b["generated_tokens"] == a["generated_tokens"]  # the same draws, every sample to its end
                assert max(map(int, b["staleness"])) <= eta
                errors.append(b["samples_per_s"] / a["samples_per_s"] - 1)
                assert b["trainer"]["utilization"] == pytest.approx(a["trainer"]["utilization"], rel=0.1)
    assert max(map(abs, errors)) < 0.1, errors
    assert statistics.mean(map(abs, errors)) < 0.03, errors


def test_april_fast_path_gives_the_schedulers_times_when_routing_sees_the_same_loads():
    # over-provisioning, refills as samples finish, the stop at B ready groups, abort and
    # resubmit from the carried tokens: on two busy workers every refill is routed with the
    # loads the schedulers' path sees, and the schedule is the same
    a, b = both("partial_rollout.enabled=true", "partial_rollout.carry=resubmit",
                "simulate.pools=[{workers: 2, max_rows: 8}]")
    assert b["mode"].startswith("APRIL") and "[fast path, " in b["mode"]
    assert_same(a, b)
    assert max(map(int, b["staleness"])) > 0  # carried samples trained versions later


def test_april_fast_path_stays_close_to_the_schedulers():
    # a group routed at a finish sees the loads of workers that may have run past that finish
    # inside a window: the schedule can differ slightly, never the stop (each window in which
    # the step stops runs again up to the stop)
    for over in (["partial_rollout.carry=resubmit"], ["partial_rollout.carry=keep_kv"],
                 ["partial_rollout.carry=resubmit", "partial_rollout.score_lag=0"],
                 ["partial_rollout.carry=keep_kv", "partial_rollout.score_lag=3", "partial_rollout.oversample=1.5"],
                 ["partial_rollout.carry=keep_kv", "simulate.pools=[{workers: 2, max_rows: 8}]"],
                 ["partial_rollout.carry=resubmit", "simulate.pools=[{workers: 16, max_rows: 64}]"],
                 # a cache that binds: preempted rows wait at the front of their worker's queue
                 ["partial_rollout.carry=keep_kv", "simulate.pools=[{workers: 4, max_rows: 16, kv_tokens: 1500}]"],
                 ["partial_rollout.carry=resubmit", "simulate.pools=[{workers: 4, max_rows: 16, kv_tokens: 1500}]"],
                 # admissions batched (a graphed engine's default): refills wait for a batch
                 ["partial_rollout.carry=keep_kv", "simulate.pools=[{workers: 4, max_rows: 32, decode: "
                  "{step_s: 0.01, prefill_s: 0.05, separate_admission: true}}]"],
                 ["partial_rollout.carry=resubmit", "simulate.pools=[{workers: 4, max_rows: 16, admit_batch: 4}]"]):
        a, b = both("partial_rollout.enabled=true", *over)
        assert b["samples_trained"] == a["samples_trained"]
        assert b["samples_per_s"] == pytest.approx(a["samples_per_s"], rel=0.02)
        assert [r["t_train"] for r in b["step_rows"]] == pytest.approx([r["t_train"] for r in a["step_rows"]], rel=0.03)
        assert b["generated_tokens"] == pytest.approx(a["generated_tokens"], rel=0.03)
        ages_a = sum(int(k) * v for k, v in a["staleness"].items()) / a["samples_trained"]
        ages_b = sum(int(k) * v for k, v in b["staleness"].items()) / b["samples_trained"]
        assert ages_b == pytest.approx(ages_a, rel=0.05)


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_fast_path_holds_the_staleness_bound(eta):
    from rollover.sim.run import simulate

    r = simulate(load_sim_config(None, BASE + ["simulate.fast=true", "mode=async", f"async.max_staleness={eta}",
                                               "simulate.pools=[{workers: 16, max_rows: 8}]", "steps=12"]))
    ages = {int(k): v for k, v in r["staleness"].items()}
    assert max(ages) <= eta and sum(ages.values()) == 12 * 12 * 4
    if eta:
        assert max(ages) == eta  # the gate lets groups start eta versions ahead, and they do


@pytest.mark.parametrize("override,named", [
    ("partial_rollout.enabled=true;partial_rollout.adaptive=true", "adaptive APRIL"),
    ("partial_rollout.enabled=true;partial_rollout.on_stale=regenerate", "regenerate"),
    ("algorithm.dynamic_sampling=true", "dynamic sampling"),
    ("simulate.reward={per_group_s: 1.0}", "scoring time"),
    ("simulate.shared_device=true", "shared device"),
    ("selection.policy=thompson", "prompt selection"),
    ("selection.dars=equal", "DARS"),
    ("simulate.prompts=100001", "the router forgetting prompts"),
    ("mode=async;rollout.inflight_weight_update=abort", "inflight_weight_update=abort"),
    ("mode=async;async.experience_pool=true", "experience_pool"),
])
def test_fast_path_refuses_what_it_does_not_model(override, named):
    from rollover.sim.run import simulate

    with pytest.raises(ConfigError, match=f"simulate.fast does not model .*{named}.*simulate.fast=false"):
        simulate(load_sim_config(None, BASE + ["simulate.fast=true", *override.split(";")]))


def test_free_decoding_does_not_hang_the_windows():
    # decode steps that cost nothing: every finish of a prefill happens at one instant; windows
    # must still move on (APRIL then stops among simultaneous completions, whose order the two
    # paths break differently)
    free = "simulate.decode={step_s: 0.0, per_row_s: 0.0, per_context_token_s: 0.0, prefill_s: 0.02}"
    a, b = both("mode=async", "async.max_staleness=1", free, "steps=4")
    assert b["simulated_s"] == pytest.approx(a["simulated_s"], rel=1e-6)
    a, b = both("partial_rollout.enabled=true", free, "steps=4")
    assert b["samples_trained"] == a["samples_trained"]
    assert b["simulated_s"] == pytest.approx(a["simulated_s"], rel=0.05)


def test_vector_draws_follow_the_length_model():
    from rollover.sim.fast import Draws

    cfg = load_sim_config(None, BASE + ["simulate.lengths={median: 300, sigma: 0.6, prompt_sigma: 0.4}",
                                        "rollout.max_new_tokens=100000", "simulate.prompts=4000"])
    d = Draws(cfg)
    prompts = np.arange(4000)
    t, stop = d.targets(prompts, np.arange(4000), 8)
    again, _ = d.targets(prompts, np.arange(4000), 8)
    assert (t == again).all() and stop.all()  # deterministic; nothing reached the budget
    logs = np.log(t.reshape(4000, 8))
    assert math.exp(np.median(logs)) == pytest.approx(300, rel=0.03)
    assert logs.std() == pytest.approx(math.hypot(0.6, 0.4), rel=0.05)
    assert logs.mean(axis=1).std() == pytest.approx(math.sqrt(0.4 ** 2 + 0.6 ** 2 / 8), rel=0.08)  # per-prompt factor
    short = Draws(load_sim_config(None, BASE + ["rollout.max_new_tokens=200"]))
    t, stop = short.targets(prompts[:500] % 200, np.arange(500), 4)
    assert t.max() == 200 and (t[~stop] == 200).all() and (t[stop] < 200).all()
    eos = Draws(load_sim_config(None, BASE + ["rollout.ignore_eos=true", "rollout.max_new_tokens=50"]))
    t, stop = eos.targets(prompts[:10], np.arange(10), 4)
    assert (t == 50).all() and not stop.any()
    emp = Draws(load_sim_config(None, BASE + ["simulate.lengths={kind: empirical, values: [5, 40, 70]}"]))
    t, _ = emp.targets(prompts[:300] % 200, np.arange(300), 4)
    assert set(t.tolist()) == {5, 40, 70}


def test_vector_draws_agree_with_the_exact_draws_in_distribution():
    from rollover.sim.fast import simulate_fast
    from rollover.sim.run import _with_rows, profile_of

    cfg = _with_rows(load_sim_config(None, BASE + ["steps=30", "simulate.pools=[{workers: 8, max_rows: 16}]"]))
    exact = simulate_fast(cfg, profile_of(cfg), draws="exact")
    vector = simulate_fast(cfg, profile_of(cfg))
    assert vector["samples_per_s"] == pytest.approx(exact["samples_per_s"], rel=0.1)
    per_sample = [r["response_tokens"] / r["samples"] for r in vector["step_rows"]]
    assert statistics.mean(per_sample) == pytest.approx(exact["generated_tokens"] / exact["samples_trained"], rel=0.1)


def test_cli_runs_the_fast_path_with_report_and_gantt(tmp_path, capsys):
    from rollover.cli import main

    report, png = tmp_path / "r.json", tmp_path / "g.png"
    rc = main(["simulate", *BASE, "simulate.fast=true", "mode=async", "async.max_staleness=2",
               "--json", str(report), "--gantt", str(png)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "[fast path, " in out and "samples trained/s" in out
    r = json.loads(report.read_text())
    assert r["steps"] == 8 and r["samples_trained"] == 8 * 12 * 4 and png.stat().st_size > 1000


# ---------------------------------------------------------------------------- the router's rule
def test_requests_go_to_the_least_loaded_and_fresh_ones_home_within_slack():
    """Hand-worked: budget 10, slack 5, three workers. Carried requests fill the least loaded
    (ties to the lowest index); a fresh one stays home while home is within slack of the least."""
    from rollover.sim import route

    impls = [route.requests_py] + ([lambda *a: route.requests(*a, fast=True)] if route.NUMBA else [])
    for impl in impls:
        loads, home = np.array([0, 0, 0]), np.array([-1, 2])
        # carried 4 -> w0 (load 6); carried 9 -> w1 (1); fresh, prompt 0 has no home -> the least-loaded
        # w2 (10), its home; fresh, prompt 1's home w2 is not within slack (10 > 1 + 5) -> w1 (11), its home
        dest = impl(loads, home, np.array([4, 9, 0, 0]), np.array([0, 0, 0, 1]), 10, 5)
        assert dest.tolist() == [0, 1, 2, 1], impl
        assert loads.tolist() == [6, 11, 10] and home.tolist() == [2, 1]


def test_groups_split_between_home_and_least_loaded():
    """Hand-worked: budget 10, slack 20, groups of 4: j of a group's samples stay home while
    home's load + j x 10 is within 20 of the least-loaded worker's, the rest go there."""
    from rollover.sim import route

    impls = [route.groups_py] + ([lambda *a: route.groups(*a, fast=True)] if route.NUMBA else [])
    for impl in impls:
        loads, home = np.array([0, 30, 10]), np.array([1, 2])
        h, m, b = impl(loads, home, np.array([0, 1]), 4, 10, 20)
        # prompt 0 (home w1 at 30, least-loaded w0 at 0): (0 + 20 - 30) // 10 + 1 = 0 stay, 4 go to w0,
        # its new home; prompt 1: the least-loaded is now w2 (10), its home: all 4 there
        assert h.tolist() == [1, 2] and m.tolist() == [0, 4] and b.tolist() == [0, 2], impl
        assert loads.tolist() == [40, 30, 50] and home.tolist() == [0, 2]
        # a split: prompt 0 (home w0 at 40, least-loaded w1 at 30) keeps (30 + 20 - 40) // 10 + 1 = 2
        # samples at home, 2 go to w1, which becomes its home
        h, m, b = impl(loads, home, np.array([0]), 4, 10, 20)
        assert (h.tolist(), m.tolist(), b.tolist()) == ([0], [2], [1])
        assert loads.tolist() == [60, 50, 50] and home.tolist() == [1, 2]


@pytest.mark.parametrize("workers,k", [(7, 40), (64, 500), (1024, 3000)])
def test_compiled_router_picks_what_the_plain_one_picks(workers, k):
    """The numba kernels (an indexed heap) against the plain Python rule, pick for pick."""
    from rollover.sim import route

    if not route.NUMBA:
        pytest.skip("numba is not installed: only the plain router runs")
    rng = np.random.default_rng(workers)
    b, slack, prompts = 100, 400, 50
    loads = rng.integers(0, 2000, workers)
    home = np.where(rng.random(prompts) < 0.3, -1, rng.integers(0, workers, prompts))
    carried = np.where(rng.random(k) < 0.4, 0, rng.integers(1, b, k))
    ps = rng.integers(0, prompts, k)
    l1, h1, l2, h2 = loads.copy(), home.copy(), loads.copy(), home.copy()
    got = route.requests(l1, h1, carried, ps, b, slack, fast=True)
    assert got.tolist() == route.requests_py(l2, h2, carried, ps, b, slack).tolist()
    assert l1.tolist() == l2.tolist() and h1.tolist() == h2.tolist()
    for few in (ps[:5], ps[:200]):  # the plain rule's argmin path (<= 64 groups) and its heap path
        got = route.groups(l1, h1, few, 8, b, slack, fast=True)
        want = route.groups_py(l2, h2, few, 8, b, slack)
        assert [a.tolist() for a in got] == [a.tolist() for a in want]
        assert l1.tolist() == l2.tolist() and h1.tolist() == h2.tolist()


def test_the_compiled_router_gives_the_same_run(monkeypatch):
    """APRIL with `resubmit` (resumed requests routed one by one) on the fast path: the same
    schedule with `simulate.router=python` and `=numba`; `numba` without numba is refused."""
    from rollover.sim import route
    from rollover.sim.fast import simulate_fast
    from rollover.sim.run import _with_rows, profile_of

    if route.NUMBA:
        reports = {}
        for router in ("python", "numba"):
            cfg = load_sim_config(None, BASE + ["partial_rollout.enabled=true", "partial_rollout.carry=resubmit",
                                                "simulate.pools=[{workers: 5, max_rows: 6}]",
                                                f"simulate.router={router}"])
            reports[router] = simulate_fast(_with_rows(cfg), profile_of(cfg))
        a, b = reports["python"], reports["numba"]
        assert a["mode"].endswith("[fast path, python router]") and b["mode"].endswith("[fast path, numba router]")
        assert [r["t_end"] for r in a["step_rows"]] == [r["t_end"] for r in b["step_rows"]]
        assert a["generated_tokens"] == b["generated_tokens"] and a["staleness"] == b["staleness"]
    monkeypatch.setattr(route, "NUMBA", False)
    with pytest.raises(ConfigError, match="simulate.router=numba needs numba"):
        route.compiled("numba")
    assert route.compiled("auto") is False


@pytest.mark.parametrize("overrides", [
    ["simulate.prompt_tokens=3000", "simulate.pools=[{workers: 2, max_rows: 24}]", "rollout.max_new_tokens=256"],
    ["simulate.prompts=5", "simulate.pools=[{workers: 1, max_rows: 16}]"],
    # four prompts fill the 8,192-token budget exactly: the fourth still goes in
    ["simulate.prompt_tokens=2048", "simulate.pools=[{workers: 1, max_rows: 24}]", "rollout.max_new_tokens=128"],
    ["partial_rollout.enabled=true", "partial_rollout.carry=resubmit", "simulate.prompt_tokens=1500",
     "simulate.pools=[{workers: 3, max_rows: 6}]"],
    # the K/V capacity stops admission (long prompts: before the prefill budget, too)
    ["simulate.prompt_tokens=600", "simulate.pools=[{workers: 2, max_rows: 12, kv_tokens: 4000}]",
     "rollout.max_new_tokens=256"],
], ids=["prefill-budget", "repeated-prompts", "exact-budget", "april-resubmit", "kv-cache"])
def test_compiled_admission_decides_what_the_plain_one_decides(monkeypatch, overrides):
    """At every planning of a run, the numba admission loop (`admission.plan_nb`, `admit`)
    against the numpy rule (`plan_py`, `admit_py`) on the same fleet state: the same keys,
    prefill tokens and admissions, and the same rows, queues and samples afterwards."""
    import copy

    from rollover.sim import admission, route
    from rollover.sim.fast import simulate_fast
    from rollover.sim.run import _with_rows, profile_of

    if not route.NUMBA:
        pytest.skip("numba is not installed: only the plain admission runs")
    plan_nb, admit_nb = admission.plan_nb, admission.admit
    changed = ("sid", "born", "entered", "seq", "admitted", "fin", "next_fin", "n_ent", "s_v0", "rows", "ctx",
               "ent_ctx", "qh", "qn")
    seen = {"calls": 0, "admitted": 0, "held": 0}

    def plan(f, idx):
        want = admission.plan_py(f, idx)
        got = plan_nb(f, idx)
        for a, b in zip(got[:4], want[:4]):
            assert a.tolist() == b.tolist()
        assert not f.seen.any()  # the marks are clear between calls
        n = got[3]
        if n.any():
            F = int(n.max())
            assert got[4].tolist() == want[4][:, :F].tolist()
        seen["calls"] += 1
        seen["admitted"] += int(n.sum())
        seen["held"] += int((n < np.minimum(f.max_rows[idx] - f.rows[idx], f.qn[idx])).sum())  # the budget stopped it
        return got

    def admit(f, idx, cand, n):
        other = copy.copy(f)
        for name in changed:
            setattr(other, name, getattr(f, name).copy())
        admission.admit_py(other, idx, cand, n)
        admit_nb(f, idx, cand, n)
        for name in changed:
            assert getattr(f, name).tolist() == getattr(other, name).tolist(), name

    monkeypatch.setattr(admission, "plan_nb", plan)
    monkeypatch.setattr(admission, "admit", admit)
    cfg = load_sim_config(None, BASE + overrides)
    simulate_fast(_with_rows(cfg), profile_of(cfg))
    assert seen["calls"] > 10 and seen["admitted"] > 0
    if any(o in overrides for o in ("simulate.prompt_tokens=3000", "simulate.prompt_tokens=2048",
                                    "simulate.prompt_tokens=600")):
        assert seen["held"] > 0  # the prefill budget or the K/V capacity stopped admissions


def test_fast_path_batches_admissions_where_the_schedulers_do():
    # the same run admitting at every step differs: the batched runs above really wait
    graphed = "decode: {step_s: 0.01, prefill_s: 0.05, separate_admission: true}"
    waits, eager = (both(f"simulate.pools=[{{workers: 2, max_rows: 6, admit_batch: {n}, {graphed}}}]") for n in (3, 1))
    assert_same(*waits)
    assert_same(*eager)
    assert waits[1]["simulated_s"] != pytest.approx(eager[1]["simulated_s"], rel=1e-3)
    assert waits[1]["generated_tokens"] == eager[1]["generated_tokens"]
