"""`rollover bench envs`: multi-turn episodes against slow environments, rollout-wise scheduling
vs batch-synchronous turns (and APRIL on top of rollout-wise), on the same engine and seeds.

Workload: `steps` rollout steps, each of `groups` x `samples` episodes (a GRPO batch). The
environment is `GuessNumber` (1-10, at most 4 guesses: the game decides how many turns) or
`count` (a fixed number of turns), and every `step` first sleeps a latency drawn log-normal,
`median * exp(sigma * z)`, clipped to [min, max] (50 ms - 2 s by default, like GUI and tool
environments). The latency of step k of an episode, and the episode's sampling seed, depend
only on (seed, episode id, k), so every schedule sees the same latencies and, the engine's
sampling being independent of batching, samples the same tokens.

Schedules, on one TorchEngine with `max_rows` rows, at most `max_rows` episodes in flight, and
one `EnvPool` with a slot per episode in flight (an environment instance each):
- rollout-wise: every episode advances on its own (`run_episode`); a new episode starts as
  soon as one ends. The step ends when all its episodes have.
- batch-synchronous: episodes in batches of `max_rows`; turn t of every live episode of the
  batch is generated as one batch, then every environment steps and the batch waits for the
  slowest before turn t + 1 (a naive loop). Built from the same `run_episode` behind a turn
  barrier (`TurnBarrier`), so the trajectories are built by the same code.
- april: rollout-wise over `oversample` x the step's groups; the step ends as soon as
  `groups` groups are complete. Episodes still running then are cancelled: their requests are
  aborted and their tokens are not kept (resuming an episode mid-way is for the rollout core),
  and finished episodes of incomplete groups are not used either; both count as discarded.
  Groups not started go back to the queue for the next step.

Metrics, over the measured steps: trajectories/s (used episodes over wall time); environment
utilization, the pool's busy time over (slots x wall time), i.e. the share of time the
environment instances spend stepping rather than waiting for the model or for each other
(useful environment utilization counts only the steps of the episodes used: APRIL's
discarded episodes kept environments busy for nothing);
engine occupancy, busy row-steps / all row-steps of the engine's decode steps, and engine busy
share, its compute seconds over wall time (idle gaps make no decode steps, so only the second
shows them); turns per episode; env time share, `episode_metrics`' env_s / (env_s + gen_s)
(gen_s is the time an episode waited for its turn's tokens: in batch-synchronous mode, also
for the rest of its batch).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, replace

from rollover.envs.base import Action, StepResult, Trajectory, episode_metrics
from rollover.envs.episode import EnvPool, run_episode
from rollover.envs.games import GuessNumber
from rollover.types import Prompt, Request, SamplingParams

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
    """Any environment whose every step first takes a drawn latency (asyncio.sleep)."""

    def __init__(self, inner, latency: Latency, seed: int, episode: str):
        self.inner, self.latency, self.seed, self.episode, self.turn = inner, latency, seed, episode, 0

    async def initial_observation(self) -> list[dict]:
        return await self.inner.initial_observation()

    async def step(self, action: Action) -> StepResult:
        self.turn += 1
        await asyncio.sleep(self.latency.draw(self.seed, self.episode, self.turn))
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


@dataclass
class Episode:
    id: str  # {group id}/{j}: request ids are {id}/turn{k}
    group: str
    env: SlowEnv
    sampling: SamplingParams


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


def make_episodes(args, prompts: list[Prompt], latency: Latency) -> list[Episode]:
    game = GuessNumber()
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    out = []
    for p in prompts:
        inner = game.make_group(p, args.samples) if args.env == "guess" else [CountEnv(args.turns)
                                                                             for _ in range(args.samples)]
        for j, env in enumerate(inner):
            eid = f"{p.id}/{j}"
            seed = random.Random(f"envs-sampling:{args.seed}:{eid}").getrandbits(62)
            out.append(Episode(eid, p.id, SlowEnv(env, latency, args.seed, eid), replace(sampling, seed=seed)))
    return out


class Runner:
    """What every schedule shares: the engine, renderer, pool and episode limits."""

    def __init__(self, args, engine, renderer, pool: EnvPool):
        self.args, self.engine, self.renderer, self.pool = args, engine, renderer, pool

    async def episode(self, engine, ep: Episode) -> Trajectory:
        a = self.args
        return await run_episode(engine, ep.env, self.renderer, ep.sampling, max_turns=a.max_turns,
                                 max_total_tokens=a.max_total_tokens, step_timeout_s=a.step_timeout_s,
                                 request_id=ep.id, pool=self.pool)

    async def rollout_wise(self, episodes: list[Episode]) -> list[Trajectory]:
        slots = asyncio.Semaphore(self.args.max_rows)

        async def one(ep):
            async with slots:
                return await self.episode(self.engine, ep)

        return list(await asyncio.gather(*map(one, episodes)))

    async def batch_sync(self, episodes: list[Episode]) -> list[Trajectory]:
        out: list[Trajectory] = []
        width = self.args.max_rows
        for i in range(0, len(episodes), width):
            batch = episodes[i: i + width]
            barrier = TurnBarrier(self.engine, len(batch))

            async def one(ep):
                try:
                    return await self.episode(barrier, ep)
                finally:
                    barrier.leave()

            out += await asyncio.gather(*map(one, batch))
            await asyncio.gather(*barrier.batches)
        return out

    async def april(self, episodes: list[Episode], groups: int) -> tuple[list[Trajectory], dict]:
        """Rollout-wise over `episodes` until `groups` groups are complete; the first `groups`
        complete groups' trajectories, and what happened to the rest."""
        slots = asyncio.Semaphore(self.args.max_rows)
        size = {ep.group: 0 for ep in episodes}
        for ep in episodes:
            size[ep.group] += 1
        finished: dict[str, list[Trajectory]] = {g: [] for g in size}
        started: set[str] = set()  # episode ids
        complete: list[str] = []
        enough = asyncio.Event()

        async def one(ep):
            async with slots:
                started.add(ep.id)
                traj = await self.episode(self.engine, ep)
            finished[ep.group].append(traj)
            if len(finished[ep.group]) == size[ep.group] and len(complete) < groups:
                complete.append(ep.group)
                if len(complete) == groups:
                    enough.set()

        tasks = [asyncio.ensure_future(one(ep)) for ep in episodes]
        waiter = asyncio.ensure_future(enough.wait())
        try:
            pending = set(tasks)
            while not enough.is_set():
                if not pending:
                    raise RuntimeError(f"april: every episode ended with fewer than {groups} complete groups")
                done, pending = await asyncio.wait([waiter, *pending], return_when=asyncio.FIRST_COMPLETED)
                pending.discard(waiter)
                for t in done - {waiter}:
                    t.result()  # an episode's error (the engine's, the renderer's) propagates
        finally:
            waiter.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        done_ids = {t.request_id for ts in finished.values() for t in ts}
        used = [t for g in complete for t in sorted(finished[g], key=lambda t: t.request_id)]
        counts = {
            "cancelled_episodes": len(started - done_ids),
            "unused_finished_episodes": sum(len(finished[g]) for g in size if g not in complete),
            "groups_not_started": [g for g in size if not any(ep.group == g and ep.id in started for ep in episodes)],
        }
        return used, counts


