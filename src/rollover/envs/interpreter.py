"""`env.name: interpreter`: reasoning with a Python interpreter inside the model's own turn.

The tool-integrated-reasoning form of ToRL (arXiv 2503.23383) and SimpleTIR: the model writes one
assistant message, and where it wants to compute it writes a code block followed by an output
fence,

    ```python
    print(17 * 23)
    ```
    ```output

The run's `rollout.stop` holds the output fence (`marker`), so generation stops there; the
environment runs the last ```python block before it (since the last output) in the sandbox
(`rollover.rewards.sandbox`, Linux as root) and goes on with the message: the program's output
(at most `output_chars` characters) and the closing fence, as a continuation
(`StepResult.continuation`, tokenised alone, never trained). The model reads it and writes on.

When the model ends its message (its end of turn, or its token budget) the text it wrote (not
the outputs) is scored against the task's answer: `score: numeric` (the default: the last number
of the `\\boxed{}` answer, or of the text), `math` (math-verify; a GSM8K solution counts by
what follows its `####`), another reward's name or `module:function`. More than `max_calls` runs end the episode with reward 0. A fence
with no ```python block before it, or a program that fails, is the model's business: the output
says so and the model goes on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from rollover.envs.base import Action, StepResult, cut, in_thread
from rollover.envs.score import Score
from rollover.envs.opening import check_system_prompt, opening, worked_examples
from rollover.types import Prompt

MARKER = "```output"
_BLOCK = re.compile(r"```python[ \t]*\n(.*?)```", re.DOTALL)


def _sandboxed(code: str) -> tuple[str, bool]:
    from rollover.rewards.sandbox import format_result, run_python  # Linux and root only: imported when used

    result = run_python(code)
    return format_result(result), result.ok


@dataclass(frozen=True)
class Interpreter:
    """The group builder: the limits, the fence, what runs the code, the score."""

    max_calls: int = 4
    marker: str = MARKER
    output_chars: int = 1000
    run: Callable[[str], tuple[str, bool]] = field(default=_sandboxed)  # code -> (what the model is shown, ran well)
    # (the model's text, answer) -> reward; or a reward's name ("numeric", the default; "math", ...) or module:function
    score: Callable[[str, object], float | None] | str = "numeric"
    # the system message that explains the fence ("default": `default_system_prompt()`); None: none,
    # for prompts that carry their own instructions
    system_prompt: str | None = "default"
    examples: tuple = ()  # worked conversations before the task (rollover.envs.opening)

    def __post_init__(self):
        object.__setattr__(self, "score", Score(self.score, "interpreter"))
        object.__setattr__(self, "examples", worked_examples(self.examples, "interpreter"))
        check_system_prompt(self.system_prompt, "interpreter")
        if self.max_calls < 1:
            raise ValueError(f"interpreter: max_calls must be >= 1, got {self.max_calls}")
        if self.output_chars < 1:
            raise ValueError(f"interpreter: output_chars must be >= 1, got {self.output_chars}")
        if not self.marker.strip():
            raise ValueError("interpreter: marker must be a non-empty string (the run's rollout.stop holds it)")

    def default_system_prompt(self) -> str:
        return ("Solve the problem step by step. You can run Python: write a ```python code block, then "
                f"{self.marker} on the next line, and stop; the program's output follows and you go on. Print what "
                f"you need to see. You may run code at most {self.max_calls} times. Put the final answer in "
                "\\boxed{}.")

    def make_group(self, prompt: Prompt, n: int) -> list["InterpreterEnv"]:
        return [self.make_one(prompt, n, j) for j in range(n)]

    def make_one(self, prompt: Prompt, n: int, j: int) -> "InterpreterEnv":
        return InterpreterEnv(self, prompt)


class InterpreterEnv:
    def __init__(self, spec: Interpreter, prompt: Prompt):
        self.spec, self.prompt = spec, prompt
        self.written = ""  # what the model wrote in its message so far (not the outputs)
        self.since = 0  # where in `written` the last output ended: blocks before it have run
        self.calls = self.failures = 0

    async def initial_observation(self) -> list[dict]:
        return opening(self.prompt, self.spec.system_prompt, self.spec.default_system_prompt(), self.spec.examples)

    async def step(self, action: Action) -> StepResult:
        self.written += action.text
        # rollout.stop holds the fence, so a stretch holds one only where it stopped (the rest of that
        # token after it, at most)
        at = action.text.rfind(self.spec.marker) if action.finish == "stop" else -1
        if at < 0:  # the model ended its message: its answer
            reward = await self.spec.score(self.written, self.prompt.answer)
            return StepResult([], reward, done=True, info=self._info(solved=reward))
        self.calls += 1
        if self.calls > self.spec.max_calls:
            return StepResult([], 0.0, done=True, info=self._info(call_limit=1.0))
        fence = len(self.written) - len(action.text) + at
        blocks, self.since = _BLOCK.findall(self.written[self.since:fence]), len(self.written)
        output, ok = f"[no ```python block before {self.spec.marker}]", False
        if blocks:
            output, ok = await in_thread(self.spec.run, blocks[-1])
        self.failures += not ok
        output = cut(output, self.spec.output_chars, "\n[output truncated]")
        return StepResult([], 0.0, done=False, continuation=f"\n{output}\n```\n", info=self._info())

    def _info(self, **extra: float) -> dict:
        return {"code_runs": self.calls, "code_failures": self.failures, **extra}
