"""RewardRunner: combination, signatures, errors, timeouts, threads, worker processes, asyncio."""

import asyncio
import faulthandler
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from rollover.rewards import (
    Reward,
    RewardFailed,
    RewardRunner,
    RewardSpec,
    build_rewards,
    resolve_reward_fn,
)
from rollover.rewards.builtins import math_reward
from rollover.rewards.pool import WorkerStartError
from rollover.types import Prompt

P = [Prompt(id="a", text="1+1?", answer="2"), Prompt(id="b", text="2+2?", answer="4")]
FIXTURES = str(Path(__file__).with_name("reward_fixtures.py"))


@pytest.fixture(autouse=True)
def hang_guard(capsys):
    """Ends the whole test process, printing every thread's stack, if a test here runs past
    two minutes. A thread-based guard would not do: a reward holding the interpreter lock
    stops it too. faulthandler's watchdog is a C thread that needs no lock."""
    with capsys.disabled():
        stderr = os.dup(2)  # the real stderr: pytest's capture file is lost when we exit
    faulthandler.dump_traceback_later(120, exit=True, file=stderr)
    yield
    faulthandler.cancel_dump_traceback_later()
    os.close(stderr)


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
    RewardRunner([Reward("w", wants_level), Reward("all", takes_all)], max_threads=1).score(
        prompts, ["c"]
    )
    assert seen == [3, {"level": 3, "source": "x"}]


def test_a_reward_that_changes_its_inputs_changes_only_its_own_copy():
    """A reward in a thread appending to a field, or editing the answer or the messages, leaves
    the prompt as it was: the next sample, step and evaluation see the data as loaded."""
    seen = []

    def tags(completion, answer, tags):
        seen.append(len(tags))
        tags.append("mine")
        answer["n"] += 1
        return 0.0

    def batch(prompts, completions, answer, tags, completion_ids, **kw):
        seen.append((len(tags[0]), prompts[0][0]["content"]))
        prompts[0][0]["content"] = "changed"
        tags[0].clear()
        for ids in completion_ids:
            ids.pop()  # (TRL rewards strip the EOS this way)
        return [0.0] * len(completions)

    prompt = Prompt(id="a", messages=[{"role": "user", "content": "q"}], answer={"n": 1}, fields={"tags": ["x"]})
    runner = RewardRunner([Reward("t", tags), Reward("b", batch)], max_threads=1)
    ids = [[5, 6, 2], [7, 2]]  # the rollouts' own response ids, which train
    for _ in range(2):
        runner.score([prompt, prompt], ["c", "d"], completion_ids=ids)
    assert seen.count(1) == 4 and seen.count((1, "q")) == 2
    assert prompt.fields == {"tags": ["x"]} and prompt.answer == {"n": 1} and prompt.messages[0]["content"] == "q"
    assert ids == [[5, 6, 2], [7, 2]]


def test_a_column_named_like_a_builtins_option_does_not_set_it():
    prompts = [Prompt(id="a", text="q", answer="5", fields={"pattern": "NEVER_MATCHES"})]
    out = RewardRunner(build_rewards(["format"])).score(prompts, [r"so \boxed{5}"])
    assert out.totals == [1.0]  # the default pattern, not the row's


def test_a_column_named_like_a_judge_option_stays_out_of_its_requests(monkeypatch):
    from rollover.rewards import judge as judge_module

    bodies = []

    def fake_chat(endpoint, key, body, timeout):
        bodies.append(body)
        return "Score: 7"

    monkeypatch.setattr(judge_module, "_chat", fake_chat)
    fields = [{"rubric": f"ROW{i}", "temperature": 0.9, "max_tokens": 3} for i in range(2)]
    prompts = [Prompt(id=f"p{i}", text=f"question {i}", answer="a", fields=fields[i]) for i in range(2)]
    reward = build_rewards([{"fn": "judge", "kwargs": {"url": "http://127.0.0.1:9/v1", "model": "m"}}])
    out = RewardRunner(reward, on_error="raise").score(prompts, ["c0", "c1"])
    assert out.totals == [0.7, 0.7]
    assert [(b["temperature"], b["max_tokens"]) for b in bodies] == [(0.0, 512), (0.0, 512)]
    assert all(judge_module.DEFAULT_RUBRIC in b["messages"][0]["content"] and "ROW" not in b["messages"][0]["content"]
               for b in bodies)


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
    assert calls == [(["1+1?", "2+2?"], ["2", "5"], ["2", "4"],
                      ["answer", "completion_ids", "log_extra", "log_metric", "trainer_state"])]


