"""`rollover bench envs`: multi-turn episodes against slow environments, the rollout core's
schedules (rollout-wise, APRIL) against batch-synchronous turns, on the same engine and seeds.

Workload: `steps` rollout steps, each of `groups` x `samples` episodes (a GRPO batch). The
environment is `GuessNumber` (1-10, at most 4 guesses: the game decides how many turns) or
`count` (a fixed number of turns), and every `step` first sleeps a latency drawn log-normal,
`median * exp(sigma * z)`, clipped to [min, max] (50 ms - 2 s by default, like GUI and tool
environments). The latency of step k of an episode depends only on (seed, task, episode index,
k), and every episode's sampling seed on (seed, the order its task was drawn, its index), as in
training, so every schedule sees the same latencies and, the engine's sampling being
independent of batching, samples the same tokens.

The run is built as training builds it (`build_run`, `env.name: rollover.bench.envs:SlowGames`):
one TorchEngine with `max_rows` rows and an environment cluster of `max_rows` slots
(`env.max_concurrent`). Schedules:
- batch_sync: episodes in batches of `max_rows`; turn t of every live episode of the batch is
  generated as one batch, then every environment steps and the batch waits for the slowest
  before turn t + 1 (a naive loop). Built from the asyncio `run_episode` behind a turn barrier
  (`TurnBarrier`) on an `EnvPool` of `max_rows` slots.
- rollout_wise: the rollout core's synchronous schedule (`run_groups`, what `rollover train`
  runs): every episode advances on its own, environment calls run on the cluster while the
  engine decodes other episodes' turns; the step ends when all its episodes have.
- april: the rollout core's APRIL collector (`partial_rollout.enabled`, alpha = `oversample`):
  episodes of alpha x `groups` groups in flight; the step ends as soon as `groups` groups are
  complete; episodes still running are stopped where they are (mid-turn, or between an
  environment call and the next turn) and carried, with their tokens and environments, into
  the next step, where they resume. Nothing is discarded; the last measured step leaves its
  carried work unused (counted in `carried_*`).

Metrics, over the measured steps: trajectories/s (episodes of the steps' groups over wall time);
environment utilization, the cluster's busy time over (slots x wall time), i.e. the share of
time the environment instances spend stepping rather than waiting for the model or for each
other (useful environment utilization counts only the steps of the episodes used); engine
occupancy, busy row-steps / all row-steps of the engine's decode steps, and engine busy share,
its compute seconds over wall time (idle gaps make no decode steps, so only the second shows
them); turns per episode; env time share, `episode_metrics`' env_s / (env_s + gen_s) (gen_s is
the time an episode waited for its turn's tokens: in batch-synchronous mode, also for the rest
of its batch).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, replace

from rollover.envs.base import Action, StepResult, Trajectory, episode_metrics
from rollover.envs.episode import EnvPool, episode_seed, run_episode
from rollover.envs.games import GuessNumber
from rollover.envs.render import ChatRenderer
from rollover.rollout.april import AprilCollector
from rollover.rollout.core import run_groups
from rollover.rollout.groups import sample_seed, sampling_from
from rollover.rollout.inputs import RolloutInputs
from rollover.types import Prompt, Request

SCHEDULES = ("rollout_wise", "batch_sync", "april")


@dataclass(frozen=True)
class Latency:
    """Log-normal step latency, clipped; a pure function of (seed, episode, turn)."""

    median_s: float
    sigma: float
    min_s: float
    max_s: float

    def draw(self, seed: int, episode: str, turn: int) -> float:
        z = random.Random(f"envs-latency:{seed}:{episode}:{turn}").gauss(0.0, 1.0)
        return min(self.max_s, max(self.min_s, self.median_s * math.exp(self.sigma * z)))


class SlowEnv:
    """Any environment whose every step first takes a latency its builder draws (asyncio.sleep)."""

    def __init__(self, inner, builder: "SlowGames", episode: str):
        self.inner, self.builder, self.episode, self.turn = inner, builder, episode, 0

    async def initial_observation(self) -> list[dict]:
        return await self.inner.initial_observation()

    async def step(self, action: Action) -> StepResult:
        self.turn += 1
        b = self.builder
        await asyncio.sleep(b.scale * b.latency.draw(b.seed, self.episode, self.turn))
        return await self.inner.step(action)


class CountEnv:
    """Exactly `turns` turns whatever the model says; reward 0 (only the timing matters)."""

    def __init__(self, turns: int):
        self.turns, self.k = turns, 0

    async def initial_observation(self) -> list[dict]:
        return [{"role": "user", "content": "Let's count. Say the next number."}]

    async def step(self, action: Action) -> StepResult:
        self.k += 1
        return StepResult([{"role": "user", "content": "Next."}], 0.0, done=self.k >= self.turns)


class SlowGames:
    """The bench's environment as a run's config names it (`env.name:
    rollover.bench.envs:SlowGames`): GuessNumber's tasks, or the count game, behind drawn step
    latencies. `scale` multiplies every latency (0 for the unmeasured warm-up)."""

    def __init__(self, game: str = "guess", turns: int = 4, median_s: float = 0.3, sigma: float = 1.0,
                 min_s: float = 0.05, max_s: float = 2.0, seed: int = 0):
        self.game, self.turns, self.seed, self.scale = game, turns, seed, 1.0
        self.latency = Latency(median_s, sigma, min_s, max_s)
        self.guess = GuessNumber()

    def prompts(self, n: int, seed: int = 0) -> list[Prompt]:
        if self.game == "guess":
            return self.guess.prompts(n, seed=seed)
        return [Prompt(id=f"count-{seed}-{i}", text="count") for i in range(n)]

    def make_group(self, prompt: Prompt, n: int) -> list[SlowEnv]:
        inner = self.guess.make_group(prompt, n) if self.game == "guess" else [CountEnv(self.turns) for _ in range(n)]
        return [SlowEnv(env, self, f"{prompt.id}/{j}") for j, env in enumerate(inner)]


class TurnBarrier:
    """An engine front that makes `run_episode` batch-synchronous: it holds each episode's
    request until every live episode of the batch has asked for its turn (so every environment
    of the previous turn has stepped), submits them as one batch, and answers each when the
    whole batch is done, as `engine.generate(batch)` in a naive loop would. Call `leave()` when
    an episode ends."""

    def __init__(self, engine, live: int):
        self.engine, self.live = engine, live
        self.pending: list[tuple[Request, asyncio.Future]] = []
        self.batches: list[asyncio.Task] = []

    async def agenerate(self, request: Request):
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((request, fut))
        self._release()
        return await fut

    def abort(self, ids):
        return self.engine.abort(ids)

    def leave(self) -> None:
        self.live -= 1
        self._release()

    def _release(self) -> None:
        if not self.pending or len(self.pending) < self.live:
            return
        batch, self.pending = self.pending, []
        futures = self.engine.submit_many([r for r, _ in batch])  # admitted together

        async def answer():
            try:
                completions = [await asyncio.wrap_future(f) for f in futures]
            except BaseException as e:
                for _, fut in batch:
                    fut.done() or fut.set_exception(e)
                raise
            for (_, fut), c in zip(batch, completions):
                fut.done() or fut.set_result(c)

        self.batches.append(asyncio.ensure_future(answer()))


class Bench:
    """The run every schedule shares (engine, renderer, environments, prompt order), and the
    schedules themselves. `rewind()` puts the prompt order back at its start, so every schedule
    draws the same tasks in the same order (and so the same sampling seeds)."""

    def __init__(self, args, run):
        self.args, self.run = args, run
        self.renderer = ChatRenderer(run.tokenizer, **run.cfg.data.chat_template_kwargs)
        self.sampling = sampling_from(run.cfg)
        self._start = run.train_iter.state_dict()

    def rewind(self) -> None:
        self.run.train_iter.load_state_dict(self._start)
        self.run.serial = 0

    def pool(self) -> EnvPool:
        """The environment cluster the core's schedules use (the run's environment thread's)."""
        return self.run.env_runner.pool

    # ------------------------------------------------------------ batch-synchronous turns
    async def _batch_sync(self, groups) -> list[Trajectory]:
        run, e = self.run, self.run.cfg.env
        episodes = []
        for g in groups:
            base = sample_seed(run.cfg.seed, g.serial, 0)
            for j, env in enumerate(run.env_builder.make_group(g.prompt, g.n)):
                episodes.append((f"{g.id}/{j}", env, replace(self.sampling, seed=episode_seed(base, j))))
        out: list[Trajectory] = []
        for i in range(0, len(episodes), self.args.max_rows):
            batch = episodes[i: i + self.args.max_rows]
            barrier = TurnBarrier(run.engine, len(batch))

            async def one(rid, env, sampling):
                try:
                    return await run_episode(barrier, env, self.renderer, sampling, max_turns=e.max_turns,
                                             max_total_tokens=e.max_total_tokens, step_timeout_s=e.step_timeout_s,
                                             request_id=rid, pool=self.sync_pool)
                finally:
                    barrier.leave()

            out += await asyncio.gather(*(one(*ep) for ep in batch))
            await asyncio.gather(*barrier.batches)
        return out

    def batch_sync(self, step: int) -> tuple[list[Trajectory], dict]:
        return asyncio.run(self._batch_sync(self.run.next_groups(self.args.groups, version=0))), {}

    # ------------------------------------------------------------ the rollout core
    def rollout_wise(self, step: int) -> tuple[list[Trajectory], dict]:
        groups = self.run.next_groups(self.args.groups, version=0)
        run_groups(RolloutInputs.of(self.run), groups, self.sampling, self.run.cfg.seed, "bench envs")
        return [g.done[j] for g in groups for j in range(g.n)], {}

    def start_april(self) -> None:
        """A fresh APRIL collector on the run; the bench notes every episode it finishes (by
        group id) to report the returned groups' trajectories."""
        self.collector = col = AprilCollector(RolloutInputs.of(self.run))
        self.finished: dict[str, object] = {}
        self.carried: set[str] = set()  # groups carried out of the last step
        finished = col.driver.on_finished

        def note(g, j):
            self.finished[g.id] = g
            finished(g, j)

        col.driver.on_finished = note

    def april(self, step: int) -> tuple[list[Trajectory], dict]:
        col = self.collector
        groups, m = col.collect(step)
        m = {**m, "resumed_groups": sum(g.id in self.carried for g in groups)}
        self.carried = {g.id for g in [*col.buffer, *col.ready_carry, *col.inflight.values()]}
        return [self.finished[g.id].done[j] for g in groups for j in range(len(g.rollouts))], m


