"""A tool-calling environment: a calculator and a sandboxed Python tool, a final answer scored.

Format. SmolLM2's chat template has no tool support (it renders every message as
`<|im_start|>{role}\\n{content}<|im_end|>` and ignores a `tools` argument), so the tools and
the call format are described in the system message, in the plain format SmolLM2's
function-calling data and Qwen2.5/Hermes use:

    <tools>
    {"name": "calculator", "description": ..., "parameters": {JSON schema}}
    </tools>

and the model calls them inside its reply, one JSON object (or a list of them) per block:

    <tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>

`tool_format` picks another format models are trained on (Llama 3's JSON reply, Mistral's
`[TOOL_CALLS]` list, Qwen3-Coder's and Qwen3.5's XML, GLM-4.5's `<arg_key>` tags;
`rollover.envs.tool_formats`).
`system_prompt` replaces that description; `examples`, worked conversations before the
question (`rollover.envs.opening`), are how a small model is shown the format it would not take
from a description alone. `tools_in="template"` hands the tools to a chat template that
describes them itself (Qwen2.5's, Hermes', Qwen3.5's), in the words its model was trained on.

Each result comes back as a message with role `tool` (and the tool's `name`). In ChatML the role
is written out (`<|im_start|>tool\\n391<|im_end|>`), so the model can tell a result from the
user, and templates with tool support (Qwen2.5, Llama 3.1) render `tool` messages in their own
way. For a template that refuses unknown roles, `result_role="user"` sends results as user
messages wrapped in `<tool_response>...</tool_response>`.

A reply without a tool call is the final answer and ends the episode: `score(reply, answer)`
is the reward (default: the `numeric` reward, the last number of the `\\boxed{}` or of the
reply). Calls are read outside a thinking model's `<think>...</think>` (a call drafted while
thinking does not run; a turn the chat template opened inside `<think>` and that was cut off
before `</think>` is all reasoning: `Action.opened_reasoning`). A reply whose calls would pass `max_tool_calls` in the episode ends it
with reward 0 (its calls not run). An answer that calls a known tool, with arguments it takes, in another format
than `tool_format` is still the answer (the model did not call as told), but it is counted
(`info` `calls_in_other_format`, over the episodes that answered) and the first one is logged
naming the format it is in: a model that never seems to call its tools may call them the way
it was trained to.

Errors. A malformed call, an unknown tool, wrong arguments, or a tool that raises `ToolError`
(the calculator's refusals) are the model's mistakes: the result message says what was wrong
and the episode goes on. Anything else a tool raises (a `SandboxError`: the sandbox itself
failed) is the environment's failure and fails the episode (`rollover.envs.episode`).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import logging
import math
import operator
from dataclasses import dataclass
from typing import Callable

from rollover.envs.base import Action, Opening, StepResult, cut, in_thread
from rollover.envs.opening import check_system_prompt, opening, worked_examples
from rollover.envs.tool_formats import (FORMATS, PROBE_TOOL, Hermes, ToolCall, call_id, described_format, read, tool_format,
                                        type_error)
from rollover.envs.score import Score
from rollover.types import Prompt

log = logging.getLogger("rollover")


class ToolError(Exception):
    """A tool refusing its input: shown to the model as the result, not an environment failure."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    run: Callable[..., str]  # called with the arguments as keywords, in a worker thread (awaited if async)

    def schema(self) -> dict:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


_CONTAINERS = (dict, list, tuple, set, frozenset)


def _as_json(value):
    """A tool's result as JSON holds it, the same in every process: a tuple a list, a set a sorted
    list (its iteration order follows string hashing, which differs between processes, so a
    resumed episode's replay would read another answer)."""
    if isinstance(value, dict):
        return {key: _as_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_json(item) for item in value]
    if isinstance(value, (set, frozenset)):
        items = [_as_json(item) for item in value]
        return sorted(items, key=lambda item: json.dumps(item, default=str, sort_keys=True))
    return value


def result_text(result) -> str:
    """What a tool's return shows the model: text as it is; a dict, list, tuple or set as JSON (a
    set sorted, the same in every process); anything else its `str`."""
    if isinstance(result, str):
        return result
    return json.dumps(_as_json(result), default=str) if isinstance(result, _CONTAINERS) else str(result)