@pytest.mark.parametrize("isolate", [False, True])
def test_a_trl_function_reads_the_trainer_state_and_logs_as_in_trl(isolate):
    """TRL hands a reward function `trainer_state`, `log_metric` and `log_extra`: here too, in a
    worker process as well; the logged numbers are the samples' extras, text is left out."""
    from rollover.rewards import TrainerState

    spec = {"fn": f"{FIXTURES}:curriculum", "isolate": isolate}
    with RewardRunner(build_rewards([spec]), timeout_s=30, workers=1) as runner:
        runner.trainer_state = TrainerState(global_step=3, max_steps=12)
        out = runner.score(P, ["ab", "abcd"])
    assert out.totals == [3.0, 3.0]
    assert [s.extras for s in out.samples] == [{"curriculum/progress": 0.25, "curriculum/length": 2.0},
                                               {"curriculum/progress": 0.25, "curriculum/length": 4.0}]
    assert out.metrics()["rewards/curriculum/length/mean"] == 3.0


def test_what_a_trl_function_logs_never_costs_a_sample_its_score():
    """A logged NaN, a container or None is left out; a column of the wrong length fails the
    call, named; the function's own dict keys win over a logged name; a function that takes
    none of TRL's extras gets none."""
    def logs_oddly(prompts, completions, log_metric, log_extra):
        log_metric("empty_mean", float("nan"))
        log_metric("twice", 1.0)
        log_metric("twice", 3.0)  # TRL's mean
        log_extra("parts", [[1, 2], None])
        log_extra("big", [10**400, 2])
        log_extra("hits", [1, 0])
        return ({"score": 1.0, "hits": 5.0}, 0.5)  # a tuple keeps what was logged too

    out = RewardRunner([Reward("odd", logs_oddly)]).score(P, ["x", "y"])
    assert out.totals == [1.0, 0.5]
    assert [s.extras for s in out.samples] == [{"odd/hits": 5.0, "odd/twice": 2.0},
                                               {"odd/big": 2.0, "odd/hits": 0.0, "odd/twice": 2.0}]

    def short_column(prompts, completions, log_extra):
        log_extra("hits", [1])
        return [1.0, 1.0]

    out = RewardRunner([Reward("short", short_column)], on_error="skip").score(P, ["x", "y"])
    assert [s.status for s in out.samples] == ["skipped", "skipped"]
    assert "log_extra('hits', ...) got 1 values for 2 completions" in out.failures[0].error

    def plain(prompts, completions, answer):
        return [0.0, 0.0]

    assert RewardRunner([Reward("plain", plain)]).score(P, ["x", "y"]).totals == [0.0, 0.0]