def measure(bench: Bench, schedule: str) -> dict:
    """`steps` rollout steps of one schedule; the figures over all of them."""
    a, run = bench.args, bench.run
    engine = run.engine
    bench.rewind()
    if schedule == "batch_sync":
        bench.sync_pool = EnvPool(a.max_rows)
        pool = bench.sync_pool
    else:
        pool = bench.pool()
    if schedule == "april":
        bench.start_april()
    engine.reset_stats()
    pool.reset()
    used: list[Trajectory] = []
    extra = {"carried_groups": 0, "carried_unstarted_groups": 0, "resumed_groups": 0}
    t0 = time.perf_counter()
    try:
        for step in range(1, a.steps + 1):
            trajs, m = getattr(bench, schedule)(step)
            used += trajs
            if m:
                extra["resumed_groups"] += m["resumed_groups"]
                extra["carried_groups"] = m["carried_groups"]  # after the last step
                extra["carried_unstarted_groups"] = m["carried_unstarted_groups"]
        wall = time.perf_counter() - t0
        s = engine.stats()
        busy_s = pool.busy_s
    finally:
        if schedule == "april":
            _close_april(bench)
    m = episode_metrics(used)
    sampled = sum(sum(t.loss_mask_T) for t in used)
    out = {
        "trajectories": len(used),
        "seconds": wall,
        "trajectories_per_s": len(used) / wall,
        "env_utilization": busy_s / (a.max_rows * wall),
        "useful_env_utilization": sum(t.env_s for t in used) / (a.max_rows * wall),
        "engine_occupancy": s.occupancy,
        "engine_busy_share": (s.decode_s + s.prefill_s) / wall,
        "turns_per_episode": m["env/turns_mean"],
        "env_time_share": m["env/env_time_share"],
        "env_busy_s": busy_s,
        "failed_episodes": int(m["env/failed"]),
        "reward_mean": sum(t.reward for t in used if t.ok) / max(1, sum(t.ok for t in used)),
        "generated_tokens": s.generated_tokens,
        "used_sampled_tokens": sampled,
        "prefill_tokens": s.prefill_tokens,
        "finish": {k.removeprefix("env/finish_"): v for k, v in m.items() if k.startswith("env/finish_")},
    }
    if schedule == "april":
        out.update(extra, unused_tokens=s.generated_tokens - sampled)
    out["_tokens"] = {t.request_id: t.tokens_T for t in used}
    return out


