"""Chat-template rendering with the character tokenizer."""

import pytest

from rollover.data import BOXED_INSTRUCTION, render_messages, render_prompt
from rollover.testing import char_tokenizer
from rollover.types import Prompt


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def test_text_prompt_becomes_one_user_turn(tok):
    ids = render_prompt(tok, Prompt(id="a", text="2+2?"))
    assert tok.decode(ids) == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    # One id per character, specials included: no BOS added on top of the template.
    assert len(ids) == len("user\n2+2?") + 1 + 1 + 1 + len("assistant\n") + 1


def test_a_prompt_ending_in_an_assistant_message_is_continued_as_trl_does(tok):
    prompt = Prompt(id="a", messages=[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is"}])
    assert tok.decode(render_prompt(tok, prompt)) == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\nIt is"


def test_system_prompt_and_instruction(tok):
    ids = render_prompt(
        tok, Prompt(id="a", text="2+2?"), system_prompt="Be brief.", instruction=BOXED_INSTRUCTION
    )
    assert tok.decode(ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?\n\nPut the final answer in \\boxed{}.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_prompt_instruction_goes_to_the_last_user_turn(tok):
    prompt = Prompt(
        id="a",
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "1+1?"},
        ],
    )
    messages = render_messages(prompt, instruction="Answer.")
    assert [m["content"] for m in messages] == ["hi", "yo", "1+1?\n\nAnswer."]
    assert prompt.messages[2]["content"] == "1+1?"  # the prompt itself is not modified
    text = tok.decode(render_prompt(tok, prompt))
    assert text.count("<|im_start|>") == 4 and text.endswith("<|im_start|>assistant\n")


def test_system_prompt_conflicting_with_data_is_refused():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    prompt = Prompt(id="a", messages=messages)
    with pytest.raises(ValueError, match="already has a system message"):
        render_messages(prompt, system_prompt="other")


def test_without_chat_template(tok):
    ids = render_prompt(tok, Prompt(id="a", text="3+5="), use_chat_template=False)
    assert tok.decode(ids) == "3+5="
    chat = Prompt(id="a", messages=[{"role": "user", "content": "q"}])
    with pytest.raises(ValueError, match="chat form"):
        render_prompt(tok, chat, use_chat_template=False)


# --- the start-up length check (`_render_all`, and through `build_run`) -------------------------
# The char tokenizer gives one id per character, and the template adds 19 ids around a text
# prompt: "<|im_start|>user\n" ... "<|im_end|>\n<|im_start|>assistant\n".
TEMPLATE_IDS = 1 + len("user\n") + 1 + 1 + 1 + len("assistant\n")


def length_cfg(tmp_path, on_bad_row, max_prompt_tokens, **over):
    from rollover.config import load_config

    return load_config(**{"model": "unused", "run_dir": str(tmp_path / "run"), "data.train": "unused",
                          "data.on_bad_row": on_bad_row, "data.max_prompt_tokens": max_prompt_tokens,
                          "data.chat_template": True, **over})


def prompts_of_lengths(prefix, lengths):
    return [Prompt(id=f"{prefix}:{i}", text="x" * n, answer="1") for i, n in enumerate(lengths)]


def test_render_all_raise_names_the_over_long_prompt(tok, tmp_path):
    from rollover.config import ConfigError
    from rollover.loops.prompts import _render_all

    train = prompts_of_lengths("t", [5, 30, 6])
    cfg = length_cfg(tmp_path, "raise", TEMPLATE_IDS + 10)
    with pytest.raises(ConfigError, match=rf"prompt 't:1' renders to {TEMPLATE_IDS + 30} tokens, more than "
                                          rf"data.max_prompt_tokens={TEMPLATE_IDS + 10}"):
        _render_all(cfg, tok, train, [])
    ids, kept, held, dropped = _render_all(length_cfg(tmp_path, "raise", TEMPLATE_IDS + 30), tok, train, [])
    assert [p.id for p in kept] == ["t:0", "t:1", "t:2"] and dropped == 0  # the limit is inclusive
    assert len(ids["t:1"]) == TEMPLATE_IDS + 30


def test_a_tokenizer_without_a_chat_template_names_data_chat_template(tmp_path):
    from rollover.config import ConfigError
    from rollover.loops.prompts import _render_all

    bare = char_tokenizer()
    bare.chat_template = None  # a base model's
    with pytest.raises(ConfigError, match="its tokenizer has no chat template; data.chat_template=false encodes"):
        _render_all(length_cfg(tmp_path, "raise", 64), bare, prompts_of_lengths("t", [5]), [])
    cfg = length_cfg(tmp_path, "raise", 64).model_copy(update={"data": length_cfg(tmp_path, "raise", 64).data.model_copy(
        update={"chat_template": False})})
    ids, kept, _, _ = _render_all(cfg, bare, prompts_of_lengths("t", [5]), [])
    assert [p.id for p in kept] == ["t:0"] and len(ids["t:0"]) >= 5

    class Processor:  # prompts with images render through the processor's template (legacy repos hold it only)
        def render(self, p):
            return [5, 6, 7], None

    with_images = [Prompt(id="i", text="which colour?", images=["a.png"])]
    ids, kept, _, _ = _render_all(length_cfg(tmp_path, "raise", 64), bare, with_images, [], Processor())
    assert ids == {"i": [5, 6, 7]}


def test_render_all_skip_drops_over_long_train_and_eval_prompts(tok, tmp_path, caplog):
    from rollover.loops.prompts import _render_all

    train = prompts_of_lengths("t", [5, 30, 6, 11])
    held_out = prompts_of_lengths("e", [40, 3])
    cfg = length_cfg(tmp_path, "skip", TEMPLATE_IDS + 10)
    with caplog.at_level("WARNING", logger="rollover"):
        ids, kept, held, dropped = _render_all(cfg, tok, train, held_out)
    assert [p.id for p in kept] == ["t:0", "t:2"]
    assert [p.id for p in held] == ["e:1"]
    assert dropped == 3
    assert set(ids) == {"t:0", "t:2", "e:1"}  # nothing rendered is left for a dropped prompt
    assert f"skipped 3 prompts longer than data.max_prompt_tokens={TEMPLATE_IDS + 10}" in caplog.text
    assert f"t:1 ({TEMPLATE_IDS + 30} tokens)" in caplog.text and f"e:0 ({TEMPLATE_IDS + 40} tokens)" in caplog.text


def test_render_all_skip_with_no_train_prompt_left_is_an_error(tok, tmp_path):
    from rollover.config import ConfigError
    from rollover.loops.prompts import _render_all

    limit = TEMPLATE_IDS + 5
    with pytest.raises(ConfigError, match=rf"no training prompt fits in data.max_prompt_tokens={limit} \(2 skipped"):
        _render_all(length_cfg(tmp_path, "skip", limit), tok, prompts_of_lengths("t", [9, 8]),
                    prompts_of_lengths("e", [1]))


def test_render_all_refuses_one_id_for_two_different_prompts(tok, tmp_path):
    from rollover.config import ConfigError
    from rollover.loops.prompts import _render_all

    cfg = length_cfg(tmp_path, "raise", 100)
    same = prompts_of_lengths("d", [3, 4])
    ids, kept, held, _ = _render_all(cfg, tok, same, list(same))  # eval = train file: fine
    assert len(kept) == len(held) == 2
    with pytest.raises(ConfigError, match="prompt id 'd:1' names two different prompts"):
        _render_all(cfg, tok, same, prompts_of_lengths("d", [3, 5]))


def test_build_run_skips_over_long_prompts_before_the_iterator(tmp_path):
    import json

    from rollover.loops.build import build_run
    from rollover.testing import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "m", "llama", seed=1)
    lengths = [5, 30, 6, 11, 31, 7, 8, 9]  # three too long at max_prompt_tokens = TEMPLATE_IDS + 10
    train = tmp_path / "train.jsonl"
    rows = [{"prompt": "x" * n, "answer": "1"} for n in lengths] + [{"prompt": 3, "answer": "1"}]  # + a bad row
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held_out = tmp_path / "held.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": "y" * n, "answer": "1"}) + "\n" for n in (2, 50, 4)))
    cfg = length_cfg(tmp_path, "skip", TEMPLATE_IDS + 10, **{
        "model": str(model_dir), "data.train": str(train), "data.eval": str(held_out), "data.eval_size": 3,
        "rollout.max_new_tokens": 4, "reward.functions": ["numeric"], "logging.progress": False,
        "logging.tensorboard": False})
    run = build_run(cfg)
    try:
        assert run.data_skipped == 1 + 3 + 1  # the bad row, three long train prompts, one long eval prompt
        assert [p.id for p in run.eval_prompts] == ["held:0", "held:2"]
        served = {p.id for p in run.train_iter.next_batch(3 * 5)}  # three epochs of the five kept
        assert served == {"train:0", "train:2", "train:5", "train:6", "train:7"}
        assert all(len(run.prompt_ids[i]) <= TEMPLATE_IDS + 10 for i in served)
    finally:
        run.close()


