"""The environment a run's config names (`env.name` + `env.options`), as an `EnvGroupBuilder`.

Built-ins: `guess_number` (`GuessNumber`), `arithmetic_retry` (`ArithmeticRetry`), `tools`
(`ToolUse`, tools named in `options.tools`: calculator, python, or your functions), `agent` (`AgentBuilder`: an
agent written against an OpenAI-style chat client, `options.fn`), `interpreter` (`Interpreter`:
Python run inside the model's own turn), `inline_tools` (`InlineTools`: your functions called by
tags inside the model's turn, Search-R1's form). Anything else is a reference,
`module:Name` or `path/to/file.py:Name`, to a class or factory that takes the options as
keyword arguments and returns an object with `make_group(prompt, n)` (and `prompts(n, seed)`
if the run draws its tasks from the environment: `data.train: env`).
"""

from __future__ import annotations

from typing import Any

from rollover.envs.base import EnvGroupBuilder


class ConfiguredTools:
    """`env.name: tools`: a `ToolUse` made from `env.options` (`tools`: built-in names, calculator
    and python, or functions as `module:function` / `path/to/file.py:function`), and those options
    for the same builder in another process (a Ray environment worker: files by absolute path)."""

    def __init__(self, tools: list[str] = ("calculator", "python"), **options: Any):
        from rollover.envs.tools import CALCULATOR, PYTHON, ToolUse, function_tool
        from rollover.rewards.registry import _absolute, load_reference

        known = {"calculator": CALCULATOR, "python": PYTHON}
        if isinstance(tools, str) or not all(isinstance(t, str) for t in tools):
            raise ValueError(f"env.options.tools={tools!r}: a list of tool names or 'file.py:function' references")
        unknown = [t for t in tools if t not in known and ":" not in t]
        if unknown:
            raise ValueError(f"env.options.tools: unknown tools {unknown}; known: {sorted(known)}, or a function "
                             "as 'module:function' or 'path/to/file.py:function'")
        self.sources = [t if t in known else _absolute(t) for t in tools]
        try:
            made = [known[t] if t in known else function_tool(load_reference(t, "env.options.tools"))
                    for t in self.sources]
        except (AttributeError, FileNotFoundError, ImportError) as e:
            raise ValueError(f"env.options.tools: {e}") from None
        self.options, self.spec = options, ToolUse(tools=tuple(made), **options)

    def worker_options(self) -> dict:
        return {"tools": list(self.sources), **self.options}

    def opening_template_kwargs(self) -> dict:
        return self.spec.opening_template_kwargs()

    def check_rendering(self, render) -> str | None:
        return self.spec.check_rendering(render)

    def make_group(self, prompt, n: int):
        return self.spec.make_group(prompt, n)

    def make_one(self, prompt, n: int, j: int):
        return self.spec.make_one(prompt, n, j)


def _builtins() -> dict:
    from rollover.envs.agent import AgentBuilder
    from rollover.envs.games import ArithmeticRetry, GuessNumber
    from rollover.envs.inline import InlineTools
    from rollover.envs.interpreter import Interpreter

    return {"guess_number": GuessNumber, "arithmetic_retry": ArithmeticRetry, "tools": ConfiguredTools, "agent": AgentBuilder,
            "interpreter": Interpreter, "inline_tools": InlineTools}


def make_env_builder(name: str, options: dict[str, Any]) -> EnvGroupBuilder:
    """The group builder `name` refers to, made with `options`; errors name the environment."""
    from rollover.rewards.registry import load_reference  # the loader rewards use

    builtins = _builtins()
    if name in builtins:
        factory = builtins[name]
    elif ":" in name:
        try:
            factory = load_reference(name, "env.name")
        except AttributeError as e:
            raise ValueError(str(e)) from None
        except FileNotFoundError as e:
            raise ValueError(f"env.name={name!r}: {e}") from None
        if isinstance(factory, type) and callable(getattr(factory, "step", None)) \
                and not callable(getattr(factory, "make_group", None)):
            raise ValueError(f"env.name={name!r} names an environment class; env.name names what makes a task's "
                             "group of them: a class or function whose result has make_group(prompt, n) "
                             "(an EnvGroupBuilder, docs/environments.md)")
    else:
        raise ValueError(f"env.name={name!r}: expected a built-in ({sorted(builtins)}), 'module:Name' or "
                         "'path/to/file.py:Name'")
    try:
        builder = factory(**options)
    except TypeError as e:
        raise ValueError(f"env.options for {name!r}: {e}") from None
    if not callable(getattr(builder, "make_group", None)):
        raise ValueError(f"env.name={name!r} made a {type(builder).__name__}, which has no make_group(prompt, n)")
    return builder


def check_template(builder, tokenizer, processor=None, **template_kwargs) -> None:
    """Refuse, before the run starts, a builder whose openings give the chat template arguments
    (`opening_template_kwargs()`, e.g. `tools=` with `tools: {tools_in: template}`) that the model's
    template ignores, or that it renders in a way the builder finds wrong (`check_rendering(render)`,
    `render(**template_kwargs)` the opening's text: e.g. the template asks for tool calls in another
    format): every episode would fail on it.
    Tried on the renderer the run's episodes use (`episode_renderer`: a vision-language model's
    processor template included), with the run's `data.chat_template_kwargs`."""
    from jinja2.exceptions import TemplateError

    from rollover.envs.render import episode_renderer

    given = getattr(builder, "opening_template_kwargs", None)
    kwargs = given() if callable(given) else {}
    if not kwargs:
        return
    renderer = episode_renderer(tokenizer, processor, **template_kwargs)

    def render(**given) -> str:
        ids, _ = renderer.initial_media([{"role": "user", "content": "2 + 2?"}], **given)
        return renderer.tokenizer.decode(ids)

    try:
        render(**kwargs)
    except TemplateError as e:
        hint = ("; describe the tools in the system message instead (env.options.tools_in: system)"
                if "tools" in kwargs else "")
        raise ValueError(f"env: the model's chat template cannot take what the environment gives it: {e}{hint}") from None
    check = getattr(builder, "check_rendering", None)
    wrong = check(render) if callable(check) else None
    if wrong:
        raise ValueError(f"env: {wrong}")