def test_a_reward_that_drops_reasoning_scores_what_follows_the_models_think():
    """`reasoning: drop`: a reward sees the text after the last </think> (per-sample, batched and
    isolated alike); an answer drafted while thinking does not count, nor does a reply cut off
    while thinking; `keep` (the default) sees the whole completion."""
    from rollover.config import load_config

    prompts = [Prompt(id=f"p{i}", text="?", answer="5") for i in range(5)]
    completions = ["<think>Maybe \\boxed{5}?</think> I am not sure.",  # a draft in the reasoning, none after
                   "<think>\\boxed{4}? no</think> So \\boxed{5}.",
                   "Maybe \\boxed{5}.</think> It is 4.",  # the template opened the reasoning (Qwen3.5's)
                   "<think>It is \\boxed{5}, I think, but",  # cut off while thinking
                   "<think>a</think> Maybe 4?<think>no, \\boxed{5} and"]  # thinking again after answering, cut off
    seen = []

    def batched(prompts, completions, **kw):
        seen.extend(completions)
        return [0.0] * len(completions)

    specs = [{"fn": "numeric", "name": "keep"}, {"fn": "numeric", "name": "drop", "reasoning": "drop"},
             {"fn": "math", "name": "math", "reasoning": "drop", "isolate": True}]
    rewards = build_rewards(specs) + [Reward("b", batched, reasoning="drop")]
    with RewardRunner(rewards, timeout_s=30, workers=1) as runner:
        out = runner.score(prompts, completions)
    assert [s.scores["keep"] for s in out.samples] == [1.0, 1.0, 1.0, 1.0, 1.0]  # every draft counted
    assert [s.scores["drop"] for s in out.samples] == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert [s.scores["math"] for s in out.samples] == [0.0, 1.0, 0.0, 0.0, 0.0]  # in a worker process too
    assert seen == [" I am not sure.", " So \\boxed{5}.", " It is 4.", "", " Maybe 4?"]
    # a prompt that opened the reasoning (Qwen3.5's template): a reply cut off while thinking has neither tag
    cut = "Maybe \\boxed{5}? Let me check again, 2 + 3 is"
    with RewardRunner(rewards[:2]) as runner:
        out = runner.score(prompts[:2], [cut, cut], opened_reasoning=[True, False])
    assert [s.scores["drop"] for s in out.samples] == [0.0, 1.0] and [s.scores["keep"] for s in out.samples] == [1.0, 1.0]
    with pytest.raises(ValueError, match="reasoning='skip': must be one of keep, drop"):
        Reward("r", batched, reasoning="skip")
    cfg = load_config(None, ['reward.functions=[{fn: numeric, reasoning: drop}]'])
    assert build_rewards(cfg.reward.functions)[0].reasoning == "drop"
    with pytest.raises(ValueError, match=r"reasoning='strip': must be keep \(the whole completion\) or drop"):
        load_config(None, ['reward.functions=[{fn: numeric, reasoning: strip}]'])


def test_a_prompt_whose_template_opens_the_reasoning_is_known_to_the_rewards():
    """A chat template that opens <think> in its generation prompt (Qwen3.5's) starts the completion
    inside the reasoning: the group says so, and a reward that drops reasoning scores nothing of a
    completion cut off before </think>. Qwen3's closed empty block (enable_thinking=False) is not open."""
    from rollover.config import load_config
    from rollover.data.render import render_prompt
    from rollover.data.render import opens_reasoning
    from rollover.rollout.groups import score_groups
    from rollover.testing import CHAT_TEMPLATE, char_tokenizer
    from rollover.types import Group, Rollout

    tokenizer = char_tokenizer()
    prompt = Prompt(id="p", text="2+3?", answer="5")
    for ending, opened in (("<think>\n", True), ("<think>\n\n</think>\n\n", False), ("", False)):
        tokenizer.chat_template = CHAT_TEMPLATE.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n" + ending)
        ids = render_prompt(tokenizer, prompt)
        assert opens_reasoning(tokenizer, ids) == opened, ending
    cfg = load_config(None, ["reward.functions=[{fn: numeric, reasoning: drop}]"])
    text = "So \\boxed{5}, but let me check"
    groups = [Group(id=f"g{o}", prompt=prompt, prompt_ids=[1], opened_reasoning=o,
                    rollouts=[Rollout(group_id=f"g{o}", prompt_ids=[1], response_ids=[2], logprobs=[0.0], versions=[0],
                                      loss_mask=[1], finish="length", text=text)]) for o in (True, False)]
    with RewardRunner(build_rewards(cfg.reward.functions)) as runner:
        score_groups(groups, runner, cfg)
    assert [g.rollouts[0].reward for g in groups] == [0.0, 1.0]


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


