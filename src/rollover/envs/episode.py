"""Running episodes: the engine samples a turn, the environment answers, until one ends it.

`run_episode` drives one environment through the engine's `agenerate`. Each turn is a fresh
`Request` whose prompt is the whole trajectory so far (token ids, never text), so any engine
that honours the `Engine` contract runs episodes, and a prefix cache sees the shared prefix.
After the turn, the environment steps on the decoded text and ids, and the renderer appends
the tokens it inserts (`rollover.envs.render`); sampled tokens are kept exactly as sampled.

An episode ends when the environment says done, after `max_turns` sampled turns, when the
next turn would not fit `max_total_tokens` (the whole sequence: opening, every turn, every
insertion), or when the engine aborts a turn. A turn cut off by the token budget is still
given to the environment, which may score it, as a single-turn reward scores a truncated
completion.

An environment that raises, returns something that is not a `StepResult` with a finite
reward, returns messages the chat template refuses (a `TemplateError`), opens with more than
`max_total_tokens` (`OpeningTooLong`: one long task, or a system message and worked examples
too long for every task), or takes longer than `step_timeout_s` in one call fails its episode: the trajectory keeps its tokens, `error` says
where and why, and `reward` is None. The run goes on; the caller counts and reports failed
episodes (`episode_metrics`). Errors of the engine, and a template the renderer cannot render
exactly, are not the environment's and propagate.

`run_group` runs the n episodes of one task concurrently. Each advances on its own: there is no
barrier between turns, so a fast episode's next turn is queued while a slow one still samples
or waits for its environment.

An `EnvPool` shared by the episodes of a run bounds how many environment calls run at once
(the environment cluster's size) and measures how busy they are (environment utilization).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import numbers
import time
import traceback
from dataclasses import replace
from typing import TYPE_CHECKING, Awaitable, Callable, Sequence

from jinja2.exceptions import TemplateError

from rollover.envs.base import INSERTED_VERSION, Action, Env, EpisodeError, Opening, StepResult, Trajectory, Turn
from rollover.data.media import Media
from rollover.data.render import opens_reasoning
from rollover.envs.render import ChatRenderer
from rollover.rewards.builtins import numpy_bool
from rollover.types import Request, SamplingParams, finite_float, prefilled

if TYPE_CHECKING:  # envs never import the engine at run time; the episode only calls agenerate
    from rollover.engine import Engine

Clock = Callable[[], float]


class OpeningTooLong(ValueError):
    """The environment's initial observation leaves no room under `max_total_tokens` to generate."""


class EnvPool:
    """The environments of a run: at most `max_concurrent` environment calls
    (`initial_observation` and `step`) at once across every episode given this pool, and a
    meter of how busy they are. One pool per event loop.

    A call first waits for a free slot; its `step_timeout_s` starts once it has one (a full pool
    is not the environment's fault), and `Turn.env_s` is the call alone. The pool sums
    `busy_s`, the seconds calls held a slot, and `wait_s`, the seconds they waited for one.

    Environment utilization over a window of `wall_s` seconds (`utilization(wall_s)`) is

        busy_s / (max_concurrent * wall_s)

    the share of the pool's slot-time spent inside environment calls rather than idle, waiting
    for the model to sample the next turn or for other episodes to catch up. With one slot per
    environment instance (a GUI VM, a sandbox), it is the share of time the instances are
    working; 1.0 means every slot worked the whole window. `reset()` starts a new window's
    counters.
    """

    def __init__(self, max_concurrent: int, clock: Clock = time.monotonic):
        if max_concurrent < 1:
            raise ValueError(f"EnvPool: max_concurrent must be >= 1, got {max_concurrent}")
        self.max_concurrent, self.clock = max_concurrent, clock
        self._slots = asyncio.Semaphore(max_concurrent)
        self.active = 0  # calls holding a slot now
        self.reset()

    def reset(self) -> None:
        self.busy_s = 0.0
        self.wait_s = 0.0
        self.calls = 0
        self.peak = self.active  # the most calls that held a slot at once

    def utilization(self, wall_s: float) -> float:
        if not wall_s > 0:
            raise ValueError(f"utilization needs a window of wall time > 0 s, got {wall_s}")
        return self.busy_s / (self.max_concurrent * wall_s)

    @contextlib.asynccontextmanager
    async def slot(self):
        asked = self.clock()
        async with self._slots:
            start = self.clock()
            self.wait_s += start - asked
            self.active += 1
            self.peak = max(self.peak, self.active)
            try:
                yield
            finally:
                self.active -= 1
                self.calls += 1
                self.busy_s += self.clock() - start



