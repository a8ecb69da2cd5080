"""`rollover bench faults`: `kill -9` at random moments, then resume; count what went wrong.

For each mode (sync, APRIL with `carry: resubmit` and `keep_kv`, async with eta = 1 and 2) a
tiny random model trains `--steps` steps with a checkpoint after every step. A trial is one
`kill -9` of the training process at a random moment of its training (after a random number
k >= 1 of its own steps, a random part into step k + 1: generation, scoring, the update, weight sync or
a checkpoint write), followed by `rollover train` again with
`resume: auto`. Trials are chained: the resumed process is itself killed at a random moment,
up to `--kills-per-chain` times, and the chain's last process runs to the end. Per mode:

- trials, resumed cleanly (the next process ran on without an error, a hang or a nonzero
  exit, until it finished or was itself killed), hangs (a process that ran `--hang-s` without finishing or dying: killed and counted);
- steps duplicated or missing in `metrics.jsonl` (each step 1..steps must appear once);
- groups and samples lost or duplicated in `trained_groups.jsonl` (sync and APRIL: against an
  uninterrupted run with the same seed; async: trained groups must be g0..g(steps x B - 1)
  exactly once each, since batches form in start order and nothing is dropped here);
- sync and APRIL: whether the final weights equal the uninterrupted run's, bit for bit
  (async is not bit-reproducible for eta >= 1: thread timing decides the interleaving).

A kill that lands while a checkpoint is being written leaves a `.step_*` temporary directory;
those are counted (`kills_mid_checkpoint`) to show the atomic write was exercised.

`env_fail` is not a kill: a multi-turn environment (`FailingEnvs`, episodes of `TURNS` turns)
fails a fixed share of its episodes (`--fail-rates`), half raising inside `step()` and half
hanging there until `env.step_timeout_s` (`--step-timeout-s`) ends the call. Which episodes
fail, how and at which turn is a hash of the task's prompt id and the sample index, never the
clock, so every run fails the same episodes. Each loop (`--env-loops`: sync, APRIL, async
eta = 1) trains `--steps` steps once per rate; per run, from `metrics.jsonl` and
`trained_groups.jsonl`:

- steps done of those asked, and whether the run aborted (exited nonzero or hung: must not);
- episodes run (`rollout/env/episodes`), failed (`rollout/env/failed`: raised, and timed out
  per `rollout/env/timed_out`), kept (trained: `samples`) and unused: run - kept - failed,
  the survivors of groups skipped with fewer than two samples (`rollout/skipped_groups`) and,
  in APRIL and async, groups scored but still waiting to train when the run ended;
- checks that the counts add up: each failed episode left its group (`rollout/dropped_samples`
  = failed, unless a collection came back empty: its episodes are not in the episode counts);
  each trained group lost exactly its injected failures (`samples` + `dropped` = n, `dropped`
  = the hash's count); sync: every scored group trained or was skipped, and unused = the
  survivors of the skipped groups.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

MODES = {
    "sync": {},
    "april": {"partial_rollout": {"enabled": True, "carry": "resubmit"}},
    "april_keep_kv": {"partial_rollout": {"enabled": True, "carry": "keep_kv"}},
    "async_eta1": {"mode": "async", "async": {"max_staleness": 1}},
    "async_eta2": {"mode": "async", "async": {"max_staleness": 2}},
    # not the driver: one of its two FSDP trainer ranks is killed; the driver must stop with an
    # error naming the rank (never hang), and the same command resume
    "fsdp_rank": {"train": {"parallel": "fsdp", "ranks": 2}},
}
RANK_MODES = ("fsdp_rank",)
ENV_MODES = ("env_fail",)  # not a kill: an environment fails some of its episodes (`FailingEnvs`)
ENV_LOOPS = {
    "sync": {},
    "april": {"partial_rollout": {"enabled": True}},
    "async": {"mode": "async", "async": {"max_staleness": 1}},
}
TURNS = 2  # turns of an env_fail episode; a failing episode fails at one of them
ENV_PROMPTS, ENV_SAMPLES = 8, 4  # env_fail: prompts per step, samples per prompt (n)


def episode_fate(prompt_id: str, j: int, rate: float, hang_share: float = 0.5) -> tuple[str, int]:
    """What episode j of task `prompt_id` does: ("ok", 0), or ("raise" | "hang", turn) for a
    failure in its `turn`-th step. A hash of the two, not the clock: every run fails the same."""
    h = hashlib.sha256(f"{prompt_id}/{j}".encode()).digest()
    u, v = int.from_bytes(h[:8], "big") / 2**64, int.from_bytes(h[8:16], "big") / 2**64
    if u >= rate:
        return "ok", 0
    return ("hang" if v < hang_share else "raise"), 1 + h[16] % TURNS


class FailingEnvs:
    """`env.name` of the env_fail runs (`rollover.bench.faults:FailingEnvs`): tasks of `TURNS`
    turns whose reward is the parity of the reply's length, with a share `rate` of episodes
    failing as `episode_fate` says."""

    def __init__(self, rate: float, hang_share: float = 0.5):
        self.rate, self.hang_share = rate, hang_share

    def prompts(self, n: int, seed: int = 0) -> list:
        from rollover.types import Prompt

        return [Prompt(id=f"envfail-{seed}-{i}", text="Say something.") for i in range(n)]

    def make_group(self, prompt, n: int) -> list:
        return [_FailingEnv(*episode_fate(prompt.id, j, self.rate, self.hang_share)) for j in range(n)]


class _FailingEnv:
    def __init__(self, fate: str, fail_turn: int):
        self.fate, self.fail_turn, self.turn = fate, fail_turn, 0

    async def initial_observation(self) -> list[dict]:
        return [{"role": "user", "content": "Say something."}]

    async def step(self, action):
        from rollover.envs.base import StepResult

        self.turn += 1
        if self.turn == self.fail_turn:
            if self.fate == "raise":
                raise RuntimeError(f"injected failure in step {self.turn}")
            await asyncio.sleep(3600)  # a call that never answers: env.step_timeout_s ends it
        done = self.turn == TURNS
        return StepResult([] if done else [{"role": "user", "content": "Again."}], float(len(action.text) % 2), done)


def _config(model: str, run_dir: Path, steps: int, seed: int, mode: str) -> dict:
    cfg = {
        "model": model, "run_dir": str(run_dir), "steps": steps, "seed": seed, "resume": "auto",
        "data": {"train": "gen:arithmetic?n=400", "eval_size": 0, "max_prompt_tokens": 64},
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 32, "max_rows": 16},
        "train": {"lr": 1e-3}, "eval": {"every": 0, "at_start": False},
        "checkpoint": {"every": 1, "keep": 2}, "logging": {"progress": False, "tensorboard": False},
    }
    for key, value in MODES[mode].items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


def _launch(cfg_path: Path, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rollover.cli", "train", str(cfg_path)],
                            stdout=log, stderr=subprocess.STDOUT)


def _train_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line torn by the kill; resume drops it
    return [r for r in rows if r.get("kind") == "train"]


def _train_steps(run_dir: Path, since: float = 0.0) -> list[int]:
    return [r["step"] for r in _train_rows(run_dir) if r["time"] >= since]


def _ledger(run_dir: Path) -> list[dict]:
    path = run_dir / "trained_groups.jsonl"
    return [g for line in path.read_text().splitlines() if line.strip() for g in json.loads(line)["groups"]]


def _weights(run_dir: Path, steps: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "checkpoints" / f"step_{steps:06d}" / "model" / "model.safetensors"))


def _rank_pids(pid: int) -> list[int]:
    """The trainer rank processes the driver `pid` started (multiprocessing spawn children)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and b"spawn_main" in (stat.parent / "cmdline").read_bytes():
                out.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return sorted(out)