def test_failures_name_the_prompt_and_a_batch_logs_a_few_then_a_count(caplog):
    """A loop's sample ids (group/index) name the prompt too; a function failing on every sample
    of a batch logs three lines and a count, not one line each."""
    def always(completion, answer, **_):
        raise ValueError(f"no answer in {completion!r}")

    prompts = [Prompt(id=f"math:{i}", text="q", answer="1") for i in range(10)]
    with pytest.raises(RewardFailed, match=r"failed on sample g7/0 \(prompt math:0\): ValueError"):
        RewardRunner([Reward("always", always)], on_error="raise").score(prompts[:1], ["x"], sample_ids=["g7/0"])
    runner = RewardRunner([Reward("always", always)], on_error="zero")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rollover.rewards"):
        out = runner.score(prompts, [f"c{i}" for i in range(10)], sample_ids=[f"g{i}/0" for i in range(10)])
    assert out.error_counts == {"always": 10}  # every failure counted
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4 and all(re.search(r"failed on sample g(\d)/0 \(prompt math:\1\)", x) for x in lines[:3])
    assert lines[-1] == "reward 'always' failed on 7 more sample(s) of this batch (on_error=zero)"


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
        ({"score": 1.0, "acc": float("nan")}, "acc is nan"),
    ],
)
def test_bad_return_values_are_failures(value, message):
    runner = RewardRunner([Reward("bad", lambda completion, answer: value)], on_error="zero")
    out = runner.score(P[:1], ["x"])
    assert out.error_counts == {"bad": 1} and message in out.failures[0].error


def test_trl_and_verl_return_values_score_as_there():
    """A TRL batched reward may return a NumPy array, a torch tensor or a generator; verl's math
    scorers return {"score", "acc", "pred": the extracted answer}: the text is no metric and is
    left out, the numbers score and log."""
    import numpy as np

    def as_array(prompts, completions, **kw):
        return np.array([1.0, 0.0])

    def as_tensor(prompts, completions, **kw):
        return torch.tensor([0.5, 1.0])

    def as_generator(prompts, completions, **kw):
        return (float(len(c)) for c in completions)

    def verl(completion, answer):
        return {"score": 1.0, "acc": True, "pred": "42"}

    out = RewardRunner([Reward("a", as_array), Reward("t", as_tensor), Reward("g", as_generator), Reward("v", verl)]
                       ).score(P, ["x", "yy"])
    assert not out.failures
    assert [s.scores for s in out.samples] == [{"a": 1.0, "t": 0.5, "g": 1.0, "v": 1.0}, {"a": 0.0, "t": 1.0, "g": 2.0, "v": 1.0}]
    assert out.samples[0].extras == {"v/acc": 1.0}

    def breaks_midway(prompts, completions, **kw):  # a generator's error is the call's: counted, not raised
        yield 1.0
        raise ValueError("bad completion")

    out = RewardRunner([Reward("b", breaks_midway)], on_error="zero").score(P, ["x", "yy"])
    assert out.error_counts == {"b": 2} and "bad completion" in out.failures[0].error
    out = RewardRunner([Reward("n", lambda completion, answer: {"score": 1.0, "acc": None})], on_error="zero"
                       ).score(P[:1], ["x"])
    assert out.error_counts == {"n": 1} and "acc must be a real number" in out.failures[0].error  # only text is left out


@pytest.mark.parametrize("on_error", ["zero", "skip"])
@pytest.mark.parametrize("value, message", [
    (10**400, "score does not fit in a float"),  # float() overflows: one sample's failure, not score()'s
    ({"score": 1, "x": 10**400}, "x does not fit in a float"),
], ids=["score", "extra"])
def test_a_number_too_large_for_a_float_is_a_failure_like_any_bad_value(value, message, on_error):
    runner = RewardRunner([Reward("big", lambda completion, answer: value)], on_error=on_error)
    out = runner.score(P[:1], ["x"])
    assert out.error_counts == {"big": 1} and message in out.failures[0].error
    assert out.totals == [0.0 if on_error == "zero" else None]


def test_numpy_bools_are_scores():
    import numpy as np

    runner = RewardRunner([Reward("close", lambda completion, answer: np.isclose(float(completion), float(answer)))])
    out = runner.score(P, ["2.0", "5"])
    assert out.totals == [1.0, 0.0] and out.failures == []


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
        max_threads=1,  # one slot: the hung call must give it up for the rest to run
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