class LiveEpisode:
    """An episode as a resumable state machine: what every runner drives, with no coroutine in
    it, so an episode can stop anywhere (mid-turn, or waiting for its environment), be carried
    across training steps and be saved in a checkpoint.

    `open_text` is the text of the assistant message still open (an opening's prefill, turns that
    environments continued, and their continuations), which the next messages' insertion closes.

    `phase` says what the episode needs next:
    - "open": the environment's `initial_observation()`, given to `opened`;
    - "generate": an engine turn: `request()` is the next turn's request, or the aborted
      turn's resumed at its next token; its completion goes to `sampled`;
    - "step": the environment's `step(self.action)`, given to `stepped`;
    - "finished": `traj` is the whole episode.

    A checkpoint keeps everything but the environment object, which is rebuilt by replaying the
    episode's action log (`replay`): a deterministic environment (same task and actions, same
    answers) comes back in the state it had. A replay whose answers differ from the recorded
    ones is an error naming the episode and the step.
    """

    open_text = ""  # (a class default: checkpoints written before it was kept load as no open message)
    prefill: dict | None = None  # the opening's last message when the first turn continued it (as the opening gave it)
    turn_stop: tuple[str, ...] = ()  # the environment's stop strings for the next turn (StepResult.stop)

    def __init__(self, request_id: str, sampling: SamplingParams, *, max_turns: int, max_total_tokens: int,
                 env: Env | None = None):
        _check_limits(max_turns, max_total_tokens)
        self.request_id = request_id
        self.sampling = sampling
        self.max_turns, self.max_total_tokens = max_turns, max_total_tokens
        self.env = env
        self.phase = "open"
        self.traj: Trajectory | None = None  # None until the initial observation is in
        self.history: list[dict] = []  # the conversation as text, for the template's context only
        self.partial = None  # the aborted turn's Completion, resumed by the next request()
        self.action: Action | None = None  # the action waiting for env.step (phase "step")
        self.turn_started: float | None = None
        self.replaced = 0  # failed episodes of its place that ran before it (env.resample_failed)

    @property
    def finished(self) -> bool:
        return self.phase == "finished"

    @property
    def turn(self) -> int:
        """The number of the turn being sampled or to sample next (1-based)."""
        return len(self.traj.turns) + (self.phase != "step")

    # ------------------------------------------------------------ transitions
    def opened(self, messages, error: EpisodeError | None, env_s: float, renderer: ChatRenderer) -> None:
        """The initial observation came back (or failed): messages, or an `Opening`."""
        kwargs, prefill = {}, True
        if isinstance(messages, Opening):
            self.turn_stop, prefill = tuple(messages.stop), messages.prefill
            messages, kwargs = messages.messages, dict(messages.template_kwargs)
        if error is None:
            try:
                prompt_ids, media = renderer.initial_media(messages, prefill, **kwargs)
            except TemplateError as e:  # the chat template refuses the environment's messages (or images)
                error = _error(0, e)
            else:
                if len(prompt_ids) >= self.max_total_tokens:  # this task's opening: the episode fails, not the run
                    error = _error(0, OpeningTooLong(
                        f"episode {self.request_id}: the initial observation is {len(prompt_ids)} tokens, "
                        f"max_total_tokens={self.max_total_tokens} leaves no room to generate (raise env.max_total_tokens: "
                        "the environment's system message and worked examples count too)"))
        if error is not None:
            self.traj = _trajectory(self.request_id, 0, finish="error", error=error, initial_env_s=env_s)
            self.phase = "finished"
            return
        self.traj = _trajectory(self.request_id, len(prompt_ids), finish="max_turns", initial_env_s=env_s, media=media)
        _append_inserted(self.traj, prompt_ids)
        self.history = list(messages)
        if prefill and prefilled(messages):  # the model's first turn continues the opening's assistant message
            self.history, self.open_text, self.prefill = self.history[:-1], messages[-1]["content"], dict(messages[-1])
        self.phase = "generate"

    def fail(self, exc: BaseException) -> None:
        """End the episode where it stands as failed by `exc` (its environment is lost)."""
        error = _error(self.turn if self.traj is not None else 0, exc)
        if self.traj is None:
            self.traj = _trajectory(self.request_id, 0, finish="error", error=error)
        else:
            self.traj.finish, self.traj.error = "error", error
        self.phase, self.action, self.partial = "finished", None, None

    def request(self, clock: Clock = time.monotonic) -> Request:
        """The next turn's request; an aborted turn resumes from its tokens (same seed, same
        budget), so it samples what it would have sampled uninterrupted."""
        if self.turn_started is None:
            self.turn_started = clock()
        if self.partial is not None:
            return replace(self.partial.resume(), media=self.traj.media)
        room = self.max_total_tokens - len(self.traj.tokens_T)
        sampling = replace(self.sampling, max_new_tokens=min(self.sampling.max_new_tokens, room),
                           seed=_turn_seed(self.sampling.seed, self.turn),
                           stop=tuple(dict.fromkeys((*self.sampling.stop, *self.turn_stop))))
        return Request(id=f"{self.request_id}/turn{self.turn}", prompt_ids=list(self.traj.tokens_T), sampling=sampling,
                       media=self.traj.media)

    def sampled(self, completion, renderer: ChatRenderer, clock: Clock = time.monotonic, *, resume: bool = True) -> None:
        """A turn's completion. Aborted: kept as `partial` for the next request (`resume`), or
        the end of the episode (finish 'abort', its tokens kept). Otherwise the turn joins the
        trajectory and the episode waits for the environment's step on `self.action`."""
        if completion.finish == "abort" and resume:
            self.partial = completion if completion.response_ids else None
            return
        self.partial = None
        ids = completion.response_ids
        text = renderer.tokenizer.decode(ids, skip_special_tokens=True)
        start_T = len(self.traj.tokens_T)
        if self.open_text and self.traj.turns:  # a message continued: open where it began open and is not yet closed
            thinking = self.traj.turns[-1].opened_reasoning and "</think>" not in self.open_text
        else:  # the template's generation prompt opened <think>
            thinking = opens_reasoning(renderer.tokenizer, self.traj.tokens_T)
        gen_s = clock() - self.turn_started if self.turn_started is not None else 0.0
        self.turn_started = None
        self.traj.turns.append(Turn(start_T, start_T + len(ids), completion.finish, text, gen_s=gen_s,
                                    opened_reasoning=thinking))
        _append_sampled(self.traj, completion)
        if completion.finish == "abort":
            self.traj.finish, self.phase = "abort", "finished"
            return
        self.action = Action(text=text, token_ids=tuple(ids), finish=completion.finish, opened_reasoning=thinking)
        self.phase = "step"

    def stepped(self, result: StepResult | None, error: EpisodeError | None, env_s: float,
                renderer: ChatRenderer) -> None:
        """The environment's answer to the last turn (or its failure)."""
        traj, turn = self.traj, self.traj.turns[-1]
        turn.env_s, self.action = env_s, None
        self.phase = "finished"
        if error is not None:
            traj.finish, traj.error = "error", error
            return
        turn.reward, turn.messages, turn.info = float(result.reward), list(result.messages), dict(result.info)
        turn.state, turn.continuation = result.state, result.continuation
        self.turn_stop = tuple(result.stop)
        k = len(traj.turns)
        if result.done or k >= self.max_turns:
            traj.finish = "done" if result.done else "max_turns"
            return
        try:
            if result.continuation is not None:  # the model's turn goes on after the text
                inserted, media = renderer.continuation(self.history, traj.tokens_T[turn.start:turn.end],
                                                        result.continuation), None
            else:
                inserted, media = renderer.insertion_media(self.history, traj.tokens_T[turn.start:turn.end],
                                                           result.messages)
        except TemplateError as e:
            traj.finish, traj.error = "error", _error(k, e)
            return
        try:
            media = Media.join(traj.media, media)
        except ValueError as e:  # images one forward cannot take together (their shapes differ)
            traj.finish, traj.error = "error", _error(k, e)
            return
        if len(traj.tokens_T) + len(inserted) >= self.max_total_tokens:
            traj.finish = "length"
            return
        _append_inserted(traj, inserted)
        traj.media = media
        if result.continuation is not None:
            self.open_text += turn.text + result.continuation
        else:
            self.history += [{"role": "assistant", "content": self.open_text + turn.text}, *result.messages]
            self.open_text = ""
        self.phase = "generate"

    async def replay(self, env: Env, timeout_s: float) -> None:
        """Bring a fresh `env` to this episode's state by replaying its action log: the opening,
        then a step for every turn the environment has answered. An answer that differs from
        the recorded one is an error naming the episode and the step."""
        if self.phase != "open":
            opening = await asyncio.wait_for(env.initial_observation(), timeout_s)
            prefill = not isinstance(opening, Opening) or opening.prefill
            opening = list(opening.messages if isinstance(opening, Opening) else opening)
            recorded = self.history[:len(opening)]
            if prefill and prefilled(opening) and self.prefill is not None:  # (history holds it joined with the turn)
                recorded = [*self.history[:len(opening) - 1], self.prefill]
            if opening != recorded:
                raise ValueError(f"episode {self.request_id}: a fresh environment opened differently from the recorded "
                                 f"run ({opening!r:.120} vs {self.history!r:.120}); resuming a checkpoint needs an "
                                 "environment that is deterministic given its task and actions")
            t = self.traj
            answered = t.turns[:-1] if self.phase == "step" else t.turns
            for k, turn in enumerate(answered, start=1):
                action = Action(turn.text, tuple(t.tokens_T[turn.start:turn.end]), turn.finish, turn.opened_reasoning)
                result = await asyncio.wait_for(env.step(action), timeout_s)
                if (list(result.messages) != turn.messages or float(result.reward) != turn.reward
                        or result.continuation != turn.continuation):
                    theirs, ours = (result.messages, turn.messages) if result.continuation == turn.continuation else \
                        (result.continuation, turn.continuation)
                    raise ValueError(
                        f"episode {self.request_id}: replaying its actions into a fresh environment answered step "
                        f"{k} differently from the recorded run ({theirs!r:.120} vs {ours!r:.120}); "
                        "resuming a checkpoint needs an environment that is deterministic given its task and actions")
        self.env = env

    def __getstate__(self):
        state = dict(self.__dict__)
        state["env"] = None  # rebuilt by replay after a checkpoint is loaded
        state["turn_started"] = None
        return state


