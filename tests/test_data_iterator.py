"""The resumable prompt iterator and held-out splits."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollover.data import PromptIterator, arithmetic, split_holdout
from rollover.types import Prompt


def prompts(n):
    return [Prompt(id=f"p{i}", text=f"q{i}", answer=str(i)) for i in range(n)]


def ids(batch):
    return [p.id for p in batch]


def test_each_epoch_visits_every_prompt_once_in_a_seeded_order():
    it = PromptIterator(prompts(6), seed=1)
    epoch0 = ids(it.next_batch(3) + it.next_batch(3))
    epoch1 = ids(it.next_batch(6))
    assert sorted(epoch0) == sorted(epoch1) == [f"p{i}" for i in range(6)]
    assert epoch0 != epoch1  # reshuffled per epoch
    assert it.epoch == 2 and it.position == 0
    assert ids(PromptIterator(prompts(6), seed=1).next_batch(6)) == epoch0


def test_unshuffled_order_and_batches_that_cross_an_epoch():
    it = PromptIterator(prompts(5), shuffle=False)
    assert ids(it.next_batch(3)) == ["p0", "p1", "p2"]
    assert ids(it.next_batch(3)) == ["p3", "p4", "p0"]  # completed from epoch 1
    assert (it.epoch, it.position, it.prompts_served) == (1, 1, 6)
    assert ids(it.next_batch(7)) == ["p1", "p2", "p3", "p4", "p0", "p1", "p2"]


@pytest.mark.parametrize("stop_after", [1, 2, 3, 4, 5])
def test_resume_gives_the_same_prompts_as_an_uninterrupted_run(stop_after):
    # 7 prompts, batches of 3: batch boundaries fall mid-epoch and, after batch 7, exactly on
    # an epoch boundary (21 = 3 * 7). Stops at batches 1..5 cover crossing into epoch 1 and 2.
    data = prompts(7)
    reference = PromptIterator(data, seed=11)
    expected = [ids(reference.next_batch(3)) for _ in range(12)]

    first = PromptIterator(data, seed=11)
    got = [ids(first.next_batch(3)) for _ in range(stop_after)]
    state = first.state_dict()
    del first  # the run is killed
    resumed = PromptIterator(data, seed=11)
    resumed.load_state_dict(state)
    got += [ids(resumed.next_batch(3)) for _ in range(12 - stop_after)]
    assert got == expected


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 9),
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=8),
    stop=st.integers(0, 8),
    seed=st.integers(0, 3),
)
def test_resume_anywhere_matches_an_uninterrupted_run(n, sizes, stop, seed):
    data = prompts(n)
    reference = PromptIterator(data, seed=seed)
    expected = [ids(reference.next_batch(k)) for k in sizes]
    run = PromptIterator(data, seed=seed)
    got = [ids(run.next_batch(k)) for k in sizes[:stop]]
    resumed = PromptIterator(data, seed=seed)
    resumed.load_state_dict(run.state_dict())
    got += [ids(resumed.next_batch(k)) for k in sizes[stop:]]
    assert got == expected
    assert resumed.prompts_served == sum(sizes) and resumed.state_dict() == reference.state_dict()


def test_resume_exactly_at_an_epoch_boundary_starts_the_next_epoch():
    data = prompts(4)
    it = PromptIterator(data, seed=0)
    it.next_batch(2)
    it.next_batch(2)  # epoch 0 is done
    state = it.state_dict()
    assert (state["epoch"], state["position"]) == (1, 0)
    expected_epoch1 = ids(it.next_batch(4))

    resumed = PromptIterator(data, seed=0)
    resumed.load_state_dict(state)
    assert ids(resumed.next_batch(4)) == expected_epoch1
    assert resumed.epoch == 2


def test_state_from_other_data_or_seed_is_refused():
    state = PromptIterator(prompts(4), seed=0).state_dict()
    with pytest.raises(ValueError, match="different prompts"):
        PromptIterator(prompts(5), seed=0).load_state_dict(state)
    changed = prompts(4)
    changed[2].answer = "changed"
    with pytest.raises(ValueError, match="different prompts"):
        PromptIterator(changed, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=0"):
        PromptIterator(prompts(4), seed=1).load_state_dict(state)


def test_holdout_split_is_deterministic_and_disjoint_by_content():
    data = arithmetic(300, seed=0)  # 1-digit sums: many questions repeat
    train, held = split_holdout(data, fraction=0.1, seed=0)
    train_questions = {p.text for p in train}
    held_questions = {p.text for p in held}
    assert not train_questions & held_questions
    assert len(held) == len(held_questions)  # each held-out question once
    assert len(train) == sum(p.text not in held_questions for p in data)  # and none of its copies trained on
    distinct = len(train_questions | held_questions)
    assert len(held_questions) == -(-distinct // 10)  # ceil(0.1 * distinct)
    assert split_holdout(data, fraction=0.1, seed=0) == (train, held)
    assert split_holdout(data, fraction=0.1, seed=1)[1] != held
    with pytest.raises(ValueError, match="fraction"):
        split_holdout(data, fraction=1.0)


def test_the_demos_held_out_prompts_are_as_many_distinct_questions():
    """examples/arith.yaml: 2000 rows of 100 distinct 1-digit sums; eval_size 48 is 48 questions,
    none of them (nor a copy) in training."""
    from rollover.config import load_config
    from rollover.loops.prompts import _prompts

    train, held, _, _ = _prompts(load_config("examples/arith.yaml"), None)
    assert len(held) == len({p.text for p in held}) == 48
    assert not {p.text for p in train} & {p.text for p in held}
    assert len({p.text for p in train}) == 52


@pytest.mark.parametrize("weights", [None, {"a": 1.0, "b": 1.0}])
def test_named_sources_that_share_questions_hold_each_out_of_both(tmp_path, weights):
    """A question held out of one source is trained on through none; a source of one question is
    not split; held-out questions are distinct and exactly eval_size (no rounded-up extra lost)."""
    import json

    from rollover.config import load_config
    from rollover.loops.prompts import _prompts

    def write(name, questions):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("\n".join(json.dumps({"prompt": q, "answer": "1"}) for q in questions))
        return str(path)

    a = write("a", [f"q{i}" for i in range(25)])
    b = write("b", [f"q{i}" for i in range(10, 35)] * 2)  # shares q10-q24 with a, each twice
    one = write("one", ["lonely"] * 3)
    cfg = load_config(**{"data.train": {"a": a, "b": b, "one": one}, "data.eval_size": 7,
                         **({"data.train_weights": {**weights, "one": 1.0}} if weights else {})})
    train, held, _, _ = _prompts(cfg, None)
    asked = {p.text for p in held}
    assert len(held) == len(asked) == 7
    assert not asked & {p.text for p in train}
    assert {p.text for p in train} | asked == {f"q{i}" for i in range(35)} | {"lonely"}  # nothing lost


def test_a_question_as_text_and_as_one_user_message_is_one_question(tmp_path):
    """The same question written as text in one source and as a one-user-message chat in another
    (or in the same file) is held out of both, and asked once."""
    import json

    from rollover.config import load_config
    from rollover.loops.prompts import _prompts

    questions = [f"What is {i} times 3?" for i in range(40)]
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"prompt": q, "answer": "1"}) + "\n" for q in questions))
    (tmp_path / "chat.jsonl").write_text("".join(
        json.dumps({"prompt": [{"role": "user", "content": q}], "answer": "1"}) + "\n" for q in questions[::-1][:30]))
    (tmp_path / "both.jsonl").write_text((tmp_path / "text.jsonl").read_text() + (tmp_path / "chat.jsonl").read_text())
    asked = lambda p: p.text if p.text is not None else p.messages[-1]["content"]  # noqa: E731
    for train_data in ({"a": str(tmp_path / "text.jsonl"), "b": str(tmp_path / "chat.jsonl")}, str(tmp_path / "both.jsonl")):
        train, held, _, _ = _prompts(load_config(**{"data.train": train_data, "data.eval_size": 6}), None)
        assert len(held) == len({asked(p) for p in held}) == 6
        assert not {asked(p) for p in held} & {asked(p) for p in train}
    # data in one form holds out what it did before the two forms counted as one question
    plain = [Prompt(id=str(i), text=q) for i, q in enumerate(questions)]
    chat = [Prompt(id=str(i), messages=[{"role": "user", "content": q}]) for i, q in enumerate(questions)]
    assert [p.id for p in split_holdout(plain, 0.1, seed=0)[1]] == ["2", "11", "21", "36"]
    assert [p.id for p in split_holdout(chat, 0.1, seed=0)[1]] == ["2", "11", "21", "36"]


def test_a_mix_draws_sources_at_their_weights_and_resumes_where_it_stopped():
    from collections import Counter

    from rollover.data import MixedIterator

    small = [Prompt(id=f"a{i}", text=f"a{i}") for i in range(3)]
    big = [Prompt(id=f"b{i}", text=f"b{i}") for i in range(100)]
    mix = MixedIterator({"a": small, "b": big}, {"a": 3.0, "b": 1.0}, seed=4)
    drawn = [p.id for p in mix.next_batch(2000)]
    share = sum(i.startswith("a") for i in drawn) / len(drawn)
    assert abs(share - 0.75) < 0.03  # by weight, not by size
    counts = Counter(i for i in drawn if i.startswith("a"))
    assert max(counts.values()) - min(counts.values()) <= 1  # the small source goes round its epochs
    again = MixedIterator({"a": small, "b": big}, {"a": 3.0, "b": 1.0}, seed=4)
    assert [p.id for p in again.next_batch(2000)] == drawn  # the seed decides
    first = MixedIterator({"a": small, "b": big}, {"a": 3.0, "b": 1.0}, seed=4)
    first.next_batch(37)
    state = first.state_dict()
    resumed = MixedIterator({"a": small, "b": big}, {"a": 3.0, "b": 1.0}, seed=4)
    resumed.load_state_dict(state)
    assert [p.id for p in resumed.next_batch(50)] == [p.id for p in first.next_batch(50)] == drawn[37:87]
    other = MixedIterator({"a": small, "b": big}, {"a": 1.0, "b": 1.0}, seed=4)
    with pytest.raises(ValueError, match="weights="):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="saved by a run mixing several sources"):
        PromptIterator(small).load_state_dict(state)
    changed = MixedIterator({"a": small, "b": big[:99]}, {"a": 3.0, "b": 1.0}, seed=4)  # b lost a row
    with pytest.raises(ValueError, match="source 'b': iterator state was saved over different prompts"):
        changed.load_state_dict(state)
    assert state["sources"]["a"]["prompts_served"] > 0
    assert changed.prompts_served == changed.iters["a"].prompts_served == 0  # a refused state moves no source


def test_a_mix_does_not_depend_on_the_order_its_sources_are_listed_in():
    from rollover.data import MixedIterator

    a = [Prompt(id=f"a{i}", text=f"a{i}") for i in range(5)]
    b = [Prompt(id=f"b{i}", text=f"b{i}") for i in range(7)]
    one = MixedIterator({"a": a, "b": b}, {"a": 1.0, "b": 2.0}, seed=1)
    other = MixedIterator({"b": b, "a": a}, {"b": 2.0, "a": 1.0}, seed=1)
    assert [p.id for p in one.next_batch(60)] == [p.id for p in other.next_batch(60)]
    other.load_state_dict(one.state_dict())


def test_rows_without_answers_train_only_when_the_config_says_so(tmp_path):
    """A prompts-only dataset (rewards such as a reward model's or a judge's need no answer) is
    refused by default, with the key that keeps it named; data.require_answer=false keeps its rows,
    and refuses rewards that compare with an answer."""
    import json

    from rollover.config import ConfigError, load_config
    from rollover.data import DataError
    from rollover.loops.prompts import _prompts

    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"write a haiku about {i}"}) for i in range(20)))
    base = {"data.train": str(path), "data.eval_size": 4}
    with pytest.raises(DataError, match=r"p\.jsonl line 1: missing answer .*data\.require_answer: false"):
        _prompts(load_config(**base), None)
    train, held, _, _ = _prompts(load_config(**base, **{"data.require_answer": False,
                                                           "reward.functions": ["format"]}), None)
    assert len(train) == 16 and len(held) == 4 and {p.answer for p in train + held} == {None}
    with pytest.raises(ConfigError, match="data.require_answer=false .* reward 'math' compares"):
        load_config(**base, **{"data.require_answer": False, "reward.functions": ["format", {"fn": "math"}]})


def test_a_saved_dataset_dicts_splits_train_and_evaluate(tmp_path):
    """`data.eval: dir?split=test` evaluates on the test split of the DatasetDict that
    `data.train: dir` trains on (its train split)."""
    import datasets

    from rollover.config import load_config
    from rollover.data import DataError
    from rollover.loops.prompts import _prompts

    datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"prompt": f"t{i}", "answer": "1"} for i in range(6)]),
        "test": datasets.Dataset.from_list([{"prompt": f"e{i}", "answer": "2"} for i in range(3)]),
    }).save_to_disk(str(tmp_path / "ds"))
    cfg = load_config(**{"data.train": str(tmp_path / "ds"), "data.eval": f"{tmp_path / 'ds'}?split=test"})
    train, held, _, _ = _prompts(cfg, None)
    assert [p.text for p in train] == [f"t{i}" for i in range(6)]
    assert [p.text for p in held] == ["e0", "e1", "e2"]
    assert not {p.id for p in train} & {p.id for p in held}
    # held out from the same directory without a split would be its train split, trained on: refused
    cfg = load_config(**{"data.train": str(tmp_path / "ds"), "data.eval": str(tmp_path / "ds")})
    with pytest.raises(DataError, match=r"holds the splits \['test', 'train'\]: name one, .*ds\?split=NAME"):
        _prompts(cfg, None)


def test_rows_without_answers_are_refused_where_an_environment_scores_against_the_answer():
    """With an environment the reward.functions are not used: the environment's own score decides
    (a built-in score compares with the answer; a function of yours may not), and a game whose
    task is the row's answer cannot take rows without one."""
    import dataclasses

    from rollover.config import ConfigError, load_config
    from rollover.config.run import ANSWER_SCORED_ENVS
    from rollover.envs.inline import InlineTools
    from rollover.envs.interpreter import Interpreter
    from rollover.envs.tools import ToolUse

    def default_score(cls):
        return next(f.default for f in dataclasses.fields(cls) if f.name == "score")

    assert ANSWER_SCORED_ENVS == {"tools": default_score(ToolUse), "interpreter": default_score(Interpreter),
                                  "inline_tools": default_score(InlineTools)}
    base = {"data.train": "rows.jsonl", "data.require_answer": False}
    for env, says in [({"env.name": "guess_number"}, "its task's solution is the row's answer"),
                      ({"env.name": "tools"}, "env.name=tools's score 'numeric'"),
                      ({"env.name": "inline_tools", "env.options": {"score": "exact"}}, "score 'exact'")]:
        with pytest.raises(ConfigError, match=f"data.require_answer=false .*{says}"):
            load_config(**base, **env)
    # the reward.functions (numeric by default) are not the environment's: not checked
    assert load_config(**base, **{"env.name": "tools", "env.options": {"score": "mine.py:grade"}}).env.name == "tools"
    assert load_config(**base, **{"env.name": "agent", "env.options": {"fn": "mine.py:agent"}}).env.name == "agent"