def _wait_rows(proc: subprocess.Popen, run_dir: Path, rows: int, since: float, deadline: float) -> bool:
    """Wait until metrics.jsonl holds `rows` train rows written after `since`; False if the
    process ended first."""
    while len(_train_steps(run_dir, since)) < rows:
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _chain(args, mode: str, root: Path, rng: random.Random, kills: int, step_s: float) -> dict:
    """One run killed `kills` times at random moments (fewer if it finishes first), then finished.

    A kill waits for a random number of this process's steps to be logged, then a random part
    of one more step, so it lands anywhere in training (generation, scoring, the update, weight
    sync, a checkpoint write) whatever start-up costs."""
    run_dir = root / "run"
    cfg_path = root / "config.json"  # JSON is YAML
    cfg_path.write_text(json.dumps(_config(args.model, run_dir, args.steps, args.seed, mode)))
    out = {"trials": 0, "resumed_clean": 0, "hangs": 0, "kills_mid_checkpoint": 0, "finished": False}
    with open(root / "log.txt", "w") as log:
        killed_before = False
        while True:
            offset = (root / "log.txt").stat().st_size
            done = max((int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*")), default=0)
            tmp_before = set((run_dir / "checkpoints").glob(".step_*"))
            kill = out["trials"] < kills and done < args.steps - 1
            started = time.time()
            proc = _launch(cfg_path, log)
            deadline = time.monotonic() + args.hang_s
            rc, hung = None, False
            if kill and _wait_rows(proc, run_dir, rng.randint(1, args.steps - done - 1), started, deadline):
                time.sleep(rng.uniform(0, 1.2 * step_s))
            rank_killed = False
            try:
                if kill and mode in RANK_MODES and proc.poll() is None and _rank_pids(proc.pid):
                    import os
                    import signal

                    os.kill(rng.choice(_rank_pids(proc.pid)), signal.SIGKILL)
                    rank_killed = True  # the driver must now stop by itself, naming the rank
                    rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                else:
                    rc = proc.wait(timeout=0 if kill else max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung = time.monotonic() > deadline
                proc.kill()
                proc.wait()
            with open(root / "log.txt", errors="replace") as f:
                f.seek(offset)
                text = f.read()
                failed = "Traceback" in text
            named = rank_killed and "trainer rank" in text and "died" in text and not failed
            if killed_before:  # this process resumed a killed run: without an error, hang or bad exit (other than
                # the one-line stop its own rank's kill asks for)?
                out["resumed_clean"] += int((rc in (0, None) or named) and not failed and not hung)
            if hung:
                out["hangs"] += 1
                break
            if rank_killed and rc not in (0, None):  # the driver stopped after its rank died
                out["trials"] += 1
                out["rank_errors_named"] = out.get("rank_errors_named", 0) + int(named)
                killed_before = True
                continue
            if rc is None:  # killed by us
                out["trials"] += 1
                out["kills_mid_checkpoint"] += int(bool(set((run_dir / "checkpoints").glob(".step_*")) - tmp_before))
                killed_before = True
                continue
            out["finished"] = rc == 0
            out["exit_code"] = rc
            break
    return out


def _check(run_dir: Path, steps: int, expected_groups: list[str] | None) -> dict:
    seen = Counter(_train_steps(run_dir))
    groups = _ledger(run_dir) if (run_dir / "trained_groups.jsonl").exists() else []
    counts = Counter(g["group"] for g in groups)
    samples = {g["group"]: g["samples"] for g in groups}
    want = expected_groups if expected_groups is not None else []
    lost = [g for g in want if g not in counts]
    dup = {g: c - 1 for g, c in counts.items() if c > 1}
    extra = [g for g in counts if expected_groups is not None and g not in set(want)]
    return {
        "steps_duplicated": sum(c - 1 for c in seen.values() if c > 1),
        "steps_missing": sum(1 for s in range(1, steps + 1) if s not in seen),
        "groups_lost": len(lost), "groups_duplicated": sum(dup.values()) + len(extra),
        "samples_duplicated": sum(samples[g] * c for g, c in dup.items()) + sum(samples[g] for g in extra),
        "lost_groups": lost,
    }


def _mode(args, mode: str, rng: random.Random, work: Path) -> dict:
    ref_dir = work / mode / "reference"
    ref_dir.mkdir(parents=True)
    (ref_dir / "config.json").write_text(json.dumps(_config(args.model, ref_dir / "run", args.steps, args.seed, mode)))
    with open(ref_dir / "log.txt", "w") as log:
        rc = _launch(ref_dir / "config.json", log).wait(timeout=args.hang_s)
    if rc != 0:
        raise RuntimeError(f"bench faults: the uninterrupted {mode} run failed (exit {rc}); see {ref_dir / 'log.txt'}")
    times = [r["time"] for r in map(json.loads, (ref_dir / "run" / "metrics.jsonl").read_text().splitlines())]
    step_s = (times[-1] - times[0]) / (len(times) - 1)
    ref_groups = _ledger(ref_dir / "run")
    B = 4
    if mode.startswith("async"):
        expected = [f"g{i}" for i in range(args.steps * B)]
    else:
        expected = [g["group"] for g in ref_groups]
    ref_samples = {g["group"]: g["samples"] for g in ref_groups}
    total = Counter()
    chains = []
    while total["trials"] < args.trials:
        root = work / mode / f"chain{len(chains)}"
        root.mkdir(parents=True)
        kills = min(args.kills_per_chain, args.trials - total["trials"])
        res = _chain(args, mode, root, rng, kills, step_s)
        if res["finished"]:
            res.update(_check(root / "run", args.steps, expected))
            res["samples_lost"] = sum(ref_samples.get(g, args.samples) for g in res.pop("lost_groups"))
            if not mode.startswith("async"):
                a, b = _weights(ref_dir / "run", args.steps), _weights(root / "run", args.steps)
                res["weights_equal"] = all(a[k].equal(b[k]) for k in a) and a.keys() == b.keys()
        chains.append(res)
        for k in ("trials", "rank_errors_named", "resumed_clean", "hangs", "kills_mid_checkpoint", "steps_duplicated", "steps_missing",
                  "groups_lost", "groups_duplicated", "samples_lost", "samples_duplicated"):
            total[k] += res.get(k, 0)
        total["unfinished_chains"] += int(not res["finished"])
        if not res["finished"] and res["hangs"] == 0:
            raise RuntimeError(f"bench faults: a {mode} chain ended with exit {res.get('exit_code')}; "
                               f"see {root / 'log.txt'}")
    out = dict(total)
    out["lost"], out["duplicated"] = out["samples_lost"], out["samples_duplicated"]
    out["chains"] = len(chains)
    out["step_s"] = round(step_s, 3)
    if not mode.startswith("async"):
        out["weights_equal"] = sum(bool(c.get("weights_equal")) for c in chains)
    return out


def _env_config(args, run_dir: Path, loop: str, rate: float) -> dict:
    cfg = {
        "model": args.model, "run_dir": str(run_dir), "steps": args.steps, "seed": args.seed,
        "data": {"train": "env", "eval_size": 0, "max_prompt_tokens": 128},
        "env": {"name": f"{__name__}:FailingEnvs", "options": {"rate": rate}, "tasks": 4 * args.steps * ENV_PROMPTS,
                "step_timeout_s": args.step_timeout_s, "max_total_tokens": 256},
        "rollout": {"prompts_per_step": ENV_PROMPTS, "samples_per_prompt": ENV_SAMPLES, "max_new_tokens": 8,
                    "max_rows": ENV_PROMPTS * ENV_SAMPLES},
        "train": {"lr": 1e-3}, "eval": {"every": 0, "at_start": False},
        "checkpoint": {"every": 0}, "logging": {"progress": False, "tensorboard": False},
    }
    for key, value in ENV_LOOPS[loop].items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


def _env_run(args, loop: str, rate: float, root: Path) -> dict:
    """One training run of `loop` against `FailingEnvs(rate)`: its counts and their checks."""
    root.mkdir(parents=True)
    run_dir, n = root / "run", ENV_SAMPLES
    (root / "config.json").write_text(json.dumps(_env_config(args, run_dir, loop, rate)))
    t0 = time.monotonic()
    with open(root / "log.txt", "w") as log:
        proc = _launch(root / "config.json", log)
        try:
            rc = proc.wait(timeout=args.hang_s)
        except subprocess.TimeoutExpired:  # a hang: counted as an aborted run
            proc.kill()
            proc.wait()
            rc = None
    wall = time.monotonic() - t0
    rows = _train_rows(run_dir)

    def total(key: str) -> int:
        return int(sum(r.get(key, 0) for r in rows))

    episodes, failed, timed_out = (total(f"rollout/env/{k}") for k in ("episodes", "failed", "timed_out"))
    dropped, skipped, empty = (total(f"rollout/{k}") for k in ("dropped_samples", "skipped_groups", "empty_collections"))
    kept = total("samples")  # trained
    trained = _ledger(run_dir) if (run_dir / "trained_groups.jsonl").exists() else []
    injected = {g["prompt"]: sum(episode_fate(g["prompt"], j, rate)[0] != "ok" for j in range(n)) for g in trained}
    unused = episodes - kept - failed
    checks = {
        "steps_done": len(rows) == args.steps,
        # an empty collection's failures are in dropped_samples (folded into the next step) but
        # its episodes are not in the episode counts
        "failed_left_their_groups": dropped == failed if empty == 0 else dropped >= failed,
        "groups_lost_only_their_failures": all(
            g["samples"] + g["dropped"] == n and g["dropped"] == injected[g["prompt"]] for g in trained),
        "ledger_matches_metrics": sum(g["samples"] for g in trained) == kept,
        "unused_not_negative": unused >= 0,
    }
    if loop == "sync" and empty == 0:  # every scored group trained this step or was skipped
        checks["groups_trained_or_skipped"] = episodes == n * (total("groups") + skipped)
        checks["unused_are_skipped_survivors"] = unused == n * skipped - (dropped - sum(g["dropped"] for g in trained))
    out = {
        "loop": loop, "fail_rate": rate, "steps_done": len(rows), "steps": args.steps, "aborted": int(rc != 0),
        "exit_code": rc, "episodes": episodes, "kept": kept, "failed": failed, "raised": failed - timed_out,
        "timed_out": timed_out, "unused": unused, "dropped_samples": dropped, "skipped_groups": skipped,
        "empty_collections": empty, "wall_s": round(wall, 1), "checks": checks, "checks_ok": all(checks.values()),
    }
    if rc != 0:
        out["log_tail"] = (root / "log.txt").read_text(errors="replace")[-2000:]
    return out


ENV_TABLE = (("loop", "{loop}"), ("fail", "{fail_rate:.0%}"), ("steps", "{steps_done}/{steps}"),
             ("episodes", "{episodes}"), ("kept", "{kept}"), ("failed", "{failed}"), ("raised", "{raised}"),
             ("hung", "{timed_out}"), ("unused", "{unused}"), ("skipped", "{skipped_groups}"),
             ("empty", "{empty_collections}"), ("aborted", "{aborted}"), ("wall s", "{wall_s:.1f}"))
ENV_WIDTH = 9  # characters per column of the env_fail table


def _env_fail(args, work: Path) -> dict:
    runs = []
    print("  " + "".join(f"{name:>{ENV_WIDTH}s}" for name, _ in ENV_TABLE) + "  checks", flush=True)
    for rate in args.fail_rates:
        for loop in args.env_loops:
            r = _env_run(args, loop, rate, work / f"{loop}_{rate:g}")
            runs.append(r)
            bad = [k for k, ok in r["checks"].items() if not ok]
            print("  " + "".join(f"{fmt.format(**r):>{ENV_WIDTH}s}" for _, fmt in ENV_TABLE) + "  "
                  + ("ok" if not bad else "FAILED: " + ", ".join(bad)), flush=True)
    return {"runs": runs, "aborted": sum(r["aborted"] for r in runs),
            "checks_failed": sum(not r["checks_ok"] for r in runs), "step_timeout_s": args.step_timeout_s}


def main(args) -> dict:
    rng = random.Random(args.seed)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="rollover-bench-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        from rollover.testing import save_tiny_model

        args.model = str(save_tiny_model(work / "tiny-llama", "llama", seed=args.seed))
    args.samples = 4
    result = {"model": args.model, "steps": args.steps, "kills_per_chain": args.kills_per_chain, "modes": {}}
    for mode in args.modes:
        if mode in ENV_MODES:
            result["modes"][mode] = _env_fail(args, work / mode)
            continue
        result["modes"][mode] = _mode(args, mode, rng, work)
        r = result["modes"][mode]
        print(f"  {mode:14s} trials={r['trials']} clean={r['resumed_clean']} hangs={r['hangs']} "
              f"steps dup/missing={r['steps_duplicated']}/{r['steps_missing']} samples lost/dup={r['lost']}/"
              f"{r['duplicated']}" + (f" weights equal {r['weights_equal']}/{r['chains']}" if "weights_equal" in r
                                      else "") + f" mid-checkpoint kills={r['kills_mid_checkpoint']}"
              + (f" rank deaths named={r.get('rank_errors_named', 0)}/{r['trials']}" if mode in RANK_MODES else ""), flush=True)
    for mode, r in result["modes"].items():  # the fields the issue asks for, per mode, at the top
        if mode in ENV_MODES:
            result[mode] = {k: r[k] for k in ("aborted", "checks_failed")}
            continue
        result[mode] = {k: r[k] for k in ("trials", "hangs", "lost", "duplicated")}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if not args.workdir and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return result


def add_arguments(p) -> None:
    from rollover.bench import at_least

    p.add_argument("--modes", nargs="+", choices=[*MODES, *ENV_MODES], default=[*MODES, *ENV_MODES],
                   help="modes whose runs are killed and resumed; env_fail: runs whose environment fails episodes")
    p.add_argument("--trials", type=at_least(1), default=20, help="kill -9 + resume trials per mode")
    p.add_argument("--kills-per-chain", type=at_least(1), default=5, help="kills of one run before it may finish")
    p.add_argument("--steps", type=at_least(2), default=8, help="training steps of each run")
    p.add_argument("--model", default=None, help="default: a tiny random Llama written to the work dir")
    p.add_argument("--hang-s", type=float, default=300.0, help="a process running this long is a hang")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--workdir", default=None, help="keep every run here (default: a temp dir, removed)")
    p.add_argument("--keep", action="store_true", help="keep the temp work dir")
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
    p.add_argument("--fail-rates", nargs="+", type=_rate, default=[0.05, 0.2],
                   help="env_fail: shares of episodes that fail (half raise in step(), half hang past the timeout)")
    p.add_argument("--env-loops", nargs="+", choices=list(ENV_LOOPS), default=list(ENV_LOOPS),
                   help="env_fail: the loops that train against the failing environment")
    p.add_argument("--step-timeout-s", type=_seconds, default=1.0,
                   help="env_fail: env.step_timeout_s, what a hang costs")


def _rate(text: str) -> float:
    import argparse

    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"a fail rate is in [0, 1), got {text}")
    return value


def _seconds(text: str) -> float:
    import argparse

    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a step timeout is > 0 s, got {text}")
    return value
