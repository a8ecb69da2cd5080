"""Typed messages that cross rollover's seams.

scheduler -> engine: `Request` (token ids, never text) with `SamplingParams`.
engine -> scheduler/reward: `Completion` (token ids, per-token logprobs and policy versions,
finish reason).

A token's provenance (behaviour logprob, policy version) travels with it from the engine to
the loss through any number of abort/resume cycles: a `Completion` turns back into a `Request`
with `Completion.resume()`, which carries the tokens generated so far.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


MIN_TEMPERATURE = 0.01  # the least positive temperature an engine samples at (vLLM's own floor)


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is sampled.

    `temperature == 0` is greedy decoding. `max_new_tokens` bounds the *whole* response,
    including tokens carried in by a resumed request. `seed` makes sampling reproducible and
    independent of batching: the noise for the token at response position `i` depends only on
    `(seed, i)`, so a sequence aborted and resumed samples exactly what it would have sampled
    uninterrupted.

    The logits are processed as vLLM does: the repetition penalty (a logit `l` of a token in the
    prompt or the response so far becomes `l / p` if positive, `l * p` if not), then the
    temperature, then `min_p`, then top-k and top-p. The penalty looks at prompt and response
    alike, so a resumed request (its earlier tokens in its prompt) samples as it would have.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off; drop tokens less likely than min_p x the likeliest
    repetition_penalty: float = 1.0  # 1: off; > 1 makes tokens of the prompt and response so far less likely
    max_new_tokens: int = 256
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's EOS ids
    ignore_eos: bool = False  # keep generating through EOS (benchmarks); stop_token_ids still stop
    stop: tuple[str, ...] = ()  # strings whose completing token ends the response (`rollover.engine.stop`)

    def validate(self) -> None:
        """Raise ValueError naming the bad field."""
        for name in ("top_k", "max_new_tokens", "seed"):  # numpy's integers: the engine's RNG and topk refuse them
            v = getattr(self, name)
            if not (v is None and name == "seed") and type(v) is not int:
                t = type(v)
                kind = t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__name__}"
                hint = " (int(x) gives one)" if hasattr(v, "__index__") or isinstance(v, float) else ""
                raise ValueError(f"{name} must be a Python int, got {kind} {v}{hint}")
        if not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature):  # also catches NaN
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE} (below it the logits "
                             f"overflow, and vLLM raises it to {MIN_TEMPERATURE}), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be > 0 and finite (1 = off), got {self.repetition_penalty}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")


@dataclass
class Request:
    """One sequence to generate, possibly resuming an earlier partial response."""

    id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Tokens generated earlier (resume). Their logprobs and versions are kept as they were.
    response_ids: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    response_versions: list[int] = field(default_factory=list)
    # a prompt's images as the model's forward takes them (`rollover.data.media.Media`); None: text only
    media: object = None

    @property
    def remaining_tokens(self) -> int:
        return self.sampling.max_new_tokens - len(self.response_ids)

    def completion(self, finish: FinishReason) -> "Completion":
        """This request's carried tokens as a completion (the inverse of `Completion.resume`)."""
        return Completion(id=self.id, prompt_ids=list(self.prompt_ids), response_ids=list(self.response_ids),
                          logprobs=list(self.response_logprobs), versions=list(self.response_versions),
                          finish=finish, sampling=self.sampling)


@dataclass
class Completion:
    """What the engine returns for a request: finished, truncated or aborted."""

    id: str
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # [T] behaviour logprob of each response token (see engine docs)
    versions: list[int]  # [T] weight version that produced each response token
    finish: FinishReason
    sampling: SamplingParams = field(default_factory=SamplingParams)

    @property
    def num_tokens(self) -> int:
        return len(self.response_ids)

    def resume(self, sampling: SamplingParams | None = None) -> Request:
        """A request that continues this completion from its tokens."""
        return Request(
            id=self.id,
            prompt_ids=list(self.prompt_ids),
            sampling=sampling or self.sampling,
            response_ids=list(self.response_ids),
            response_logprobs=list(self.logprobs),
            response_versions=list(self.versions),
        )


