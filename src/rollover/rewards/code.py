"""A reward that runs the completion's code against the sample's tests, in the sandbox.

Convention: the code is the last ```python (or ```py) fenced block of the completion; `answer`
is Python test code, usually asserts, or a list of such snippets (MBPP's `test_list`), run one
after another after the code in the same module, so the tests see what the code defines. The
sample scores 1.0 when the program exits 0, breaks no sandbox limit or rule, and reaches the
end of the tests, else 0.0.

"Reaches the end": a random token is printed on a line of its own after the tests and must be
the last line of stdout, so code that calls `sys.exit(0)` or `os._exit(0)` before the tests run
scores 0. Code that reads its own file to find the token is not stopped by this.

A limit or rule broken by the code (timeout, memory, network, ...) is the policy's fault, so it
scores 0 like any failure; it is not a reward error. A failure of the sandbox itself
(`SandboxError`) raises, for the reward runner to report, and so do tests that could not fail:
none, empty ones, ones that do not parse alone, ones that only define, import or state literals
(a JSON text of tests, HumanEval's uncalled `check`), or an answer of another type (a dict, a number).

The limits are checked when the reward is built (`_prepare`), and `RewardRunner` refuses a
`timeout_s` that the sandbox's wall clock does not end before (`_check_timeout`).

The function returns a dict with the same keys every time, so their means are rates:
`no_code` (no fenced block found), `violation` (a sandbox limit or rule was hit) and `timeout`
(the violation was the CPU or wall-clock limit).
"""

from __future__ import annotations

import dataclasses
import re
import secrets

from rollover.rewards.extract import gold
from rollover.rewards.sandbox import CPU_SLOTS, SandboxLimits, run_python

_FENCED_PYTHON = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str | None:
    """The last ```python fenced block, or None if there is none (an unclosed one is not)."""
    blocks = _FENCED_PYTHON.findall(completion)
    return blocks[-1] if blocks else None


def code_reward(
    completion: str, answer: str | list[str], *, limits: SandboxLimits | dict | None = None, **_
) -> dict[str, float]:
    """1.0 if the completion's code passes the test code in `answer`, else 0.0.

    `answer` is test code, or a list of test snippets (MBPP's `test_list`) run one after another.
    `limits` is a SandboxLimits or a dict of its fields (as a reward's kwargs in config)."""
    tests = _tests(answer)
    limits = _limits(limits)
    code = extract_code(completion)
    if code is None:
        return {"score": 0.0, "no_code": 1.0, "violation": 0.0, "timeout": 0.0}
    token = secrets.token_hex(16)
    # The token starts a line of its own even when the program's last line is unfinished
    # (`print("ready", end="")`): an empty line before it is harmless, a glued one fails.
    program = f"{code}\n\n# --- tests ---\n{tests}\n\nprint()\nprint({token!r})\n"
    result = run_python(program, limits=limits)
    passed = result.ok and result.stdout.splitlines()[-1:] == [token]
    return {
        "score": float(passed),
        "no_code": 0.0,
        "violation": float(result.violation is not None),
        "timeout": float(result.violation in ("cpu", "wall")),
    }


def _tests(answer) -> str:
    """The test code `answer` holds; anything that would let a program pass untested raises
    (a list formatted as text is a valid expression statement, and whitespace tests nothing)."""
    gold(answer, "code")
    if isinstance(answer, (list, tuple)):
        for i, test in enumerate(answer):
            if not isinstance(test, str):
                raise TypeError(f"code: test {i} of the answer is not a string of test code but "
                                f"{type(test).__name__}: {test!r:.80}")
            if not test.strip():
                raise ValueError(f"code: test {i} of the answer is empty: it would test nothing")
        if not answer:
            raise ValueError("code: the answer is an empty list of tests: any program that runs would pass")
        for i, test in enumerate(answer):
            _parse(test, f"test {i} of the answer")
        return _can_fail("\n".join(answer), "the answer's tests")
    if not isinstance(answer, str):
        raise TypeError(f"code: the answer must be test code (a string) or a list of test snippets, got "
                        f"{type(answer).__name__}: {answer!r:.80}")
    if not answer.strip():
        raise ValueError("code: the answer (the tests) is empty: any program that runs would pass")
    return _can_fail(answer, "the answer (the tests)")


def _parse(code: str, what: str):
    """The test code's syntax tree: tests that do not parse on their own (an indented snippet would
    become the end of the program's last function, never run) raise."""
    import ast

    try:
        return ast.parse(code)
    except SyntaxError as e:
        raise ValueError(f"code: {what} does not parse on its own ({type(e).__name__}: {e.msg}, line {e.lineno}): "
                         "appended to the program it could test nothing") from None


def _can_fail(code: str, what: str) -> str:
    """`code` when it runs something that can fail: a top level of only definitions, imports,
    `pass` and literals (a JSON text of tests, HumanEval's `check(candidate)` never called, a
    comment) would let any program pass, and raises."""
    import ast

    def inert(node) -> bool:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Pass, ast.Import,
                             ast.ImportFrom)):
            return True
        if isinstance(node, ast.Expr):
            try:
                ast.literal_eval(node.value)
                return True
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return False
        return False

    if all(inert(node) for node in _parse(code, what).body):
        raise ValueError(f"code: nothing in {what} can fail (only definitions, imports, pass or literals at the "
                         "top level): any program that runs would pass. A JSON text of tests is not test code "
                         "(load it as a list of snippets); HumanEval's check(candidate) must be called")
    return code


def _limits(limits: SandboxLimits | dict | None) -> SandboxLimits:
    if limits is None or isinstance(limits, SandboxLimits):
        return limits or SandboxLimits()
    if not isinstance(limits, dict):
        raise TypeError(f"limits must be a mapping of SandboxLimits fields, got {limits!r:.80}")
    known = [f.name for f in dataclasses.fields(SandboxLimits)]
    unknown = [k for k in limits if k not in known]
    if unknown:
        raise ValueError(f"limits has no {', '.join(map(repr, unknown))}; the limits are {', '.join(known)}")
    return SandboxLimits(**limits)


# Above the sandbox's wall clock: interpreter start, namespaces, writing and removing the directory.
_MARGIN_S = 1.0


def _prepare(load: bool = True, **kwargs) -> dict:
    """The bound arguments checked when the reward is built (`rollover.rewards.registry.prepare`),
    so that a misspelt limit fails there rather than on every sample."""
    unknown = sorted(set(kwargs) - {"limits"})
    if unknown:
        raise ValueError(f"unknown kwargs {unknown} (known: limits)")
    return {**kwargs, "limits": _limits(kwargs["limits"])} if "limits" in kwargs else kwargs


def _check_timeout(timeout_s: float, limits: SandboxLimits | dict | None = None) -> None:
    """Called by `RewardRunner` with its `timeout_s`: a run that may last past the call's timeout
    turns a correct slow program into a reward timeout (a failure) instead of a score."""
    wall_s = _limits(limits).wall_s
    if wall_s + _MARGIN_S >= timeout_s:
        raise ValueError(f"its sandbox's wall clock (limits.wall_s={wall_s:g} s, plus {_MARGIN_S:g} s to start) "
                         f"does not end before the reward's timeout (reward.timeout_s={timeout_s:g} s), so a "
                         f"slow correct program would fail as a timeout: raise reward.timeout_s above "
                         f"{wall_s + _MARGIN_S:g} or lower limits.wall_s")


code_reward._rollover_prepare = _prepare
code_reward._rollover_check_timeout = _check_timeout
code_reward._rollover_max_concurrency = CPU_SLOTS  # the runner queues the rest before their timeout starts
