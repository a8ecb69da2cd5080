"""Agents written against an OpenAI-style chat client as environments (`env.name: agent`,
`rollover.envs.agent`): the conversation an agent builds is the episode, its return value the
reward, and whatever it does wrong fails its own episode with the reason."""

from __future__ import annotations

import asyncio
import gc
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollover.config import load_config
from rollover.envs.agent import AgentBuilder
from rollover.envs.base import Action
from rollover.envs.tool_formats import ToolCall, schemas_of
from rollover.loops.sync import train_sync
from rollover.testing import save_tiny_model
from rollover.types import Prompt

EXAMPLE = str(Path(__file__).parents[1] / "examples" / "agent_arith.py")

AGENTS = '''
import asyncio

CANCELLED = []


async def edits_history(client, prompt):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
    reply = await client.chat.completions.create(messages=msgs)
    msgs[0]["content"] = "Be verbose."  # rewriting what the model already saw
    await client.chat.completions.create(messages=msgs + [reply.choices[0].message, {"role": "user", "content": "?"}])


ADD = {"type": "function", "function": {"name": "add", "description": "a + b",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                        "b": {"type": "integer"}}}}}


async def uses_tools(client, prompt):  # OpenAI's function-calling loop
    import json

    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    while True:
        reply = await client.chat.completions.create(messages=msgs, tools=[ADD])
        message = reply.choices[0].message
        if not message.tool_calls:
            return {"reward": float(message.content.strip() == "5"), "finish_stop": float(reply.choices[0].finish_reason == "stop")}
        msgs.append(message)
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            msgs.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                         "content": str(args["a"] + args["b"])})


async def worked_example(client, prompt):
    msgs = [{"role": "user", "content": "1 + 1?"},
            {"role": "assistant", "content": "Adding.", "tool_calls": [
                {"id": "ex", "type": "function", "function": {"name": "add", "arguments": '{"b": 1, "a": 1}'}}]},
            {"role": "tool", "tool_call_id": "ex", "content": "2"}, {"role": "user", "content": "2 + 3?"}]
    await client.chat.completions.create(messages=msgs, tools=[ADD])


async def ends_with_its_own_answer(client, prompt):  # OpenAI's API answers anew after an assistant message
    await client.chat.completions.create(messages=[{"role": "user", "content": "Hi."},
                                                   {"role": "assistant", "content": "Hello."}])
    return 1.0


async def child_exits(client, prompt):  # a task the agent starts raises SystemExit
    async def child():
        raise SystemExit("from a child task")

    asyncio.ensure_future(child())
    await asyncio.sleep(0.05)
    await client.chat.completions.create(messages=[{"role": "user", "content": "Still here?"}])
    return 1.0


async def retries(client, prompt):  # a client that gave up waiting and sent the same call again
    msgs = [{"role": "user", "content": "Hi."}]
    first = asyncio.ensure_future(client.chat.completions.create(messages=msgs))
    await asyncio.sleep(0.05)
    first.cancel()
    reply = await client.chat.completions.create(messages=msgs)
    return float(reply.choices[0].message.content == "Hello.")


async def changes_tools(client, prompt):
    reply = await client.chat.completions.create(messages=[{"role": "user", "content": "Hi."}], tools=[ADD])
    await client.chat.completions.create(messages=[{"role": "user", "content": "Hi."}, reply.choices[0].message,
                                                   {"role": "user", "content": "?"}])


async def never_calls(client, prompt):
    return 1.0


async def says_yes(client, prompt):
    await client.chat.completions.create(messages=[{"role": "user", "content": "Hi."}])
    return "yes"


async def says_nan(client, prompt):
    await client.chat.completions.create(messages=[{"role": "user", "content": "Hi."}])
    return {"reward": float("nan")}


async def calls_twice_at_once(client, prompt):  # (the same call twice is a retry: it waits for the same reply)
    msgs = [{"role": "user", "content": "Hi."}]
    await asyncio.gather(client.chat.completions.create(messages=msgs),
                         client.chat.completions.create(messages=msgs + [{"role": "user", "content": "And?"}]))


async def waits_forever(client, prompt):
    msgs = [{"role": "user", "content": "Hi."}]
    try:
        while True:
            reply = await client.chat.completions.create(messages=msgs)
            msgs += [reply.choices[0].message, {"role": "user", "content": "More."}]
    finally:
        CANCELLED.append(prompt.id)


def not_async(client, prompt):
    return 0.0


async def exits(client, prompt):
    await client.chat.completions.create(messages=[{"role": "user", "content": "Hi."}])
    raise SystemExit("giving up")


async def cancels_itself(client, prompt):
    await client.chat.completions.create(messages=[{"role": "user", "content": "Hi."}])
    raise asyncio.CancelledError()


async def wants_stop(client, prompt):
    await client.chat.completions.create(messages=[{"role": "user", "content": "Hi."}], stop=5)


async def react(client, prompt):  # a ReAct loop: the policy stops where the observation is to come
    msgs = [{"role": "user", "content": "Q"}]
    reply = await client.chat.completions.create(messages=msgs, stop=["Observation:"])
    msgs += [{"role": "assistant", "content": reply.choices[0].message.content},
             {"role": "user", "content": "Observation: 42"}]
    reply = await client.chat.completions.create(messages=msgs, stop="Observation:")
    return float(reply.choices[0].message.content == "Answer: 42")


async def react_via_openai(client, prompt):  # the same through the episode's endpoint, with OpenAI's SDK
    from openai import AsyncOpenAI

    api = AsyncOpenAI(base_url=client.base_url, api_key="-", max_retries=0)
    msgs = [{"role": "user", "content": "Q"}]
    reply = await api.chat.completions.create(model="policy", messages=msgs, stop=["Observation:"])
    msgs += [{"role": "assistant", "content": reply.choices[0].message.content},
             {"role": "user", "content": "Observation: 42"}]
    reply = await api.chat.completions.create(model="policy", messages=msgs, stop="Observation:")
    return float(reply.choices[0].message.content == "Answer: 42")


async def raises(client, prompt):
    await client.chat.completions.create(messages=[{"role": "user", "content": "Hi."}])
    raise KeyError("no such tool")


async def loops_until_cut(client, prompt, record):
    msgs = [{"role": "user", "content": prompt.text}]
    try:
        while True:
            reply = await client.chat.completions.create(messages=msgs)
            msgs += [reply.choices[0].message, {"role": "user", "content": "Go on."}]
    except asyncio.CancelledError:
        with open(record, "a") as f:
            f.write(prompt.id + " ")
        raise


async def via_openai(client, prompt):  # the conversation through the episode's endpoint, with OpenAI's SDK
    from openai import AsyncOpenAI

    api = AsyncOpenAI(base_url=client.base_url, api_key="-", max_retries=0)
    msgs = [{"role": "user", "content": "Hi."}]
    reply = await api.chat.completions.create(model="policy", messages=msgs)
    msgs += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "Again."}]
    reply = await api.chat.completions.create(model="policy", messages=msgs)
    return {"reward": float(len(reply.choices[0].message.content)), "tokens": float(reply.usage.completion_tokens)}


async def tools_via_openai(client, prompt):  # OpenAI's SDK parses the tool calls out of the endpoint's JSON
    from openai import AsyncOpenAI

    api = AsyncOpenAI(base_url=client.base_url, api_key="-", max_retries=0)
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    reply = await api.chat.completions.create(model="policy", messages=msgs, tools=[ADD])
    message = reply.choices[0].message
    msgs += [message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "5"}]
    reply = await api.chat.completions.create(model="policy", messages=msgs, tools=[ADD])
    return float(reply.choices[0].message.content == "5")


PROGRAM = """
import json, sys, urllib.request
url, msgs = sys.argv[1] + "/chat/completions", [{"role": "user", "content": "Count."}]
for _ in range(2):
    req = urllib.request.Request(url, json.dumps({"model": "p", "messages": msgs}).encode(),
                                 {"Content-Type": "application/json"})
    text = json.load(urllib.request.urlopen(req))["choices"][0]["message"]["content"]
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "More."}]
print(len(msgs))
"""


async def runs_a_program(client, prompt):  # another process, given only the URL
    import sys

    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", PROGRAM, client.base_url,
                                                stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    return float(out)


async def streams(client, prompt):
    import json, urllib.error, urllib.request

    body = json.dumps({"messages": [{"role": "user", "content": "Hi."}], "stream": True}).encode()
    try:
        await asyncio.to_thread(urllib.request.urlopen, urllib.request.Request(client.base_url + "/chat/completions", body))
    except urllib.error.HTTPError as e:
        return {"reward": 0.0, "status": float(e.code)}
'''


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    path = tmp_path_factory.mktemp("agents") / "agents.py"
    path.write_text(AGENTS)
    return str(path)