def _close_april(bench: Bench) -> None:
    """End the APRIL measurement: carried requests aborted, the run's driver idle again."""
    col = bench.collector
    with col.driver.lock:
        col.driver.hold = True
    col.driver.abort_all()
    deadline = time.monotonic() + bench.run.cfg.rollout.stall_timeout_s
    try:
        while not col.driver.idle:
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench envs: {len(col.driver.routes)} aborted requests and {col.driver.env_calls} "
                                   f"environment calls of the APRIL collector were still live "
                                   f"{bench.run.cfg.rollout.stall_timeout_s:g} s after the last step")
            time.sleep(0.01)
    finally:
        col.close()


def bench_config(args, run_dir: str):
    from rollover.config import load_config

    n_tasks = math.ceil(args.oversample * args.groups) * (args.steps + 2) + 1
    return load_config(
        model=args.model, run_dir=run_dir, seed=args.seed, steps=1, resume="never", **{
            "data.train": "env", "data.eval_size": 1, "eval.every": 0, "eval.at_start": False,
            "env.name": "rollover.bench.envs:SlowGames", "env.tasks": n_tasks,
            "env.options": {"game": args.env, "turns": args.turns, "median_s": args.latency_median * args.latency_scale,
                            "sigma": args.latency_sigma, "min_s": args.latency_min * args.latency_scale,
                            "max_s": args.latency_max * args.latency_scale, "seed": args.seed},
            "env.max_turns": args.max_turns, "env.max_total_tokens": args.max_total_tokens,
            "env.step_timeout_s": args.step_timeout_s, "env.max_concurrent": args.max_rows,
            "rollout.prompts_per_step": args.groups, "rollout.samples_per_prompt": args.samples,
            "rollout.max_new_tokens": args.max_new_tokens, "rollout.max_rows": args.max_rows,
            "rollout.temperature": args.temperature,
            "partial_rollout.oversample": args.oversample, "partial_rollout.max_carry_steps": 10**6,
            "logging.progress": False, "logging.tensorboard": False,
        })


