"""Prompt selection and rollout allocation: history bookkeeping, policies, allocators, resume."""

from __future__ import annotations

import math
import pickle
import random

import pytest

from rollover.rollout.allocation import dars_extra_rollouts, xrpo_allocation
from rollover.rollout.selection import (
    PromptHistory,
    SelectionPolicy,
    SkipSaturatedPolicy,
    ThompsonPolicy,
    UniformPolicy,
)


def make_history(counts: dict[str, tuple[int, int]], step: int = 0) -> PromptHistory:
    """A history where prompt id -> (successes, attempts); success reward 1, failure reward 0."""
    h = PromptHistory()
    for pid, (wins, n) in counts.items():
        h.observe(pid, [1.0] * wins + [0.0] * (n - wins), [True] * wins + [False] * (n - wins), version=0, step=step)
    return h


# --- PromptHistory -----------------------------------------------------------------------------


def test_history_observe_accumulates():
    h = PromptHistory()
    h.observe("a", [1.0, 0.0, 1.0, 0.5], [True, False, True, False], version=3, step=7)
    s = h.get("a")
    assert (s.attempts, s.successes, s.reward_sum, s.reward_sq_sum) == (4.0, 2.0, 2.5, 2.25)
    assert (s.last_version, s.last_step) == (3, 7)
    assert s.success_rate == 0.5
    assert s.mean_reward == 0.625
    # (2.25 - 2.5**2 / 4) / 3
    assert s.reward_variance() == pytest.approx(0.6875 / 3)
    h.observe("a", [0.0, 0.0], [False, False], version=5, step=9)
    s = h.get("a")
    assert (s.attempts, s.successes, s.reward_sum, s.reward_sq_sum) == (6.0, 2.0, 2.5, 2.25)
    assert (s.last_version, s.last_step) == (5, 9)
    assert h.get("missing") is None and "a" in h and "missing" not in h and len(h) == 1
    assert h.stats("missing").attempts == 0 and h.stats("missing").success_rate is None


def test_history_one_sample_has_no_variance():
    h = PromptHistory()
    h.observe("x", [0.3], [False], version=0, step=0)
    assert h.get("x").reward_variance() is None


def test_history_decay_scales_evidence_keeps_mean():
    h = PromptHistory()
    h.observe("a", [1.0, 0.0, 1.0, 0.5], [True, False, True, False], version=3, step=7)
    h.observe("b", [1.0] * 8, [True] * 8, version=4, step=8)
    h.decay(0.5)
    a, b = h.get("a"), h.get("b")
    assert (a.attempts, a.successes, a.reward_sum, a.reward_sq_sum) == (2.0, 1.0, 1.25, 1.125)
    assert (b.attempts, b.successes) == (4.0, 4.0)
    assert a.success_rate == 0.5 and a.mean_reward == 0.625
    assert (a.last_version, a.last_step, b.last_step) == (3, 7, 8)
    # n = 2 now: (1.125 - 1.25**2 / 2) / 1
    assert a.reward_variance() == pytest.approx(0.34375)
    h.decay(1.0)
    assert h.get("a").attempts == 2.0


def test_history_state_round_trip():
    h = PromptHistory()
    h.observe("a", [1.0, 0.25], [True, False], version=1, step=2)
    h.observe("b", [0.1, 0.2, 0.3], [False, False, False], version=2, step=3)
    h.decay(0.9)
    state = h.state_dict()
    g = PromptHistory()
    g.load_state_dict(pickle.loads(pickle.dumps(state)))
    assert g.state_dict() == state
    assert g.get("b") == h.get("b")
    # the saved state is a snapshot, not a view
    h.observe("a", [1.0], [True], version=9, step=9)
    assert state["prompts"]["a"]["attempts"] == pytest.approx(1.8)
    with pytest.raises(ValueError, match="last_step"):
        g.load_state_dict({"prompts": {"a": {"attempts": 1.0, "successes": 0.0, "reward_sum": 0.0,
                                             "reward_sq_sum": 0.0, "last_version": 0}}})


def test_history_errors_name_arguments():
    h = PromptHistory()
    with pytest.raises(ValueError, match="successes"):
        h.observe("a", [1.0, 0.0], [True], version=0, step=0)
    with pytest.raises(ValueError, match="rewards"):
        h.observe("a", [], [], version=0, step=0)
    with pytest.raises(ValueError, match="rewards"):
        h.observe("a", [float("nan")], [False], version=0, step=0)
    for gamma in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="gamma"):
            h.decay(gamma)


# --- UniformPolicy and the choose() contract ---------------------------------------------------


