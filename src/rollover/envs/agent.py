"""Agents written against an OpenAI-style chat client, trained as environments.

Many agents are already code that calls a chat-completions API: it builds a conversation,
calls `client.chat.completions.create(messages=...)`, reads the reply, runs a tool or a check,
appends both to the conversation and calls again, and finally knows how well it did. `env.name:
agent` trains such code unchanged: each episode runs

    async def my_agent(client, prompt, **options) -> float | dict

with a `client` whose `chat.completions.create` is answered by the policy being trained, and
whose `base_url` serves the same episode as an OpenAI-compatible endpoint for a program the
agent runs (`rollover.envs.agent_server`). The episode is the agent's one conversation: its
first call's messages are the opening, each later call must repeat the conversation so far with
the model's reply appended as an assistant message (the content as returned, surrounding
whitespace aside), followed by the messages the agent adds (tool results, feedback, a next
question); the value it returns is the episode's reward (a number, or a dict with "reward" and
other numbers to report).

How it maps onto `Env`: `initial_observation()` starts the agent and returns the messages of
its first call; `step(action)` answers the pending call with the turn's text and returns the
messages the next call adds, or the reward once the agent returns. Agents run on one event loop
of their own (a thread per process, shared by the process's agents: an agent must not block it;
blocking work goes through `asyncio.to_thread`), so they work wherever environments run: the
environment pool, `env.inline`, Ray environment workers. The tokens are the engine's, never
re-tokenised: the reply text the agent sees is only for the agent (`rollover.envs.render`).

Refused, each failing its episode with the reason: a call whose messages do not continue the
conversation (an edited history, a second conversation, a sub-agent on the same client), two
calls at once, and arguments rollover cannot honour (`n`, `stream`, `stop`, `logprobs`,
`response_format`, a `tools=` other than the first call's).

Tools (`tools=`, OpenAI's function schemas): the opening describes them to the model, by default
in a system message in Hermes' format (`<tools>` JSON, calls written as `<tool_call>{"name", "arguments"}</tool_call>`,
as `rollover.envs.tools.ToolUse` does, so any chat template carries it; with `tools_in:
template`, through the chat template's own tools rendering, an `Opening`); a reply's well-formed
`<tool_call>` blocks come back as `tool_calls` (finish_reason "tool_calls") with the text around
them as the content; the agent's `tool` messages are inserted as the chat template renders them. Sampling settings (temperature, max_tokens, ...) are ignored:
the run samples with `rollout.*` so that the behaviour logprobs are the ones trained on.
Anything the agent raises (even SystemExit or a CancelledError of its own) fails its episode
only. An episode that ends (done, failed, timed out, or cut by `env.max_turns` /
`env.max_total_tokens`, the last without the agent's reward: 0) cancels its agent and its
endpoint. Resuming a checkpoint replays live episodes' turns into a fresh agent, which must then
make the same calls (`LiveEpisode.replay`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import itertools
import numbers
import secrets
import threading
import weakref
import json
import logging
from dataclasses import asdict, dataclass, field

from rollover.envs.base import Action, Opening, StepResult
from rollover.types import Prompt

# create() arguments rollover cannot honour, with the values that ask for nothing
ALLOWED = {"functions": (None, []), "tool_choice": (None, "none", "auto"), "n": (None, 1),
           "stream": (None, False), "stop": (None, [], ""), "logprobs": (None, False), "top_logprobs": (None, 0),
           "response_format": (None, {"type": "text"})}


@dataclass
class Function:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


@dataclass
class ToolCallObject:
    id: str
    function: Function
    type: str = "function"


@dataclass
class ChatMessage:
    role: str
    content: str | None
    tool_calls: list[ToolCallObject] | None = None

    def model_dump(self, **_) -> dict:
        out = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [asdict(c) for c in self.tool_calls]
        return out

    to_dict = model_dump


@dataclass
class Choice:
    index: int
    message: ChatMessage
    finish_reason: str  # "stop", "length" or "tool_calls"


@dataclass
class Usage:
    """Counts the reply's tokens only: the environment does not see the prompt's (0 there)."""

    completion_tokens: int
    prompt_tokens: int = 0
    total_tokens: int = 0


@dataclass
class ChatCompletion:
    """The fields of an OpenAI chat completion that agents read."""

    id: str
    choices: list[Choice]
    usage: Usage
    model: str = "rollover-policy"
    object: str = "chat.completion"
    created: int = 0

    def model_dump(self, **_) -> dict:
        return asdict(self)

    to_dict = model_dump


def refused_arguments(kwargs: dict) -> str | None:
    """Why a call's arguments cannot be honoured (None: they can)."""
    refused = sorted(k for k, v in kwargs.items()
                     if k in ALLOWED and not any(v is a or (type(v) is type(a) and v == a) for a in ALLOWED[k]))
    if refused:
        return (f"chat.completions.create: {', '.join(refused)} not supported by rollover's agent client "
                "(the reply is the policy's whole turn, sampled with rollout.*; tools go in tools=)")
    return None


