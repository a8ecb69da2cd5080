"""`env.name: inline_tools`: tools the model calls by tags inside its own answer (Search-R1's form).

Search-R1 (arXiv 2503.09516) and its successors train a model that writes, in one assistant
message,

    <think>...</think><search>who wrote Dune</search>

and stops at the closing tag (the run's `rollout.stop` holds `</search>`); the retriever's
passages go on inside the same message, `<information>...</information>`, and the model reads
on, searches again or answers `<answer>Frank Herbert</answer>`.

`tools` maps each tag to a function of the text between the tags, `module:function` or
`path/to/file.py:function` (an `async def` is awaited; any other runs in a worker thread), that
returns what the model is shown (at most `output_chars` characters, in `result`'s format). What
it raises fails the episode (counted and reported), as a tool that broke is not the model's
mistake, except `rollover.envs.tools.ToolError` (a refusal of the model's input, as the
calculator's), which the model is shown as `error: ...` and which counts in `tool_errors`. The closing tags must be in `rollout.stop` (refused at start-up otherwise), so a call
is where the model's turn stopped; a closing tag without its opening one shows the model an
error.

When the model ends its message, the text it wrote (not the results) is scored against the
task's answer by `score`: a built-in reward's name (`em`, the default: SQuAD's and Search-R1's
exact match of the `<answer>`'s text against one of the gold answers; `exact`; `numeric`;
`math`) or `module:function`, called with the completion and the answer. More than `max_calls` calls end the episode with reward 0.

`retry` (off by default) is Search-R1's "invalid action": a message the model ends with neither
a call nor an `<answer>...</answer>` is not scored yet; `retry`'s text comes back as a user
message and the model tries again, at most `max_retries` times (`info` `invalid_actions`); the
message after a retry is scored on its own. Those turns count in `env.max_turns`. Search-R1
writes that text inside the model's message; here the model has ended its message (its
end-of-turn token is sampled and trained on), so a new turn asks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from rollover.envs.base import Action, StepResult, cut
from rollover.envs.opening import check_system_prompt, opening, worked_examples
from rollover.envs.score import Score, call
from rollover.envs.tools import ToolError, result_text
from rollover.types import Prompt

RESULT = "\n<information>{result}</information>\n"
ANSWER = re.compile(r"<answer>.*?</answer>", re.DOTALL)


@dataclass(frozen=True)
class InlineTools:
    """The group builder: the tools by tag, the result's format, the limits, the score."""

    tools: dict = field(default_factory=dict)  # tag -> function(text between the tags) -> str
    result: str = RESULT
    max_calls: int = 4
    output_chars: int = 2000
    score: Callable | str = "em"
    # the system message that tells the model the tags ("default": `default_system_prompt()`); None:
    # no system message, for prompts that carry their own instructions (Search-R1's datasets do)
    system_prompt: str | None = "default"
    examples: tuple = ()  # worked conversations before the task (rollover.envs.opening)
    # a message with neither a call nor an <answer>: the user message that asks again ("default":
    # `default_retry()`), at most max_retries times; None: it is scored as it is
    retry: str | None = None
    max_retries: int = 1

    def __post_init__(self):
        check_system_prompt(self.system_prompt, "inline_tools")
        if not isinstance(self.tools, dict) or not self.tools:
            raise ValueError(f"inline_tools: tools={self.tools!r}: a mapping of tags to functions, e.g. "
                             "{search: 'retriever.py:search'}")
        bad = [t for t in self.tools if not re.fullmatch(r"[A-Za-z_][\w-]*", str(t))]
        if bad:
            raise ValueError(f"inline_tools: tags {bad} are not names (letters, digits, _ and -)")
        made = {}
        for tag, fn in self.tools.items():
            if not callable(fn):
                from rollover.rewards.registry import load_reference

                try:
                    fn = load_reference(fn, f"inline_tools tool {tag!r}")
                except (AttributeError, FileNotFoundError, ImportError, ValueError) as e:
                    raise ValueError(str(e)) from None
            made[tag] = fn
        object.__setattr__(self, "tools", made)
        object.__setattr__(self, "score", Score(self.score, "inline_tools"))
        try:
            shown = self.result.format(result="\0")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"inline_tools: result={self.result!r} is not a format with only {{result}} ({e!r})") from None
        if "\0" not in shown:
            raise ValueError(f"inline_tools: result={self.result!r} must hold {{result}}")
        if self.max_calls < 1 or self.output_chars < 1:
            raise ValueError("inline_tools: max_calls and output_chars must be >= 1")
        object.__setattr__(self, "examples", worked_examples(self.examples, "inline_tools"))
        self._check_examples()
        if self.retry is not None and (not isinstance(self.retry, str) or not self.retry.strip()):
            raise ValueError(f"inline_tools: retry={self.retry!r}: the text that asks the model again, 'default' or null")
        if self.max_retries < 1:
            raise ValueError(f"inline_tools: max_retries={self.max_retries} must be >= 1 (retry: null turns retries off)")

    def _check_examples(self) -> None:
        """Each call in an example's assistant message is written as the model would write it and
        followed by its result as the environment writes it (`result`'s format; whitespace at its
        ends aside), at most `max_calls` calls a conversation: what an example shows, the model copies."""
        head, tail = (part.strip() for part in self.result.format(result="\0").split("\0", 1))
        for i, conversation in enumerate(self.examples, 1):
            made = 0
            for j, message in enumerate(conversation, 1):
                text = message["content"] if message["role"] == "assistant" else ""
                for found in re.finditer("|".join(f"</{re.escape(t)}>" for t in self.tools), text):
                    tag, made = found.group()[2:-1], made + 1
                    after = text[found.end():].lstrip()
                    wrong = (f"</{tag}> without <{tag}> before it" if f"<{tag}>" not in text[:found.start()]
                             else f"</{tag}> is not followed by its result as the environment writes it, "
                                  f"{self.result.strip()!r}" if not after.startswith(head) or tail not in after else "")
                    if wrong:
                        raise ValueError(f"inline_tools: examples[{i}], message {j}: {wrong}")
            if made > self.max_calls:
                raise ValueError(f"inline_tools: examples[{i}]: {made} tool calls, past max_calls={self.max_calls} "
                                 "(an episode that calls more scores 0)")

    def default_system_prompt(self) -> str:
        tags = ", ".join(f"<{t}>...</{t}>" for t in self.tools)
        return (f"Answer the question. You can call tools by writing {tags} and stopping; the result follows "
                f"and you go on. You may call tools at most {self.max_calls} times. Give the final answer as "
                "<answer>...</answer>.")

    def default_retry(self) -> str:
        tags = " or ".join(f"<{t}>...</{t}>" for t in self.tools)
        return (f"That message has no tool call and no <answer>...</answer>. Call a tool with {tags}, or give "
                "the final answer as <answer>...</answer>.")

    def make_group(self, prompt: Prompt, n: int) -> list["InlineToolsEnv"]:
        return [self.make_one(prompt, n, j) for j in range(n)]

    def make_one(self, prompt: Prompt, n: int, j: int) -> "InlineToolsEnv":
        return InlineToolsEnv(self, prompt)