def test_uniform_takes_first_k_and_checks_arguments():
    p = UniformPolicy()
    assert isinstance(p, SelectionPolicy)
    assert p.choose(["c", "a", "b"], 2, PromptHistory(), 0) == ["c", "a"]
    assert p.choose(["c", "a", "b"], 0, PromptHistory(), 0) == []
    with pytest.raises(ValueError, match="k"):
        p.choose(["a", "b"], 3, PromptHistory(), 0)
    with pytest.raises(ValueError, match="k"):
        p.choose(["a", "b"], -1, PromptHistory(), 0)
    with pytest.raises(ValueError, match="candidates"):
        p.choose(["a", "a"], 1, PromptHistory(), 0)


# --- ThompsonPolicy ----------------------------------------------------------------------------


def expected_thompson(seed, counts, candidates, k, alpha0=1.0, beta0=1.0, calls=1):
    """Re-draw by hand: one betavariate per candidate, in candidate order, per call."""
    rng = random.Random(seed)
    out = []
    for _ in range(calls):
        scores = []
        for pid in candidates:
            wins, n = counts.get(pid, (0, 0))
            p = rng.betavariate(alpha0 + wins, beta0 + (n - wins))
            scores.append(p * (1 - p))
        order = sorted(range(len(candidates)), key=lambda i: (-scores[i], i))
        out.append([candidates[i] for i in order[:k]])
    return out


@pytest.mark.parametrize("seed,alpha0,beta0", [(123, 1.0, 1.0), (5, 2.0, 3.0), (2024, 0.5, 0.5)])
def test_thompson_matches_hand_drawn_picks(seed, alpha0, beta0):
    counts = {"a": (5, 10), "b": (0, 50), "c": (50, 50), "e": (2, 3)}
    candidates = ["b", "new", "a", "c", "e"]
    h = make_history(counts)
    p = ThompsonPolicy(seed=seed, alpha0=alpha0, beta0=beta0)
    got = [p.choose(candidates, 3, h, step) for step in range(4)]
    assert got == expected_thompson(seed, counts, candidates, 3, alpha0, beta0, calls=4)
    assert all(len(set(g)) == 3 and set(g) <= set(candidates) for g in got)


def test_thompson_prefers_uncertain_prompts():
    h = make_history({"half": (5, 10), "never": (0, 50), "always": (50, 50)})
    picks = {"half": 0, "never": 0, "always": 0}
    for seed in range(300):
        (pid,) = ThompsonPolicy(seed=seed).choose(["never", "always", "half"], 1, h, 0)
        picks[pid] += 1
    # Beta(6, 6) draws sit near 1/2 (score near 1/4); Beta(1, 51) and Beta(51, 1) draws sit near 0
    # or 1 (score about 0.02), so "half" should win almost every time.
    assert picks["half"] >= 285, picks


def test_thompson_does_not_touch_history():
    h = make_history({"a": (5, 10)})
    before = h.state_dict()
    ThompsonPolicy(seed=1).choose(["a", "b"], 2, h, 0)
    assert h.state_dict() == before


def test_thompson_errors_name_arguments():
    with pytest.raises(ValueError, match="alpha0"):
        ThompsonPolicy(alpha0=0.0)
    with pytest.raises(ValueError, match="beta0"):
        ThompsonPolicy(beta0=-1.0)
    with pytest.raises(ValueError, match="k"):
        ThompsonPolicy().choose(["a"], 2, PromptHistory(), 0)


# --- SkipSaturatedPolicy -----------------------------------------------------------------------


def saturated_history() -> PromptHistory:
    h = PromptHistory()
    h.observe("easy", [1.0] * 10, [True] * 10, version=0, step=0)  # always solved
    h.observe("hard", [0.0] * 8, [False] * 8, version=1, step=2)  # never solved
    h.observe("mid", [1.0, 0.0] * 3, [True, False] * 3, version=1, step=2)
    h.observe("few", [0.0] * 3, [False] * 3, version=1, step=2)  # too few attempts to judge
    return h


CANDS = ["easy", "hard", "mid", "few", "new"]


def test_skip_saturated_skips_and_fills_least_recent_first():
    h = saturated_history()
    p = SkipSaturatedPolicy(UniformPolicy())
    assert p.choose(CANDS, 3, h, step=5) == ["mid", "few", "new"]
    assert p.choose(CANDS, 2, h, step=5) == ["mid", "few"]
    # fewer than k offered: fill with skipped prompts, least recently seen first (easy: step 0)
    assert p.choose(CANDS, 4, h, step=5) == ["mid", "few", "new", "easy"]
    assert p.choose(CANDS, 5, h, step=5) == ["mid", "few", "new", "easy", "hard"]
    # the fill order follows last_step, not candidate order
    assert p.choose(["hard", "easy", "mid"], 2, h, step=5) == ["mid", "easy"]
    assert p.choose(["hard", "easy"], 1, h, step=5) == ["easy"]