def act(text: str, finish: str = "stop") -> Action:
    return Action(text=text, token_ids=tuple(range(len(text))), finish=finish)


def test_an_agents_conversation_is_the_episode_and_its_return_the_reward():
    """Each call on its own event loop, as `env.inline` makes them: the agent keeps running on
    its own loop between them."""
    env = AgentBuilder(f"{EXAMPLE}:retry_agent", attempt_penalty=0.3).make_one(
        Prompt(id="p", text="What is 1 + 2?", answer=3), 1, 0)
    opening = asyncio.run(env.initial_observation())
    assert opening == [{"role": "user", "content": "What is 1 + 2? Answer with just the number."}]
    wrong = asyncio.run(env.step(act("It is 5.")))
    assert wrong.messages == [{"role": "user", "content": "That is not right. Try again."}]
    assert not wrong.done and wrong.reward == 0.0
    right = asyncio.run(env.step(act(" 3\n")))
    assert right.done and right.reward == pytest.approx(0.7) and right.info == {"attempts": 2}


def test_an_agents_call_ending_in_an_assistant_message_is_answered_in_a_new_turn(agents):
    """As OpenAI's chat API does (an environment's own opening ending so is continued, a prefill)."""
    from rollover.envs.base import Opening
    from rollover.envs.render import ChatRenderer
    from rollover.testing import char_tokenizer

    env = AgentBuilder(f"{agents}:ends_with_its_own_answer").make_one(Prompt(id="p", text="x"), 1, 0)
    opening = asyncio.run(env.initial_observation())
    assert isinstance(opening, Opening) and opening.prefill is False
    tok = char_tokenizer()
    ids = ChatRenderer(tok).initial(opening.messages, opening.prefill)
    assert tok.decode(ids).endswith("<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>assistant\n")
    assert asyncio.run(env.step(act("Hi again."))).reward == 1.0


