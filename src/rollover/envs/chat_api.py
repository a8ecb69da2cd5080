"""OpenAI's chat-completions API as rollover's agents see it (`rollover.envs.agent`): the
response objects an agent reads (the fields agents use, `model_dump` and `to_dict` as the SDK
has them), the arguments rollover refuses, messages in the form calls are compared in and the
form the chat template gets, tools described to the model and tool calls read back from its
text (in a `rollover.envs.tool_formats` format, Hermes' by default), and the check that a call continues the conversation."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from rollover.envs.tool_formats import FORMATS, ToolFormat, call_id, read, schemas_of

HERMES = FORMATS["hermes"]

# create() arguments rollover cannot honour, with the values that ask for nothing
ALLOWED = {"functions": (None, []), "tool_choice": (None, "none", "auto"), "n": (None, 1),
           "stream": (None, False), "logprobs": (None, False), "top_logprobs": (None, 0),
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


def as_message(m, where: str) -> dict:
    """A chat message as {"role", "content"} (a dict, or a message object an agent appended as
    the SDK returned it): content given as parts joined into text, OpenAI's `developer` role as
    `system`, an assistant message's tool calls as [(name, arguments as canonical JSON)], a tool
    result's `name` / `tool_call_id` kept. The form calls are compared in; `rendered` is the
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
            out["tool_calls"] = [call_key(c) for c in calls]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{where}: malformed tool_calls ({e})") from None
    for key in ("name", "tool_call_id"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def rendered(messages: list[dict], fmt: ToolFormat = HERMES) -> list[dict]:
    """Messages for the chat template: an assistant message's tool calls written into its text
    as the model writes them (in `fmt`, the format the tools' description asks for)."""
    out = []
    for m in messages:
        if "tool_calls" in m:
            blocks = fmt.write(m["tool_calls"])
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = f"{m['content']}\n{blocks}" if m["content"] else blocks
        out.append(m)
    return out


def call_key(call) -> tuple[str, str]:
    """(name, arguments as canonical JSON) of a tool call in OpenAI's form (dict or object)."""
    fn = call["function"] if isinstance(call, dict) else call.function
    name, args = (fn["name"], fn["arguments"]) if isinstance(fn, dict) else (fn.name, fn.arguments)
    return name, json.dumps(json.loads(args) if isinstance(args, str) else args, sort_keys=True)


def with_tools(messages: list[dict], tools: list | None, fmt: ToolFormat = HERMES) -> list[dict]:
    """The opening as the model sees it: the tools' description (in `fmt`'s words, as
    `rollover.envs.tools.ToolUse` writes it: any chat template carries it) first in the system
    message."""
    if not tools:
        return messages
    head = fmt.instructions(tools)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{head}\n\n{messages[0]['content']}"}, *messages[1:]]
    return [{"role": "system", "content": head}, *messages]


def stop_argument(stop, where: str) -> tuple[str, ...]:
    """A call's `stop=` (OpenAI's: None, a string, or a list of up to 4) as a tuple of strings."""
    if stop is None or stop == "" or stop == []:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, (list, tuple)) and 0 < len(stop) <= 4 and all(isinstance(s, str) and s for s in stop):
        return tuple(stop)
    raise ValueError(f"{where}: stop={stop!r:.80}: a string or a list of up to 4 non-empty strings (OpenAI's limit)")


def before_stop(text: str, stops: tuple[str, ...]) -> str:
    """`text` up to the first of `stops` in it (as OpenAI's reply leaves the stop string out)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


def reply_message(text: str, tools: list | None, turn: int = 1, fmt: ToolFormat = HERMES,
                  opened: bool = False) -> tuple[ChatMessage, bool]:
    """The policy's turn as the agent receives it: with tools, its calls (read in `fmt`, all
    well-formed, outside the reasoning; `opened`: the turn began inside an open `<think>`) as
    `tool_calls` (ids by turn and place: the same in a replay) and the text around them as the
    content; (message, whether it calls tools)."""
    if tools:
        parsed = read(fmt, text, schemas_of(tools), opened)
        if parsed.calls and not parsed.problems:
            content = parsed.content or None
            objects = [ToolCallObject(c.id or call_id(turn, i), Function(c.name, json.dumps(c.arguments)))
                       for i, c in enumerate(parsed.calls)]
            return ChatMessage("assistant", content, objects), True
    return ChatMessage("assistant", text), False


def continuation(sent: list[dict], reply: ChatMessage, text: str, messages: list[dict], call: int) -> list[dict]:
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
    expected_calls = [call_key(asdict(c)) for c in reply.tool_calls or []]
    as_sent = (got["content"].strip(), got.get("tool_calls", [])) if got is not None else None
    if got is None or got["role"] != "assistant" or as_sent not in (((reply.content or "").strip(), expected_calls),
                                                                    (text.strip(), [])):
        raise ValueError(f"call {call}: message {k} must be the model's reply as an assistant message, got "
                         f"{got or 'nothing'!r:.80}")
    return messages[k + 1:]