class _Completions:
    def __init__(self, channel: "_Channel"):
        self._channel = channel

    async def create(self, *, messages, model: str | None = None, tools=None, **kwargs) -> ChatCompletion:
        """The policy's next turn in this conversation (see the module docstring)."""
        refused = refused_arguments(kwargs)
        if refused:
            error = ValueError(refused)
            self._channel.fail(error)  # caught by the agent or not, the episode fails with it
            raise error
        return await self._channel.call(messages, tools)


@dataclass
class _Chat:
    completions: _Completions


@dataclass
class AgentClient:
    """The `client` an agent gets: `client.chat.completions.create(messages=...)`, as
    `openai.AsyncOpenAI` spells it; `base_url`, the same episode as an OpenAI-compatible endpoint
    for a program the agent runs (`rollover.envs.agent_server`)."""

    chat: _Chat
    base_url: str


def _agent_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for agents, on a daemon thread of its own, started at first use
    (and again if its thread is gone)."""
    global _LOOP, _THREAD, _SERVER
    with _LOOP_LOCK:
        if _LOOP is None or _THREAD is None or not _THREAD.is_alive():
            _LOOP, _SERVER = asyncio.new_event_loop(), None
            _THREAD = threading.Thread(target=_serve_forever, args=(_LOOP,), name="rollover-agents", daemon=True)
            _THREAD.start()
    return _LOOP


def _serve_forever(loop: asyncio.AbstractEventLoop) -> None:
    """The agents' loop, which goes on after a SystemExit or KeyboardInterrupt out of some task an
    agent started (asyncio lets those two out of `run_forever`): other agents keep their loop."""
    while True:
        try:
            loop.run_forever()
            return  # stopped on purpose
        except BaseException as e:  # noqa: BLE001 - one agent's task: logged, the loop goes on
            log.warning("an agent's task raised %s out of the agents' event loop: %s", type(e).__name__, e)


_LOOP: asyncio.AbstractEventLoop | None = None
_THREAD: threading.Thread | None = None
_LOOP_LOCK = threading.Lock()
_IDS = itertools.count()
log = logging.getLogger("rollover")
_SERVER = None  # the process's AgentServer, on the agents' loop


async def _server():
    """The process's endpoint for agents, started at first use (on the agents' loop)."""
    global _SERVER
    from rollover.envs.agent_server import AgentServer

    if _SERVER is None:
        _SERVER = AgentServer()
    await _SERVER.start()
    return _SERVER


def _as_message(m, where: str) -> dict:
    """A chat message as {"role", "content"} (a dict, or a message object an agent appended as
    the SDK returned it): content given as parts joined into text, OpenAI's `developer` role as
    `system`, an assistant message's tool calls as [(name, arguments as canonical JSON)], a tool
    result's `name` / `tool_call_id` kept. The form calls are compared in; `_rendered` is the
    form the chat template gets."""
    if not isinstance(m, dict):
        m = m.model_dump() if hasattr(m, "model_dump") else {"role": getattr(m, "role", None),
                                                             "content": getattr(m, "content", None)}
    content, calls = m.get("content"), m.get("tool_calls") or []
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ValueError(f"{where}: only text parts are supported in a message's content, got {content!r:.120}")
        content = "".join(p["text"] for p in content)
    if content is None and calls:
        content = ""
    out = {"role": "system" if m.get("role") == "developer" else m.get("role"), "content": content}
    if not isinstance(out["role"], str) or not isinstance(out["content"], str):
        raise ValueError(f"{where}: a chat message needs a string role and content, got {m!r:.120}")
    if calls:
        try:
            out["tool_calls"] = [_call_key(c) for c in calls]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{where}: malformed tool_calls ({e})") from None
    for key in ("name", "tool_call_id"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def _rendered(messages: list[dict]) -> list[dict]:
    """Messages for the chat template: an assistant message's tool calls written into its text
    as the model writes them (`<tool_call>` blocks, the format the tools' description asks for)."""
    out = []
    for m in messages:
        if "tool_calls" in m:
            blocks = "\n".join(f'<tool_call>{{"name": {json.dumps(name)}, "arguments": {args}}}</tool_call>'
                               for name, args in m["tool_calls"])
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = f"{m['content']}\n{blocks}" if m["content"] else blocks
        out.append(m)
    return out


def _call_key(call) -> tuple[str, str]:
    """(name, arguments as canonical JSON) of a tool call in OpenAI's form (dict or object)."""
    fn = call["function"] if isinstance(call, dict) else call.function
    name, args = (fn["name"], fn["arguments"]) if isinstance(fn, dict) else (fn.name, fn.arguments)
    return name, json.dumps(json.loads(args) if isinstance(args, str) else args, sort_keys=True)


def tools_prompt(tools: list) -> str:
    """The tools, described for the model in a system message (Hermes' format, as
    `rollover.envs.tools.ToolUse` writes it: any chat template carries it)."""
    schemas = "\n".join(json.dumps(t.get("function", t) if isinstance(t, dict) else t) for t in tools)
    return ("You can call tools. They are described here as JSON:\n"
            f"<tools>\n{schemas}\n</tools>\n"
            'To call a tool, write <tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call> and stop; '
            "the result comes back in the next message.")


def with_tools(messages: list[dict], tools: list | None) -> list[dict]:
    """The opening as the model sees it: the tools' description first in the system message."""
    if not tools:
        return messages
    head = tools_prompt(tools)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{head}\n\n{messages[0]['content']}"}, *messages[1:]]
    return [{"role": "system", "content": head}, *messages]


def reply_message(text: str, tools: list | None, turn: int = 1) -> tuple[ChatMessage, bool]:
    """The policy's turn as the agent receives it: with tools, its well-formed `<tool_call>` blocks
    as `tool_calls` (ids by turn and place: the same in a replay) and the text around them as the
    content; (message, whether it calls tools)."""
    from rollover.envs.tools import _TOOL_CALL, parse_tool_calls

    if tools:
        calls, problems = parse_tool_calls(text)
        if calls and not problems:
            content = _TOOL_CALL.sub("", text).strip() or None
            objects = [ToolCallObject(f"call{turn}x{i}", Function(c.name, json.dumps(c.arguments)))
                       for i, c in enumerate(calls)]
            return ChatMessage("assistant", content, objects), True
    return ChatMessage("assistant", text), False


@dataclass
class _Channel:
    """Between the agent (on the agents' loop) and its `AgentEnv` (on the environment's loop).
    `next` is what the environment waits for: ("call", messages), ("done", value) or ("error",
    exception); it is replaced before each reply, so the agent's next event finds it there."""

    next: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    reply: asyncio.Future | None = None  # the pending call's answer, on the agents' loop
    sent: list[dict] = field(default_factory=list)  # the conversation so far, as the agent sent it
    calls: int = 0
    tools: list | None = None  # the first call's tools=, which every later call must repeat
    ended: tuple | None = None  # ("done", value) or ("error", exception) once the agent has returned or raised
    task: asyncio.Task | None = None  # the agent, once started
    pending: tuple | None = None  # (messages, tools) of the call the reply answers

    async def call(self, messages, tools=None) -> ChatCompletion:
        """The policy's reply to this call. What is wrong with it fails the episode (and raises
        into the caller); the same call again while it waits (a client's retry after a timeout)
        waits for the same reply."""
        try:
            where = f"call {self.calls + 1}"
            if not isinstance(messages, (list, tuple)) or not messages:
                raise ValueError(f"{where}: messages must be a non-empty list")
            if tools is not None and not (isinstance(tools, (list, tuple)) and all(isinstance(t, dict) for t in tools)):
                raise ValueError(f"{where}: tools must be a list of function schemas, got {tools!r:.80}")
            tools = list(tools) if tools else None
            msgs = [_as_message(m, f"{where}, message {i}") for i, m in enumerate(messages)]
            if self.reply is not None and not self.reply.done():
                if (msgs, tools) == self.pending:
                    return await asyncio.shield(self.reply)
                raise RuntimeError("chat.completions.create: a call is already waiting for the policy; an episode is "
                                   "one conversation, one call at a time")
            if self.calls and tools != self.tools:
                raise ValueError(f"{where}: tools= differs from the first call's: the model saw those in its opening")
        except (ValueError, RuntimeError) as e:
            self.fail(e)
            raise
        self.calls += 1
        if self.calls == 1:
            self.tools = tools
        self.pending = (msgs, tools)
        self.reply = asyncio.get_running_loop().create_future()
        _settle(self.next, ("call", msgs))
        return await asyncio.shield(self.reply)

    def finished(self, task: asyncio.Task) -> None:
        if self.ended is None:  # else: failed through the endpoint, or closed, first
            if task.cancelled():  # a CancelledError out of the agent's own code: its episode fails, nothing else
                self.ended = ("error", RuntimeError("the agent ended with a CancelledError"))
            elif task.exception() is not None:
                self.ended = ("error", task.exception())
            else:
                self.ended = ("done", task.result())
        _settle(self.next, self.ended)

    def fail(self, exc: BaseException) -> None:
        """A call the agent made wrong through the endpoint: the episode fails with it, as a raising
        in-process call fails it."""
        if self.ended is None:
            self.ended = ("error", exc)
        _settle(self.next, self.ended)

    def close(self) -> None:
        """The episode is over (on the agents' loop): the agent is cancelled, a call still waiting
        ends (the endpoint answers 410), later ones are refused."""
        if self.ended is None:
            self.ended = ("error", RuntimeError("the episode has ended"))
        if self.task is not None:
            self.task.cancel()
        if self.reply is not None and not self.reply.done():
            self.reply.cancel()

    def expect(self) -> concurrent.futures.Future:
        """A fresh `next`, settled at once if the agent has already ended (it can end while a call
        is out: a second call raising beside the first)."""
        self.next = concurrent.futures.Future()
        if self.ended is not None:
            _settle(self.next, self.ended)
        return self.next


def _settle(fut: concurrent.futures.Future, value) -> None:
    try:
        fut.set_result(value)
    except concurrent.futures.InvalidStateError:  # settled already, or cancelled by a call that timed out
        pass


async def _run(fn, client, prompt, options):
    """The agent, with SystemExit and KeyboardInterrupt turned into errors of its episode (they
    would stop the agents' loop, and every other agent with it)."""
    try:
        return await fn(client, prompt, **options)
    except (SystemExit, KeyboardInterrupt) as e:
        raise RuntimeError(f"the agent raised {type(e).__name__}: {e}") from None


def _close(loop: asyncio.AbstractEventLoop, channel: _Channel, token: str) -> None:
    """An episode's agent cancelled, its pending call ended and its endpoint removed, once the
    episode is over (finished, cut or failed; at the latest when its environment is let go)."""
    def close() -> None:
        channel.close()
        if _SERVER is not None:
            _SERVER.channels.pop(token, None)

    if not loop.is_closed():
        loop.call_soon_threadsafe(close)


class AgentEnv:
    """One episode: the agent `fn(client, prompt, **options)` as an `Env` (module docstring)."""

    def __init__(self, fn, prompt: Prompt, options: dict, tools_in: str = "system"):
        self.fn, self.prompt, self.options, self.tools_in = fn, prompt, options, tools_in
        self.channel = _Channel()
        self.token = secrets.token_hex(12)  # the episode's endpoint path
        self._end = None  # closes the episode's agent and endpoint (a finalizer: also when the env is let go)

    async def initial_observation(self) -> list[dict] | Opening:
        self.loop = loop = _agent_loop()  # the loop this agent lives on (a restarted one is another's)
        ch = self.channel
        server = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_server(), loop))
        server.channels[self.token] = ch
        client = AgentClient(_Chat(_Completions(ch)), base_url=server.url(self.token))
        # registered before the agent exists: its `close` cancels whatever has started by then
        self._end = weakref.finalize(self, _close, loop, ch, self.token)

        def start() -> None:
            if ch.ended is not None:  # closed before it could start (the call timed out)
                return
            try:
                ch.task = loop.create_task(_run(self.fn, client, self.prompt, self.options))
            except Exception as e:  # noqa: BLE001 - whatever it is, it is this episode's failure
                ch.ended = ("error", e)
                _settle(ch.next, ch.ended)
                return
            ch.task.add_done_callback(ch.finished)

        loop.call_soon_threadsafe(start)
        kind, value = await self._wait(ch.next)
        if kind == "call":
            ch.sent = value
            if self.tools_in == "template" and ch.tools:  # the chat template describes them, in its own words
                return Opening(_rendered(value), {"tools": ch.tools})
            return with_tools(_rendered(value), ch.tools)
        self._end()
        if kind == "error":
            raise value
        raise ValueError(f"the agent returned {value!r:.60} without calling chat.completions.create")

    async def _wait(self, fut: concurrent.futures.Future):
        """The agent's next event; a call cancelled on the way (its step timed out) ends the agent."""
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self._end()
            raise

    async def step(self, action: Action) -> StepResult:
        loop, ch = self.loop, self.channel
        nxt = ch.expect()  # before the reply: the agent's next event lands here
        message, calls = reply_message(action.text, ch.tools, ch.calls)
        finish = "length" if action.finish == "length" else "tool_calls" if calls else "stop"
        completion = ChatCompletion(
            id=f"rollover-{next(_IDS)}", choices=[Choice(0, message, finish)],
            usage=Usage(completion_tokens=len(action.token_ids), total_tokens=len(action.token_ids)))
        reply = ch.reply
        loop.call_soon_threadsafe(lambda: reply.done() or reply.set_result(completion))
        kind, value = await self._wait(nxt)
        try:
            if kind == "error":
                raise value
            if kind == "done":
                self._end()  # its endpoint goes with it
                return _final(value)
            new = _continuation(ch.sent, message, action.text, value, ch.calls)
        except BaseException:
            self._end()
            raise
        ch.sent = value
        return StepResult(messages=_rendered(new), reward=0.0, done=False)