async def run_episode(
    engine: "Engine",
    env: Env,
    renderer: ChatRenderer,
    sampling: SamplingParams,
    *,
    max_turns: int,
    max_total_tokens: int,
    step_timeout_s: float,
    request_id: str,
    clock: Clock = time.monotonic,
    pool: EnvPool | None = None,
) -> Trajectory:
    """One episode of `env`. `sampling.max_new_tokens` bounds each turn; a seeded `sampling`
    gets a seed per turn derived from it, so a seeded episode is reproducible. With a `pool`,
    every call of `env` takes one of its slots. An aborted turn ends the episode (finish
    'abort', its tokens kept); the rollout core resumes such turns instead."""
    _check_limits(max_turns, max_total_tokens, step_timeout_s)
    ep = LiveEpisode(request_id, sampling, max_turns=max_turns, max_total_tokens=max_total_tokens, env=env)
    ep.opened(*await _call_env(env.initial_observation, _not_messages, step_timeout_s, 0, clock, pool), renderer)
    while not ep.finished:
        if ep.phase == "generate":
            ep.sampled(await _generate(engine, ep.request(clock)), renderer, clock, resume=False)
        else:
            ep.stepped(*await env_step(ep, step_timeout_s, clock, pool), renderer)
    return ep.traj


async def env_step(ep: LiveEpisode, timeout_s: float, clock: Clock = time.monotonic, pool: EnvPool | None = None):
    """The call an episode in phase "step" waits for: (result, error, seconds)."""
    return await _call_env(functools.partial(ep.env.step, ep.action), _not_step_result, timeout_s, ep.turn, clock, pool)


