"""What the simulated model is asked and what it answers: prompts, response lengths, rewards.

Every draw is a function of the run seed and of the sample's own seed (the one the rollout core
gives each sample, which survives abort and resume), so a simulation is deterministic and a
resumed request finishes at the same length as an uninterrupted one.

Response lengths: log-normal around `median` (the long tail practitioners see) with a
per-prompt factor (some prompts make every sample long: a group's samples are correlated), or
`empirical`: drawn from a list of measured lengths (e.g. a real run's). A draw at or past the
budget is truncated there (finish 'length').

Rewards: prompt i is solved by each sample with probability p_i ~ Beta(alpha, beta), drawn once
per prompt; enough for dynamic sampling and prompt selection to have something to filter.
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollover.types import Prompt, Request

if TYPE_CHECKING:
    from rollover.rewards.runner import BatchRewards

TOKEN, EOS = 2, 1  # the simulated model's one word and its end of sequence


def _rng(*keys: int) -> random.Random:
    x = 0x9E3779B97F4A7C15
    for k in keys:
        x = (x * 6364136223846793005 + (k & 0xFFFFFFFFFFFFFFFF) + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
    return random.Random(x)


@dataclass(frozen=True)
class LengthModel:
    kind: str = "lognormal"  # or "empirical"
    median: float = 256.0
    sigma: float = 0.8  # of a sample's log-length around its prompt's
    prompt_sigma: float = 0.5  # of a prompt's log-length factor
    values: tuple[int, ...] = ()  # empirical lengths

    def __post_init__(self):
        if self.kind not in ("lognormal", "empirical"):
            raise ValueError(f"lengths.kind must be 'lognormal' or 'empirical', got {self.kind!r}")
        if self.kind == "empirical" and not self.values:
            raise ValueError("lengths.kind=empirical needs lengths.values (a list of response lengths)")
        if self.kind == "lognormal" and not self.median >= 1:
            raise ValueError(f"lengths.median must be >= 1, got {self.median}")

    def draw(self, prompt_key: int, sample_seed: int) -> int:
        """Response tokens of this sample if nothing truncated it (>= 1)."""
        r = _rng(sample_seed)
        if self.kind == "empirical":
            return max(1, int(self.values[r.randrange(len(self.values))]))
        factor = _rng(prompt_key, 17).gauss(0.0, self.prompt_sigma)
        return max(1, round(self.median * math.exp(factor + r.gauss(0.0, self.sigma))))


def make_prompts(n: int, seed: int, prompt_tokens: int, alpha: float, beta: float
                 ) -> tuple[list[Prompt], dict[str, list[int]]]:
    """n prompts (their solve probability in `answer`) and their token ids: prompt i's first
    token is unique to it, so no two prompts share a prefix."""
    prompts, ids = [], {}
    for i in range(n):
        p = _rng(seed, i, 29).betavariate(alpha, beta)
        prompts.append(Prompt(id=f"sim{i}", text=f"prompt {i}", answer=p))
        ids[f"sim{i}"] = [10 + i] + [TOKEN] * (prompt_tokens - 1)
    return prompts, ids


def prompt_key(req: Request) -> int:
    return hash(tuple(req.prompt_ids))


class SimTokenizer:
    """Decodes nothing (no simulated reward reads text). For simulated episodes it has a chat
    template, ChatML-like: a message is `<s>role content<e>`, and text encodes a token per
    word (`p{i}`, prompt i's own word, to its own id; any other word to TOKEN), with the
    turn's closing `<e>` the model's EOS, so an episode's inserted tokens are what the
    environment's words make plus a few of the template's."""

    pad_token_id = 0
    chat_template = "sim"
    START = 3  # `<s>`
    all_special_ids = [EOS, START]
    added_tokens_decoder: dict = {}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""

    def apply_chat_template(self, messages, add_generation_prompt: bool = False, tokenize: bool = False,
                            **template_kwargs) -> str:  # data.chat_template_kwargs: a template's own, nothing here
        text = "".join(f"<s>{m['role']} {m['content']}<e>\n" for m in messages)
        return text + ("<s>assistant " if add_generation_prompt else "")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        for i, part in enumerate(text.split("<e>")):
            if i:
                ids.append(EOS)
            for j, piece in enumerate(part.split("<s>")):
                if j:
                    ids.append(self.START)
                ids += [10 + int(w[1:]) if w[:1] == "p" and w[1:].isdigit() else TOKEN for w in piece.split()]
        return ids


@dataclass
class _Fn:
    name: str


class SimRewards:
    """A `RewardRunner` whose reward is 1 with the prompt's solve probability, else 0."""

    def __init__(self, seed: int):
        self.seed = seed
        self.rewards = [_Fn("sim")]
        self.on_score = None  # called with the scored groups' sizes, in order (the simulated scoring time)

    def score(self, prompts, texts, sample_ids, completion_ids=None, opened_reasoning=None) -> BatchRewards:
        from rollover.rewards.runner import BatchRewards, SampleReward  # the reward stack: schedulers' path only

        if self.on_score is not None:
            sizes: dict[str, int] = {}
            for sid in sample_ids:
                group = sid.rsplit("/", 1)[0]
                sizes[group] = sizes.get(group, 0) + 1
            self.on_score(list(sizes.values()))
        out = []
        for p, sid in zip(prompts, sample_ids):
            r = 1.0 if _rng(self.seed, zlib.crc32(sid.encode()), 31).random() < float(p.answer) else 0.0
            out.append(SampleReward(sample_id=sid, status="ok", total=r, scores={"sim": r}))
        return BatchRewards(samples=out, failures=[], error_counts={}, timeout_counts={}, stuck_threads=0)

    def close(self) -> None:
        pass
