"""How a model writes its tool calls, and how the tools are described to it.

A model calls tools in the format it was trained on. `ToolFormat` reads calls out of a reply,
writes calls back as the model would (an assistant message of an agent's conversation), and
describes the tools in a system message for templates that do not describe them themselves.

- `hermes` (Qwen2.5 / Qwen3, Hermes, SmolLM2's function-calling data): the tools as JSON inside
  `<tools>...</tools>`; each call a `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  block (one call or a list per block), anywhere in the reply; a last block the turn ended
  before closing is read where it holds whole JSON, as vLLM reads it.
- `llama3_json` (Llama 3.1 to 3.3's JSON tool calling; vLLM's `llama3_json` parser): the reply
  *is* the call, a JSON object `{"name": ..., "parameters": {...}}` (`arguments` is read too),
  several separated by `;`. A reply is read as calls when it starts with `{"name"` and its first
  object has `parameters` or `arguments`; any other reply is the final answer.
- `mistral` (Mistral's `[TOOL_CALLS]`): a JSON list of `{"name": ..., "arguments": {...}}` after
  the `[TOOL_CALLS]` marker. The marker is a special token, which the decoded turn leaves out
  (`rollover.envs.base.Action.text`), so a reply with a `[{"name"` list in it whose first object
  has `arguments` is read as calls from there too. The text before is the message's content. The calls' `id`s (Mistral's
  models write them, nine letters and digits) are kept; results must carry them back (`tool_call_id`), and its
  templates refuse ids other than nine letters and digits, so calls without one get such an id
  (`call_id`).
- `qwen3_coder` (Qwen3-Coder, Qwen3.5 and later Qwen models; vLLM's `qwen3_coder` parser): XML, one
  call a block, each argument's value written as text:

      <tool_call>
      <function=calculator>
      <parameter=expression>
      17 * 23
      </parameter>
      </function>
      </tool_call>

  A value is read by the type the tool's schema gives its parameter (`schemas`): a string as
  written (one newline either side dropped), integers, numbers, booleans, objects and arrays as
  JSON (a Python literal is read too); a value that is not of its type is a problem of that call.
  A whole `<function=...>...</function>` written without its `<tool_call>` block, or in a last
  block the turn ended before closing, is read as a call too, as vLLM does.

- `glm45` (GLM-4.5, 4.6 and 4.7; vLLM's `glm45` and `glm47` parsers): the tool's name after
  `<tool_call>`, then each argument as a key and a value in tags:

      <tool_call>calculator
      <arg_key>expression</arg_key>
      <arg_value>17 * 23</arg_value>
      </tool_call>

  (GLM-4.7 writes no newlines; both are read). A value is read as `qwen3_coder` reads it: by the
  type the tool's schema gives it, and as text where it gives none (as vLLM 0.32's parser reads it).
  A last block the turn ended before closing is read where it ends with a whole `</arg_value>`.

`parse(text, schemas)` takes the tools' JSON-schema `parameters` by name (`schemas_of`); only
`qwen3_coder` and `glm45` need them. `read(fmt, reply, schemas)` is how an environment reads a reply: a
thinking model's reasoning (`<think>...</think>`) is left out, as vLLM's reasoning parsers leave
it out of the message whose calls they read, so a call drafted while thinking does not run.

What is not read: Mistral's newer `[TOOL_CALLS]name[ARGS]{...}` form (its markers are special
tokens too, and without them the name and arguments run together), and Llama's built-in tools
(`<|python_tag|>` code for its code interpreter).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Callable

from rollover.types import split_reasoning  # (reasoning, the rest) of a reply


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    id: str | None = None  # the id the model wrote for it (Mistral's), else None


def call_id(turn: int, place: int) -> str:
    """A call's id where the model wrote none: by turn and place (the same in a replay), nine
    letters and digits (Mistral's templates refuse other ids)."""
    return f"c{turn % 10_000:04d}x{place % 1000:03d}"


@dataclass(frozen=True)
class Parsed:
    calls: list[ToolCall]
    problems: list[str]  # what was wrong with what was meant as a call (the model's mistakes)
    content: str  # the reply without its calls


def as_call(item) -> ToolCall | str:
    """A call from its JSON (`arguments`, or Llama's `parameters`, an object or a JSON string of
    one, or absent; Mistral's `id` kept), or what is wrong with it."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return 'expected {"name": ..., "arguments": {...}}'
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return "arguments are a string that is not JSON"
    if not isinstance(arguments, dict):
        return "arguments must be an object"
    given = item.get("id")  # kept where Mistral's templates take it: nine letters and digits
    valid = isinstance(given, str) and re.fullmatch(r"[A-Za-z0-9]{9}", given)
    return ToolCall(item["name"], arguments, given if valid else None)


def _calls_of(payload, where: str, calls: list[ToolCall], problems: list[str]) -> None:
    for item in payload if isinstance(payload, list) else [payload]:
        call = as_call(item)
        if isinstance(call, str):
            problems.append(f"{where}: {call}")
        else:
            calls.append(call)


# a `<tool_call>` block: its body may not hold another `<tool_call>`, so each opening tag is scanned
# to the next tag only (a reply of many unclosed tags reads in linear time, not quadratic)
TOOL_CALL_BLOCK = re.compile(r"<tool_call>((?:(?!<tool_call>).)*?)</tool_call>", re.DOTALL)


def closed_blocks(text: str, whole: Callable[[str], bool]) -> tuple[list[str], str, list[str]]:
    """(the bodies of `text`'s `<tool_call>` blocks, the text without them, problems): a last block the
    turn ended before closing is read too where its body is a whole call (`whole(body)`), as vLLM's
    parsers read it (a model that stops after the call, before `</tool_call>`); any other block left
    open is a problem."""
    blocks, content = TOOL_CALL_BLOCK.findall(text), TOOL_CALL_BLOCK.sub("", text)
    open_at = content.find("<tool_call>")
    if open_at < 0:
        return blocks, content, []
    body = content[open_at + len("<tool_call>"):]
    if content.count("<tool_call>") == 1 and whole(body):
        return blocks + [body], content[:open_at], []
    return blocks, content, ["a <tool_call> is not closed with </tool_call>"]


def _json_call(body: str) -> bool:
    """Whether `body` is JSON as a Hermes block holds it (a call or a list), all of it."""
    try:
        json.loads(body)
    except (ValueError, RecursionError):
        return False
    return True


def schemas_of(tools: list) -> dict[str, dict]:
    """Each tool's JSON-schema `parameters` by name, from OpenAI's `{"type": "function", "function":
    {...}}` form or the function itself (`Tool.schema()`)."""
    out = {}
    for t in tools or ():
        fn = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
    return out


def _schemas(tools: list) -> str:
    """One JSON line per tool: OpenAI's `{"type": "function", "function": {...}}` or the function itself."""
    return "\n".join(json.dumps(t.get("function", t) if isinstance(t, dict) else t) for t in tools)


class Hermes:
    name = "hermes"

    def parse(self, text: str, schemas: dict | None = None) -> Parsed:
        calls: list[ToolCall] = []
        problems: list[str] = []
        blocks, content, unclosed = closed_blocks(text, _json_call)
        for i, block in enumerate(blocks, 1):
            try:
                payload = json.loads(block)
            except json.JSONDecodeError as e:
                problems.append(f"tool call {i} is not valid JSON ({e.msg})")
                continue
            except RecursionError:
                problems.append(f"tool call {i} is nested too deeply to read")
                continue
            _calls_of(payload, f"tool call {i}", calls, problems)
        return Parsed(calls, problems + unclosed, content.strip())

    def write(self, calls: list[tuple[str, str]]) -> str:
        return "\n".join(f'<tool_call>{{"name": {json.dumps(n)}, "arguments": {args}}}</tool_call>' for n, args in calls)

    def instructions(self, tools: list) -> str:
        return ("You can call tools. They are described here as JSON:\n"
                f"<tools>\n{_schemas(tools)}\n</tools>\n"
                'To call a tool, write <tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call> and stop; '
                "the result comes back in the next message.")


def _json_sequence(text: str, sep: str) -> tuple[list, str | None]:
    """The JSON values at the start of `text`, separated by `sep` (one after the last is allowed),
    and what is wrong after them."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            return values, f"not valid JSON at character {e.pos} ({e.msg})"
        except RecursionError:
            return values, "nested too deeply to read"
        values.append(value)
        rest = text[i:].lstrip()
        if not rest:
            return values, None
        if not rest.startswith(sep):
            return values, f"unexpected text after the call: {rest[:40]!r}"
        rest = rest[len(sep):].lstrip()
        if not rest:
            return values, None
        i = len(text) - len(rest)


def _meant_as_call(body: str, kind: type, written_as_call: re.Pattern) -> bool:
    """Whether a reply's JSON, where calls are unmarked (Llama's object, Mistral's list without its
    special token), is a call: its first object has `arguments` (or Llama's `parameters`); JSON
    that does not read is a call only if it begins as one (`written_as_call`), else an answer that
    holds JSON-like text (code, a record with `...`)."""
    try:
        first, _ = json.JSONDecoder().raw_decode(body)
    except (json.JSONDecodeError, RecursionError):
        return bool(written_as_call.match(body))
    if kind is list:  # Mistral's: its calls have `arguments`
        first = first[0] if isinstance(first, list) and first else None
        return not isinstance(first, dict) or "arguments" in first
    return not isinstance(first, dict) or "parameters" in first or "arguments" in first


def _read(body: str, sep: str, content: str) -> Parsed:
    """The calls of a reply whose calls are JSON values (calls or lists of calls) joined by `sep`."""
    values, wrong = _json_sequence(body, sep)
    calls: list[ToolCall] = []
    problems = [f"tool call: {wrong}"] if wrong else []
    for i, value in enumerate(values, 1):
        _calls_of(value, f"tool call {i}", calls, problems)
    return Parsed(calls, problems, content)


class Llama3Json:
    name = "llama3_json"
    START = re.compile(r'^\s*(<\|python_tag\|>)?\s*\{\s*"name"')
    CALL = re.compile(r'\{\s*"name"\s*:\s*"[^"]*"\s*,\s*"(parameters|arguments)"\s*:')  # written as a call

    def parse(self, text: str, schemas: dict | None = None) -> Parsed:
        if not self.START.match(text):
            return Parsed([], [], text.strip())
        body = text.strip().removeprefix("<|python_tag|>").lstrip()
        if not _meant_as_call(body, dict, self.CALL):
            return Parsed([], [], text.strip())  # a JSON answer with a "name" field, not a call
        return _read(body, ";", "")

    def write(self, calls: list[tuple[str, str]]) -> str:
        return "; ".join(f'{{"name": {json.dumps(n)}, "parameters": {args}}}' for n, args in calls)

    def instructions(self, tools: list) -> str:
        return ("You can call functions. They are described here as JSON:\n"
                f"{_schemas(tools)}\n"
                'To call one, reply with only a JSON object {"name": "<function name>", "parameters": {...}} '
                "(several calls separated by ;) and stop; the result comes back in the next message.")


class Mistral:
    name = "mistral"
    MARK = "[TOOL_CALLS]"
    START = re.compile(r'\[\s*\{\s*"name"')
    CALL = re.compile(r'\[\s*\{\s*"name"\s*:\s*"[^"]*"\s*,\s*"arguments"\s*:')  # written as a call

    def parse(self, text: str, schemas: dict | None = None) -> Parsed:
        if self.MARK in text:
            content, _, body = text.partition(self.MARK)
        elif found := self.START.search(text):  # the marker was a special token, left out of the decoded turn
            content, body = text[:found.start()], text[found.start():]
            if not _meant_as_call(body, list, self.CALL) or content.rstrip().endswith("<tool_call>"):
                return Parsed([], [], text.strip())  # a JSON answer with names in it, or a Hermes block: not calls
        else:
            return Parsed([], [], text.strip())
        return _read(body.strip(), self.MARK, content.strip())

    def write(self, calls: list[tuple[str, str]]) -> str:
        return self.MARK + "[" + ", ".join(f'{{"name": {json.dumps(n)}, "arguments": {args}}}' for n, args in calls) + "]"

    def instructions(self, tools: list) -> str:
        return ("You can call tools. They are described here as JSON:\n"
                f"{_schemas(tools)}\n"
                f'To call tools, write {self.MARK} and then a JSON list [{{"name": "<tool name>", "arguments": {{...}}}}] '
                "and stop; the results come back in the next messages.")


class Qwen3Coder:
    name = "qwen3_coder"
    FUNCTION = re.compile(r"<function=([^<>]*)>(.*?)(</function>|\Z)", re.DOTALL)
    BARE = re.compile(r"<function=[^<>]*>.*?</function>", re.DOTALL)  # a whole call written without its block
    PARAMETER = re.compile(r"<parameter=([^<>]*)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)

    def parse(self, text: str, schemas: dict | None = None) -> Parsed:
        blocks, content, unclosed = closed_blocks(text, lambda body: bool(self.BARE.search(body)))
        problems: list[str] = []
        if not blocks and not unclosed and (bare := self.BARE.search(text)):  # a whole call without its block, as vLLM reads it
            blocks, content = [text[bare.start():]], text[:bare.start()]
        calls: list[ToolCall] = []
        for i, block in enumerate(blocks, 1):
            functions = self.FUNCTION.findall(block)
            if not functions:
                problems.append(f"tool call {i}: expected <function=NAME> with <parameter=NAME>value</parameter> "
                                "inside, closed by </function>")
            for name, body, closed in functions:
                call = self._call(name.strip(), body, closed, (schemas or {}).get(name.strip()))
                if isinstance(call, ToolCall):
                    calls.append(call)
                else:
                    problems.append(f"tool call {i}: {call}")
        return Parsed(calls, problems + unclosed, content.strip())

    def _call(self, name: str, body: str, closed: str, schema: dict | None) -> ToolCall | str:
        if not name:
            return "<function=> needs the tool's name"
        if not closed:
            return f"<function={name}> is not closed with </function>"
        properties = _properties(schema)
        arguments: dict = {}
        for key, value in self.PARAMETER.findall(body):
            key = key.strip()
            if key in arguments:
                return f"argument {key!r} is given twice"
            value = value.removeprefix("\n").removesuffix("\n")
            try:
                arguments[key] = typed(value, properties.get(key))
            except ValueError as e:
                return f"argument {key!r} {e}"
        return ToolCall(name, arguments)

    def write(self, calls: list[tuple[str, str]]) -> str:
        return "\n".join(f"<tool_call>\n<function={n}>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n"
                                                                for k, v in _text_arguments(n, args))
                         + "</function>\n</tool_call>" for n, args in calls)

    def instructions(self, tools: list) -> str:
        return ("You can call tools. They are described here as JSON:\n"
                f"<tools>\n{_schemas(tools)}\n</tools>\n"
                "To call a tool, write\n<tool_call>\n<function=TOOL NAME>\n<parameter=ARGUMENT NAME>\nvalue\n</parameter>\n"
                "</function>\n</tool_call>\n(one <parameter> per argument) and stop; the result comes back in the next message.")


class Glm45:
    name = "glm45"
    NAME = re.compile(r"\s*([^\s<>{}\[\]\"',:]+)\s*")  # the tool's name, before its first argument
    # a key and its value, each scanned to the next tag only (a reply of many unclosed tags reads in linear time)
    PAIR = re.compile(r"<arg_key>((?:(?!</?arg_key>).)*?)</arg_key>\s*<arg_value>((?:(?!<arg_key>|</?arg_value>).)*?)</arg_value>",
                      re.DOTALL)

    def parse(self, text: str, schemas: dict | None = None) -> Parsed:
        blocks, content, unclosed = closed_blocks(text, lambda body: body.rstrip().endswith("</arg_value>"))
        calls: list[ToolCall] = []
        problems: list[str] = []
        for i, block in enumerate(blocks, 1):
            call = self._call(block, schemas or {})
            if isinstance(call, ToolCall):
                calls.append(call)
            else:
                problems.append(f"tool call {i}: {call}")
        return Parsed(calls, problems + unclosed, content.strip())

    def _call(self, block: str, schemas: dict) -> ToolCall | str:
        first = block.find("<arg_key>")
        head, pairs = (block, "") if first < 0 else (block[:first], block[first:])
        named = self.NAME.fullmatch(head)
        if not named:
            return ("expected the tool's name after <tool_call>, then each argument as "
                    "<arg_key>NAME</arg_key><arg_value>value</arg_value>")
        name = named.group(1)
        properties = _properties(schemas.get(name))
        arguments: dict = {}
        for key, value in self.PAIR.findall(pairs):
            key = key.strip()
            if key in arguments:
                return f"argument {key!r} is given twice"
            try:
                arguments[key] = typed(value, properties.get(key))
            except ValueError as e:
                return f"argument {key!r} {e}"
        if self.PAIR.sub("", pairs).strip():
            return f"{name}: each argument must be <arg_key>NAME</arg_key> then <arg_value>value</arg_value>"
        return ToolCall(name, arguments)

    def write(self, calls: list[tuple[str, str]]) -> str:
        return "\n".join(f"<tool_call>{n}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n"
                                                       for k, v in _text_arguments(n, args)) + "</tool_call>"
                         for n, args in calls)

    def instructions(self, tools: list) -> str:
        return ("You can call tools. They are described here as JSON:\n"
                f"<tools>\n{_schemas(tools)}\n</tools>\n"
                "To call a tool, write\n<tool_call>TOOL NAME\n<arg_key>ARGUMENT NAME</arg_key>\n<arg_value>value</arg_value>\n"
                "</tool_call>\n(one <arg_key> and <arg_value> per argument) and stop; the result comes back in the next message.")


def _properties(schema) -> dict:
    """A tool's JSON-schema `properties` (each argument's schema by name), {} where it has none."""
    properties = schema.get("properties") if isinstance(schema, dict) else None
    return properties if isinstance(properties, dict) else {}


def _text_arguments(name: str, args: str) -> list[tuple[str, str]]:
    """A call's JSON arguments as (name, value written as text) pairs: strings as they are, any other
    value as JSON (how XML-style formats write them)."""
    given = json.loads(args)
    if not isinstance(given, dict):
        raise ValueError(f"tool call {name!r}: arguments must be a JSON object to write as tags, got {args!r:.60}")
    return [(k, v if isinstance(v, str) else json.dumps(v)) for k, v in given.items()]


_JSON_TYPES = {"integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


def typed(text: str, schema: dict | None):
    """A value written as text (`qwen3_coder`'s and `glm45`'s arguments) read by its JSON schema's
    `type` (or the types of its `anyOf` / `oneOf` alternatives): a string as written (also where the
    schema gives no type, or allows a string among others), `null` as None where the schema allows it (a `null` type,
    `nullable`), any other type from JSON or a Python literal that JSON can hold (finite numbers); a
    ValueError saying what it should be."""
    schema = schema if isinstance(schema, dict) else {}
    alternatives = [a for key in ("anyOf", "oneOf") if isinstance(schema.get(key), list) for a in schema[key]
                    if isinstance(a, dict)]
    kinds = _types(schema) + [k for a in alternatives for k in _types(a)]
    nullable = "null" in kinds or any(s.get("nullable") is True for s in (schema, *alternatives))
    if nullable and text.strip() == "null":
        return None
    wanted = [k for k in kinds if k in _JSON_TYPES]
    if not wanted or "string" in kinds:
        return text
    raw = text.strip()
    if "boolean" in wanted and raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    value = _literal(text)
    for k in wanted:
        if k == "integer" and isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, _JSON_TYPES[k]) and not (k != "boolean" and isinstance(value, bool)):
            return value
    raise ValueError(f"must be {' or '.join(wanted)}, got {raw[:40]!r}")


def type_error(value, schema: dict | None) -> str | None:
    """What is wrong with a JSON argument `value` for its schema's `type` (or its `anyOf` /
    `oneOf` alternatives'), or None: a schema or an alternative without a type (a `$ref`, an
    `enum`) takes anything, as does `object` (what transformers writes for a hint it cannot
    describe: an Enum, a set, a class); an integer may be written 2.0, a bool is not a number."""
    schema = schema if isinstance(schema, dict) else {}
    alternatives = [a for key in ("anyOf", "oneOf") if isinstance(schema.get(key), list) for a in schema[key]
                    if isinstance(a, dict)]
    if any(not _types(a) for a in alternatives):
        return None
    kinds = _types(schema) + [k for a in alternatives for k in _types(a)]
    if "object" in kinds:
        return None
    if value is None and ("null" in kinds or any(s.get("nullable") is True for s in (schema, *alternatives))):
        return None
    known = [k for k in kinds if k in _JSON_TYPES or k in ("string", "null")]
    if len(known) < len(kinds) or not kinds:  # a type this check does not know: the tool decides
        return None
    for k in known:
        if k == "string" and isinstance(value, str) or k == "null" and value is None:
            return None
        if k == "integer" and isinstance(value, float) and value.is_integer():
            return None
        if k in _JSON_TYPES and isinstance(value, _JSON_TYPES[k]) and not (k != "boolean" and isinstance(value, bool)):
            return None
    return f"must be {' or '.join(known)}, got {json.dumps(value)[:40]}"


def _literal(text: str):
    """`text` read as JSON, else as a Python literal, where the value is one JSON can hold (no sets,
    bytes, complex numbers, NaN or infinity), as JSON holds it; else `text` itself."""
    raw = text.strip()
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # (a JSONDecodeError, or an integer past Python's digit limit)
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return text
    try:
        return json.loads(json.dumps(value, allow_nan=False))  # as JSON holds it: a tuple a list, keys strings
    except (TypeError, ValueError, RecursionError):
        return text


def _types(schema: dict) -> list[str]:
    kind = schema.get("type")
    return [kind] if isinstance(kind, str) else [k for k in kind if isinstance(k, str)] if isinstance(kind, list) else []


ToolFormat = Hermes | Llama3Json | Mistral | Qwen3Coder | Glm45
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Llama3Json(), Mistral(), Qwen3Coder(), Glm45())}


def read(fmt: "ToolFormat", text: str, schemas: dict | None = None, opened: bool = False) -> Parsed:
    """The calls of a reply in `fmt`, read outside its reasoning (`split_reasoning`; `opened`: the
    turn began inside an open `<think>`); the content keeps the reasoning."""
    reasoning, rest = split_reasoning(text, opened)
    parsed = fmt.parse(rest, schemas)
    if not reasoning:
        return parsed
    return Parsed(parsed.calls, parsed.problems, "\n\n".join(p for p in (reasoning.strip(), parsed.content) if p))


def described_format(text: str) -> str | None:
    """The call format a chat template's own words ask for (`text`: an opening it rendered with a
    tool that describes nothing, `PROBE_TOOL`), where they say so plainly: `<function=...>` with
    `<parameter=...>` (qwen3_coder), `<arg_key>` tags (glm45), else `<tool_call>` blocks (hermes);
    None where they do not."""
    if "<function=" in text and "<parameter=" in text:
        return "qwen3_coder"
    if "<arg_key>" in text and "<arg_value>" in text:
        return "glm45"
    return "hermes" if "<tool_call>" in text else None


# a tool with nothing in its description, for reading a chat template's own words about tools
PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "",
                                               "parameters": {"type": "object", "properties": {}}}}


def tool_format(name: str) -> ToolFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown tool_format {name!r}; known: {', '.join(FORMATS)}")
    return FORMATS[name]