@dataclass
class Prompt:
    """One task instance from a dataset or generator.

    Exactly one of `messages` (chat form: [{"role", "content"}]) and `text` (a plain string,
    still rendered through the chat template as a single user turn unless the data config says
    otherwise) is set. `answer` is the ground truth handed to reward functions; `fields` holds
    every other column (they reach reward functions as keyword arguments).
    """

    id: str
    messages: list[dict] | None = None
    text: str | None = None
    answer: object = None
    fields: dict = field(default_factory=dict)
    images: list | None = None  # the row's images (paths, bytes or PIL images; `rollover.data.media`)


@dataclass
class Rollout:
    """One finished, scored sample: what the data manager filters and the trainer learns from.
    Its advantage is not part of it: advantages are computed over a batch of groups
    (`rollover.rollout.groups.group_advantages`) and go into the `TrainBatch` beside it.

    `logprobs` and `versions` are per response token, exactly as the engine produced them
    across any number of resumes; `loss_mask` (per response token, 1 = trained) may switch
    off tokens (stale prefixes, truncated completions).
    """

    group_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    loss_mask: list[int]
    finish: FinishReason
    reward: float | None = None  # weighted total; None = unscored (skipped)
    scores: dict = field(default_factory=dict)  # per reward function
    extras: dict = field(default_factory=dict)  # other numbers the functions returned, as "<function>/<key>"
    text: str = ""
    turns: list[dict] | None = None  # multi-turn: what each turn said and was answered (logs only, never trained)
    media: object = None  # the prompt's images as the forward takes them (`rollover.data.media.Media`)
    unshaped: float | None = None  # the reward before DAPO's overlong shaping, where it added to it


@dataclass
class Group:
    """The n samples of one prompt, once all of them are complete. A failed sample (no reward)
    leaves the group when it is filtered (`keep_group`); the group trains on the rest."""

    id: str
    prompt: Prompt
    prompt_ids: list[int]
    rollouts: list[Rollout]
    start_version: int = 0  # policy version when the group was first submitted
    serial: int = 0  # the order in which the run drew its prompt
    dropped: int = 0  # failed samples taken out of `rollouts`
    greedy: Rollout | None = None  # ReMax: the prompt's greedy answer, scored, its reward the baseline; never trained
    opened_reasoning: bool = False  # the prompt ends in an open `<think>` (`rollover.types.split_reasoning`)

    @property
    def rewards(self) -> list[float | None]:
        return [r.reward for r in self.rollouts]


def finite_float(value: object) -> float | None:
    """`value` as a finite float when it is a real number (a 0-d array or tensor too) that is
    one; None for NaN, inf, an int past 1.8e308 (`float` raises on it), text or a container."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()
    if not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def split_reasoning(text: str, opened: bool = False) -> tuple[str, str]:
    """(reasoning, the rest) of a reply: up to its last `</think>`, or from a `<think>` never closed
    (a turn cut off while thinking) to the end; ("", text) without either. `opened`: the prompt
    ended in an open `<think>` (the chat template opened the reasoning, as Qwen3.5's and Qwen3's
    Thinking-2507 do), so a reply without `</think>` is all reasoning."""
    end = text.rfind("</think>")
    if end >= 0:
        return text[:end + len("</think>")], text[end + len("</think>"):]
    if opened:
        return text, ""
    start = text.find("<think>")
    return (text[start:], text[:start]) if start >= 0 else ("", text)


def answer_of(text: str, opened: bool = False) -> str:
    """A reply's answer: what follows its reasoning (`split_reasoning`), up to a `<think>` opened
    again there and never closed (what a reply cut off while thinking again drafted is no answer)."""
    rest = split_reasoning(text, opened)[1]
    start = rest.find("<think>")
    return rest[:start] if start >= 0 else rest


def prefilled(messages: list[dict]) -> bool:
    """Whether chat messages end in the assistant's text message: a prefill the model continues."""
    return bool(messages) and messages[-1].get("role") == "assistant" and isinstance(messages[-1].get("content"), str)
