"""Environments and the episodes they make: the types that cross the core -> env seam.

An environment (`Env`) is a small object with two async methods, used once per episode:
`initial_observation()` returns the opening chat messages, and `step(action)` takes what the
model wrote and returns the messages to insert next (user feedback, tool results), a reward
and whether the episode is over. Environments see text and token ids, never the engine: the
core owns the tokens (`rollover.envs.episode`).

An `EnvGroupBuilder` makes the n environments of one task (a GRPO group): `make_group(prompt,
n)`. They are n separate objects, so each episode has its own state.

A `Trajectory` is an episode's token sequence, exactly as the model saw it: the rendered
opening messages, then for each turn the sampled tokens followed by the tokens the environment
inserted (the rest of the chat template around its messages). Per token it carries
`loss_mask_T` (1 = sampled, trained), `logprobs_T` (the engine's behaviour logprob; None where
inserted) and `versions_T` (the policy version that sampled it; -1 where inserted).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import numbers
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Hashable, Literal, Protocol, Sequence

from rollover.types import FinishReason, Prompt, Rollout, finite_float

INSERTED_VERSION = -1  # versions_T of a token the environment (or the prompt) put there

# done: the environment ended the episode; max_turns / length: the runner's turn or token
# budget ended it; abort: the engine aborted the turn being sampled; error: the environment
# raised or timed out (see `EpisodeError`).
EpisodeFinish = Literal["done", "max_turns", "length", "abort", "error"]


@dataclass(frozen=True)
class Action:
    """One assistant turn as the environment receives it."""

    text: str  # the sampled tokens decoded, special tokens (the end-of-turn mark) left out
    token_ids: tuple[int, ...]  # exactly the sampled ids of this turn
    finish: FinishReason  # 'stop' (end of turn, a stop token or a rollout.stop string) or 'length' (turn budget hit)
    opened_reasoning: bool = False  # the turn began inside an open `<think>` the chat template wrote (Qwen3.5's)


@dataclass
class Opening:
    """What `initial_observation` may return instead of a message list: the messages, and
    keyword arguments for the chat template when it renders this episode's opening (e.g.
    `{"tools": [...]}` for a template that describes tools itself, per episode). Later
    insertions render only what follows an assistant turn, which those arguments do not
    change for the templates this is meant for (Qwen's, Hermes')."""

    messages: list[dict]
    template_kwargs: dict = field(default_factory=dict)
    stop: tuple[str, ...] = ()  # strings that also end the model's first turn (as StepResult.stop)
    # messages ending in the assistant's: True continues that message (a prefill, as a data
    # prompt's); False closes it and opens a new turn, as OpenAI's chat API does (agents)
    prefill: bool = True


@dataclass
class StepResult:
    """What `Env.step` returns. `messages` are ignored when `done` (nothing follows them).

    `continuation`, instead of messages: text that goes on inside the model's own turn, with no
    chat template around it (tokenised alone, never trained); the model then continues the same
    assistant message after it. The tool-integrated-reasoning form (Search-R1's `<information>`,
    a code cell's output): a `rollout.stop` string ends the model's turn at its call, the
    result is the continuation."""

    messages: list[dict]  # chat messages to insert: {"role": "user" | "tool" | ..., "content"}
    reward: float
    done: bool
    info: dict = field(default_factory=dict)  # numbers worth reporting (e.g. {"guesses": 3}): rollout/env/info/<key>
    # what the step left the environment in (a tuple, a string, a number), for env.credit=gigpo:
    # turns that start from equal states (within a group) are compared with each other. None:
    # the whole conversation so far stands for it
    state: Hashable | None = None
    continuation: str | None = None  # text inside the model's turn, instead of messages (above)
    # strings that also end the model's next turn, beside rollout.stop's (an agent's `stop=`)
    stop: tuple[str, ...] = ()


class Env(Protocol):
    """One episode's environment. Both methods are coroutines and must not block the event
    loop: run blocking work (a subprocess, a sandbox) with `asyncio.to_thread`, or the episode
    runner's step timeout cannot fire. (The loops that run environments give each such call a
    thread of its own, `ThreadPerCall`: one that hangs past its timeout holds up nothing else.)"""

    async def initial_observation(self) -> list[dict] | Opening: ...

    async def step(self, action: Action) -> StepResult: ...


class EnvGroupBuilder(Protocol):
    """Makes the n environments of one task; each is used for one episode.

    Optional, for `data.train: env`: `prompts(n, seed) -> list[Prompt]`, the builder's own
    tasks, the same for the same (n, seed). Training calls `prompts(env.tasks, seed=seed)` and,
    for held-out tasks when data.eval is unset, `prompts(data.eval_size, seed=seed + 1_000_003)`.
    It is not one of the protocol's methods because a builder fed by a dataset needs none.

    Optional: `make_one(prompt, n, j) -> Env`, the environment `make_group(prompt, n)` makes at
    place j, alone. `env.resample_failed` uses it to replace one failed episode; without it, a
    whole group is made to use one (what a costly environment, a sandbox, pays n times for).
    """

    def make_group(self, prompt: Prompt, n: int) -> Sequence[Env]: ...


def make_one(builder, prompt: Prompt, n: int, j: int) -> Env:
    """The environment `builder` makes at place j of a group of n: by its `make_one` where it
    has one, else the j-th of a whole group."""
    if callable(getattr(builder, "make_one", None)):
        return checked_env(builder.make_one(prompt, n, j), f"make_one(prompt, {n}, {j})")
    return make_group(builder, prompt, n)[j]


def make_group(builder, prompt: Prompt, n: int) -> list[Env]:
    """`builder.make_group(prompt, n)`, checked: n environments, each an object of its own
    (an episode's state is its environment's) with the `Env` methods."""
    made = builder.make_group(prompt, n)
    where = f"make_group(prompt, {n}) of {type(builder).__name__}"
    if not hasattr(made, "__iter__") or isinstance(made, (str, bytes, dict)):
        raise TypeError(f"{where} returned {type(made).__name__}, not a list of environments")
    envs = list(made)
    if len(envs) != n:
        raise ValueError(f"{where} returned {len(envs)} environments")
    if len({id(e) for e in envs}) < n:
        raise ValueError(f"{where} returned one object more than once: each episode needs an environment of its own "
                         "(the episode's state lives in it)")
    return [checked_env(e, where) for e in envs]


def checked_env(env, where: str) -> Env:
    for method in ("initial_observation", "step"):
        if not callable(getattr(env, method, None)):
            raise TypeError(f"{where} returned a {type(env).__name__}, which has no {method}(): an environment has "
                            "async initial_observation() and async step(action) (rollover.envs.Env)")
    return env


class EnvLost(RuntimeError):
    """The process holding an episode's environment is gone (an environment worker died): the
    episode fails, the run goes on."""


@dataclass(frozen=True)
class EpisodeError:
    """Why an environment failed its episode. The episode gets no reward."""

    turn: int  # 0: initial_observation; k >= 1: the step after the k-th sampled turn
    type: str  # the exception's class name, or "TimeoutError" for a step past the timeout
    message: str
    traceback: str  # formatted, for the report; "" for a timeout
    timed_out: bool

    def describe(self) -> str:
        where = "initial_observation" if self.turn == 0 else f"step {self.turn}"
        return f"{where}: {self.type}: {self.message}"


@dataclass
class Turn:
    """One sampled assistant turn and what the environment made of it.

    The turn's sampled tokens are `tokens_T[start:end]`; the tokens inserted after it (end of
    the assistant turn, the environment's messages, the next generation prompt) are
    `tokens_T[end:next turn's start]`, absent after the last turn.
    """

    start: int
    end: int
    finish: FinishReason  # the engine's finish for this turn
    text: str  # Action.text
    reward: float = 0.0  # 0.0 until the environment has stepped (never stepped: error, abort)
    messages: list[dict] = field(default_factory=list)  # the environment's reply to the turn
    continuation: str | None = None  # or its text inside the model's turn (StepResult.continuation)
    info: dict = field(default_factory=dict)
    state: Hashable | None = None  # StepResult.state
    gen_s: float = 0.0  # wall time waiting for the engine
    env_s: float = 0.0  # wall time in env.step
    opened_reasoning: bool = False  # Action.opened_reasoning


@dataclass
class Trajectory:
    """An episode's tokens, exactly as sampled and inserted, and what happened in it."""

    request_id: str
    prompt_len: int  # tokens_T[:prompt_len] is the rendered initial observation
    tokens_T: list[int]
    loss_mask_T: list[int]  # 1 = sampled by the policy, 0 = prompt or inserted by the env
    logprobs_T: list[float | None]  # behaviour logprob of sampled tokens; None elsewhere
    versions_T: list[int]  # policy version of sampled tokens; INSERTED_VERSION elsewhere
    turns: list[Turn]
    finish: EpisodeFinish
    error: EpisodeError | None = None
    initial_env_s: float = 0.0  # wall time in initial_observation
    resampled: int = 0  # failed episodes of its group's place that ran before it (env.resample_failed)
    media: object = None  # the images in its messages so far, in order, as the forward takes them (`Media`)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def reward(self) -> float | None:
        """The sum of the turns' rewards; None for a failed episode (never a silent 0)."""
        return None if self.error is not None else sum(t.reward for t in self.turns)

    @property
    def turn_rewards(self) -> list[float]:
        return [t.reward for t in self.turns]

    @property
    def info(self) -> dict:
        """The turns' info dicts merged, later turns winning."""
        merged: dict = {}
        for t in self.turns:
            merged.update(t.info)
        return merged

    @property
    def env_s(self) -> float:
        return self.initial_env_s + sum(t.env_s for t in self.turns)

    @property
    def gen_s(self) -> float:
        return sum(t.gen_s for t in self.turns)

    def to_rollout(self, group_id: str, *, failed_ok: bool = False) -> Rollout:
        """The trajectory in the single-turn rollout's shape: the initial observation is the
        prompt, everything after it the response. Inserted tokens keep loss mask 0 and
        version -1; their logprob becomes 0.0 (as padding is in `TrainBatch`), so it must only
        ever be read through the mask. A failed episode is refused: it has no reward. Finish:
        `done` -> 'stop', `abort` -> 'abort', `max_turns` and `length` (truncated) -> 'length'.
        With `failed_ok`, a failed episode becomes a rollout with reward None (unscored)."""
        if self.error is not None and not failed_ok:
            raise ValueError(f"episode {self.request_id} failed ({self.error.describe()}): it has no reward")
        p = self.prompt_len
        return Rollout(
            group_id=group_id,
            prompt_ids=self.tokens_T[:p],
            response_ids=self.tokens_T[p:],
            logprobs=[0.0 if lp is None else lp for lp in self.logprobs_T[p:]],
            versions=self.versions_T[p:],
            loss_mask=self.loss_mask_T[p:],
            finish="stop" if self.finish == "done" else ("abort" if self.finish == "abort" else "length"),
            reward=self.reward,
            media=self.media,
        )