def test_skip_saturated_reprobes_after_reprobe_every_skips():
    """Counted in times met, whatever the steps between them (a large dataset brings a prompt
    back once an epoch, many steps later)."""
    h = saturated_history()
    p = SkipSaturatedPolicy(UniformPolicy(), reprobe_every=2)
    assert p.choose(CANDS, 3, h, step=100) == ["mid", "few", "new"]  # easy and hard skipped once
    assert p.choose(["hard", "mid"], 1, h, step=500) == ["mid"]  # hard twice
    assert p.choose(CANDS, 3, h, step=900) == ["hard", "mid", "few"]  # hard offered again; easy skipped twice
    assert p.skips == {"easy": 2}  # hard trained: its count starts over
    assert p.choose(["hard", "easy", "mid"], 2, h, step=901) == ["easy", "mid"]
    assert p.skips == {"hard": 1}
    h.observe("easy", [1.0] * 4, [True] * 4, version=2, step=901)  # re-probed and still saturated
    assert p.choose(["easy", "mid"], 1, h, step=902) == ["mid"]
    # a saturated prompt filling a short draw trains, and its count starts over
    assert p.choose(["easy"], 1, h, step=903) == ["easy"] and p.skips == {"hard": 1}


def test_skip_saturated_custom_band_and_decay_unsaturates():
    h = make_history({"lo": (1, 10), "hi": (9, 10), "ok": (5, 10)}, step=0)
    p = SkipSaturatedPolicy(UniformPolicy(), min_attempts=8, low=0.2, high=0.8, reprobe_every=100)
    assert p.choose(["lo", "hi", "ok"], 1, h, step=1) == ["ok"]
    h.decay(0.5)  # 5 pseudo-attempts left, below min_attempts: no longer judged saturated
    assert p.choose(["lo", "hi", "ok"], 3, h, step=1) == ["lo", "hi", "ok"]


def test_skip_saturated_with_thompson_inner_matches_hand_draws():
    h = saturated_history()
    p = SkipSaturatedPolicy(ThompsonPolicy(seed=42))
    got = p.choose(CANDS, 2, h, step=5)
    counts = {"mid": (3, 6), "few": (0, 3)}
    assert got == expected_thompson(42, counts, ["mid", "few", "new"], 2)[0]


def test_skip_saturated_errors_name_arguments():
    with pytest.raises(ValueError, match="min_attempts"):
        SkipSaturatedPolicy(UniformPolicy(), min_attempts=-1)
    with pytest.raises(ValueError, match="low"):
        SkipSaturatedPolicy(UniformPolicy(), low=0.6, high=0.4)
    with pytest.raises(ValueError, match="high"):
        SkipSaturatedPolicy(UniformPolicy(), high=1.5)
    with pytest.raises(ValueError, match="reprobe_every"):
        SkipSaturatedPolicy(UniformPolicy(), reprobe_every=0)
    with pytest.raises(ValueError, match="k"):
        SkipSaturatedPolicy(UniformPolicy()).choose(["a"], 2, PromptHistory(), 0)


# --- RNG state round trip ----------------------------------------------------------------------


@pytest.mark.parametrize("wrap", [False, True])
def test_policy_state_round_trip_resumes_same_choices(wrap):
    def build(seed):
        t = ThompsonPolicy(seed=seed)
        return SkipSaturatedPolicy(t, reprobe_every=3) if wrap else t

    h = saturated_history()
    cands = CANDS + ["x", "y", "z"]
    p = build(7)
    for step in range(3):
        p.choose(cands, 3, h, step)
    state = pickle.loads(pickle.dumps(p.state_dict()))
    q = build(999)
    q.load_state_dict(state)
    assert [p.choose(cands, 3, h, s) for s in range(3, 8)] == [q.choose(cands, 3, h, s) for s in range(3, 8)]


def test_policy_state_accepts_listified_rng_state():
    p = ThompsonPolicy(seed=3)
    p.choose(["a", "b", "c"], 1, PromptHistory(), 0)
    version, internal, gauss = p.state_dict()["rng"]
    q = ThompsonPolicy(seed=0)
    q.load_state_dict({"rng": [version, list(internal), gauss]})
    h = make_history({"a": (1, 4)})
    assert p.choose(["a", "b", "c"], 2, h, 1) == q.choose(["a", "b", "c"], 2, h, 1)


