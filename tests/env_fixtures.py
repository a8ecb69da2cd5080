"""Environments the Ray environment-worker tests name by reference, so actors can import them."""

import asyncio
import os
import signal
import time

from rollover.envs.base import StepResult
from rollover.types import Prompt


class Fragile:
    """Task "die": a step SIGKILLs the process holding the environment. Task "raise": a step
    raises. Task "hang:PATH": a step hangs, and writes PATH when cancelled. Task "freeze": a step
    blocks its thread (and an async holder's event loop) for 10 minutes. Task "exit": a step calls
    sys.exit. Any other task: one
    step, reward 1, done; the step reports the holder's pid."""

    def prompts(self, n, seed=0):
        return [Prompt(id=f"fragile-{i}", text="Say something.", answer="ok") for i in range(n)]

    def make_group(self, prompt, n):
        return [FragileEnv(prompt.answer) for _ in range(n)]


class FragileEnv:
    def __init__(self, task):
        self.task = task

    async def initial_observation(self):
        return [{"role": "user", "content": f"Task {self.task}."}]

    async def step(self, action):
        if self.task.startswith("hang:"):  # hangs; writes the file named after "hang:" once cancelled
            try:
                await asyncio.sleep(600)
            except asyncio.CancelledError:
                with open(self.task[5:], "w") as f:
                    f.write("cancelled")
                raise
        if self.task == "freeze":
            time.sleep(600)
        if self.task == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.task == "raise":
            raise RuntimeError(f"simulator crashed on {action.text!r}")
        if self.task == "exit":  # sys.exit in an environment: its episode's failure, not its holder's end
            raise SystemExit(3)
        return StepResult([], 1.0, done=True, info={"pid": os.getpid()})


class Shaped:
    """Three turns, each rewarded on its own: 0.1 per digit the action holds, plus 1 on the last
    turn when the action holds a 7 (a reward at every turn, for per-turn credit)."""

    def prompts(self, n, seed=0):
        return [Prompt(id=f"shaped-{i}", text=f"Write digits ({i}).", answer="7") for i in range(n)]

    def make_group(self, prompt, n):
        return [ShapedEnv() for _ in range(n)]


class ShapedEnv:
    def __init__(self):
        self.turn = 0

    async def initial_observation(self):
        return [{"role": "user", "content": "Digits, please."}]

    async def step(self, action):
        self.turn += 1
        reward = 0.1 * sum(ch.isdigit() for ch in action.text)
        if self.turn == 3:
            return StepResult([], reward + ("7" in action.text), done=True)
        return StepResult([{"role": "user", "content": "More."}], reward, done=False)


class ShapedStates(Shaped):
    """Shaped, whose steps name the state they leave: the turn and whether the action held a 7
    (env.credit=gigpo compares the next turns of episodes in equal states)."""

    def make_group(self, prompt, n):
        return [ShapedStatesEnv() for _ in range(n)]


class ShapedStatesEnv(ShapedEnv):
    async def step(self, action):
        result = await super().step(action)
        result.state = (self.turn, "7" in action.text)
        return result


class SeeColors:
    """Name the colour of a square: the opening shows one image, and a wrong answer is told so
    with a second image of the same colour (images in the opening and in an insertion)."""

    COLORS = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220)}

    def prompts(self, n, seed=0):
        return [Prompt(id=f"see-{i}", text="Which colour?", answer=list(self.COLORS)[(seed + i) % 3]) for i in range(n)]

    def make_group(self, prompt, n):
        return [SeeColorsEnv(prompt.answer, prompt.images[0] if prompt.images else None) for _ in range(n)]


class SeeColorsEnv:
    def __init__(self, answer, shown=None):
        self.answer, self.shown = answer, shown  # shown: the row's own image (a dataset with images), else drawn

    def image(self, shade: int):
        from PIL import Image

        r, g, b = SeeColors.COLORS[self.answer]
        return Image.new("RGB", (28, 28), (min(r + shade, 255), min(g + shade, 255), min(b + shade, 255)))

    async def initial_observation(self):
        return [{"role": "user", "content": [{"type": "image", "image": self.shown or self.image(0)},
                                             {"type": "text", "text": "Which colour is this?"}]}]

    async def step(self, action):
        if self.answer in action.text:
            return StepResult([], 1.0, done=True)
        return StepResult([{"role": "user", "content": [{"type": "text", "text": "No. Look again:"},
                                                        {"type": "image", "image": self.image(30)}]}], 0.0, done=False)


class DictTasks(Fragile):
    """A task generator that gives dicts, not Prompts (refused at start, naming it)."""

    def prompts(self, n, seed=0):
        return [{"text": "hi", "answer": "hi"} for _ in range(n)]
