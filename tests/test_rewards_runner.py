"""RewardRunner: combination, signatures, errors, timeouts, threads and asyncio."""

import asyncio
import logging
import threading
import time

import pytest

from rollover.rewards import (
    Reward,
    RewardFailed,
    RewardRunner,
    RewardSpec,
    build_rewards,
    resolve_reward_fn,
)
from rollover.rewards.builtins import math_reward
from rollover.types import Prompt

P = [Prompt(id="a", text="1+1?", answer="2"), Prompt(id="b", text="2+2?", answer="4")]


def length_reward(completion, answer):
    return float(len(completion))


def first_char_is_answer(completion, answer):
    return 1.0 if completion[:1] == answer else 0.0


def fails_on_b(completion, answer):
    if answer == "4":
        raise ValueError("boom")
    return 1.0


def test_weighted_sum_of_scores():
    runner = RewardRunner(
        [Reward("len", length_reward, 0.5), Reward("first", first_char_is_answer, 2.0)]
    )
    out = runner.score(P, ["2 is it", "5"])
    assert out.totals == [0.5 * 7 + 2.0 * 1, 0.5 * 1 + 2.0 * 0]
    assert [s.sample_id for s in out.samples] == ["a#0", "b#1"]
    assert out.samples[1].scores == {"len": 1.0, "first": 0.0}
    assert all(s.status == "ok" for s in out.samples)
    metrics = out.metrics()
    assert metrics["reward/mean"] == pytest.approx((5.5 + 0.5) / 2)
    assert metrics["rewards/len/mean"] == 4.0 and metrics["rewards/first/errors"] == 0.0


def test_fields_reach_functions_that_ask_for_them():
    seen = []

    def wants_level(completion, answer, level):
        seen.append(level)
        return 0.0

    def takes_all(completion, answer, **fields):
        seen.append(fields)
        return 0.0

    prompts = [Prompt(id="a", text="q", answer="1", fields={"level": 3, "source": "x"})]
    RewardRunner([Reward("w", wants_level), Reward("all", takes_all)], max_workers=1).score(
        prompts, ["c"]
    )
    assert seen == [3, {"level": 3, "source": "x"}]


def test_dict_return_adds_score_and_logs_extras():
    def scored(completion, answer):
        return {"score": 1.0, "length": len(completion)}

    out = RewardRunner([Reward("s", scored, 3.0)]).score(P, ["ab", "abcd"])
    assert out.totals == [3.0, 3.0]
    assert out.samples[0].extras == {"s/length": 2.0}
    assert out.metrics()["rewards/s/length/mean"] == 3.0


def test_trl_signature_is_called_once_per_batch():
    calls = []

    def trl_accuracy(prompts, completions, solution, **kwargs):
        calls.append((prompts, completions, solution, sorted(kwargs)))
        return [1.0 if c == s else 0.0 for c, s in zip(completions, solution)]

    reward = Reward("acc", trl_accuracy)
    assert reward.batched
    out = RewardRunner([reward]).score(P, ["2", "5"], completion_ids=[[1], [2]])
    assert out.totals == [1.0, 0.0]
    assert calls == [(["1+1?", "2+2?"], ["2", "5"], ["2", "4"], ["answer", "completion_ids"])]


def test_none_abstains_and_all_none_skips_the_sample():
    def code_only(prompts, completions, **kw):
        return [None, 0.5, None]

    def math_only(completion, answer):
        return 1.0 if answer == "2" else None

    runner = RewardRunner([Reward("code", code_only, 2.0), Reward("math", math_only)])
    out = runner.score(P + [Prompt(id="c", text="?", answer="9")], ["x", "y", "z"])
    assert out.totals[:2] == [1.0, 1.0]  # a: math only; b: code only (2.0 * 0.5)
    assert out.samples[2].status == "skipped" and out.samples[2].total is None
    assert "returned None" in out.samples[2].skip_reason
    assert out.num_skipped == 1 and out.error_counts == {"code": 0, "math": 0}


