"""An episode's first messages: a system message, worked examples, the task.

A small model rarely follows a tool format from its description alone: SmolLM2-135M-Instruct,
told about a calculator in the system message, called it in none of 128 episodes; with two
worked conversations before the question it tried in many (1.7 turns per episode against 1.0;
docs/benchmarks.md, "A model learns to call a tool"). `examples` are those conversations (few-shot prompting as chat turns):
each a list of messages, placed after the system message and before the task's own messages.
They are part of the prompt, so no loss falls on them.
"""

from __future__ import annotations

import re
from typing import Callable

from rollover.data.render import render_messages
from rollover.types import Prompt

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def worked_examples(examples, where: str, roles=("user", "assistant"),
                    calls: Callable[[str], tuple[list[str], list[str]]] | None = None,
                    max_calls: int | None = None) -> tuple[tuple[dict, ...], ...]:
    """`examples` checked and frozen: a list of conversations, each a list of `{role, content}`
    messages that starts with the user and alternates, ending with the assistant's answer.

    Where the environment has a `tool` role, `calls(text) -> (names of the tools called,
    problems)` reads an assistant message: a call it cannot read or would refuse (an unknown tool,
    wrong arguments) is refused here, since a mistake in an example is what the model copies;
    each call is followed by one `tool` message (its `name` is the call's), at most `max_calls`
    calls a conversation, and the last assistant message is an answer, not a call. Results
    themselves are not checked against the tools (a tool may have side effects)."""
    if examples is None:
        return ()
    if not isinstance(examples, (list, tuple)):
        raise ValueError(f"{where}: examples={examples!r:.80}: a list of conversations, each a list of "
                         "{role, content} messages")
    out = []
    for i, conversation in enumerate(examples, 1):
        at = f"{where}: examples[{i}]"
        if isinstance(conversation, dict):
            raise ValueError(f"{at}: a conversation (a list of messages), got one message {conversation!r:.80}; "
                             "examples is a list of conversations: nest one conversation in a list")
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise ValueError(f"{at}: a non-empty list of {{role, content}} messages, got {conversation!r:.80}")
        messages, pending, made = [], [], 0  # pending: names of the calls still owed a result
        for j, message in enumerate(conversation, 1):
            where_j = f"{at}, message {j}"
            if not isinstance(message, dict) or message.get("role") not in roles or not isinstance(message.get("content"), str):
                raise ValueError(f"{where_j}: expected {{role: {' | '.join(roles)}, content: text}}, got {message!r:.120}")
            role, content = message["role"], message["content"]
            extra = sorted(set(message) - {"role", "content"} - ({"name"} if role == "tool" else set()))
            if extra:
                raise ValueError(f"{where_j}: unknown keys {extra} (a message is role and content"
                                 + (", and name for a tool result" if "tool" in roles else "")
                                 + "; calls are written in the content, in the environment's tool format)")
            if _CONTROL.search(content):
                raise ValueError(f"{where_j}: a control character in {content!r:.80} (in YAML, a double-quoted "
                                 "\"\\boxed\" is a backspace and 'oxed': quote such text with single quotes)")
            previous = messages[-1]["role"] if messages else None
            if role == "tool":
                if not pending:
                    raise ValueError(f"{where_j}: a tool result must follow an assistant message that calls a tool"
                                     + (" (the message before has no call the environment reads)" if previous == "assistant" else ""))
                name = pending.pop(0)
                if message.get("name", name) != name:
                    raise ValueError(f"{where_j}: the result's name {message['name']!r} is not the call's, {name!r}")
                message = {**message, "name": name}
            elif pending:
                raise ValueError(f"{where_j}: {len(pending)} tool call(s) of the assistant message before have no result")
            elif role == previous or (role == "assistant") == (previous in (None, "assistant")):
                raise ValueError(f"{where_j}: a conversation starts with the user and alternates user and assistant; "
                                 f"a {role} message cannot follow {'the start' if previous is None else 'a ' + previous + ' message'}")
            if role == "assistant" and calls is not None:
                pending, problems = calls(content)
                if problems:
                    raise ValueError(f"{where_j}: a call the environment would refuse: {'; '.join(problems)}")
                made += len(pending)
                if max_calls is not None and made > max_calls:
                    raise ValueError(f"{at}: {made} tool calls, past max_tool_calls={max_calls} (an episode that "
                                     "calls more scores 0)")
            messages.append(dict(message))
        if messages[-1]["role"] != "assistant" or pending:
            raise ValueError(f"{at}: must end with the assistant's answer (an assistant message without a call)")
        out.append(tuple(messages))
    return tuple(out)


def check_system_prompt(system_prompt, where: str) -> None:
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ValueError(f"{where}: system_prompt={system_prompt!r:.80}: text, 'default' (the environment's own) or null (none)")


def opening(prompt: Prompt, system_prompt: str | None, default: str, examples=(),
            tool_message: Callable[[dict], dict] = dict) -> list[dict]:
    """The episode's first messages: the prompt under `system_prompt` ("default": `default`, put
    before the data's own system message where the prompt has one; None: no system message),
    after the worked `examples` (their `tool` messages as `tool_message` writes them)."""
    system = default if system_prompt == "default" else system_prompt
    leads = bool(prompt.messages) and prompt.messages[0]["role"] == "system"
    if system_prompt == "default" and system and leads:  # (a system_prompt given as well is refused)
        # the data's system message stays, the environment's text (its tools, its rules) before it
        messages = render_messages(prompt, system_prompt=None)
        content = messages[0]["content"]
        merged = f"{system}\n\n{content}" if isinstance(content, str) else \
            [{"type": "text", "text": f"{system}\n\n"}, *content]
        messages[0] = {**messages[0], "content": merged}
    else:
        messages = render_messages(prompt, system_prompt=system)
    at = 1 if messages and messages[0]["role"] == "system" else 0
    shots = [tool_message(m) if m["role"] == "tool" else dict(m) for conversation in examples for m in conversation]
    return messages[:at] + shots + messages[at:]