class InlineToolsEnv:
    def __init__(self, spec: InlineTools, prompt: Prompt):
        self.spec, self.prompt = spec, prompt
        self.written = ""  # what the model wrote in its message so far (not the results)
        self.calls = self.errors = self.retries = 0

    async def initial_observation(self) -> list[dict]:
        return opening(self.prompt, self.spec.system_prompt, self.spec.default_system_prompt(), self.spec.examples)

    async def step(self, action: Action) -> StepResult:
        self.written += action.text
        # rollout.stop holds the closing tags, so a stretch holds one only where it stopped (the rest
        # of that token after it, at most)
        ends = {t: action.text.rfind(f"</{t}>") for t in self.spec.tools}
        closing = max(ends, key=ends.get)
        if action.finish != "stop" or ends[closing] < 0:  # the model ended its message: its answer
            spec = self.spec
            if spec.retry is not None and action.finish == "stop" and self.retries < spec.max_retries \
                    and not ANSWER.search(self.written):  # neither a call nor an answer: ask again
                self.retries += 1
                self.written = ""  # the next message is a new attempt: scored on its own
                text = spec.default_retry() if spec.retry == "default" else spec.retry
                return StepResult([{"role": "user", "content": text}], 0.0, done=False, info=self._info())
            reward = await spec.score(self.written, self.prompt.answer)
            return StepResult([], reward, done=True, info=self._info(solved=reward))
        self.calls += 1
        if self.calls > self.spec.max_calls:
            return StepResult([], 0.0, done=True, info=self._info(call_limit=1.0))
        end = ends[closing]
        start = action.text.rfind(f"<{closing}>", 0, end)
        if start < 0:
            self.errors += 1
            output = f"error: </{closing}> without <{closing}> before it"
        else:
            try:
                query = action.text[start + len(closing) + 2: end]
                output = result_text(await call(self.spec.tools[closing], query))
            except ToolError as e:  # the function refusing the model's input: the model's mistake, shown
                self.errors += 1
                output = f"error: {e}"
        output = cut(output, self.spec.output_chars)
        return StepResult([], 0.0, done=False, continuation=self.spec.result.format(result=output),
                          info=self._info())

    def _info(self, **extra: float) -> dict:
        retries = {"invalid_actions": self.retries} if self.spec.retry is not None else {}
        return {"tool_calls": self.calls, "tool_errors": self.errors, **retries, **extra}