def test_on_error_raise_names_function_and_sample():
    runner = RewardRunner([Reward("fails_on_b", fails_on_b)], on_error="raise")
    with pytest.raises(RewardFailed, match=r"'fails_on_b' failed on sample b#1: ValueError: boom"):
        runner.score(P, ["x", "y"])


def test_on_error_zero_scores_zero_but_counts_and_logs(caplog):
    runner = RewardRunner(
        [Reward("fails_on_b", fails_on_b), Reward("len", length_reward)], on_error="zero"
    )
    with caplog.at_level(logging.WARNING, logger="rollover.rewards"):
        out = runner.score(P, ["x", "yy"])
    assert out.totals == [2.0, 2.0]  # b: 0 (failed) + 2 (length)
    assert out.samples[1].status == "ok" and out.samples[1].failed == ["fails_on_b"]
    assert out.samples[1].scores["fails_on_b"] == 0.0
    assert out.error_counts == {"fails_on_b": 1, "len": 0}
    assert out.metrics()["rewards/fails_on_b/errors"] == 1.0
    (failure,) = out.failures
    assert (failure.fn, failure.sample_id) == ("fails_on_b", "b#1")
    assert failure.error == "ValueError: boom" and not failure.timed_out
    assert "'fails_on_b' failed on sample b#1: ValueError: boom" in caplog.text


def test_on_error_skip_marks_the_sample_unscored():
    runner = RewardRunner(
        [Reward("fails_on_b", fails_on_b), Reward("len", length_reward)], on_error="skip"
    )
    out = runner.score(P, ["x", "yy"])
    assert out.totals == [2.0, None]
    assert out.samples[1].status == "skipped"
    assert out.samples[1].scores == {"fails_on_b": None, "len": 2.0}
    assert out.metrics()["reward/skipped"] == 1.0 and out.error_counts["fails_on_b"] == 1


@pytest.mark.parametrize(
    "value, message",
    [
        ("high", "must be a real number"),
        (float("nan"), "score is nan"),
        ({"x": 1}, "without a 'score'"),
        ({"score": 1.0, "note": "text"}, "note must be a real number"),
    ],
)
def test_bad_return_values_are_failures(value, message):
    runner = RewardRunner([Reward("bad", lambda completion, answer: value)], on_error="zero")
    out = runner.score(P[:1], ["x"])
    assert out.error_counts == {"bad": 1} and message in out.failures[0].error


def test_trl_function_returning_the_wrong_length_fails_every_sample():
    short = Reward("short", lambda prompts, completions, **kw: [1.0])
    runner = RewardRunner([short], on_error="skip")
    out = runner.score(P, ["x", "y"])
    assert out.num_skipped == 2 and "expected a list of 2 scores" in out.failures[0].error


def test_hanging_reward_times_out_without_blocking_others_or_the_next_batch():
    release = threading.Event()

    def hangs_on_b(completion, answer):
        if answer == "4":
            release.wait(30)  # stands in for a call that never returns
        return 1.0

    runner = RewardRunner(
        [Reward("hangs_on_b", hangs_on_b), Reward("len", length_reward)],
        timeout_s=0.3,
        on_error="zero",
        max_workers=1,  # one slot: the hung call must give it up for the rest to run
    )
    start = time.monotonic()
    out = runner.score(P + P, ["x", "yy", "zzz", "wwww"])
    elapsed = time.monotonic() - start
    assert elapsed < 2.0  # two hung calls, 0.3 s each; nothing waits for them to finish
    assert out.totals == [2.0, 2.0, 4.0, 4.0]
    assert out.timeout_counts == {"hangs_on_b": 2, "len": 0}
    assert out.failures[0].timed_out and "timed out after 0.3 s" in out.failures[0].error
    assert out.stuck_threads == 2 and out.metrics()["reward/stuck_threads"] == 2.0

    again = runner.score(P[:1], ["x"])  # the next batch runs while the old calls still hang
    assert again.totals == [2.0]
    release.set()
    deadline = time.monotonic() + 10
    while runner.score(P[:1], ["x"]).stuck_threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runner.score(P[:1], ["x"]).stuck_threads == 0  # finished calls are forgotten