def episode_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Counts and means over episodes, for the metrics log: episodes, failed (and timed out),
    turns per episode, the environment's share of the episode time, finish reasons, and
    `env/info/<key>`: each numeric `info` value averaged over the episodes that reported it
    (an episode's `Trajectory.info`: its turns' info merged, later turns winning); other values
    are not metrics and are left out. Training logs these under `rollout/` (`rollout/env/...`)."""
    n = len(trajectories)
    if n == 0:
        return {}
    env_s = sum(t.env_s for t in trajectories)
    gen_s = sum(t.gen_s for t in trajectories)
    out = {
        "env/episodes": float(n),
        "env/failed": float(sum(not t.ok for t in trajectories)),
        "env/resampled": float(sum(getattr(t, "resampled", 0) for t in trajectories)),
        "env/timed_out": float(sum(t.error is not None and t.error.timed_out for t in trajectories)),
        "env/turns_mean": sum(len(t.turns) for t in trajectories) / n,
        "env/env_time_share": env_s / (env_s + gen_s) if env_s + gen_s > 0 else 0.0,
    }
    for reason in ("done", "max_turns", "length", "abort", "error"):
        out[f"env/finish_{reason}"] = sum(t.finish == reason for t in trajectories) / n
    out.update({f"env/info/{key}": v for key, v in info_means(trajectories).items()})
    return out


def info_means(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Each numeric `info` value (an episode's `Trajectory.info`) averaged over the episodes
    that reported it; other values are not metrics and are left out, as are numbers that are
    not finite floats (NaN, inf, an int past 1.8e308)."""
    values: dict[str, list[float]] = {}
    for t in trajectories:
        for key, v in t.info.items():
            if isinstance(v, numbers.Real) and (number := finite_float(v)) is not None:  # bools count (a rate)
                values.setdefault(str(key), []).append(number)
    return {key: sum(values[key]) / len(values[key]) for key in sorted(values)}