# --- DARS --------------------------------------------------------------------------------------


def dars_history() -> PromptHistory:
    # difficulties: a 0.5, b 1.0, c 0.0, d unseen (0.5), e 0.75
    return make_history({"a": (2, 4), "b": (0, 4), "c": (4, 4), "e": (1, 4)})


IDS = ["a", "b", "c", "d", "e"]


def test_dars_equal_schedule_exact():
    h = dars_history()
    # 4 prompts with difficulty > 0: 10 // 4 = 2 each, 2 left to the hardest (b, then e)
    assert dars_extra_rollouts(h, IDS, 10, 8, "equal") == {"a": 2, "b": 3, "c": 0, "d": 2, "e": 3}
    # 11: 2 each, 3 left: b, e, then a (ties with d at 0.5, earlier in order)
    assert dars_extra_rollouts(h, IDS, 11, 8, "equal") == {"a": 3, "b": 3, "c": 0, "d": 2, "e": 3}
    assert dars_extra_rollouts(h, IDS, 3, 8, "equal") == {"a": 1, "b": 1, "c": 0, "d": 0, "e": 1}


def test_dars_hardest_schedule_exact():
    h = dars_history()
    # total difficulty 2.75; budget 11 splits exactly 2 / 4 / 0 / 2 / 3
    assert dars_extra_rollouts(h, IDS, 11, 8, "hardest") == {"a": 2, "b": 4, "c": 0, "d": 2, "e": 3}
    # budget 10: quotas a 1.818, b 3.636, d 1.818, e 2.727 -> floors 1, 3, 1, 2 (7), 3 left go to
    # the largest remainders: a (.818), d (.818, later in order), e (.727)
    assert dars_extra_rollouts(h, IDS, 10, 8, "hardest") == {"a": 2, "b": 3, "c": 0, "d": 2, "e": 3}
    # budget 5: quotas .909, 1.818, .909, 1.364 -> floors 0, 1, 0, 1 (2), 3 left: a, d, b
    assert dars_extra_rollouts(h, IDS, 5, 8, "hardest") == {"a": 1, "b": 2, "c": 0, "d": 1, "e": 1}
    # decimal success rates still split exactly: difficulties 0.3 and 0.7
    h2 = make_history({"p": (7, 10), "q": (3, 10)})
    assert dars_extra_rollouts(h2, ["p", "q"], 10, 4, "hardest") == {"p": 3, "q": 7}


def test_dars_nothing_to_give():
    h = make_history({"a": (4, 4), "b": (2, 2)})
    for schedule in ("equal", "hardest"):
        assert dars_extra_rollouts(h, ["a", "b"], 16, 4, schedule) == {"a": 0, "b": 0}
        assert dars_extra_rollouts(dars_history(), IDS, 0, 4, schedule) == dict.fromkeys(IDS, 0)
        assert dars_extra_rollouts(h, [], 16, 4, schedule) == {}


def random_history(rng: random.Random, n_prompts: int) -> tuple[PromptHistory, list[str]]:
    h = PromptHistory()
    ids = [f"p{i}" for i in range(n_prompts)]
    for pid in ids:
        if rng.random() < 0.2:
            continue  # unseen
        n = rng.randint(1, 12)
        wins = rng.choice([0, n, rng.randint(0, n)])
        rewards = [rng.random() for _ in range(n)]
        h.observe(pid, rewards, [j < wins for j in range(n)], version=0, step=0)
        if rng.random() < 0.3:
            h.decay(rng.uniform(0.3, 1.0))
    return h, ids


def test_dars_random_cases_respect_budget():
    rng = random.Random(0)
    for _ in range(400):
        h, ids = random_history(rng, rng.randint(1, 9))
        budget = rng.randint(0, 40)
        diffs = {}
        for pid in ids:
            s = h.stats(pid)
            diffs[pid] = 0.5 if s.attempts == 0 else 1 - s.successes / s.attempts
        hard = [pid for pid in ids if diffs[pid] > 1e-12]
        for schedule in ("equal", "hardest"):
            out = dars_extra_rollouts(h, ids, budget, 8, schedule)
            assert set(out) == set(ids) and all(v >= 0 for v in out.values())
            assert sum(out.values()) == (budget if hard else 0)
            assert all(out[pid] == 0 for pid in ids if pid not in hard)
            if schedule == "equal" and hard:
                assert max(out[p] for p in hard) - min(out[p] for p in hard) <= 1
            if schedule == "hardest" and hard:
                total = sum(diffs[p] for p in hard)
                for pid in hard:
                    quota = budget * diffs[pid] / total
                    assert math.floor(quota - 1e-9) <= out[pid] <= math.ceil(quota + 1e-9)