def main(args) -> dict:
    import tempfile

    from rollover.loops.build import build_run

    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(bench_config(args, tmp), record=False)
        try:
            bench = Bench(args, run)
            run.env_builder.scale = 0.0  # warm-up, unmeasured: one group, no latency
            bench.rewind()
            run_groups(RolloutInputs.of(run), run.next_groups(1, version=0), bench.sampling, args.seed, "bench envs warm-up")
            run.env_builder.scale = 1.0
            modes = {s: measure(bench, s) for s in args.schedules}
        finally:
            run.close()
    tokens = {k: m.pop("_tokens") for k, m in modes.items()}
    settings = {k: getattr(args, k) for k in (
        "env", "turns", "max_turns", "groups", "samples", "steps", "max_rows", "max_new_tokens", "max_total_tokens",
        "temperature", "latency_median", "latency_sigma", "latency_min", "latency_max", "latency_scale",
        "oversample", "step_timeout_s", "seed")}
    result = {"model": args.model, "settings": settings, **modes}
    rw, bs = modes.get("rollout_wise"), modes.get("batch_sync")
    if rw and bs:
        result["speedup"] = rw["trajectories_per_s"] / bs["trajectories_per_s"]
        result["env_util_ratio"] = rw["env_utilization"] / bs["env_utilization"]
        shared = tokens["rollout_wise"].keys() & tokens["batch_sync"].keys()
        result["identical_trajectories"] = sum(tokens["rollout_wise"][k] == tokens["batch_sync"][k] for k in shared)
    if bs and "april" in modes:
        result["april_speedup"] = modes["april"]["trajectories_per_s"] / bs["trajectories_per_s"]
        result["april_env_util_ratio"] = modes["april"]["env_utilization"] / bs["env_utilization"]
        result["april_useful_env_util_ratio"] = (modes["april"]["useful_env_utilization"]
                                                 / bs["useful_env_utilization"])
    if rw and "april" in modes:
        result["april_vs_rollout_wise"] = modes["april"]["trajectories_per_s"] / rw["trajectories_per_s"]
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def print_table(r: dict) -> None:
    s = r["settings"]
    turns = "GuessNumber (game-driven turns)" if s["env"] == "guess" else f"{s['turns']} fixed turns"
    print(f"\nrollover bench envs — {r['model']}, {s['steps']} steps x {s['groups']} groups x {s['samples']} "
          f"episodes, {turns}, {s['max_rows']} rows, <= {s['max_new_tokens']} tokens/turn, step latency log-normal "
          f"median {s['latency_median'] * s['latency_scale']:g} s sigma {s['latency_sigma']:g} clipped to "
          f"[{s['latency_min'] * s['latency_scale']:g}, {s['latency_max'] * s['latency_scale']:g}] s")
    print(f"  {'schedule':13s} {'traj/s':>8s} {'env util':>9s} {'occupancy':>10s} {'engine busy':>12s} "
          f"{'turns/ep':>9s} {'env share':>10s} {'seconds':>8s}")
    for name in [k for k in SCHEDULES if k in r]:
        m = r[name]
        print(f"  {name:13s} {m['trajectories_per_s']:8.3f} {m['env_utilization']:9.3f} "
              f"{m['engine_occupancy']:10.3f} {m['engine_busy_share']:12.3f} {m['turns_per_episode']:9.2f} "
              f"{m['env_time_share']:10.3f} {m['seconds']:8.1f}")
    if "speedup" in r:
        print(f"  rollout-wise vs batch-synchronous: {r['speedup']:.2f}x trajectories/s, "
              f"{r['env_util_ratio']:.2f}x environment utilization "
              f"({r['identical_trajectories']}/{r['rollout_wise']['trajectories']} trajectories identical)")
    if "april_speedup" in r:
        a = r["april"]
        print(f"  april vs batch-synchronous: {r['april_speedup']:.2f}x trajectories/s, "
              f"{r['april_env_util_ratio']:.2f}x environment utilization ({r['april_useful_env_util_ratio']:.2f}x "
              f"counting only the episodes used); {a['resumed_groups']} of the groups used were carried from "
              f"an earlier step; at the end {a['carried_groups']} groups carried, {a['unused_tokens']} of "
              f"{a['generated_tokens']} generated tokens not (yet) in a used episode")