def test_timeout_under_raise_mode():
    runner = RewardRunner(
        [Reward("slow", lambda completion, answer: time.sleep(1.0))], timeout_s=0.05
    )
    with pytest.raises(RewardFailed, match=r"'slow' failed on sample a#0: RewardTimeout"):
        runner.score(P[:1], ["x"])


def test_math_reward_through_the_runner_from_a_worker_thread():
    results = []
    with RewardRunner([Reward("math", math_reward)], timeout_s=20) as runner:
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
    with pytest.raises(ValueError, match="workers and max_threads must be >= 1"):
        RewardRunner([Reward("len", length_reward)], workers=0)
    with pytest.raises(TypeError, match="must take"):
        Reward("one_arg", lambda completion: 1.0)
    # a worker's wait overflows past ~24 days: every isolated call would fail
    for timeout_s in (float("inf"), float("nan"), 3e6):
        with pytest.raises(ValueError, match=r"timeout_s must be in \(0, 1e\+06\] seconds"):
            RewardRunner([Reward("len", length_reward)], timeout_s=timeout_s)


def test_config_refuses_a_reward_timeout_too_large_to_wait_for():
    from rollover.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"reward.timeout_s=3e6: must be <= 1e\+06"):
        load_config(overrides=["reward.timeout_s=3e6"])
    assert load_config(overrides=["reward.timeout_s=1e6"]).reward.timeout_s == 1e6


# --- naming rewards from config -------------------------------------------------------------


def test_builtin_and_module_references():
    assert resolve_reward_fn("math") is math_reward
    numeric = resolve_reward_fn("rollover.rewards.builtins:numeric_reward")
    assert numeric.__name__ == "numeric_reward"
    assert RewardSpec("rollover.rewards.builtins:numeric_reward").build().name == "numeric_reward"
    with pytest.raises(ValueError, match=r"unknown reward 'maths' \(did you mean 'math'\?\)"):
        resolve_reward_fn("maths")
    with pytest.raises(ValueError, match=r"unknown reward 'zzz': expected"):
        resolve_reward_fn("zzz")
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
    # a function object as fn, a weight that is not a number: refused when built, naming the reward
    with pytest.raises(TypeError, match="a reward's fn is a name or a reference, got <function .*named by reference"):
        build_rewards([{"fn": lambda c, a: 1.0}])
    for weight in ("abc", None, True, float("nan")):
        with pytest.raises(ValueError, match=r"reward 'exact': weight must be a finite number, got"):
            build_rewards([{"fn": "exact", "weight": weight}])
    with pytest.raises(ValueError, match="unique"):
        build_rewards(["exact", "exact"])
    # a built-in's options are checked (every dataset field also reaches it, so a typo would pass)
    with pytest.raises(ValueError, match="reward 'format' \\(format\\): has no option 'patern'; its options: pattern"):
        build_rewards([{"fn": "format", "kwargs": {"patern": "x"}}])
    with pytest.raises(ValueError, match=r"reward 'format' \(format\): pattern '\(' is not a regular expression: missing \)"):
        build_rewards([{"fn": "format", "kwargs": {"pattern": "("}}])  # it had failed on every sample, at the first scoring
    with pytest.raises(ValueError, match="build_rewards takes a list of rewards, got the str 'numeric'"):
        build_rewards("numeric")  # (it had looked up the rewards 'n', 'u', ...)
    with pytest.raises(ValueError, match="'numeric' \\(numeric\\) has no option 'tolerance'; its options: none"):
        build_rewards([{"fn": "numeric", "kwargs": {"tolerance": 0.1}}])
    path.write_text("def any_options(completion, answer, **kw):\n    return float(kw['level'])\n")
    assert build_rewards([{"fn": f"{path}:any_options", "kwargs": {"level": 2}}])[0].fn("x", "y") == 2.0  # yours: as given