@pytest.mark.parametrize("name, where, message", [
    ("edits_history", "step", "call 2: message 0 differs from the conversation so far"),
    ("changes_tools", "step", "call 2: tools= differs from the first call's"),
    ("never_calls", "open", "returned 1.0 without calling chat.completions.create"),
    ("says_yes", "step", "returned 'yes': expected a number"),
    ("says_nan", "step", "the agent returned the reward nan: a finite number is needed"),
    ("calls_twice_at_once", "step", "a call is already waiting for the policy"),
    ("wants_stop", "open", "call 1: stop=5: a string or a list of up to 4 non-empty strings"),
    ("exits", "step", "the agent raised SystemExit: giving up"),
    ("cancels_itself", "step", "the agent ended with a CancelledError"),
])
def test_what_an_agent_does_wrong_fails_its_episode_with_the_reason(agents, name, where, message):
    env = AgentBuilder(f"{agents}:{name}").make_one(Prompt(id=name, text="x"), 1, 0)
    if where == "step":
        assert asyncio.run(env.initial_observation())[-1] == {"role": "user", "content": "Hi."}
    with pytest.raises((ValueError, RuntimeError), match=message):
        asyncio.run(env.initial_observation() if where == "open" else env.step(act("Hello.")))


@pytest.mark.parametrize("name", ["react", "react_via_openai"])
def test_an_agents_stop_strings_end_the_turn_and_stay_out_of_its_reply(agents, name):
    """stop= (a ReAct agent's, in process or through the endpoint with OpenAI's SDK): the turn
    answering the call stops there (the episode's next request carries it, beside
    rollout.stop's), and the reply's content leaves it out, as OpenAI's does."""
    from rollover.envs.base import Opening

    if name == "react_via_openai":
        pytest.importorskip("openai")
    env = AgentBuilder(f"{agents}:{name}").make_one(Prompt(id="r", text="x"), 1, 0)
    opening = asyncio.run(env.initial_observation())
    assert isinstance(opening, Opening) and opening.stop == ("Observation:",)
    first = asyncio.run(env.step(act("Thought: look it up.\nObservation:")))
    assert first.stop == ("Observation:",) and first.messages == [{"role": "user", "content": "Observation: 42"}]
    assert asyncio.run(env.step(act("Answer: 42"))).reward == 1.0