def function_tool(fn: Callable) -> Tool:
    """A Python function (or `async def`) as a tool, TRL's `tools=[fn]`: its name, its docstring's
    first part and its typed arguments (Google-style `Args:` descriptions) make the schema, as
    transformers' `get_json_schema` reads them. Whatever it raises (an `Exception`) is shown to the
    model as `error: <type>: <message>` and counted in the episode's `tool_errors` (a
    `SystemExit` too; not a `KeyboardInterrupt`); what it returns is shown as text (a dict, list,
    tuple or set as JSON, a set sorted; values JSON cannot hold as their `str`)."""
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)["function"]
    except Exception as e:  # transformers' docstring and type-hint parsing errors
        raise ValueError(f"tool {getattr(fn, '__name__', fn)!r}: {e}") from None
    try:
        starred = [p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.VAR_POSITIONAL]
    except (TypeError, ValueError):
        starred = []
    if starred:  # a call names its arguments: *args would take none of them
        raise ValueError(f"tool {getattr(fn, '__name__', fn)!r}: *{starred[0]} cannot be given by name, as a tool "
                         "call gives every argument: name each argument (a list argument takes many values)")

    def refused(e: BaseException) -> ToolError:
        return ToolError(f"{type(e).__name__}: {e}")

    if inspect.iscoroutinefunction(fn):
        async def run(**arguments):
            try:
                result = await fn(**arguments)
            except ToolError:
                raise
            except asyncio.CancelledError as e:
                if asyncio.current_task().cancelling():  # the episode is being cancelled, not the tool failing
                    raise
                raise refused(e) from e
            except (KeyboardInterrupt, GeneratorExit):
                raise
            except BaseException as e:  # SystemExit from argparse or sys.exit too: the tool's, shown
                raise refused(e) from e
            return result_text(result)
    else:
        def run(**arguments):
            try:
                result = fn(**arguments)
            except ToolError:
                raise
            except (KeyboardInterrupt, GeneratorExit):
                raise
            except BaseException as e:
                raise refused(e) from e
            return result_text(result)
    return Tool(schema["name"], schema.get("description", ""), schema["parameters"], run)


