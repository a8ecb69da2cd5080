"""The environment a run's config names (`env.name` + `env.options`), as an `EnvGroupBuilder`.

Built-ins: `guess_number` (`GuessNumber`), `arithmetic_retry` (`ArithmeticRetry`), `tools`
(`ToolUse`, tools named in `options.tools`: calculator, python), `agent` (`AgentBuilder`: an
agent written against an OpenAI-style chat client, `options.fn`). Anything else is a reference,
`module:Name` or `path/to/file.py:Name`, to a class or factory that takes the options as
keyword arguments and returns an object with `make_group(prompt, n)` (and `prompts(n, seed)`
if the run draws its tasks from the environment: `data.train: env`).
"""

from __future__ import annotations

from typing import Any

from rollover.envs.base import EnvGroupBuilder


def _tools(tools: list[str] = ("calculator", "python"), **options: Any):
    from rollover.envs.tools import CALCULATOR, PYTHON, ToolUse

    known = {"calculator": CALCULATOR, "python": PYTHON}
    unknown = [t for t in tools if t not in known]
    if unknown:
        raise ValueError(f"env.options.tools: unknown tools {unknown}; known: {sorted(known)}")
    return ToolUse(tools=tuple(known[t] for t in tools), **options)


def _builtins() -> dict:
    from rollover.envs.agent import AgentBuilder
    from rollover.envs.games import ArithmeticRetry, GuessNumber

    return {"guess_number": GuessNumber, "arithmetic_retry": ArithmeticRetry, "tools": _tools, "agent": AgentBuilder}


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
