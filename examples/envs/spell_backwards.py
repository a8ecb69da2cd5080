"""A complete multi-turn environment: spell a word backwards, in two tries (reward 1 for the
right answer at the first try, 0.5 at the second). Train on it:

    rollover train examples/arith_retry.yaml env.name=examples/envs/spell_backwards.py:SpellBackwardsTask \
        env.options={} run_dir=runs/spell
"""

import random

from rollover.envs.base import Action, StepResult
from rollover.types import Prompt

WORDS = ["cat", "dog", "sun", "tree", "book", "milk", "star", "fish", "lamp", "rain"]


class SpellBackwards:  # one episode; its state lives on the object
    def __init__(self, word: str):
        self.word, self.tries = word, 0

    async def initial_observation(self) -> list[dict]:
        return [{"role": "user", "content": f"Spell '{self.word}' backwards. Reply with just that."}]

    async def step(self, action: Action) -> StepResult:
        self.tries += 1
        right = action.text.strip().strip(".'\"").lower() == self.word[::-1]
        done = right or self.tries == 2
        retry = [] if done else [{"role": "user", "content": "Not quite. Try again."}]
        return StepResult(retry, float(right) / self.tries, done, info={"tries": self.tries})


class SpellBackwardsTask:  # the group builder: n fresh environments per task, and the tasks (data.train: env)
    def make_group(self, prompt: Prompt, n: int) -> list[SpellBackwards]:
        return [SpellBackwards(prompt.answer) for _ in range(n)]

    def prompts(self, n: int, seed: int = 0) -> list[Prompt]:
        rng = random.Random(seed)
        words = [rng.choice(WORDS) for _ in range(n)]
        return [Prompt(id=f"spell-{seed}-{i}", text=f"Spell '{w}' backwards.", answer=w) for i, w in enumerate(words)]