def test_a_module_reference_to_a_file_off_the_path_says_how_to_load_it(tmp_path, monkeypatch):
    (tmp_path / "my_grades.py").write_text("def correct(completion, answer, **_):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])  # as the rollover command
    with pytest.raises(ModuleNotFoundError, match=r"reward 'my_grades:correct': no module named 'my_grades' on the "
                                                  r"Python path \(my_grades.py is in the current directory: write "
                                                  r"'my_grades.py:correct'"):
        resolve_reward_fn("my_grades:correct")
    assert resolve_reward_fn("my_grades.py:correct")("x", "y") == 1.0


# --- isolated rewards: worker processes killed at the timeout --------------------------------

# sympy evaluates the tower of powers inside C code, holding the interpreter lock for minutes:
# before worker processes, `timeout_s` never fired on it.
BOMB = r"so the answer is \boxed{9^{9^{9^{9^{9}}}}}"


def _alive(pid: int) -> bool:
    """True while process `pid` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _misbehaves(**spec):
    return build_rewards([{"fn": f"{FIXTURES}:misbehaves", "isolate": True, "name": "m", **spec}])


@pytest.mark.parametrize("on_error", ["raise", "zero", "skip"])
def test_pathological_math_answer_is_killed_at_the_timeout(on_error):
    prompts = [Prompt(id="bomb", text="?", answer="5"), Prompt(id="fine", text="?", answer="5")]
    with RewardRunner(build_rewards(["math"]), timeout_s=2, on_error=on_error) as runner:
        start = time.monotonic()
        if on_error == "raise":
            failed = r"'math' failed on sample bomb#0: RewardTimeout"
            with pytest.raises(RewardFailed, match=failed):
                runner.score(prompts, [BOMB, r"\boxed{5}"])
        else:
            out = runner.score(prompts, [BOMB, r"\boxed{5}"])
        # Minutes without the worker processes; here the 2 s timeout, plus starting two
        # workers (about 0.5 s each, in parallel, not counted against the timeout).
        assert time.monotonic() - start < 2 + 4
        if on_error != "raise":
            assert out.timeout_counts == {"math": 1} and out.error_counts == {"math": 1}
            (failure,) = out.failures
            assert (failure.fn, failure.sample_id, failure.timed_out) == ("math", "bomb#0", True)
            assert "timed out after 2 s; worker process" in failure.error
            assert out.totals == ([0.0, 1.0] if on_error == "zero" else [None, 1.0])
        assert runner.score(prompts[1:], [r"\boxed{5}"]).totals == [1.0]  # a fresh worker


def test_isolated_function_that_never_returns_is_killed_and_its_worker_replaced():
    with RewardRunner(_misbehaves(), timeout_s=0.5, on_error="zero", workers=1) as runner:
        first = runner.score(P[:1], ["ok"])
        (old_pid,) = runner.pool.pids
        assert first.samples[0].extras["m/pid"] == old_pid != os.getpid()

        start = time.monotonic()
        out = runner.score(P, ["spin", "ok"])  # `while True: pass` in the worker
        assert time.monotonic() - start < 0.5 + 4
        assert out.totals == [0.0, 1.0] and out.timeout_counts == {"m": 1}
        (failure,) = out.failures
        assert failure.sample_id == "a#0"
        assert f"worker process {old_pid} was killed" in failure.error
        new_pid = out.samples[1].extras["m/pid"]
        assert new_pid != old_pid and runner.pool.pids == [new_pid] and not _alive(old_pid)

        again = runner.score(P, ["ok", "ok"])
        assert again.totals == [1.0, 1.0] and again.error_counts == {"m": 0}


def test_a_killed_worker_takes_the_processes_its_reward_started_with_it():
    def sleepers(tag: str) -> list[int]:
        out = subprocess.run(["pgrep", "-f", f"^sleep {tag}$"], capture_output=True, text=True)
        return [int(x) for x in out.stdout.split()]

    tag = str(600 + os.getpid() % 1000)  # a duration no other process sleeps for
    with RewardRunner(_misbehaves(), timeout_s=1.0, on_error="zero", workers=1) as runner:
        out = runner.score(P[:1], [f"spawn {tag}"])  # starts `sleep <tag>`, then hangs
        assert out.timeout_counts == {"m": 1}
        deadline = time.monotonic() + 5
        while sleepers(tag) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sleepers(tag) == []  # not orphaned to init


@pytest.mark.parametrize("how, death", [("exit", "exited with code 3"), ("sigkill", "SIGKILL")])
def test_worker_dying_mid_call_is_a_counted_failure(how, death, caplog):
    with RewardRunner(_misbehaves(), on_error="zero", workers=1) as runner:
        with caplog.at_level(logging.WARNING, logger="rollover.rewards"):
            out = runner.score(P, [how, "ok"])
        assert runner.score(P[:1], ["ok"]).totals == [1.0]
    assert out.totals == [0.0, 1.0]
    assert out.error_counts == {"m": 1} and out.timeout_counts == {"m": 0}
    (failure,) = out.failures
    assert (failure.fn, failure.sample_id) == ("m", "a#0") and death in failure.error
    assert "reward 'm' failed on sample a#0: WorkerDied: reward worker process" in caplog.text


def test_isolated_rewards_score_like_in_thread_ones():
    cases = [
        (r"3 + 5 = 8, so \boxed{8}", "8"),
        (r"\boxed{\frac{1}{2}}", "0.5"),
        (r"so \boxed{x^2 + 1}", "1 + x^2"),
        (r"7 is tempting, but \boxed{9}", "8"),
        ("no idea", "8"),
        (r"\boxed{8}", r"\boxed{"),  # math abstains: the gold answer does not parse
    ]
    prompts = [Prompt(id=f"p{i}", text="?", answer=a, fields={"level": i}) for i, (_, a) in
               enumerate(cases)]
    completions = [c for c, _ in cases]
    specs = [
        {"fn": "math"},
        {"fn": f"{FIXTURES}:scaled_length", "kwargs": {"scale": 0.5}, "weight": 2.0},
        {"fn": f"{FIXTURES}:prefix_match", "weight": 0.25},  # TRL signature, one call per batch
    ]

    def score(isolate):
        rewards = build_rewards([{**spec, "isolate": isolate} for spec in specs])
        assert [r.isolated for r in rewards] == [isolate] * 3
        with RewardRunner(rewards, timeout_s=30, workers=2) as runner:
            out = runner.score(prompts, completions)
        return [(s.status, s.total, s.scores, s.extras, s.failed) for s in out.samples]

    in_thread, isolated = score(False), score(True)
    assert isolated == in_thread
    assert [scores["math"] for _, _, scores, _, _ in isolated] == [1.0, 1.0, 1.0, 0.0, 0.0, None]
    assert isolated[1][2]["scaled_length"] == 0.5 * len(completions[1]) + 1


def test_errors_in_a_worker_are_reported_like_in_thread_errors():
    with RewardRunner(_misbehaves(), on_error="zero", workers=1) as runner:
        out = runner.score(P, ["raise", "unpicklable"])
    assert [f.error for f in out.failures] == [
        "ValueError: asked to raise (answer 2)",
        "RuntimeError: NeedsTwoArgs: odd: error",  # stands in for an exception pickle refuses
    ]
    with RewardRunner(_misbehaves(), on_error="raise", workers=1) as runner:
        with pytest.raises(RewardFailed, match="'m' failed on sample a#0: ValueError") as info:
            runner.score(P[:1], ["raise"])
    notes = "".join(info.value.__cause__.__notes__)
    assert "in the reward worker process" in notes and "in misbehaves" in notes


def test_close_leaves_no_worker_processes():
    with RewardRunner(_misbehaves(), workers=2) as runner:
        assert runner.score(P, ["ok", "ok"]).totals == [1.0, 1.0]
        pids = runner.pool.pids
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
    assert not any(_alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        runner.score(P, ["ok", "ok"])


@pytest.mark.parametrize("when", ["idle", "mid-call"])
def test_workers_do_not_outlive_a_parent_that_dies(when, tmp_path):
    # The parent is killed without closing the runner. An idle worker sees its pipe close; a
    # busy one is ended by its own watchdog (timeout 1 s + grace 0.5 s here).
    script = tmp_path / "parent.py"
    script.write_text(
        "import os, sys\n"
        "from rollover.rewards import RewardRunner, build_rewards, pool\n"
        "from rollover.types import Prompt\n"
        "pool.WATCHDOG_GRACE_S = 0.5\n"
        f"spec = {{'fn': {FIXTURES!r} + ':misbehaves', 'isolate': True}}\n"
        "runner = RewardRunner(build_rewards([spec]), timeout_s=1.0, workers=1)\n"
        "prompts = [Prompt(id='a', text='?', answer='1')]\n"
        "runner.score(prompts, ['ok'])\n"
        "print(runner.pool.pids[0], flush=True)\n"
        f"if {when!r} == 'idle':\n"
        "    os._exit(0)\n"
        "runner.score(prompts, ['spin'])\n"
    )
    with open(tmp_path / "stderr", "w") as stderr:
        parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                                  stderr=stderr, text=True)
    pid = int(parent.stdout.readline())
    if when == "mid-call":
        time.sleep(0.5)  # the worker is spinning; its parent would kill it at 1 s
        assert _alive(pid)
        parent.kill()
    parent.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_which_rewards_are_isolated_and_what_workers_rebuild(monkeypatch):
    rewards = build_rewards(
        [
            "math",
            "numeric",
            {"fn": f"{FIXTURES}:misbehaves", "isolate": True},
            f"{FIXTURES}:marked",  # its function says isolate = True
            {"fn": "math", "isolate": False, "name": "math_in_thread"},
            {"fn": "format", "isolate": True, "kwargs": {"pattern": "x"}},
        ]
    )
    assert [r.isolated for r in rewards] == [True, False, True, True, False, True]
    assert rewards[0].reference == ("math", {})
    assert rewards[2].reference == (f"{FIXTURES}:misbehaves", {})
    assert rewards[5].reference == ("format", {"pattern": "x"})
    # A function object: rebuilt by module and name when that finds it again.
    assert Reward("m", math_reward).reference == ("rollover.rewards.builtins:math_reward", {})
    # A relative file is made absolute, so a worker finds it whatever its directory.
    monkeypatch.chdir(Path(FIXTURES).parent)
    relative = RewardSpec("reward_fixtures.py:marked").build()
    assert relative.reference == (f"{FIXTURES}:marked", {})
    with pytest.raises(TypeError, match="reward 'judge' is isolated .* cannot be named"):
        Reward("judge", lambda completion, answer: 1.0, isolate=True)


def test_a_reward_no_worker_can_load_stops_scoring_whatever_on_error(tmp_path):
    path = tmp_path / "gone.py"
    path.write_text("def f(completion, answer):\n    return 1.0\n")
    rewards = build_rewards([{"fn": f"{path}:f", "isolate": True}])
    path.unlink()
    with RewardRunner(rewards, on_error="zero", workers=1) as runner:
        with pytest.raises(WorkerStartError, match="could not rebuild(.|\n)*FileNotFoundError"):
            runner.score(P, ["x", "y"])


@pytest.mark.parametrize("isolate", [False, True])
def test_a_batched_reward_may_fail_one_sample_with_an_exception_in_its_place(isolate):
    """The sample in whose place the list holds an exception fails with it (even one pickle
    cannot rebuild, from a worker process); the others keep their scores."""
    spec = {"fn": f"{FIXTURES}:second_fails", "isolate": isolate}
    with RewardRunner(build_rewards([spec]), timeout_s=30, on_error="skip", workers=1) as runner:
        got = runner.score([Prompt(id=str(i), text="q") for i in range(3)], ["a", "b", "c"])
    assert [s.status for s in got.samples] == ["ok", "skipped", "ok"]
    assert len(got.failures) == 1 and "judge: gave up" in got.failures[0].error


def test_an_isolated_reward_named_from_the_running_script_is_refused_when_built(monkeypatch):
    """'__main__:f' resolves here, but a worker process's __main__ is not this script: refused at
    build time, naming the reward (it had failed at the first scoring, as a missing function)."""
    import __main__

    def scripted(completion, answer):
        return 1.0

    monkeypatch.setattr(__main__, "scripted", scripted, raising=False)
    assert build_rewards([{"fn": "__main__:scripted"}])[0].fn is scripted  # in a thread: fine
    with pytest.raises(TypeError, match=r"reward 'scripted' is isolated .* '__main__:scripted' names this process's script"):
        build_rewards([{"fn": "__main__:scripted", "isolate": True}])