def test_chat_template_arguments_reach_the_template(tmp_path):
    """data.chat_template_kwargs (Qwen3's enable_thinking, say): prompts are rendered with them,
    and so is every turn of an episode."""
    from rollover.envs.render import ChatRenderer
    from rollover.loops.prompts import _render_all

    tok = char_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n"
                         "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")
    plain = tok.decode(render_prompt(tok, Prompt(id="a", text="1+1=")))
    quiet = tok.decode(render_prompt(tok, Prompt(id="a", text="1+1="), template_kwargs={"enable_thinking": False}))
    assert quiet == plain + "<think></think>"
    cfg = length_cfg(tmp_path, "raise", 200, **{"data.chat_template_kwargs": {"enable_thinking": False}})
    ids, _, _, _ = _render_all(cfg, tok, [Prompt(id="a", text="1+1=")], [])
    assert tok.decode(ids["a"]).endswith("assistant\n<think></think>")
    renderer = ChatRenderer(tok, **cfg.data.chat_template_kwargs)
    assert tok.decode(renderer.initial([{"role": "user", "content": "hi"}])).endswith("<think></think>")
    with pytest.raises(ValueError, match="chat template arguments need use_chat_template"):
        render_prompt(tok, Prompt(id="a", text="1+1="), use_chat_template=False, template_kwargs={"enable_thinking": False})


