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
calls at once, and arguments rollover cannot honour (`n`, `stream`, `logprobs`,
`response_format`, a `tools=` other than the first call's).

`stop=` (a ReAct agent's "Observation:") ends the turn that answers the call at the first of its
strings, beside `rollout.stop`'s, and the reply's content leaves it out, as OpenAI's does; the
trained tokens keep it. (smolagents does not fit yet: it writes its end-of-code mark back into
the reply and merges it with the next message, which the conversation check refuses.)

Tools (`tools=`, OpenAI's function schemas): the opening describes them to the model, by default
in a system message in the words of `tool_format` (`rollover.envs.tool_formats`; Hermes' by
default: `<tools>` JSON, calls written as `<tool_call>{"name", "arguments"}</tool_call>`, as
`rollover.envs.tools.ToolUse` does, so any chat template carries it; with `tools_in: template`,
through the chat template's own tools rendering, an `Opening`); a reply's well-formed calls in
that format come back as `tool_calls` (finish_reason "tool_calls") with the text around them as
the content; the agent's `tool` messages are inserted as the chat template renders them. Sampling settings (temperature, max_tokens, ...) are ignored:
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
import math
import numbers
import secrets
import threading
import weakref
import logging
from dataclasses import dataclass, field

from rollover.envs import tool_formats
from rollover.envs.base import Action, Opening, StepResult
from rollover.envs.chat_api import (ChatCompletion, Choice, Usage, as_message, before_stop, continuation,
                                    refused_arguments, rendered, reply_message, stop_argument, with_tools)
from rollover.types import Prompt, prefilled


class _Completions:
    def __init__(self, channel: "_Channel"):
        self._channel = channel

    async def create(self, *, messages, model: str | None = None, tools=None, **kwargs) -> ChatCompletion:
        """The policy's next turn in this conversation (see the module docstring)."""
        return await self._channel.call(messages, tools, **kwargs)


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
    stop: tuple[str, ...] = ()  # the pending call's stop= strings

    async def call(self, messages, tools=None, **kwargs) -> ChatCompletion:
        """The policy's reply to this call (`chat.completions.create`'s arguments, from the client
        or the endpoint). What is wrong with it fails the episode, caught by the agent or not, and
        raises into the caller; the same call again while it waits (a client's retry after a
        timeout) waits for the same reply."""
        try:
            where = f"call {self.calls + 1}"
            stop = stop_argument(kwargs.pop("stop", None), where)
            refused = refused_arguments(kwargs)
            if refused:
                raise ValueError(refused)
            if not isinstance(messages, (list, tuple)) or not messages:
                raise ValueError(f"{where}: messages must be a non-empty list")
            if tools is not None and not (isinstance(tools, (list, tuple)) and all(isinstance(t, dict) for t in tools)):
                raise ValueError(f"{where}: tools must be a list of function schemas, got {tools!r:.80}")
            tools = list(tools) if tools else None
            msgs = [as_message(m, f"{where}, message {i}") for i, m in enumerate(messages)]
            if self.reply is not None and not self.reply.done():
                if (msgs, tools) == self.pending and stop == self.stop:
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
        self.pending, self.stop = (msgs, tools), stop
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
        """A call the agent made wrong: the episode fails with it."""
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

    def __init__(self, fn, prompt: Prompt, options: dict, tools_in: str = "system", tool_format: str = "hermes"):
        self.fn, self.prompt, self.options, self.tools_in = fn, prompt, options, tools_in
        self.format = tool_formats.tool_format(tool_format)
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
                return Opening(rendered(value, self.format), {"tools": ch.tools}, stop=ch.stop, prefill=False)
            messages = with_tools(rendered(value, self.format), ch.tools, self.format)
            if ch.stop or prefilled(messages):
                return Opening(messages, stop=ch.stop, prefill=False)  # (a last assistant message is closed, as OpenAI's)
            return messages
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
        text = before_stop(action.text, ch.stop) if action.finish == "stop" else action.text
        message, calls = reply_message(text, ch.tools, ch.calls, self.format, action.opened_reasoning)
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
            new = continuation(ch.sent, message, action.text, value, ch.calls)
        except BaseException:
            self._end()
            raise
        ch.sent = value
        return StepResult(messages=rendered(new, self.format), reward=0.0, done=False, stop=ch.stop)


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
    if not math.isfinite(value):
        raise ValueError(f"the agent returned the reward {value!r}: a finite number is needed")
    return StepResult(messages=[], reward=float(value), done=True, info=info)


class AgentBuilder:
    """`env.name: agent`: `env.options.fn` names the agent (`module:function` or
    `path/to/file.py:function`, an `async def`); `env.options.tools_in` says where an agent's
    `tools=` are described to the model: "system" (default: a system message, for any chat
    template) or "template" (the chat template's own `tools` rendering, for models trained on
    it); `env.options.tool_format` how calls are described and read: "hermes" (default; Qwen2.5 /
    Qwen3, Hermes), "llama3_json" (Llama 3.1-3.3), "mistral", "qwen3_coder" (Qwen3-Coder,
    Qwen3.5) or "glm45" (GLM-4.5 to 4.7); the other options are passed to the agent."""

    def __init__(self, fn: str, tools_in: str = "system", tool_format: str = "hermes", **options):
        from rollover.rewards.registry import _absolute, load_reference

        if tools_in not in ("system", "template"):
            raise ValueError(f"env.options.tools_in must be 'system' or 'template', got {tools_in!r}")
        if tool_format not in tool_formats.FORMATS:
            raise ValueError(f"env.options.tool_format must be one of {', '.join(tool_formats.FORMATS)}, "
                             f"got {tool_format!r}")
        self.tool_format = tool_format
        if not isinstance(fn, str):
            raise ValueError("env.options.fn: the agent as 'module:function' or 'path/to/file.py:function'")
        self.ref, self.tools_in, self.options = _absolute(fn), tools_in, options
        self.fn = load_reference(self.ref, "env.options.fn")
        if not inspect.iscoroutinefunction(self.fn):
            raise ValueError(f"env.options.fn={fn!r}: the agent must be an async function "
                             "(async def agent(client, prompt, **options))")
        try:
            inspect.signature(self.fn).bind(None, None, **options)
        except TypeError as e:
            raise ValueError(f"env.options for the agent {fn!r}: {e}") from None

    def worker_options(self) -> dict:
        """`env.options` for the same builder in another process (a Ray environment worker, whose
        working directory may differ): the agent's file by its absolute path."""
        return {"fn": self.ref, "tools_in": self.tools_in, "tool_format": self.tool_format, **self.options}

    def agent(self):
        """The agent function, as loaded."""
        return self.fn

    def make_group(self, prompt: Prompt, n: int) -> list[AgentEnv]:
        return [self.make_one(prompt, n, j) for j in range(n)]

    def make_one(self, prompt: Prompt, n: int, j: int) -> AgentEnv:
        return AgentEnv(self.fn, prompt, dict(self.options), self.tools_in, self.tool_format)