def _at_least_one(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 1.0:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value:g}")
    return value


def add_arguments(p) -> None:
    from rollover.bench import at_least

    p.add_argument("--model", default="smollm2-135m-instruct", help="model: a local path, hub id or alias (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--env", choices=["guess", "count"], default="guess",
                   help="GuessNumber (the game decides the turns) or a fixed number of turns (--turns)")
    p.add_argument("--turns", type=at_least(1), default=4, help="turns of the count environment")
    p.add_argument("--max-turns", type=at_least(1), default=8, help="turns per episode at most")
    p.add_argument("--groups", type=at_least(1), default=8, help="groups per rollout step")
    p.add_argument("--samples", type=at_least(1), default=4, help="episodes per group")
    p.add_argument("--steps", type=at_least(1), default=1, help="measured rollout steps per schedule")
    p.add_argument("--max-rows", type=at_least(1), default=16, help="engine rows = episodes in flight = env slots")
    p.add_argument("--max-new-tokens", type=at_least(1), default=16, help="per turn")
    p.add_argument("--max-total-tokens", type=at_least(2), default=512, help="per episode (the engine's max_len)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--latency-median", type=float, default=0.3, help="seconds")
    p.add_argument("--latency-sigma", type=float, default=1.0, help="spread (log-normal sigma) of an environment step's latency")
    p.add_argument("--latency-min", type=float, default=0.05, help="seconds")
    p.add_argument("--latency-max", type=float, default=2.0, help="seconds")
    p.add_argument("--latency-scale", type=float, default=1.0, help="multiplies median, min and max (tests)")
    p.add_argument("--oversample", type=_at_least_one, default=2.0, help="APRIL: groups launched per group needed")
    p.add_argument("--step-timeout-s", type=float, default=30.0, help="seconds an environment step may take before it counts as failed")
    p.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES), help="turn schedules to compare")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