def test_a_chat_template_argument_the_template_never_reads_is_named(tmp_path, caplog):
    """A misspelt data.chat_template_kwargs key renders every prompt as if it were not given:
    each key the template never reads is warned about, with the name it likely meant; a key the
    template reads, or a template this cannot parse, gives no warning."""
    import logging

    from rollover.loops.prompts import _render_all

    tok = char_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    kwargs = {"enable_thinkng": False, "enable_thinking": False, "persona": "x"}
    cfg = length_cfg(tmp_path, "raise", 200, **{"data.chat_template_kwargs": kwargs})
    with caplog.at_level(logging.WARNING, logger="rollover"):
        _render_all(cfg, tok, [Prompt(id="a", text="1+1=")], [])
    said = [r.getMessage() for r in caplog.records if "chat_template_kwargs" in r.getMessage()]
    assert len(said) == 2, said
    assert said[0].startswith("data.chat_template_kwargs.enable_thinkng: the chat template of model=")
    assert said[0].endswith("never reads 'enable_thinkng', so it changes nothing (did you mean 'enable_thinking'?)")
    assert said[1].startswith("data.chat_template_kwargs.persona:") and "did you mean" not in said[1]
    caplog.clear()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %"  # cut short: not parsed here
    with caplog.at_level(logging.WARNING, logger="rollover"):
        from rollover.loops.prompts import _warn_unread_template_kwargs

        _warn_unread_template_kwargs(cfg, tok)
    assert "chat_template_kwargs" not in caplog.text


@pytest.mark.parametrize("key", ["chat_template", "return_assistant_tokens_mask", "tokenize", "max_length"])
def test_chat_template_kwargs_refuse_apply_chat_templates_own_arguments(key):
    """data.chat_template_kwargs are template variables: an argument of apply_chat_template (a
    template in `chat_template` replaced every prompt, and was said to change nothing) is refused."""
    from rollover.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=rf"\['{key}'\] are arguments of apply_chat_template that rollover sets itself"):
        load_config(**{"data.chat_template_kwargs": {key: "x", "enable_thinking": False}})
    load_config(**{"data.chat_template_kwargs": {"tools": [], "enable_thinking": False}})  # variables pass


def test_a_row_that_does_not_render_is_a_bad_row_named_by_its_prompt(tmp_path, caplog):
    """A role the template refuses, or a row whose own system message meets data.system_prompt:
    an error naming the prompt, or under data.on_bad_row=skip skipped and counted, the rest kept."""
    import logging

    from rollover.config import ConfigError
    from rollover.loops.prompts import _render_all

    tok = char_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                         "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}{{ m['content'] }}{% endfor %}")
    train = [Prompt(id="d:0", text="1+1="), Prompt(id="d:1", messages=[{"role": "human", "content": "2+2="}]),
             Prompt(id="d:2", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "3+3="}])]
    with pytest.raises(ConfigError, match=r"prompt 'd:1' does not render: TemplateError: Unknown role: human; fix or drop"):
        _render_all(length_cfg(tmp_path, "raise", 64), tok, train, [])
    with caplog.at_level(logging.WARNING, logger="rollover"):
        ids, kept, _, dropped = _render_all(length_cfg(tmp_path, "skip", 64, **{"data.system_prompt": "terse"}),
                                            tok, train, [])
    assert [p.id for p in kept] == ["d:0"] and dropped == 2 and set(ids) == {"d:0"}
    assert "skipped 2 prompts that do not render" in caplog.text and "prompt 'd:2' does not render" in caplog.text