def test_a_sample_without_an_answer_is_an_error_of_each_reward_that_needs_one():
    """Named by another spelling a built-in escapes the config's check; scored without an answer it
    raises (counted as the reward's error) instead of scoring 0, or 1 for `code`'s missing tests."""
    from rollover.rewards.builtins import BUILTINS

    for name in ("math", "numeric", "exact", "em", "countdown", "code"):
        with pytest.raises(ValueError, match=f"{name}: the sample has no answer to compare with"):
            BUILTINS[name]("print(1)\n\\boxed{1}", None, numbers=[1])
    assert BUILTINS["format"]("<answer>1</answer>", None, pattern="<answer>") == 1.0


def test_skipped_rows_are_named_in_the_log_and_a_missing_source_names_its_key(tmp_path, caplog):
    import json
    import logging

    from rollover.config import ConfigError, load_config
    from rollover.loops.prompts import SKIPPED_SHOWN, _prompts

    path = tmp_path / "rows.jsonl"
    lines = [json.dumps({"prompt": f"q{i}", "answer": "1"}) for i in range(12)] + ["{not json"] * (SKIPPED_SHOWN + 2)
    path.write_text("\n".join(lines))
    with caplog.at_level(logging.WARNING, logger="rollover"):
        train, held, skipped, _ = _prompts(load_config(**{"data.train": str(path), "data.eval_size": 2,
                                                          "data.on_bad_row": "skip"}), None)
    assert skipped == SKIPPED_SHOWN + 2 and len(train) + len(held) == 12
    named = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: skipped ")]
    assert named[0] == f"data: skipped {path} line 13: not valid JSON (Expecting property name enclosed in double quotes at column 2)"
    assert len(named) == SKIPPED_SHOWN + 1 and named[-1] == f"data: skipped 2 more rows of {path}"
    with pytest.raises(ConfigError, match=r"data.eval=.*nope.jsonl: dataset not found"):
        _prompts(load_config(**{"data.train": str(path), "data.eval": str(tmp_path / "nope.jsonl"),
                                "data.on_bad_row": "skip"}), None)