def _continuation(sent: list[dict], reply: ChatMessage, text: str, messages: list[dict], call: int) -> list[dict]:
    """The messages a call adds after the conversation so far and the model's reply; an error
    naming the first difference where it does not continue it. The reply may come back as
    returned (its content, surrounding whitespace aside, and its tool calls) or as the whole
    text the model wrote."""
    k = len(sent)
    for i, (old, new) in enumerate(zip(sent, messages)):
        if old != new:
            raise ValueError(f"call {call}: message {i} differs from the conversation so far ({new!r:.80} vs "
                             f"{old!r:.80}); an episode trains one conversation that only grows")
    got = messages[k] if len(messages) > k else None
    expected_calls = [_call_key(asdict(c)) for c in reply.tool_calls or []]
    as_sent = (got["content"].strip(), got.get("tool_calls", [])) if got is not None else None
    if got is None or got["role"] != "assistant" or as_sent not in (((reply.content or "").strip(), expected_calls),
                                                                    (text.strip(), [])):
        raise ValueError(f"call {call}: message {k} must be the model's reply as an assistant message, got "
                         f"{got or 'nothing'!r:.80}")
    return messages[k + 1:]


def _final(value) -> StepResult:
    """The agent's return value as the last step: a number, or a dict with "reward" and numbers."""
    info = {}
    if isinstance(value, dict):
        info = {k: v for k, v in value.items() if k != "reward"}
        if "reward" not in value or not all(isinstance(v, numbers.Real) for v in info.values()):
            raise ValueError(f"the agent returned {value!r:.80}: a dict needs a 'reward' and numbers only")
        value = value["reward"]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"the agent returned {value!r:.60}: expected a number (the reward) or a dict with 'reward'")
    return StepResult(messages=[], reward=float(value), done=True, info=info)