# --- the calculator -----------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**50  # every literal, intermediate and result stays below this in absolute value
_MAX_LOG10 = 50

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """Evaluate arithmetic: numbers, + - * / // % **, unary signs and parentheses; nothing else
    (no names, calls or attributes: the expression is walked as an AST, never `eval`ed). A power
    whose result would reach `MAX_MAGNITUDE` is refused before it is computed."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):  # ValueError: a null byte
        raise ToolError(f"not an arithmetic expression: {expression!r}") from None
    return _format(_evaluate(tree.body))


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(left) > 1 and right * math.log10(abs(left)) >= _MAX_LOG10:
            raise ToolError(f"{left} ** {right} is too large (limit {MAX_MAGNITUDE:.0e})")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result too large") from None
        return _bounded(value)
    raise ToolError(f"not arithmetic: {type(node).__name__} (use numbers, + - * / // % ** and parentheses)")


def _bounded(value) -> int | float:
    if isinstance(value, complex):
        raise ToolError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result too large")
    if abs(value) >= MAX_MAGNITUDE:
        raise ToolError(f"result too large (limit {MAX_MAGNITUDE:.0e})")
    return value


def _format(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"


CALCULATOR = Tool(
    "calculator",
    "Evaluate an arithmetic expression with + - * / // % ** and parentheses, e.g. '(17 + 3) * 4'.",
    {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    calculate,
)


def _run_python(code: str) -> str:
    from rollover.rewards.sandbox import python_tool  # Linux and root only: imported when used

    return python_tool(code)


PYTHON = Tool(
    "python",
    "Run a Python program in a sandbox (no network, no files outside its directory, a few "
    "seconds) and return what it prints. Use print() to see values.",
    {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    _run_python,
)


# --- parsing tool calls -------------------------------------------------------------------------

def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """The Hermes-format calls in a reply, and what was wrong with the blocks that are not calls
    (`rollover.envs.tool_formats.Hermes`: a block is `<tool_call>JSON</tool_call>`, the JSON one
    call or a list of calls; a `<tool_call>` without its closing tag is a problem, but for a last one
    holding whole JSON: the turn ended before closing it)."""
    parsed = Hermes().parse(text)
    return parsed.calls, parsed.problems


# --- the environment ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolUse:
    """The group builder: the tools, the limits, the format of results, the final score."""

    tools: tuple[Tool, ...] = (CALCULATOR, PYTHON)
    max_tool_calls: int = 4
    result_role: str = "tool"  # or "user" (results wrapped in <tool_response> tags)
    # the final reply's score: a reward's name (numeric, math, exact, em), `module:function` or a function
    # f(reply, answer) (rollover.envs.score.Score)
    score: Callable[[str, object], float] | str = "numeric"
    reasoning: str = "keep"  # "drop": the score sees what follows a thinking model's </think>
    tool_format: str = "hermes"  # how calls are written: hermes, llama3_json, mistral, qwen3_coder, glm45 (rollover.envs.tool_formats)
    # the system message that describes the tools ("default": `default_system_prompt()`); None: none,
    # for prompts that carry their own
    system_prompt: str | None = "default"
    # worked conversations before the task (rollover.envs.opening): user, assistant (calls written in
    # `tool_format`) and tool messages (results, written as the environment writes them)
    examples: tuple = ()
    # where the tools are described: "system" (in the system message, in rollover's words, which any
    # template carries) or "template" (the chat template's `tools=`, in its own words: for models
    # trained on their template's tool format, Qwen2.5's and Hermes')
    tools_in: str = "system"
    # a result longer than this many characters is cut there, "[truncated]" marking it (verl's
    # max_tool_response_length, in characters); None: shown whole (a huge one ends the episode at
    # env.max_total_tokens, finish "length")
    output_chars: int | None = None

    def __post_init__(self):
        if self.output_chars is not None and (isinstance(self.output_chars, bool) or not isinstance(self.output_chars, int)
                                              or self.output_chars < 1):
            raise ValueError(f"tools: output_chars must be an integer >= 1 (or null), got {self.output_chars!r}")
        if self.tools_in not in ("system", "template"):
            raise ValueError(f"tools: tools_in must be 'system' or 'template', got {self.tools_in!r}")
        object.__setattr__(self, "score", Score(self.score, "tools", self.reasoning))
        reader = tool_format(self.tool_format)  # a name it knows

        known = {t.name: t for t in self.tools}
        schemas = {name: t.parameters for name, t in known.items()}

        def calls(text: str) -> tuple[list[str], list[str]]:  # as step() would read and run them
            parsed = read(reader, text, schemas)
            problems = list(parsed.problems)
            problems += [wrong for call in parsed.calls if (wrong := _refusal(known, call))]
            return [c.name for c in parsed.calls], problems

        check_system_prompt(self.system_prompt, "tools")
        examples = worked_examples(self.examples, "tools", ("user", "assistant", "tool"), calls, self.max_tool_calls)
        if self.tool_format == "mistral" and any(m["role"] == "tool" for e in examples for m in e):
            raise ValueError("tools: examples cannot hold tool calls with tool_format mistral (its templates match "
                             "each result to a call id an example does not carry)")
        object.__setattr__(self, "examples", examples)
        if self.max_tool_calls < 1:
            raise ValueError(f"ToolUse: max_tool_calls must be >= 1, got {self.max_tool_calls}")
        if self.result_role not in ("tool", "user"):
            raise ValueError(f"ToolUse: result_role must be 'tool' or 'user', got {self.result_role!r}")
        names = [t.name for t in self.tools]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"ToolUse: tools must be non-empty with distinct names, got {names}")

    def default_system_prompt(self) -> str:
        rules = (f"You may call tools at most {self.max_tool_calls} times. When you know the answer, reply without "
                 "a tool call and put the final answer in \\boxed{}.")
        if self.tools_in == "template":
            return rules
        return tool_format(self.tool_format).instructions([t.schema() for t in self.tools]) + " " + rules

    def opening_template_kwargs(self) -> dict:
        """What every opening gives the chat template: the tools (OpenAI's function form) with
        `tools_in="template"`, else nothing."""
        if self.tools_in != "template":
            return {}
        return {"tools": [{"type": "function", "function": t.schema()} for t in self.tools]}

    def check_rendering(self, render: Callable[..., str]) -> str | None:
        """What is wrong with how the model's chat template renders an opening (`render(**template_kwargs)`:
        its text): with `tools_in="template"`, a template whose own words (tried with a tool that
        describes nothing, so no tool's description speaks for it) ask for calls in another format than
        `tool_format`: every call would fail to read. None: nothing found."""
        if self.tools_in != "template":
            return None
        asked = described_format(render(tools=[PROBE_TOOL]))
        if asked is None or asked == self.tool_format:
            return None
        return (f"the chat template describes tool calls in the {asked} format, but env.options.tool_format is "
                f"{self.tool_format}: set env.options.tool_format: {asked}")

    def make_group(self, prompt: Prompt, n: int) -> list["ToolEnv"]:
        return [self.make_one(prompt, n, j) for j in range(n)]

    def make_one(self, prompt: Prompt, n: int, j: int) -> "ToolEnv":
        return ToolEnv(self, prompt)


class ToolEnv:
    def __init__(self, spec: ToolUse, prompt: Prompt):
        self.spec, self.prompt, self.calls, self.errors, self.turn = spec, prompt, 0, 0, 0
        self.tools = {t.name: t for t in spec.tools}
        self.schemas = {name: t.parameters for name, t in self.tools.items()}

    async def initial_observation(self) -> list[dict] | Opening:
        spec = self.spec
        messages = opening(self.prompt, spec.system_prompt, spec.default_system_prompt(), spec.examples,
                           lambda m: self._message(m["content"], m.get("name"), ""))
        kwargs = spec.opening_template_kwargs()
        return Opening(messages, kwargs) if kwargs else messages

    async def step(self, action: Action) -> StepResult:
        parsed = read(tool_format(self.spec.tool_format), action.text, self.schemas, action.opened_reasoning)
        calls, problems = parsed.calls, parsed.problems
        if not calls and not problems:
            reward = await self.spec.score(action.text, self.prompt.answer, action.opened_reasoning)
            other = self._other_format(action.text, opened=action.opened_reasoning)
            return StepResult([], reward, done=True, info=self._info(solved=reward, calls_in_other_format=float(bool(other))))
        if not calls:  # every call it meant failed to read: in another format? (logged once)
            self._other_format(action.text, "its calls fail to read and the model is shown why", action.opened_reasoning)
        if self.calls + len(calls) > self.spec.max_tool_calls:  # none of them runs (nor counts in tool_calls)
            return StepResult([], 0.0, done=True, info=self._info(tool_limit=1.0))
        self.calls += len(calls)
        self.turn += 1
        results = [(None, f"error: {p}", False) for p in problems]
        for call in calls:
            text, ok = await self._run(call)
            results.append((call.name, cut(text, self.spec.output_chars), ok))
        self.errors += sum(not ok for _, _, ok in results)
        ids = [None] * len(problems) + [c.id for c in calls]
        messages = [self._message(text, name, ids[i] or call_id(self.turn, i))
                    for i, (name, text, _) in enumerate(results)]
        return StepResult(messages, 0.0, done=False, info=self._info())

    async def _run(self, call: ToolCall) -> tuple[str, bool]:
        """The result the model is shown, and False if it is the model's mistake."""
        wrong = _refusal(self.tools, call)
        if wrong:
            return f"error: {wrong}", False
        tool = self.tools[call.name]
        try:
            if inspect.iscoroutinefunction(tool.run):
                return await tool.run(**call.arguments), True
            return await in_thread(tool.run, **call.arguments), True
        except ToolError as e:
            return f"error: {e}", False

    def _other_format(self, text: str, read_as: str = "it is read as the final answer", opened: bool = False) -> str | None:
        """The other tool format in which `text` calls one of the tools as it could run (a known tool, the
        arguments its schema names: not an echo of the tools' description), if any (logged once a process,
        saying how `tool_format` read it: `read_as`)."""
        for name, reader in FORMATS.items():
            if name != self.spec.tool_format and any(not _refusal(self.tools, c) for c in read(reader, text, self.schemas, opened).calls):
                if (self.spec.tool_format, name) not in _WARNED:
                    _WARNED.add((self.spec.tool_format, name))
                    log.warning("tools: a reply calls a tool in the %s format, but tool_format is %s: %s (set "
                                "env.options.tool_format: %s if the model calls tools that way; counted in info "
                                "calls_in_other_format): %.200r", name, self.spec.tool_format, read_as, name, text)
                return name
        return None

    def _message(self, content: str, name: str | None, call: str) -> dict:
        if self.spec.result_role == "user":
            return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        message = {"role": "tool", "content": content} | ({"name": name} if name else {})
        if self.spec.tool_format == "mistral":  # its templates match results to calls by a 9-character id
            message["tool_call_id"] = call
        return message

    def _info(self, **extra: float) -> dict:
        return {"tool_calls": self.calls, "tool_errors": self.errors, **extra}


_WARNED: set[tuple[str, str]] = set()  # (tool_format, the format a reply called in): logged already


def _refusal(tools: dict, call: ToolCall) -> str:
    """Why `call` cannot run ("" if it can): a tool not among `tools`, or arguments its schema refuses."""
    tool = tools.get(call.name)
    if tool is None:
        return f"unknown tool {call.name!r} (tools: {', '.join(tools)})"
    wrong = _check_arguments(tool, call.arguments)
    return f"{call.name}: {wrong}" if wrong else ""


def _check_arguments(tool: Tool, arguments: dict) -> str | None:
    """What is wrong with `arguments` for `tool`'s schema (names, and types as JSON gives them:
    `{"a": "1"}` for an integer is refused, not passed on as text), or None."""
    properties = tool.parameters.get("properties", {})
    missing = [k for k in tool.parameters.get("required", []) if k not in arguments]
    unknown = [k for k in arguments if k not in properties]
    if missing or unknown:
        return f"missing arguments {missing}, unknown arguments {unknown} (expected {sorted(properties)})"
    for k, v in arguments.items():
        wrong = type_error(v, properties[k])
        if wrong:
            return f"argument {k!r} {wrong}"
    return None
