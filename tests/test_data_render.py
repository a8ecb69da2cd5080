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