async def env_open(ep: LiveEpisode, timeout_s: float, clock: Clock = time.monotonic, pool: EnvPool | None = None):
    """The call an episode in phase "open" waits for: (messages, error, seconds)."""
    return await _call_env(ep.env.initial_observation, _not_messages, timeout_s, 0, clock, pool)


async def run_group(
    engine: "Engine",
    envs: Sequence[Env],
    renderer: ChatRenderer,
    sampling: SamplingParams,
    *,
    group_id: str,
    max_turns: int,
    max_total_tokens: int,
    step_timeout_s: float,
    clock: Clock = time.monotonic,
    pool: EnvPool | None = None,
) -> list[Trajectory]:
    """The episodes of `envs` (one task's group), concurrently; trajectories in `envs` order.

    Episode j's request ids are `{group_id}/{j}/turn{k}`; a seeded `sampling` gives each
    episode its own seed. An engine error in one episode cancels the others (their requests
    are aborted in the engine) and propagates. Give every group of a run the same `pool`.
    """
    async with asyncio.TaskGroup() as tg:
        tasks = [
            tg.create_task(
                run_episode(
                    engine, env, renderer, replace(sampling, seed=episode_seed(sampling.seed, j)),
                    max_turns=max_turns, max_total_tokens=max_total_tokens, step_timeout_s=step_timeout_s,
                    request_id=f"{group_id}/{j}", clock=clock, pool=pool,
                )
            )
            for j, env in enumerate(envs)
        ]
    return [t.result() for t in tasks]