def test_too_many_stuck_calls_stop_the_runner():
    release = threading.Event()
    runner = RewardRunner(
        [Reward("hang", lambda completion, answer: release.wait(30))],
        timeout_s=0.05,
        on_error="zero",
        max_stuck_threads=1,
    )
    runner.score(P, ["x", "y"])
    with pytest.raises(RuntimeError, match="2 reward calls abandoned"):
        runner.score(P, ["x", "y"])
    release.set()


def test_timeout_under_raise_mode():
    runner = RewardRunner(
        [Reward("slow", lambda completion, answer: time.sleep(1.0))], timeout_s=0.05
    )
    with pytest.raises(RewardFailed, match=r"'slow' failed on sample a#0: TimeoutError"):
        runner.score(P[:1], ["x"])


def test_math_reward_through_the_runner_from_a_worker_thread():
    runner = RewardRunner([Reward("math", math_reward)], timeout_s=20)
    results = []
    worker = threading.Thread(
        target=lambda: results.append(runner.score(P, [r"\boxed{2}", r"\boxed{5}"]).totals)
    )
    worker.start()
    worker.join(timeout=30)
    assert results == [[1.0, 0.0]]


def test_ascore_from_an_event_loop_and_async_rewards():
    async def judge(completion, answer):
        await asyncio.sleep(0.01)
        return 1.0 if completion == answer else 0.0

    runner = RewardRunner([Reward("judge", judge)])

    async def main():
        return await runner.ascore(P, ["2", "5"])

    assert asyncio.run(main()).totals == [1.0, 0.0]


def test_runner_rejects_bad_config():
    with pytest.raises(ValueError, match="on_error"):
        RewardRunner([Reward("len", length_reward)], on_error="ignore")
    with pytest.raises(ValueError, match="unique"):
        RewardRunner([Reward("len", length_reward), Reward("len", length_reward)])
    with pytest.raises(TypeError, match="must take"):
        Reward("one_arg", lambda completion: 1.0)


# --- naming rewards from config -------------------------------------------------------------


def test_builtin_and_module_references():
    assert resolve_reward_fn("math") is math_reward
    numeric = resolve_reward_fn("rollover.rewards.builtins:numeric_reward")
    assert numeric.__name__ == "numeric_reward"
    assert RewardSpec("rollover.rewards.builtins:numeric_reward").build().name == "numeric_reward"
    with pytest.raises(ValueError, match="unknown reward 'maths'"):
        resolve_reward_fn("maths")
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        resolve_reward_fn("rollover.rewards.builtins:nope")


def test_file_reference_with_bound_kwargs_and_weights(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(
        "def ends_with(completion, answer, suffix='!'):\n"
        "    return 1.0 if completion.endswith(suffix) else 0.0\n"
    )
    rewards = build_rewards(
        [
            {"fn": f"{path}:ends_with", "weight": 2.0, "kwargs": {"suffix": "?"}, "name": "q"},
            "exact",
            RewardSpec("format", weight=0.5, kwargs={"pattern": r"^\d+$"}),
        ]
    )
    assert [(r.name, r.weight) for r in rewards] == [("q", 2.0), ("exact", 1.0), ("format", 0.5)]
    # A field named like a bound kwarg must not override it.
    prompts = [Prompt(id="a", text="q", answer="12", fields={"suffix": "2", "pattern": "x"})]
    out = RewardRunner(rewards).score(prompts, ["12"])
    assert out.samples[0].scores == {"q": 0.0, "exact": 1.0, "format": 1.0}
    assert out.totals == [1.5]
    with pytest.raises(FileNotFoundError):
        resolve_reward_fn(f"{tmp_path}/missing.py:f")
    with pytest.raises(ValueError, match="unique"):
        build_rewards(["exact", "exact"])
