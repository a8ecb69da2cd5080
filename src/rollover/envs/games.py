"""Multi-turn feedback games small enough for SmolLM2-135M to learn on a CPU.

- `GuessNumber`: guess a whole number in [low, high]; after each guess the environment says
  "Higher." or "Lower."; reward 1 for the right number (less `turn_penalty` per extra guess),
  0 when the guesses run out.
- `ArithmeticRetry`: "What is 3 + 5?"; a wrong answer gets "That is not right. Try again."
  until `max_attempts`; reward 1 for the right answer (less `attempt_penalty` per retry).

Each is a group builder (`make_group(prompt, n)`) with `prompts(n, seed)` that generates tasks
deterministically from a seed; the secret or the answer is the prompt's `answer`. The model's
answer is the last integer in its reply ("I guess 4, no, 7" -> 7; "5-3" reads as 5 and 3, not
5 and -3); a reply without one is told to answer with a number, and that costs a guess like any
other.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from rollover.data.generators import arithmetic
from rollover.envs.base import Action, StepResult
from rollover.types import Prompt

# A minus sign counts only when it does not follow a word character or ")" ("5-3" is 5 and 3).
_INTEGER = re.compile(r"(?:(?<![\w)])-)?\d+")


def last_integer(text: str) -> int | None:
    found = _INTEGER.findall(text)
    return int(found[-1]) if found else None


def _user(content: str) -> dict:
    return {"role": "user", "content": content}


# --- guess the number ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GuessNumber:
    """The rules of the game, and the builder of its episodes."""

    low: int = 1
    high: int = 10
    max_guesses: int = 4  # ceil(log2(high - low + 1)) guesses always suffice with bisection
    turn_penalty: float = 0.0  # reward for a correct guess: max(0, 1 - turn_penalty * (guesses - 1))

    def __post_init__(self):
        if self.high <= self.low:
            raise ValueError(f"GuessNumber: high must be > low, got [{self.low}, {self.high}]")
        if self.max_guesses < 1:
            raise ValueError(f"GuessNumber: max_guesses must be >= 1, got {self.max_guesses}")
        if not 0.0 <= self.turn_penalty <= 1.0:
            raise ValueError(f"GuessNumber: turn_penalty must be in [0, 1], got {self.turn_penalty}")

    def prompts(self, n: int, seed: int = 0) -> list[Prompt]:
        """n games; game i depends only on (seed, the range, i)."""
        out = []
        for i in range(n):
            rng = random.Random(f"guess:{seed}:{self.low}:{self.high}:{i}")
            out.append(Prompt(id=f"guess-{seed}-{i}", text=self.rules(), answer=rng.randint(self.low, self.high)))
        return out

    def rules(self) -> str:
        return (
            f"I am thinking of a whole number between {self.low} and {self.high}. Guess it! After each "
            "guess I will tell you whether my number is higher or lower than your guess. You have "
            f"{self.max_guesses} guesses. Reply with just your guess."
        )

    def make_group(self, prompt: Prompt, n: int) -> list["GuessNumberEnv"]:
        return [self.make_one(prompt, n, j) for j in range(n)]

    def make_one(self, prompt: Prompt, n: int, j: int) -> "GuessNumberEnv":
        return GuessNumberEnv(self, int(prompt.answer))


class GuessNumberEnv:
    def __init__(self, game: GuessNumber, secret: int):
        if not game.low <= secret <= game.high:
            raise ValueError(f"secret {secret} is outside [{game.low}, {game.high}]")
        self.game, self.secret, self.guesses, self.no_number = game, secret, 0, 0
        self.low, self.high = game.low, game.high  # what the answers so far tell the player

    async def initial_observation(self) -> list[dict]:
        return [_user(self.game.rules())]

    async def step(self, action: Action) -> StepResult:
        g, guess = self.game, last_integer(action.text)
        self.guesses += 1
        self.no_number += guess is None
        info = {"guesses": self.guesses, "solved": float(guess == self.secret), "no_number": self.no_number}
        if guess == self.secret:
            reward = max(0.0, 1.0 - g.turn_penalty * (self.guesses - 1))
            return StepResult([_user("Correct!")], reward, done=True, info=info)
        if self.guesses >= g.max_guesses:
            return StepResult([_user(f"Out of guesses. My number was {self.secret}.")], 0.0, done=True, info=info)
        if guess is None or not g.low <= guess <= g.high:
            feedback = f"Please answer with a number between {g.low} and {g.high}."
        elif self.secret > guess:
            feedback, self.low = "Higher.", max(self.low, guess + 1)
        else:
            feedback, self.high = "Lower.", min(self.high, guess - 1)
        # the player's state (env.credit=gigpo compares turns from equal ones): guesses left and the range still open
        return StepResult([_user(feedback)], 0.0, done=False, info=info, state=(self.guesses, self.low, self.high))


# --- arithmetic with a retry --------------------------------------------------------------------


@dataclass(frozen=True)
class ArithmeticRetry:
    """Arithmetic questions (`rollover.data.generators.arithmetic`) with feedback and retries."""

    digits: int = 1
    ops: str = "+"
    max_attempts: int = 3
    attempt_penalty: float = 0.0  # reward for a right answer: max(0, 1 - attempt_penalty * retries)

    def __post_init__(self):
        if self.max_attempts < 1:
            raise ValueError(f"ArithmeticRetry: max_attempts must be >= 1, got {self.max_attempts}")
        if not 0.0 <= self.attempt_penalty <= 1.0:
            raise ValueError(f"ArithmeticRetry: attempt_penalty must be in [0, 1], got {self.attempt_penalty}")

    def prompts(self, n: int, seed: int = 0) -> list[Prompt]:
        return arithmetic(n, seed=seed, digits=self.digits, ops=self.ops)

    def make_group(self, prompt: Prompt, n: int) -> list["ArithmeticRetryEnv"]:
        return [self.make_one(prompt, n, j) for j in range(n)]

    def make_one(self, prompt: Prompt, n: int, j: int) -> "ArithmeticRetryEnv":
        return ArithmeticRetryEnv(self, prompt.text, int(prompt.answer))


class ArithmeticRetryEnv:
    def __init__(self, task: ArithmeticRetry, question: str, answer: int):
        self.task, self.question, self.answer, self.attempts = task, question, answer, 0

    async def initial_observation(self) -> list[dict]:
        return [_user(f"{self.question} Answer with just the number.")]

    async def step(self, action: Action) -> StepResult:
        value = last_integer(action.text)
        self.attempts += 1
        info = {"attempts": self.attempts, "solved": float(value == self.answer)}
        if value == self.answer:
            reward = max(0.0, 1.0 - self.task.attempt_penalty * (self.attempts - 1))
            return StepResult([_user("Correct!")], reward, done=True, info=info)
        if self.attempts >= self.task.max_attempts:
            return StepResult([_user(f"The answer was {self.answer}.")], 0.0, done=True, info=info)
        feedback = "Please answer with a number." if value is None else "That is not right. Try again."
        return StepResult([_user(feedback)], 0.0, done=False, info=info, state=self.attempts)  # attempts made