async def _generate(engine: "Engine", request: Request):
    """`engine.agenerate`, shielded: a cancelled episode aborts its request in the engine, which
    resolves the engine's future, rather than cancelling that future under the engine (which
    TorchEngine does not survive: it resolves every future it was given)."""
    generation = asyncio.ensure_future(engine.agenerate(request))
    try:
        return await asyncio.shield(generation)
    except asyncio.CancelledError:
        engine.abort([request.id])
        raise


async def _call_env(
    call: Callable[[], Awaitable], wrong: Callable[[object], str | None], timeout_s: float, turn: int, clock: Clock,
    pool: EnvPool | None,
):
    """(value, None, seconds) or (None, EpisodeError, seconds), in one of the pool's slots
    when there is a pool (the wait for a slot is not in the seconds or the timeout)."""
    if pool is None:
        return await _timed_call(call, wrong, timeout_s, turn, clock)
    async with pool.slot():
        return await _timed_call(call, wrong, timeout_s, turn, clock)


async def _timed_call(
    call: Callable[[], Awaitable], wrong: Callable[[object], str | None], timeout_s: float, turn: int, clock: Clock
):
    """Only Exceptions (and SystemExit) count as the environment's failure; cancellation and
    KeyboardInterrupt propagate. `wrong(value)` says what is wrong with a value the environment returned (a
    TypeError of the episode)."""
    start = clock()
    try:
        async with asyncio.timeout(timeout_s) as deadline:
            pending = call()
            if not inspect.isawaitable(pending):
                name = getattr(getattr(call, "func", call), "__qualname__", "the environment's method")
                raise TypeError(f"{name} returned {type(pending).__name__}, not an awaitable: write it as `async def` "
                                "(blocking work goes through asyncio.to_thread)")
            value = await pending
    except TimeoutError as e:
        if deadline.expired():
            message = f"no answer within step_timeout_s={timeout_s:g}"
            return None, EpisodeError(turn, "TimeoutError", message, "", timed_out=True), clock() - start
        return None, _error(turn, e), clock() - start
    except (Exception, SystemExit) as e:  # the environment's failure (a sys.exit in it too), with its traceback
        return None, _error(turn, e), clock() - start
    try:
        problem = wrong(value)
    except Exception as e:  # noqa: BLE001 - the value's own methods raised while it was checked
        problem = f"what the environment returned could not be checked ({type(e).__name__}: {e})"
    if problem is not None:
        return None, _error(turn, TypeError(problem)), clock() - start
    return value, None, clock() - start


def _error(turn: int, e: BaseException) -> EpisodeError:
    tb = "".join(traceback.format_exception(e)) if e.__traceback__ is not None else ""
    return EpisodeError(turn, type(e).__name__, str(e), tb, timed_out=False)


def _trajectory(request_id: str, prompt_len: int, **kw) -> Trajectory:
    return Trajectory(request_id=request_id, prompt_len=prompt_len, tokens_T=[], loss_mask_T=[], logprobs_T=[],
                      versions_T=[], turns=[], **kw)