async def measure(runner: Runner, schedule: str, prompts: list[Prompt], latency: Latency) -> dict:
    """`steps` rollout steps of one schedule; the figures over all of them."""
    a, engine, pool = runner.args, runner.engine, runner.pool
    engine.reset_stats()
    pool.reset()
    used: list[Trajectory] = []
    extra = {"cancelled_episodes": 0, "unused_finished_episodes": 0}
    cursor = 0
    t0 = time.perf_counter()
    for _ in range(a.steps):
        if schedule == "april":
            launched = prompts[cursor: cursor + math.ceil(a.oversample * a.groups)]
            trajs, counts = await runner.april(make_episodes(a, launched, latency), a.groups)
            not_started = set(counts.pop("groups_not_started"))  # back to the queue (a suffix: FIFO admission)
            cursor += next((i for i, p in enumerate(launched) if p.id in not_started), len(launched))
            for k, v in counts.items():
                extra[k] += v
        else:
            step = make_episodes(a, prompts[cursor: cursor + a.groups], latency)
            cursor += a.groups
            trajs = await (runner.rollout_wise(step) if schedule == "rollout_wise" else runner.batch_sync(step))
        used += trajs
    wall = time.perf_counter() - t0
    s = engine.stats()
    m = episode_metrics(used)
    sampled = sum(sum(t.loss_mask_T) for t in used)
    out = {
        "trajectories": len(used),
        "seconds": wall,
        "trajectories_per_s": len(used) / wall,
        "env_utilization": pool.utilization(wall),
        "useful_env_utilization": sum(t.env_s for t in used) / (pool.max_concurrent * wall),
        "engine_occupancy": s.occupancy,
        "engine_busy_share": (s.decode_s + s.prefill_s) / wall,
        "turns_per_episode": m["env/turns_mean"],
        "env_time_share": m["env/env_time_share"],
        "env_busy_s": pool.busy_s,
        "env_wait_s": pool.wait_s,
        "env_calls": pool.calls,
        "failed_episodes": int(m["env/failed"]),
        "reward_mean": sum(t.reward for t in used if t.ok) / max(1, sum(t.ok for t in used)),
        "generated_tokens": s.generated_tokens,
        "used_sampled_tokens": sampled,
        "prefill_tokens": s.prefill_tokens,
        "finish": {k.removeprefix("env/finish_"): v for k, v in m.items() if k.startswith("env/finish_")},
    }
    if schedule == "april":
        out.update(extra, discarded_tokens=s.generated_tokens - sampled)
    out["_tokens"] = {t.request_id: t.tokens_T for t in used}
    return out