class AgentBuilder:
    """`env.name: agent`: `env.options.fn` names the agent (`module:function` or
    `path/to/file.py:function`, an `async def`); `env.options.tools_in` says where an agent's
    `tools=` are described to the model: "system" (default: a system message in Hermes' format,
    for any chat template) or "template" (the chat template's own `tools` rendering, for models
    trained on it whose calls are `<tool_call>` JSON: Qwen2.5 / Qwen3, Hermes); the other options
    are passed to the agent."""

    def __init__(self, fn: str, tools_in: str = "system", **options):
        from rollover.rewards.registry import _absolute

        if tools_in not in ("system", "template"):
            raise ValueError(f"env.options.tools_in must be 'system' or 'template', got {tools_in!r}")
        self.tools_in = tools_in

        if not isinstance(fn, str):
            raise ValueError("env.options.fn: the agent as 'module:function' or 'path/to/file.py:function'")
        self.ref, self.options = _absolute(fn), options  # a worker process loads the same function
        self._fn = None
        agent = self.agent()
        if not inspect.iscoroutinefunction(agent):
            raise ValueError(f"env.options.fn={fn!r}: the agent must be an async function "
                             "(async def agent(client, prompt, **options))")
        try:
            inspect.signature(agent).bind(None, None, **options)
        except TypeError as e:
            raise ValueError(f"env.options for the agent {fn!r}: {e}") from None

    def worker_options(self) -> dict:
        """`env.options` for the same builder in another process (a Ray environment worker, whose
        working directory may differ): the agent's file by its absolute path."""
        return {"fn": self.ref, "tools_in": self.tools_in, **self.options}

    def agent(self):
        if self._fn is None:
            from rollover.rewards.registry import load_reference

            self._fn = load_reference(self.ref, "env.options.fn")
        return self._fn

    def __getstate__(self):
        return {"ref": self.ref, "options": self.options, "tools_in": self.tools_in, "_fn": None}

    def make_group(self, prompt: Prompt, n: int) -> list[AgentEnv]:
        return [self.make_one(prompt, n, j) for j in range(n)]

    def make_one(self, prompt: Prompt, n: int, j: int) -> AgentEnv:
        return AgentEnv(self.agent(), prompt, dict(self.options), self.tools_in)
