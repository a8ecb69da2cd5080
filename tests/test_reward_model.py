"""The built-in `reward_model` reward: a sequence classifier's score (tiny random models, CPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from rollover.rewards import RewardRunner, build_rewards
from rollover.testing import char_tokenizer, save_tiny_model, tiny_config
from rollover.types import Prompt


def save_reward_model(path, *, num_labels=1, template=True, seed=0, pad=True):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    config = tiny_config("llama", num_labels=num_labels)
    if not pad:
        config.pad_token_id = None
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    tok = char_tokenizer()
    if not template:
        tok.chat_template = None
    elif isinstance(template, str):
        tok.chat_template = template
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return save_reward_model(tmp_path_factory.mktemp("rm") / "rm")


def alone(path, text, add_special_tokens):
    """The classifier's logit for one text, unpadded, straight from transformers."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok(text, add_special_tokens=add_special_tokens, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return float(model(input_ids=ids).logits[0, 0])


def prompts_of(*items):
    return [Prompt(id=f"p{i}", text=t) if isinstance(t, str) else Prompt(id=f"p{i}", messages=t)
            for i, t in enumerate(items)]


def test_scores_are_the_classifiers_own_on_the_conversation_in_the_models_template(rm_dir):
    """Batched and padded, each sample scores as it does alone: the prompt's messages (a text prompt
    as one user message) and the completion as the assistant's, in the reward model's template."""
    chat = [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+3="}]
    prompts = prompts_of("1+1=", chat, "7+8=", chat)
    completions = ["2", "the answer is 5", "15 because 7 and 8 make fifteen", ""]
    [reward] = build_rewards([{"fn": "reward_model", "kwargs": {"path": rm_dir, "batch_size": 3}}])
    with RewardRunner([reward], timeout_s=60) as runner:
        got = runner.score(prompts, completions)
    template = char_tokenizer()
    for sample, prompt, completion in zip(got.samples, prompts, completions):
        messages = prompt.messages or [{"role": "user", "content": prompt.text}]
        text = template.apply_chat_template([*messages, {"role": "assistant", "content": completion}], tokenize=False)
        assert sample.scores["reward_model"] == pytest.approx(alone(rm_dir, text, False), abs=1e-5)
        assert sample.extras["reward_model/truncated"] == 0.0
    scores = [s.scores["reward_model"] for s in got.samples]
    assert len(set(scores)) == 4  # a random head tells the samples apart
    assert got.metrics()["rewards/reward_model/truncated/mean"] == 0.0


def test_a_prefilled_answer_and_its_completion_are_scored_as_one_assistant_turn(rm_dir):
    """A prompt ending in an assistant message (a prefill the policy continues): the reward model
    reads the prefill and the completion as one answer, not two assistant turns."""
    prefill = [{"role": "user", "content": "2+3="}, {"role": "assistant", "content": "The sum is"}]
    [reward] = build_rewards([{"fn": "reward_model", "kwargs": {"path": rm_dir}}])
    with RewardRunner([reward], timeout_s=60) as runner:
        got = runner.score(prompts_of(prefill), [" 5"])
    text = char_tokenizer().apply_chat_template([prefill[0], {"role": "assistant", "content": "The sum is 5"}],
                                                tokenize=False)
    assert got.samples[0].scores["reward_model"] == pytest.approx(alone(rm_dir, text, False), abs=1e-5)


def test_without_a_template_the_prompt_text_and_completion_are_scored_and_long_samples_keep_their_end(tmp_path):
    path = save_reward_model(tmp_path / "plain", template=False, seed=1)
    long_completion = "x" * 40 + " so 9"
    [reward] = build_rewards([{"fn": "reward_model", "kwargs": {"path": path, "max_length": 16}}])
    with RewardRunner([reward], timeout_s=60) as runner:
        got = runner.score(prompts_of("4+5=", "1+2="), [long_completion, "3"])
    tok = char_tokenizer()
    tail = tok.decode(tok("4+5=" + long_completion, add_special_tokens=True)["input_ids"][-16:])
    assert got.samples[0].scores["reward_model"] == pytest.approx(alone(path, tail, False), abs=1e-5)
    assert got.samples[1].scores["reward_model"] == pytest.approx(alone(path, "1+2=3", True), abs=1e-5)
    assert [s.extras["reward_model/truncated"] for s in got.samples] == [1.0, 0.0]


def test_without_a_padding_id_each_sample_is_read_at_its_last_token_as_alone(tmp_path):
    """A classifier whose config names no padding id reads one sample at its last token, an end
    token included: a batch does the same (padded with an id none of its rows holds)."""
    ends_in_eos = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>{% endfor %}"
    path = save_reward_model(tmp_path / "nopad", pad=False, template=ends_in_eos, seed=2)
    completions = ["2<pad>", "ok<|im_end|>", "", "a<|im_end|><|im_end|>", "a"]
    prompts = prompts_of("1+1=", "hi", "x", "q", "q")
    [reward] = build_rewards([{"fn": "reward_model", "kwargs": {"path": path, "batch_size": 5}}])
    with RewardRunner([reward], timeout_s=60) as runner:
        got = [s.scores["reward_model"] for s in runner.score(prompts, completions).samples]
    template = char_tokenizer()
    template.chat_template = ends_in_eos
    for score, prompt, completion in zip(got, prompts, completions):
        text = template.apply_chat_template([{"role": "user", "content": prompt.text},
                                             {"role": "assistant", "content": completion}], tokenize=False)
        assert score == pytest.approx(alone(path, text, False), abs=1e-5)
    assert got[3] != pytest.approx(got[4], abs=1e-4)  # its own end tokens count


def test_a_cut_sample_keeps_its_leading_special_tokens_and_its_end(tmp_path):
    from rollover.testing import CHAT_TEMPLATE

    path = save_reward_model(tmp_path / "bos", template="<bos>" + CHAT_TEMPLATE, seed=4)
    [reward] = build_rewards([{"fn": "reward_model", "kwargs": {"path": path, "max_length": 16}}])
    with RewardRunner([reward], timeout_s=60) as runner:
        got = runner.score(prompts_of("1+1="), ["x" * 40 + " so 2"]).samples[0]
    tok = char_tokenizer()
    tok.chat_template = "<bos>" + CHAT_TEMPLATE
    ids = tok(tok.apply_chat_template([{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "x" * 40 + " so 2"}],
                                      tokenize=False), add_special_tokens=False)["input_ids"]
    assert ids[:2] == [tok.bos_token_id, tok.convert_tokens_to_ids("<|im_start|>")]
    kept = tok.decode(ids[:2] + ids[-14:])
    assert got.scores["reward_model"] == pytest.approx(alone(path, kept, False), abs=1e-5)
    assert got.extras["reward_model/truncated"] == 1.0


def test_the_model_loads_only_where_the_reward_runs_and_is_let_go_on_close(rm_dir, monkeypatch, tmp_path):
    from rollover.rewards import model

    monkeypatch.chdir(tmp_path.parent)
    relative = os.path.relpath(rm_dir, tmp_path.parent)
    model._close()
    [isolated] = build_rewards([{"fn": "reward_model", "isolate": True, "kwargs": {"path": relative}}])
    assert model._SCORERS == {}  # a worker process loads it, not this one
    assert isolated.reference == ("reward_model", {"path": str(Path(rm_dir).resolve())})  # the same directory there
    [here] = build_rewards([{"fn": "reward_model", "kwargs": {"path": rm_dir}}])
    assert len(model._SCORERS) == 1
    RewardRunner([here], timeout_s=60).close()
    assert model._SCORERS == {}


def test_reward_names_hold_no_slash_and_a_users_prepare_attribute_is_left_alone():
    with pytest.raises(ValueError, match=r"reward names may not contain '/': \['fmt/len'\]"):
        build_rewards([{"fn": "numeric", "name": "fmt"}, {"fn": "exact", "name": "fmt/len"}])
    from rollover.rewards import Reward, RewardSpec

    class Judge:  # a user's callable with a method of its own named prepare
        def prepare(self):
            raise AssertionError("not rollover's to call")

        def __call__(self, completion, answer, scale=1.0):
            return scale

    import sys
    import types

    module = types.ModuleType("judge_module")
    module.judge = Judge()
    sys.modules["judge_module"] = module
    try:
        reward = RewardSpec("judge_module:judge", kwargs={"scale": 2.0}).build()
    finally:
        del sys.modules["judge_module"]
    assert isinstance(reward, Reward) and reward.fn("x", "y") == 2.0


def test_a_wrong_reward_model_is_refused_when_the_rewards_are_built(tmp_path, rm_dir):
    with pytest.raises(ValueError, match=r"reward 'reward_model' \(reward_model\): path='.*nowhere'.*not a reward model"):
        build_rewards([{"fn": "reward_model", "kwargs": {"path": str(tmp_path / "nowhere")}}])
    two = save_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(ValueError, match=r"the classifier has 2 labels; a reward model has one"):
        build_rewards([{"fn": "reward_model", "kwargs": {"path": two}}])
    with pytest.raises(ValueError, match=r"kwargs.path is required"):
        build_rewards(["reward_model"])
    with pytest.raises(ValueError, match=r"unknown kwargs \['batch'\]"):
        build_rewards([{"fn": "reward_model", "kwargs": {"path": rm_dir, "batch": 4}}])
    with pytest.raises(ValueError, match=r"batch_size=0: must be an integer >= 1"):
        build_rewards([{"fn": "reward_model", "kwargs": {"path": rm_dir, "batch_size": 0}}])


def test_a_run_trains_on_the_reward_models_score_beside_a_rule(rm_dir, tmp_path):
    """In a run, each trained sample's reward is the rule's score plus the weighted score the
    reward model gives its prompt and response (read back from the samples log)."""
    from rollover.config import load_config
    from rollover.loops.sync import train_sync

    model_dir = str(save_tiny_model(tmp_path / "policy", "llama", seed=3))
    cfg = load_config(**{
        "device": "cpu", "model": model_dir, "run_dir": str(tmp_path / "run"), "steps": 1, "seed": 7,
        "data.train": "gen:arithmetic?n=40", "data.eval_size": 4, "data.max_prompt_tokens": 64,
        "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 3, "rollout.max_new_tokens": 6,
        "rollout.max_rows": 8, "eval.at_start": False, "eval.samples_per_prompt": 1, "logging.samples": 1,
        "logging.progress": False, "logging.tensorboard": False,
        "reward.functions": ["numeric", {"fn": "reward_model", "weight": 0.5, "kwargs": {"path": rm_dir}}],
    })
    train_sync(cfg)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    train = next(r for r in rows if r["kind"] == "train")
    assert "rewards/reward_model/mean" in train and train["rewards/reward_model/truncated/mean"] == 0.0
    from rollover.metrics.samples import samples_path

    samples = [json.loads(line) for line in open(samples_path(tmp_path / "run", 1))][1:]
    assert len(samples) == 6
    from rollover.data import load_prompts

    by_id = {p.id: p for p in load_prompts("gen:arithmetic?n=40").prompts}
    template = char_tokenizer()
    for s in samples:
        prompt = by_id[s["prompt_id"]]
        messages = prompt.messages or [{"role": "user", "content": prompt.text}]
        response = template.decode(s["response_ids"], skip_special_tokens=True)  # what the rewards saw
        text = template.apply_chat_template([*messages, {"role": "assistant", "content": response}], tokenize=False)
        score = alone(rm_dir, text, False)
        assert s["scores"]["reward_model"] == pytest.approx(score, abs=1e-5)
        assert s["reward"] == pytest.approx(s["scores"]["numeric"] + 0.5 * score, abs=1e-5)
        assert s["extras"] == {"reward_model/truncated": 0.0}


def test_in_a_worker_process_the_reward_model_loads_there_and_scores_the_same(rm_dir):
    """isolate: true (and Ray reward workers, which rebuild rewards the same way): the worker
    loads the model when it rebuilds the reward and gives the in-process scores."""
    prompts, completions = prompts_of("1+1=", "2+2="), ["2", "four"]
    spec = {"fn": "reward_model", "kwargs": {"path": rm_dir}}
    scores = []
    for isolate in (False, True):
        with RewardRunner(build_rewards([{**spec, "isolate": isolate}]), timeout_s=60, workers=1) as runner:
            scores.append([s.scores["reward_model"] for s in runner.score(prompts, completions).samples])
    assert scores[1] == pytest.approx(scores[0], abs=1e-6)