def _append_sampled(traj: Trajectory, completion) -> None:
    """The engine's tokens with their logprobs and versions, exactly as returned."""
    n = len(completion.response_ids)
    if not (len(completion.logprobs) == len(completion.versions) == n):
        raise ValueError(f"completion {completion.id}: per-token lists differ in length")
    traj.tokens_T += completion.response_ids
    traj.loss_mask_T += [1] * n
    traj.logprobs_T += completion.logprobs
    traj.versions_T += completion.versions


def _append_inserted(traj: Trajectory, ids: list[int]) -> None:
    traj.tokens_T += ids
    traj.loss_mask_T += [0] * len(ids)
    traj.logprobs_T += [None] * len(ids)
    traj.versions_T += [INSERTED_VERSION] * len(ids)


def _is_messages(value) -> bool:
    """A list of chat messages: dicts with a role and a content that is text or a list of parts
    (`{"type": "text", ...}`, images); None only beside an assistant's `tool_calls`."""
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
        and (isinstance(m["content"], (str, list)) or (m["content"] is None and "tool_calls" in m)) for m in value)


def _not_stop(stop) -> str | None:
    if isinstance(stop, (tuple, list)) and all(isinstance(s, str) and s for s in stop):
        return None
    return f"stop={stop!r:.100}: a tuple of non-empty strings"


def _not_messages(value) -> str | None:
    if isinstance(value, Opening) and _not_stop(value.stop):
        return f"initial_observation returned an Opening with {_not_stop(value.stop)}"
    if _is_messages(value) or (isinstance(value, Opening) and _is_messages(value.messages)
                               and isinstance(value.template_kwargs, dict)):
        return None
    return (f"initial_observation returned {value!r:.200}, not a list of message dicts, each with a 'role' and a "
            "'content' that is a string (or a list of parts)")


def _not_step_result(value) -> str | None:
    """What is wrong with what `step` returned, naming the field; None when it is a StepResult.
    A numpy number as the reward is taken as a float, a bool (Python's or numpy's) as 1.0 or 0.0,
    and no messages (None) after the last step as none."""
    if not isinstance(value, StepResult):
        return f"step returned {value!r:.200}, not a StepResult(messages, reward, done, info)"
    if value.done and value.messages is None:  # nothing follows the last step's messages
        value.messages = []
    if isinstance(value.reward, bool) or numpy_bool(value.reward) or (
            isinstance(value.reward, numbers.Real) and not isinstance(value.reward, (int, float))):
        value.reward = float(value.reward)
    r = value.reward
    if not (isinstance(r, (int, float)) and not isinstance(r, bool) and finite_float(r) is not None):
        return f"step returned reward={r!r:.100}: a finite number is needed"
    if not _is_messages(value.messages):
        return (f"step returned messages={value.messages!r:.200}: a list of message dicts, each with a 'role' and a "
                "'content' that is a string (or a list of parts), is needed")
    if not isinstance(value.info, dict):
        return f"step returned info={value.info!r:.100}: a dict is needed"
    try:
        hash(value.state)
    except Exception as e:  # noqa: BLE001 - TypeError, or whatever the state's own __hash__ raises
        return (f"step returned a state that cannot be hashed ({type(e).__name__}: {e}): give a tuple, a string or a "
                "number")
    if value.continuation is not None and (not isinstance(value.continuation, str) or value.messages):
        return (f"step returned continuation={value.continuation!r:.100} with messages={value.messages!r:.100}: "
                "a continuation is a string, given instead of messages")
    return _not_stop(value.stop)


def episode_seed(seed: int | None, j: int) -> int | None:
    return None if seed is None else (seed * 1_000_003 + j) % 2**62


def _turn_seed(seed: int | None, turn: int) -> int | None:
    return None if seed is None else (seed * 1_009 + turn) % 2**62


def _check_limits(max_turns: int, max_total_tokens: int, step_timeout_s: float | None = None) -> None:
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if max_total_tokens < 2:
        raise ValueError(f"max_total_tokens must be >= 2, got {max_total_tokens}")
    if step_timeout_s is not None and not step_timeout_s > 0:
        raise ValueError(f"step_timeout_s must be > 0, got {step_timeout_s}")
