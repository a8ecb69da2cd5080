"""A reward that runs the completion's code against the sample's tests, in the sandbox.

Convention: the code is the last ```python (or ```py) fenced block of the completion; `answer`
is Python test code, usually asserts, run after it in the same module, so the tests see what
the code defines. The sample scores 1.0 when the program exits 0, breaks no sandbox limit or
rule, and reaches the end of the tests, else 0.0.

"Reaches the end": a random token is printed after the tests and must be the last line of
stdout, so code that calls `sys.exit(0)` or `os._exit(0)` before the tests run scores 0. Code
that reads its own file to find the token is not stopped by this.

A limit or rule broken by the code (timeout, memory, network, ...) is the policy's fault, so it
scores 0 like any failure; it is not a reward error. Only a failure of the sandbox itself
(`SandboxError`) raises, for the reward runner to report.

The function returns a dict with the same keys every time, so their means are rates:
`no_code` (no fenced block found), `violation` (a sandbox limit or rule was hit) and `timeout`
(the violation was the CPU or wall-clock limit).
"""

from __future__ import annotations

import re
import secrets

from rollover.rewards.extract import gold
from rollover.rewards.sandbox import SandboxLimits, run_python

_FENCED_PYTHON = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str | None:
    """The last ```python fenced block, or None if there is none (an unclosed one is not)."""
    blocks = _FENCED_PYTHON.findall(completion)
    return blocks[-1] if blocks else None


def code_reward(
    completion: str, answer: str, *, limits: SandboxLimits | dict | None = None, **_
) -> dict[str, float]:
    """1.0 if the completion's code passes the test code in `answer`, else 0.0.

    `limits` is a SandboxLimits or a dict of its fields (as a reward's kwargs in config)."""
    gold(answer, "code")  # the tests: without them any program that runs would pass
    if isinstance(limits, dict):
        limits = SandboxLimits(**limits)
    code = extract_code(completion)
    if code is None:
        return {"score": 0.0, "no_code": 1.0, "violation": 0.0, "timeout": 0.0}
    token = secrets.token_hex(16)
    program = f"{code}\n\n# --- tests ---\n{answer}\n\nprint({token!r})\n"
    result = run_python(program, limits=limits or SandboxLimits())
    passed = result.ok and result.stdout.splitlines()[-1:] == [token]
    return {
        "score": float(passed),
        "no_code": 0.0,
        "violation": float(result.violation is not None),
        "timeout": float(result.violation in ("cpu", "wall")),
    }