def test_dars_errors_name_arguments():
    h = dars_history()
    with pytest.raises(ValueError, match="schedule"):
        dars_extra_rollouts(h, IDS, 10, 8, "proportional")
    with pytest.raises(ValueError, match="budget"):
        dars_extra_rollouts(h, IDS, -1, 8, "equal")
    with pytest.raises(ValueError, match="base_n"):
        dars_extra_rollouts(h, IDS, 10, 0, "equal")
    with pytest.raises(ValueError, match="prompt_ids"):
        dars_extra_rollouts(h, ["a", "a"], 10, 8, "equal")


# --- XRPO --------------------------------------------------------------------------------------


def xrpo_history() -> PromptHistory:
    h = PromptHistory()
    h.observe("a", [1.0, 0.0, 1.0, 0.0], [True, False, True, False], version=0, step=0)  # s2 = 1/3, n 4
    h.observe("b", [1.0] * 4, [True] * 4, version=0, step=0)  # s2 = 0
    h.observe("d", [1.0], [True], version=0, step=0)  # n 1: Bernoulli p = 2/3, s2 = 2/9
    return h  # c unseen: p = 1/2, s2 = 1/4


def test_xrpo_exact_small_case():
    h = xrpo_history()
    # after min_n = 1 each, n = a 5, b 5, c 1, d 2; gains s2 / (n (n + 1)):
    #   a 1/90, b 0, c 1/8, d 1/27
    # 1st -> c (n 2: 1/24); 2nd -> c (1/24 > 1/27; n 3: 1/48); 3rd -> d (1/27; n 3: 1/54);
    # 4th -> c (1/48 > 1/54 > 1/90)
    assert xrpo_allocation(h, ["a", "b", "c", "d"], 8, min_n=1) == {"a": 1, "b": 1, "c": 4, "d": 2}
    # with nothing beyond the minimum to hand out
    assert xrpo_allocation(h, ["a", "b", "c", "d"], 8, min_n=2) == {"a": 2, "b": 2, "c": 2, "d": 2}


def test_xrpo_ties_and_unseen_with_zero_minimum():
    h = PromptHistory()
    # identical unseen prompts tie: the earlier one gets the sample
    assert xrpo_allocation(h, ["x", "y"], 3, min_n=1) == {"x": 2, "y": 1}
    assert xrpo_allocation(h, ["x", "y"], 4, min_n=1) == {"x": 2, "y": 2}
    # min_n = 0: a prompt with no samples at all has infinite gain and is served first
    h2 = make_history({"seen": (1, 2)})
    assert xrpo_allocation(h2, ["seen", "x", "y"], 2, min_n=0) == {"seen": 0, "x": 1, "y": 1}


def test_xrpo_spreads_extras_evenly_over_prompts_that_never_varied():
    h = make_history({"p": (4, 4), "q": (0, 4), "r": (4, 4)})  # s2 = 0 for all: every gain is 0
    assert xrpo_allocation(h, ["p", "q", "r"], 12, min_n=2) == {"p": 4, "q": 4, "r": 4}
    assert xrpo_allocation(h, ["p", "q", "r"], 11, min_n=2) == {"p": 4, "q": 4, "r": 3}


def test_selection_sizes_follow_the_allocation_and_keep_the_step_budget():
    from types import SimpleNamespace

    from rollover.config import SelectionConfig
    from rollover.rollout.selection import PromptSelection
    from rollover.types import Prompt

    sel = PromptSelection(SelectionConfig(allocation="xrpo", min_samples=2), seed=0, correct=1.0)
    sel.history = xrpo_history()
    prompts = [Prompt(id=i, text=i) for i in ("a", "b", "c", "d")]
    assert sel.sizes(prompts, 4) == [xrpo_allocation(sel.history, ["a", "b", "c", "d"], 16, min_n=2)[i]
                                     for i in ("a", "b", "c", "d")]
    assert sum(sel.sizes(prompts, 4)) == 16 and min(sel.sizes(prompts, 4)) >= 2
    assert sel.sizes(prompts[:2] + prompts[:1], 4) == [4, 4, 4]  # a prompt twice in one draw: fixed sizes
    fixed = PromptSelection(SelectionConfig(), seed=0, correct=1.0)
    assert fixed.sizes(prompts, 4) == [4] * 4
    # uniform policy with allocation draws exactly k prompts in data order
    it = SimpleNamespace(next_batch=lambda k: prompts[:k])
    assert [p.id for p in sel.next(it, 3, version=0)] == ["a", "b", "c"]