@pytest.mark.parametrize("name, reward", [("via_openai", 7.0), ("runs_a_program", 5.0)])
def test_a_program_talks_to_its_episode_through_an_openai_compatible_endpoint(agents, name, reward):
    """`client.base_url`: OpenAI's own SDK on the agent's loop, or another process given only
    the URL, drive the same episode as the in-process client."""
    if name == "via_openai":
        pytest.importorskip("openai")  # (installed with the vllm extras)
    env = AgentBuilder(f"{agents}:{name}").make_one(Prompt(id=name, text="x"), 1, 0)
    first = asyncio.run(env.initial_observation())
    second = asyncio.run(env.step(act("Hello.")))
    assert len(first) == 1 and first[0]["role"] == "user"
    assert not second.done and second.messages[0]["role"] == "user"
    last = asyncio.run(env.step(act("Bye now")))
    assert last.done and last.reward == reward


def test_a_request_the_endpoint_cannot_serve_is_answered_with_the_reason_and_fails_the_episode(agents):
    import urllib.error
    import urllib.request

    env = AgentBuilder(f"{agents}:streams").make_one(Prompt(id="s", text="x"), 1, 0)
    with pytest.raises(ValueError, match="stream not supported"):
        asyncio.run(env.initial_observation())
    from rollover.envs import agent

    base = f"http://127.0.0.1:{agent._SERVER.port}/episodes/{env.token}/v1"
    for method, path, status in (("POST", "/chat/completions", 410), ("GET", "/chat/completions", 405),
                                 ("POST", "/nowhere", 404)):
        req = urllib.request.Request(base + path, b"{}" if method == "POST" else None, method=method)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=5)
        assert info.value.code == status, (method, path)  # (the episode is over: its endpoint answers 410)


def test_tool_calls_come_back_as_openai_tool_calls_and_results_go_in_as_tool_messages(agents):
    """tools=: the opening describes them to the model (a system message), a reply's
    `<tool_call>` blocks come back as `tool_calls`, the agent's tool messages are the next
    insertion, and its final answer ends the episode."""
    env = AgentBuilder(f"{agents}:uses_tools").make_one(Prompt(id="t", text="x"), 1, 0)
    opening = asyncio.run(env.initial_observation())
    assert [m["role"] for m in opening] == ["system", "user"] and '"name": "add"' in opening[0]["content"]
    result = asyncio.run(env.step(act('Let me add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')))
    assert not result.done
    assert [(m["role"], m["content"], m["name"]) for m in result.messages] == [("tool", "5", "add")]
    final = asyncio.run(env.step(act(" 5")))
    assert final.done and final.reward == 1.0 and final.info == {"finish_stop": 1.0}


def test_a_tool_using_agent_replays_into_a_fresh_one_and_earlier_tool_calls_render_as_the_model_writes_them(agents):
    """Tool-call ids are the same in a replay (a resumed checkpoint's), and an assistant message
    with tool calls that the agent supplies itself (a worked example) reaches the chat template
    as `<tool_call>` text, not as objects a template might drop."""
    from rollover.envs.base import Action as A, Turn
    from rollover.envs.episode import LiveEpisode
    from rollover.envs.render import ChatRenderer
    from rollover.testing import char_tokenizer
    from rollover.types import SamplingParams

    builder = AgentBuilder(f"{agents}:uses_tools")
    env = builder.make_one(Prompt(id="t", text="x"), 1, 0)
    ep = LiveEpisode("g/0", SamplingParams(max_new_tokens=40), max_turns=4, max_total_tokens=4000, env=env)
    renderer = ChatRenderer(char_tokenizer())
    ep.opened(asyncio.run(env.initial_observation()), None, 0.0, renderer)
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    ids = renderer.tokenizer.encode(call, add_special_tokens=False)
    ep.traj.tokens_T += ids
    ep.traj.turns.append(Turn(len(ep.traj.tokens_T) - len(ids), len(ep.traj.tokens_T), "stop", call))
    turn = ep.traj.turns[-1]
    result = asyncio.run(env.step(A(call, tuple(ids), "stop")))
    turn.messages, turn.reward = list(result.messages), result.reward
    ep.phase = "generate"
    asyncio.run(ep.replay(builder.make_one(Prompt(id="t", text="x"), 1, 0), timeout_s=5))  # raises on any difference

    worked = AgentBuilder(f"{agents}:worked_example").make_one(Prompt(id="w", text="x"), 1, 0)
    opening = asyncio.run(worked.initial_observation())
    assert opening[2] == {"role": "assistant", "content": 'Adding.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'}
    assert "<tool_call>" in renderer._text(opening, add_generation_prompt=True)