async def run_all(args, engine, renderer) -> dict:
    latency = Latency(args.latency_median * args.latency_scale, args.latency_sigma,
                      args.latency_min * args.latency_scale, args.latency_max * args.latency_scale)
    game = GuessNumber()
    n_prompts = math.ceil(args.oversample * args.groups) * args.steps + 1
    prompts = game.prompts(n_prompts, seed=args.seed) if args.env == "guess" else [
        Prompt(id=f"count-{args.seed}-{i}", text="count") for i in range(n_prompts)]
    runner = Runner(args, engine, renderer, EnvPool(args.max_rows))
    # Warm-up, unmeasured: one group with no latency (first calls, packed weights).
    warm = make_episodes(args, [Prompt(id="warmup", text=prompts[0].text, answer=prompts[0].answer)],
                         Latency(0.0, 0.0, 0.0, 0.0))
    await runner.rollout_wise(warm)
    return {s: await measure(runner, s, prompts, latency) for s in args.schedules}


def main(args) -> dict:
    from rollover.engine.torch_engine import TorchEngine
    from rollover.envs.render import ChatRenderer
    from rollover.models import load_hf_model, load_tokenizer

    renderer = ChatRenderer(load_tokenizer(args.model))
    with TorchEngine(load_hf_model(args.model), max_rows=args.max_rows, max_len=args.max_total_tokens,
                     seed=args.seed) as engine:
        modes = asyncio.run(run_all(args, engine, renderer))
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
        useful = a["useful_env_utilization"] / r["batch_sync"]["useful_env_utilization"]
        print(f"  april vs batch-synchronous: {r['april_speedup']:.2f}x trajectories/s, "
              f"{r['april_env_util_ratio']:.2f}x environment utilization ({useful:.2f}x counting only the episodes "
              f"used); discarded {a['cancelled_episodes']} cancelled and "
              f"{a['unused_finished_episodes']} finished-but-unused episodes, {a['discarded_tokens']} of "
              f"{a['generated_tokens']} generated tokens")


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

    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--env", choices=["guess", "count"], default="guess",
                   help="GuessNumber (the game decides the turns) or a fixed number of turns (--turns)")
    p.add_argument("--turns", type=at_least(1), default=4, help="turns of the count environment")
    p.add_argument("--max-turns", type=at_least(1), default=8)
    p.add_argument("--groups", type=at_least(1), default=8, help="groups per rollout step")
    p.add_argument("--samples", type=at_least(1), default=4, help="episodes per group")
    p.add_argument("--steps", type=at_least(1), default=1, help="measured rollout steps per schedule")
    p.add_argument("--max-rows", type=at_least(1), default=16, help="engine rows = episodes in flight = env slots")
    p.add_argument("--max-new-tokens", type=at_least(1), default=16, help="per turn")
    p.add_argument("--max-total-tokens", type=at_least(2), default=512, help="per episode (the engine's max_len)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--latency-median", type=float, default=0.3, help="seconds")
    p.add_argument("--latency-sigma", type=float, default=1.0)
    p.add_argument("--latency-min", type=float, default=0.05, help="seconds")
    p.add_argument("--latency-max", type=float, default=2.0, help="seconds")
    p.add_argument("--latency-scale", type=float, default=1.0, help="multiplies median, min and max (tests)")
    p.add_argument("--oversample", type=_at_least_one, default=2.0, help="APRIL: groups launched per group needed")
    p.add_argument("--step-timeout-s", type=float, default=30.0)
    p.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