def naive_xrpo(h: PromptHistory, ids: list[str], budget: int, min_n: int) -> dict[str, int]:
    alloc = {pid: min_n for pid in ids}
    for _ in range(budget - min_n * len(ids)):
        best, best_gain = None, -1.0
        for pid in ids:
            s = h.stats(pid)
            if s.attempts >= 2:
                s2 = max(0.0, (s.reward_sq_sum - s.reward_sum * s.reward_sum / s.attempts) / (s.attempts - 1))
            else:
                p = (s.successes + 1) / (s.attempts + 2)
                s2 = p * (1 - p)
            n = s.attempts + alloc[pid]
            g = math.inf if n <= 0 else s2 / (n * (n + 1))
            if g > best_gain or (g == best_gain and alloc[pid] < alloc[best]):
                best, best_gain = pid, g
        alloc[best] += 1
    return alloc


def test_xrpo_random_cases_sum_to_budget_and_match_naive_greedy():
    rng = random.Random(1)
    for _ in range(300):
        h, ids = random_history(rng, rng.randint(1, 8))
        min_n = rng.randint(0, 3)
        budget = min_n * len(ids) + rng.randint(0, 30)
        out = xrpo_allocation(h, ids, budget, min_n)
        assert sum(out.values()) == budget
        assert all(out[pid] >= min_n for pid in ids)
        assert out == naive_xrpo(h, ids, budget, min_n)


def test_xrpo_errors_name_arguments():
    h = xrpo_history()
    with pytest.raises(ValueError, match="budget"):
        xrpo_allocation(h, ["a", "b", "c"], 5, min_n=2)
    with pytest.raises(ValueError, match="min_n"):
        xrpo_allocation(h, ["a"], 5, min_n=-1)
    with pytest.raises(ValueError, match="budget"):
        xrpo_allocation(h, ["a"], -2, min_n=0)
    with pytest.raises(ValueError, match="prompt_ids"):
        xrpo_allocation(h, ["a", "a"], 4, min_n=1)


# ---------------------------------------------------------------------------------------------
# In a run: selection.policy


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rollover.testing import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama", seed=3))