class ThreadPerCall(ThreadPoolExecutor):
    """The executor of the event loops that run environments (`asyncio.to_thread` and
    `run_in_executor(None, ...)` go to it): each call runs on a daemon thread of its own. A call
    past its step timeout cannot be stopped, only left: on a pool it would keep a worker, and a few
    hung tool calls would leave every later call of the run queued until it timed out too; its
    daemon thread holds nothing else up, and the process still exits when the run ends. (A
    ThreadPoolExecutor only as a loop's default executor must be one; its pool is never used.)"""

    def __init__(self, name: str = "rollover-env-call"):
        super().__init__(max_workers=1, thread_name_prefix=name)
        self._closed = False

    def submit(self, fn, /, *args, **kwargs) -> Future:
        if self._closed:
            raise RuntimeError("cannot run a call after the executor was shut down")
        future: Future = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:
                future.set_exception(e)
            else:
                future.set_result(result)

        threading.Thread(target=run, name=self._thread_name_prefix, daemon=True).start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuses later calls; never waits for a running one (a hung call would never return)."""
        self._closed = True


def env_loop() -> asyncio.AbstractEventLoop:
    """A new event loop for environment calls, its default executor a `ThreadPerCall`."""
    loop = asyncio.new_event_loop()
    loop.set_default_executor(ThreadPerCall())
    return loop


_CALLS = ThreadPerCall()


async def in_thread(fn, /, *args, **kwargs):
    """`fn(*args, **kwargs)` on a thread of its own (`ThreadPerCall`), awaited: what the built-in
    environments run tools, sandboxes and scorers with, on whichever loop runs them."""
    context = contextvars.copy_context()  # as asyncio.to_thread: the caller's context variables
    return await asyncio.get_running_loop().run_in_executor(_CALLS, functools.partial(context.run, fn, *args, **kwargs))


def cut(text: str, limit: int | None, mark: str = " [truncated]") -> str:
    """`text`, or its first `limit` characters and `mark` where it is longer (None: no limit):
    what a tool's or a program's output shows the model."""
    return text if limit is None or len(text) <= limit else text[:limit] + mark