@pytest.mark.parametrize("fmt, reply", [
    ("mistral", '[{"name": "add", "arguments": {"a": 2, "b": 3}}]'),
    ("llama3_json", '{"name": "add", "parameters": {"a": 2, "b": 3}}'),
    ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n</parameter>\n"
                    "</function>\n</tool_call>"),  # the values typed by the tool's schema: 2 + 3, not "2" + "3"
])
def test_tool_calls_in_llama3_mistral_and_qwen3_coder_formats(agents, fmt, reply):
    """env.options.tool_format: the tools are described in the format's words, the model's calls
    are read in it, and an assistant message the agent supplies is written as the model writes it."""
    env = AgentBuilder(f"{agents}:uses_tools", tool_format=fmt).make_one(Prompt(id="t", text="x"), 1, 0)
    opening = asyncio.run(env.initial_observation())
    assert ("<tool_call>" in opening[0]["content"]) == ("<function=" in opening[0]["content"]) == (fmt == "qwen3_coder")
    assert '"name": "add"' in opening[0]["content"]
    result = asyncio.run(env.step(act(reply)))
    assert [(m["role"], m["content"], m["name"]) for m in result.messages] == [("tool", "5", "add")]
    worked = AgentBuilder(f"{agents}:worked_example", tool_format=fmt).make_one(Prompt(id="w", text="x"), 1, 0)
    assistant = asyncio.run(worked.initial_observation())[2]["content"]
    assert ("<tool_call>" in assistant) == (fmt == "qwen3_coder")
    integers = schemas_of([{"name": "add", "parameters": {"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}])
    assert env.format.parse(assistant.removeprefix("Adding.\n"), integers).calls == [ToolCall("add", {"a": 1, "b": 1})]
    with pytest.raises(ValueError, match="env.options.tool_format must be one of hermes, llama3_json, mistral, qwen3_coder, glm45"):
        AgentBuilder(f"{agents}:uses_tools", tool_format="xml")


def test_a_call_retried_while_it_waits_gets_the_same_reply(agents):
    env = AgentBuilder(f"{agents}:retries").make_one(Prompt(id="r", text="x"), 1, 0)
    asyncio.run(env.initial_observation())
    time.sleep(0.3)  # the policy takes its time: the agent gives up on its first call and sends it again
    assert asyncio.run(env.step(act("Hello."))).reward == 1.0


def test_the_agents_loop_outlives_a_system_exit_and_the_endpoint_outlives_bad_http(agents):
    import socket

    from rollover.envs import agent

    env = AgentBuilder(f"{agents}:child_exits").make_one(Prompt(id="c", text="x"), 1, 0)
    assert asyncio.run(env.initial_observation())[0]["content"] == "Still here?"
    assert asyncio.run(env.step(act("Yes."))).reward == 1.0
    port = agent._SERVER.port
    for raw, status in ((b"POST /episodes/x/v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 411),
                        (b"POST /episodes/x/v1/chat/completions HTTP/1.1\r\nContent-Length: 12abc\r\n\r\n", 400)):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(raw)
            assert sock.recv(4096).split(b" ")[1] == str(status).encode()
    healthy = AgentBuilder(f"{EXAMPLE}:retry_agent").make_one(Prompt(id="h", text="1 + 1 =", answer=2), 1, 0)
    asyncio.run(healthy.initial_observation())
    assert asyncio.run(healthy.step(act("2"))).reward == 1.0


def test_tools_in_the_chat_templates_own_words(agents):
    """tools_in: template hands the tools to the chat template (an `Opening`), for models trained
    on its format; a template that ignores them fails the episode rather than train a model
    never shown its tools."""
    from rollover.envs.episode import LiveEpisode
    from rollover.envs.render import ChatRenderer
    from rollover.testing import CHAT_TEMPLATE, char_tokenizer
    from rollover.types import SamplingParams

    with_tools = char_tokenizer()
    with_tools.chat_template = ("{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t['function']['name'] }} "
                                "{% endfor %}<|im_end|>\n{% endif %}" + CHAT_TEMPLATE)
    for tokenizer, works in ((with_tools, True), (char_tokenizer(), False)):
        env = AgentBuilder(f"{agents}:uses_tools", tools_in="template").make_one(Prompt(id="t", text="x"), 1, 0)
        ep = LiveEpisode("g/0", SamplingParams(max_new_tokens=8), max_turns=4, max_total_tokens=4000, env=env)
        opening = asyncio.run(env.initial_observation())
        assert [t["function"]["name"] for t in opening.template_kwargs["tools"]] == ["add"]
        assert opening.messages[0]["role"] == "user"  # no description of its own
        ep.opened(opening, None, 0.0, ChatRenderer(tokenizer))
        if works:
            assert ep.phase == "generate" and "Tools: add" in tokenizer.decode(ep.traj.tokens_T)
        else:
            assert ep.finished and "the chat template ignores tools=" in ep.traj.error.message


def test_tool_calls_through_the_endpoint_with_openais_sdk(agents):
    pytest.importorskip("openai")
    env = AgentBuilder(f"{agents}:tools_via_openai").make_one(Prompt(id="o", text="x"), 1, 0)
    asyncio.run(env.initial_observation())
    result = asyncio.run(env.step(act('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')))
    assert [(m["role"], m["content"]) for m in result.messages] == [("tool", "5")]
    assert asyncio.run(env.step(act("5"))).reward == 1.0


def test_an_agent_must_be_async_importable_and_take_its_options(agents):
    with pytest.raises(ValueError, match="must be an async function"):
        AgentBuilder(f"{agents}:not_async")
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        AgentBuilder(f"{agents}:nope")
    with pytest.raises(ValueError, match="env.options for the agent .*unexpected keyword argument 'max_attemps'"):
        AgentBuilder(f"{EXAMPLE}:retry_agent", max_attemps=3)


def test_after_an_agent_fails_the_next_one_runs_and_the_failed_one_is_let_go(agents):
    """SystemExit in one agent does not stop the agents' loop; an agent that raised does not
    keep its environment alive (its traceback holds the environment's frames)."""
    import weakref

    env = AgentBuilder(f"{agents}:exits").make_one(Prompt(id="e", text="x"), 1, 0)
    asyncio.run(env.initial_observation())
    with pytest.raises(RuntimeError, match="SystemExit"):
        asyncio.run(env.step(act("Hi.")))
    failed = AgentBuilder(f"{agents}:raises").make_one(Prompt(id="r", text="x"), 1, 0)
    asyncio.run(failed.initial_observation())
    with pytest.raises(KeyError, match="no such tool"):
        asyncio.run(failed.step(act("Hi.")))
    from rollover.envs import agent

    gone, token = weakref.ref(failed), failed.token
    del failed
    deadline = time.monotonic() + 5  # the episode's endpoint is removed on the agents' loop, soon after
    while token in agent._SERVER.channels and time.monotonic() < deadline:
        time.sleep(0.01)
    gc.collect()
    assert gone() is None
    healthy = AgentBuilder(f"{EXAMPLE}:retry_agent").make_one(Prompt(id="h", text="1 + 1 =", answer=2), 1, 0)
    asyncio.run(healthy.initial_observation())
    assert asyncio.run(healthy.step(act("2"))).reward == 1.0


def test_an_episode_cut_short_cancels_its_agent(agents):
    """env.max_turns ends the episode while the agent waits for a reply: once the episode lets
    its environment go, the agent is cancelled."""
    builder = AgentBuilder(f"{agents}:waits_forever")
    cancelled = builder.agent().__globals__["CANCELLED"]  # the agent's module as the builder loaded it
    env = builder.make_one(Prompt(id="cut", text="x"), 1, 0)
    asyncio.run(env.initial_observation())
    assert not asyncio.run(env.step(act("Hi."))).done
    del env
    gc.collect()
    deadline = time.monotonic() + 5
    while "cut" not in cancelled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cancelled == ["cut"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama", seed=21))


def agent_cfg(model_dir, run_dir, **over):
    base = {
        "device": "cpu", "model": model_dir, "run_dir": str(run_dir), "steps": 2, "seed": 3, "resume": "auto",
        "data.train": "gen:arithmetic?n=40", "data.eval_size": 2, "data.max_prompt_tokens": 128,
        "env.name": "agent", "env.options": {"fn": f"{EXAMPLE}:retry_agent", "max_attempts": 2},
        "env.max_turns": 2, "env.max_total_tokens": 300, "rollout.prompts_per_step": 2,
        "rollout.samples_per_prompt": 2, "rollout.max_new_tokens": 6, "rollout.max_rows": 8, "train.lr": 1e-3,
        "eval.every": 0, "eval.at_start": False, "checkpoint.every": 1, "logging.progress": False,
        "logging.tensorboard": False,
    }
    base.update(over)
    return load_config(**base)


def rows(run_dir):
    return [r for r in map(json.loads, open(run_dir / "metrics.jsonl")) if r["kind"] == "train"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_trains_on_the_agents_conversations(model_dir, tmp_path, mode):
    from rollover.loops.async_ import train_async

    over = {"mode": "async", "async.max_staleness": 1} if mode == "async" else {}
    (train_async if mode == "async" else train_sync)(agent_cfg(model_dir, tmp_path, **over))
    got = rows(tmp_path)
    assert [r["step"] for r in got] == [1, 2]
    # (async mode counts episodes as its rollout service finishes them, in whichever step's row)
    assert sum(r.get("rollout/env/episodes", 0) for r in got) >= 8
    assert sum(r.get("rollout/env/failed", 0) for r in got) == 0
    counted = [r for r in got if r.get("rollout/env/episodes")]
    assert all(1 <= r["rollout/env/info/attempts"] <= 2 for r in counted)  # the agent's own numbers are reported
    assert all(r["rollout/env/turns_mean"] > 1 for r in counted)  # the tiny model answers wrong: the agent asks again
    if mode == "sync":
        assert all(r["actor/loss_tokens"] == r["rollout/generated_tokens"] for r in got)  # its feedback is not trained
        # step 1 trains on the engine's own samples: nothing re-tokenised between turns
        assert got[0]["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-4)


def test_episodes_cut_by_the_turn_limit_cancel_their_agents_during_the_run(model_dir, tmp_path, agents):
    record = tmp_path / "cancelled.txt"
    cfg = agent_cfg(model_dir, tmp_path / "run", steps=1, **{
        "env.options": {"fn": f"{agents}:loops_until_cut", "record": str(record)}, "env.max_turns": 2,
        "checkpoint.every": 0})
    train_sync(cfg)
    assert rows(tmp_path / "run")[0]["rollout/env/finish_max_turns"] == 1.0  # every episode was cut
    evaluated = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if r["kind"] == "eval"]
    episodes = 4 + sum(r["eval/samples"] for r in evaluated)  # the final evaluation's are cut too
    deadline = time.monotonic() + 5
    while (not record.exists() or len(record.read_text().split()) < episodes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(record.read_text().split()) == episodes  # each cut episode's agent was cancelled


def test_april_carries_agents_across_steps_and_resumes_exactly(model_dir, tmp_path):
    """APRIL stops mid-episode and carries live episodes in its checkpoint; a resumed run
    replays their turns into fresh agents and ends with the straight run's weights."""
    over = {"env.inline": True, "partial_rollout.enabled": True, "partial_rollout.oversample": 4.0,
            "rollout.samples_per_prompt": 4, "rollout.max_rows": 32, "checkpoint.keep": 3}
    train_sync(agent_cfg(model_dir, tmp_path / "straight", steps=3, **over))
    train_sync(agent_cfg(model_dir, tmp_path / "resumed", steps=1, **over))
    state = torch.load(tmp_path / "resumed" / "checkpoints" / "step_000001" / "state.pt", weights_only=False)
    carried = [ep for g in state["collector"]["buffer"] for ep in (g.episodes or {}).values()]
    assert any(not ep.finished and ep.traj is not None and ep.traj.turns for ep in carried)  # mid-conversation
    train_sync(agent_cfg(model_dir, tmp_path / "resumed", steps=3, **over))
    a = load_file(str(tmp_path / "straight" / "checkpoints" / "step_000003" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "checkpoints" / "step_000003" / "model" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["reward/mean"] for r in rows(tmp_path / "straight")] == [r["reward/mean"] for r in rows(tmp_path / "resumed")]