@pytest.mark.parametrize("mode", ["sync", "april", "xrpo"])
def test_a_run_selects_by_its_policy_and_resumes_exactly(model_dir, tmp_path, mode):
    """selection.policy in a run: groups come from the chosen candidates, every scored group
    is in the history, and a run killed and resumed equals the straight run bit for bit (the
    history and the policy's generator are in the checkpoint)."""
    import json

    import torch
    from safetensors.torch import load_file

    from rollover.loops.sync import train_sync
    from test_train import tiny_cfg

    over = {"selection.policy": "thompson_skip_saturated", "selection.candidates": 2.0, "selection.decay": 0.9,
            "selection.min_attempts": 3, "selection.reprobe_every": 2, "steps": 4, "checkpoint.every": 2,
            **({"partial_rollout.enabled": True, "partial_rollout.carry": "resubmit"} if mode == "april" else {})}
    if mode == "xrpo":  # group sizes by XRPO over 6 training prompts (revisited from step 3)
        over = {"selection.allocation": "xrpo", "data.train": "gen:arithmetic?n=8", "data.eval_size": 2, "steps": 4, "checkpoint.every": 2}
    train_sync(tiny_cfg(model_dir, tmp_path / "straight", **over))
    train_sync(tiny_cfg(model_dir, tmp_path / "split", **{**over, "steps": 2}))
    train_sync(tiny_cfg(model_dir, tmp_path / "split", **over))
    a = load_file(str(tmp_path / "straight" / "checkpoints" / "step_000004" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "split" / "checkpoints" / "step_000004" / "model" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    ledger = [json.loads(x) for x in open(tmp_path / "straight" / "trained_groups.jsonl")]
    assert ledger == [json.loads(x) for x in open(tmp_path / "split" / "trained_groups.jsonl")]
    if mode == "xrpo":  # every step keeps its 3 x 3 samples, at least 2 a group, split unevenly once seen
        sizes = {row["step"]: [g["samples"] for g in row["groups"]] for row in ledger}
        assert sorted(sizes) == [1, 2, 3, 4]
        for step, n in sizes.items():
            assert sum(n) == 9 and min(n) >= 2, (step, n)
        assert len(set(sizes[3])) > 1 or len(set(sizes[4])) > 1, sizes
    from rollover.train.checkpoint import load_state

    state = load_state(tmp_path / "straight" / "checkpoints" / "step_000004")
    assert state["selection"]["version"] >= 2 and state["selection"]["history"]["prompts"]


def test_prompt_selection_keeps_k_of_the_drawn_candidates():
    from types import SimpleNamespace as NS

    from rollover.data.iterator import PromptIterator
    from rollover.rollout.selection import PromptSelection
    from rollover.types import Group, Prompt, Rollout

    prompts = [Prompt(id=f"p{i}", text=str(i)) for i in range(12)]
    it = PromptIterator(prompts, seed=0, shuffle=False)
    cfg = NS(policy="thompson", candidates=3.0, decay=1.0, alpha0=1.0, beta0=1.0, min_attempts=8, reprobe_every=10)
    sel = PromptSelection(cfg, seed=0, correct=1.0)

    def group(pid, rewards):
        rolls = [Rollout(group_id="g", prompt_ids=[1], response_ids=[2], logprobs=[0.0], versions=[0], loss_mask=[1],
                         finish="stop", reward=r, scores={"numeric": r}) for r in rewards]
        return Group(id="g", prompt=Prompt(id=pid, text="?"), prompt_ids=[1], rollouts=rolls)

    for i in range(6):  # p0-p2 always solved, p3-p5 never: no variance
        sel.observe(group(f"p{i}", [1.0] * 40 if i < 3 else [0.0] * 40), "numeric", version=0)
    sel.observe(group("p6", [1.0, 0.0] * 20), "numeric", version=0)  # half solved
    chosen = sel.next(it, 2, version=0)  # candidates p0..p5: all saturated; p0..p2 near 1, p3..p5 near 0
    assert len(chosen) == 2 and len({p.id for p in chosen}) == 2 and all(p.id in {f"p{i}" for i in range(6)} for p in chosen)
    chosen = sel.next(it, 2, version=0)  # candidates p6..p11: p6 (half solved) is among the two best draws (seed 0)
    assert "p6" in {p.id for p in chosen} and it.position == 0  # 12 drawn, the epoch wrapped


def test_dars_extra_samples_follow_its_schedules():
    from rollover.rollout.allocation import dars_extra_samples

    # N = 8, a = 0.25: S = 2 * 0.25 * 0.75 = 0.375, A = 4, N S = 3
    assert dars_extra_samples(0.25, 8, "equal") == 3  # ceil((4 - 3) / 0.375) = ceil(2.67)
    assert dars_extra_samples(0.25, 8, "hardest") == 8  # ceil((2 * 0.75 * 4 - 3) / 0.375) = 8 exactly
    # a = 0 counts as 0.5 / 8: S = 0.1171875, (4 - 0.9375) / S = 26.1 -> 27, capped at 32 - 8
    assert dars_extra_samples(0.0, 8, "equal") == 24
    assert dars_extra_samples(0.0, 8, "equal", n_max=64) == 27
    assert dars_extra_samples(0.5, 8, "equal") == dars_extra_samples(0.9, 8, "hardest") == 0
    with pytest.raises(ValueError, match="accuracy"):
        dars_extra_samples(1.5, 8)


def test_xrpo_sizes_a_short_draw_among_the_latest_prompts():
    """APRIL refills and async admissions draw a prompt or two at a time: each is sized among the
    step's worth of prompts sized before it, not alone (alone it would get all k x n = n)."""
    from types import SimpleNamespace as NS

    from rollover.rollout.selection import PromptSelection
    from rollover.types import Prompt

    def build():
        sel = PromptSelection(NS(policy="uniform", allocation="xrpo", min_samples=2, decay=1.0), seed=0, correct=1.0,
                              per_step=3)
        sel.history.observe("a", [0.0, 1.0] * 4, [False, True] * 4, version=0, step=0)  # reward variance 2/7
        for pid in ("b", "c"):
            sel.history.observe(pid, [1.0] * 8, [True] * 8, version=0, step=0)  # always solved: variance 0
        return sel

    P = {i: Prompt(id=i, text=i) for i in "abc"}
    sel = build()
    # a step's draw: 12 samples, 2 each and the 6 left to the only prompt whose estimate they narrow
    assert sel.sizes([P["a"], P["b"], P["c"]], 4) == [8, 2, 2]
    assert sel.sizes([P["b"]], 4) == [2]  # among c and a (the latest before it), as in the step's draw
    assert sel.sizes([P["a"]], 4) == [8]  # among b and c
    state = sel.state_dict()
    again = build()
    again.load_state_dict(state)
    assert list(again.recent) == list(sel.recent) == ["c", "b", "a"]  # resumed with the same peers
    assert again.sizes([P["c"]], 4) == sel.sizes([P["c"]], 4) == [2]


def test_prompt_selection_decays_once_per_version_not_per_draw():
    from types import SimpleNamespace as NS

    from rollover.data.iterator import PromptIterator
    from rollover.rollout.selection import PromptSelection
    from rollover.types import Group, Prompt, Rollout

    it = PromptIterator([Prompt(id=f"p{i}", text=str(i)) for i in range(8)], seed=0, shuffle=False)
    sel = PromptSelection(NS(policy="thompson", candidates=1.0, decay=0.5, alpha0=1.0, beta0=1.0, min_attempts=8,
                             reprobe_every=10), seed=0, correct=1.0)
    roll = Rollout(group_id="g", prompt_ids=[1], response_ids=[2], logprobs=[0.0], versions=[0], loss_mask=[1],
                   finish="stop", reward=1.0, scores={"numeric": 1.0})
    sel.observe(Group(id="g", prompt=Prompt(id="p0", text="?"), prompt_ids=[1], rollouts=[roll] * 8), "numeric", 0)
    sel.next(it, 2, version=0)
    sel.next(it, 2, version=0)  # APRIL refills and async admissions draw many times per version
    assert sel.history.stats("p0").attempts == 8
    sel.next(it, 2, version=2)  # two versions later: two halvings
    assert sel.history.stats("p0").attempts == 2 and sel.version == 2


def test_dars_second_stage_grows_unsolved_groups_in_a_run(model_dir, tmp_path):
    """selection.dars=equal: the tiny model solves nothing, so each group of 3 (accuracy 0,
    counted as 0.5/3) is owed ceil((1.5 - 3 S) / S) = 3 extra samples with S = 2 (1/6)(5/6),
    capped at dars_max_samples - 3 = 2; the extras are generated in the same step, merged
    into their group, scored and counted, and the group trains with 5 samples."""
    import json

    from rollover.loops.sync import train_sync
    from rollover.metrics import read_metrics
    from rollover.rollout.allocation import dars_extra_samples
    from test_train import tiny_cfg

    assert dars_extra_samples(0.0, 3, "equal") == 3 and dars_extra_samples(0.0, 3, "equal", 5) == 2
    train_sync(tiny_cfg(model_dir, tmp_path, **{"selection.dars": "equal", "selection.dars_max_samples": 5,
                                                  "steps": 2, "eval.every": 0}))
    rows = read_metrics(tmp_path, kind="train")
    ledger = [json.loads(x) for x in open(tmp_path / "trained_groups.jsonl")]
    for row, led in zip(rows, ledger):
        solved = row["accuracy"] * row["samples"]
        assert solved == 0  # what the expected counts rest on
        assert row["rollout/dars_extra_samples"] == 6 and row["rollout/dars_groups"] == 3
        assert row["samples"] == 15 and [g["samples"] for g in led["groups"]] == [5, 5, 5]
    assert rows[-1]["samples_consumed_total"] == 30


@pytest.mark.parametrize("over,message", [
    ({"selection.dars": "equal", "partial_rollout.enabled": True}, "selection.dars .* runs in sync mode"),
    ({"selection.dars": "hardest", "mode": "async"}, "selection.dars .* runs in sync mode"),
    ({"selection.dars": "equal", "selection.dars_max_samples": 3}, "dars_max_samples=3 must be above"),
])
def test_dars_config_errors(over, message):
    from rollover.config import load_config

    with pytest.raises(ValueError, match=message):
        load_config(None, [f"{k}={v}" for k, v in {"rollout.samples_per_prompt": 3, **over}.items()])


def test_large_groups_with_april_complete_across_steps(model_dir, tmp_path):
    """BroRL-style large groups under APRIL: a group of 12 samples with 8 engine rows is never
    in the engine at once; every trained group still has its 12 samples, no sample twice."""
    import json

    from rollover.loops.sync import train_sync
    from test_train import tiny_cfg

    train_sync(tiny_cfg(model_dir, tmp_path, **{"partial_rollout.enabled": True, "rollout.samples_per_prompt": 12,
                                                  "rollout.prompts_per_step": 2, "rollout.max_rows": 8,
                                                  "steps": 3, "eval.every": 0}))
    ledger = [json.loads(x) for x in open(tmp_path / "trained_groups.jsonl")]
    groups = [g for row in ledger for g in row["groups"]]
    assert len(groups) == 6 and all(g["samples"] == 12 for g in groups)
    assert len({g["group"] for g in groups}) == 6
