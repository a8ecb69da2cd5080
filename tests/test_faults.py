"""No hang, no loss: consistent async checkpoints, stall timeouts, graceful SIGINT/SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollover.config import load_config
from rollover.loops.async_ import train_async
from rollover.rollout.stops import Stalled, Watchdog
from rollover.loops.sync import train_sync
from rollover.testing import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama", seed=21))


def cfg_for(model_dir, run_dir, **over):
    base = {
        "model": model_dir, "run_dir": str(run_dir), "steps": 4, "seed": 5, "resume": "auto",
        "data.train": "gen:arithmetic?n=200", "data.eval_size": 4, "data.max_prompt_tokens": 64,
        "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2, "rollout.max_new_tokens": 8,
        "rollout.max_rows": 4, "train.lr": 1e-3, "eval.every": 0, "eval.at_start": False,
        "eval.samples_per_prompt": 1, "checkpoint.every": 1, "checkpoint.keep": 100,
        "logging.progress": False, "logging.tensorboard": False,
    }
    base.update(over)
    return load_config(**base)


def slow_reward(tmp_path, seed):
    path = tmp_path / f"slow_{seed}.py"
    path.write_text("import random, time\n"
                    f"_rng = random.Random({seed})\n"
                    "def slow(completion, answer, **kw):\n"
                    "    time.sleep(_rng.random() * 0.03)\n"
                    "    return float(any(c.isdigit() for c in completion))\n")
    return f"{path}:slow"


def ledger(run_dir) -> list[dict]:
    return [json.loads(x) for x in open(Path(run_dir) / "trained_groups.jsonl")]


# ---------------------------------------------------------------- watchdog


def test_watchdog_fires_only_without_progress():
    now = {"t": 0.0}
    state = {"p": 0}
    dog = Watchdog("the trainer", "a batch", lambda: state["p"], timeout_s=10, describe=lambda: "group g3 missing",
                   clock=lambda: now["t"])
    for t in range(1, 30):  # progress every 5 s: never fires
        now["t"] = t
        if t % 5 == 0:
            state["p"] += 1
        dog.check()
    now["t"] = 34.9  # last change at t=25
    dog.check()
    now["t"] = 35.0
    with pytest.raises(Stalled, match=r"the trainer waited 10 s for a batch .*group g3 missing.*stall timeout of 10 s"):
        dog.check()


# ---------------------------------------------------------------- async snapshots


def _places(state: dict, B: int) -> list[int]:
    """Every group serial a checkpoint accounts for: trained, in flight, queued, resolved."""
    a, m = state["async"], state["async"]["manager"]
    serials = list(range(state["step"] * B))  # trained (no drops: batches form in serial order)
    serials += [g.serial for g in a["inflight"]]
    serials += [g.serial for g in m["inbox"]]
    serials += [s for s in m["resolved"]]
    serials += [int(g.id[1:]) for g in m["forming"]]
    serials += [int(g.id[1:]) for b in m["batches"] for g in b]
    return sorted(serials)


@pytest.mark.parametrize("seed,eta", [(0, 1), (1, 2), (2, 1)])
def test_every_async_checkpoint_accounts_for_every_group(model_dir, tmp_path, seed, eta):
    cfg = cfg_for(model_dir, tmp_path, mode="async", steps=8, seed=seed, **{
        "async.max_staleness": eta, "reward.functions": [slow_reward(tmp_path, seed)],
        "rollout.max_new_tokens": 12})
    train_async(cfg)
    ckpts = sorted((tmp_path / "checkpoints").glob("step_*"))
    assert len(ckpts) == 8
    for c in ckpts:
        state = torch.load(c / "state.pt", weights_only=False)
        assert _places(state, 2) == list(range(state["serial"])), c.name  # each group exactly once
        assert state["async"]["gate"]["live"] == state["serial"]  # nothing dropped in this run
    trained = [g["group"] for row in ledger(tmp_path) for g in row["groups"]]
    assert trained == [f"g{i}" for i in range(16)]


def test_a_lost_group_ends_the_run_with_a_stall_error_naming_it(model_dir, tmp_path, monkeypatch):
    """The failure the probe found (a group lost between two owners, then a wait forever) now
    ends in stall_timeout_s with an error that says what was waited for."""
    from rollover.rollout import async_rollout

    real = async_rollout.DataManager._process

    def lossy(self, pg):
        if pg.serial == 3:
            return  # dropped on the floor: never resolved
        real(self, pg)

    monkeypatch.setattr(async_rollout.DataManager, "_process", lossy)
    cfg = cfg_for(model_dir, tmp_path, mode="async", steps=4, **{"rollout.stall_timeout_s": 3,
                                                                  "async.max_staleness": 1})
    t0 = time.monotonic()
    with pytest.raises(Stalled, match=r"the trainer waited 3 s for a batch from the data manager.*waits for group g3"):
        train_async(cfg)
    assert time.monotonic() - t0 < 60


# ---------------------------------------------------------------- signals


def _signal_when(run_dir: Path, step: int, sig=signal.SIGINT, times: int = 1) -> threading.Thread:
    """Send `sig` to this process once metrics.jsonl holds a train row for `step`."""
    def watch():
        path = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if path.exists() and any(json.loads(x).get("step") == step and json.loads(x)["kind"] == "train"
                                     for x in path.read_text().splitlines() if x.strip()):
                for _ in range(times):
                    os.kill(os.getpid(), sig)
                return
            time.sleep(0.02)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def _weights(run_dir: Path, step: int) -> dict:
    return load_file(str(run_dir / "checkpoints" / f"step_{step:06d}" / "model" / "model.safetensors"))


@pytest.mark.parametrize("april", [False, True])
def test_sigint_saves_at_the_step_and_resume_is_exact(model_dir, tmp_path, april):
    # a tiny random model never answers right (the default reward): one it earns about half the
    # time (a digit 0-4 in its reply), so the weights move and their equality below means something
    over = {"checkpoint.every": 0, "steps": 6, "partial_rollout.enabled": april,
            "reward.functions": [{"fn": "format", "kwargs": {"pattern": "[0-4]"}}]}
    train_sync(cfg_for(model_dir, tmp_path / "straight", **over))
    run_dir = tmp_path / "interrupted"
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)  # SIG_IGN in a background job
    _signal_when(run_dir, 2, signal.SIGTERM if april else signal.SIGINT)
    result = train_sync(cfg_for(model_dir, run_dir, **over))
    assert result["interrupted"] == ("SIGTERM" if april else "SIGINT")
    stopped = result["step"]
    assert 2 <= stopped < 6 and Path(result["checkpoint"]) == run_dir / "checkpoints" / f"step_{stopped:06d}"
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # handlers restored
    train_sync(cfg_for(model_dir, run_dir, **over))  # resume: auto
    a, b = _weights(tmp_path / "straight", 6), _weights(run_dir, 6)
    assert all(torch.equal(a[k], b[k]) for k in a)
    grads = [r["actor/grad_norm"] for r in map(json.loads, open(run_dir / "metrics.jsonl")) if r["kind"] == "train"]
    assert any(g > 0 for g in grads)  # it trained (Adam's moments then move the weights in every later step)
    assert [r["step"] for r in ledger(run_dir)] == [1, 2, 3, 4, 5, 6]
    assert ledger(run_dir) == ledger(tmp_path / "straight")


def test_an_evaluation_a_signal_skipped_runs_at_the_resume(model_dir, tmp_path):
    """A signal ends a step at its checkpoint, before the step's evaluation (eval.every, or the last
    step's): the resume runs it first, with the checkpoint's weights, and adds it to the checkpoint,
    so the run logs the evaluations, values and weights of an unstopped run. The stopped state is
    made exactly: a run to step 2 without its evaluation row and eval.json."""
    from rollover.metrics import read_metrics

    over = {"eval.every": 2, "reward.functions": [{"fn": "format", "kwargs": {"pattern": "[0-4]"}}]}
    train_sync(cfg_for(model_dir, tmp_path / "straight", **over))
    run_dir = tmp_path / "stopped"
    train_sync(cfg_for(model_dir, run_dir, steps=2, **over))
    rows = [x for x in (run_dir / "metrics.jsonl").read_text().splitlines() if json.loads(x)["kind"] != "eval"]
    (run_dir / "metrics.jsonl").write_text("".join(x + "\n" for x in rows))
    (run_dir / "checkpoints" / "step_000002" / "eval.json").unlink()
    assert train_sync(cfg_for(model_dir, run_dir, **over))["step"] == 4
    evals = lambda d: [{k: v for k, v in r.items() if k != "time"} for r in read_metrics(d, kind="eval")]  # noqa: E731
    assert [r["step"] for r in evals(run_dir)] == [2, 4] and evals(run_dir) == evals(tmp_path / "straight")
    assert json.loads((run_dir / "checkpoints" / "step_000002" / "eval.json").read_text()) == \
        json.loads((tmp_path / "straight" / "checkpoints" / "step_000002" / "eval.json").read_text())
    a, b = _weights(tmp_path / "straight", 4), _weights(run_dir, 4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # a finished run resumed reports its last evaluation, read back
    again = train_sync(cfg_for(model_dir, run_dir, **over))
    assert again["step"] == 4 and again["eval/accuracy"] == evals(run_dir)[-1]["eval/accuracy"]
    assert len(evals(run_dir)) == 2


def test_sigint_in_async_mode_saves_a_consistent_checkpoint(model_dir, tmp_path):
    cfg = cfg_for(model_dir, tmp_path, mode="async", steps=6, **{"checkpoint.every": 0, "async.max_staleness": 2,
                                                                  "rollout.max_new_tokens": 12})
    _signal_when(tmp_path, 2)
    result = train_async(cfg)
    assert result["interrupted"] == "SIGINT"
    state = torch.load(Path(result["checkpoint"]) / "state.pt", weights_only=False)
    assert state["step"] == result["step"] < 6
    assert _places(state, 2) == list(range(state["serial"]))
    assert train_async(cfg)["step"] == 6
    trained = [g["group"] for row in ledger(tmp_path) for g in row["groups"]]
    assert trained == [f"g{i}" for i in range(12)]  # nothing lost, nothing twice


SCRIPT = """
import sys
from rollover.config import load_config
from rollover.loops.sync import train_sync
cfg = load_config(sys.argv[1])
print("RESULT", train_sync(cfg), flush=True)
"""


def test_second_signal_exits_at_once_without_saving(model_dir, tmp_path):
    from rollover.config import dump_config

    slow = tmp_path / "slow_judge.py"  # every step takes >= 2 s: the second signal lands inside one
    slow.write_text("import time\ndef judge(completion, answer, **kw):\n    time.sleep(2.0)\n    return 1.0\n")
    cfg = cfg_for(model_dir, tmp_path / "run", steps=200, **{"checkpoint.every": 0,
                                                             "reward.functions": [f"{slow}:judge"]})
    (tmp_path / "c.yaml").write_text(dump_config(cfg))
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path / "c.yaml")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)  # past Interrupts.REPEAT_S: a second request, not the first delivered twice
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGINT, err[-2000:]
    assert "SIGINT received: finishing this step" in err and "second SIGINT: exiting now" in err
    assert "RESULT" not in out
    assert not (tmp_path / "run" / "checkpoints").exists() or not list((tmp_path / "run" / "checkpoints").glob("step_*"))


def test_a_save_removes_what_a_kill_mid_save_left(tmp_path):
    from rollover.testing import tiny_model
    from rollover.train import checkpoint

    stale = tmp_path / "checkpoints" / ".step_000003-x1y2"
    (stale / "model").mkdir(parents=True)  # a kill -9 during a save leaves this behind
    final = checkpoint.save(tmp_path, 4, model=tiny_model(), tokenizer=None, trainer_state={}, extra={}, keep=2)
    assert (final / "DONE").exists() and not stale.exists()
    assert checkpoint.latest(tmp_path) == final


def test_a_second_process_on_the_same_run_dir_is_refused(model_dir, tmp_path):
    from rollover.config import ConfigError, dump_config
    from rollover.loops.build import build_run

    cfg = cfg_for(model_dir, tmp_path / "run", steps=2)
    first = build_run(cfg)
    try:
        (tmp_path / "c.yaml").write_text(dump_config(cfg))
        other = subprocess.run([sys.executable, "-m", "rollover.cli", "train", str(tmp_path / "c.yaml")],
                               capture_output=True, text=True, timeout=120)
        assert other.returncode == 2
        assert f"is in use by a running rollover process (pid {os.getpid()})" in other.stderr
        with pytest.raises(ConfigError, match="is in use by a run built earlier in this process and not closed"):
            build_run(cfg)  # also within one process
    finally:
        first.close()
    train_sync(cfg)  # released: the run dir is usable again
    assert [r["step"] for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if r["kind"] == "train"] == [1, 2]


def test_a_run_that_ends_on_the_run_dir_while_another_starts_is_not_overwritten(model_dir, tmp_path, monkeypatch):
    """Two launches on one run_dir: the second decides what to resume before it can hold the lock
    (it builds its model and engine in between). A first run still live is refused before anything
    is built; one that ended in between (its checkpoints and metrics now there) makes the second
    stop, not train from scratch over them."""
    from rollover.config import ConfigError
    from rollover.loops import build
    from rollover.loops.build import build_run
    from rollover.loops.resume import lock_run_dir

    cfg = cfg_for(model_dir, tmp_path / "run", steps=2)
    (tmp_path / "run").mkdir()
    held = lock_run_dir(tmp_path / "run")
    monkeypatch.setattr(build, "_load_model", lambda *a, **k: pytest.fail("built a model for a run_dir in use"))
    with pytest.raises(ConfigError, match="is in use by a run built earlier in this process"):
        build_run(cfg)
    held.close()
    monkeypatch.undo()
    make_engine = build._make_engine

    def the_other_run_ends(*args, **kwargs):  # while this one builds its engine
        (tmp_path / "run" / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
        return make_engine(*args, **kwargs)

    monkeypatch.setattr(build, "_make_engine", the_other_run_ends)
    with pytest.raises(ConfigError, match="changed while this run was starting: another process wrote"):
        build_run(cfg)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"kind": "train", "step": 1}\n'  # left as it was


def test_one_signal_delivered_twice_at_once_is_one_request(monkeypatch):
    """GNU timeout (or anything that signals the process and its group) delivers SIGTERM twice
    at once: that is one request to stop after the step, not the second that exits unsaved."""
    import io

    from rollover.loops.guard import Interrupts

    exits = []
    monkeypatch.setattr("os._exit", lambda code: exits.append(code))
    guard = Interrupts(stream=io.StringIO())
    guard._handle(signal.SIGTERM, None)
    guard._handle(signal.SIGTERM, None)
    assert guard.requested == "SIGTERM" and exits == []
    time.sleep(Interrupts.REPEAT_S + 0.05)
    guard._handle(signal.SIGTERM, None)
    assert exits == [128 + signal.SIGTERM]


# ---------------------------------------------------------------- bench faults: env_fail


def test_episode_fates_are_a_hash_of_prompt_and_sample():
    from collections import Counter

    from rollover.bench.faults import TURNS, episode_fate

    fates = [episode_fate(f"envfail-0-{i}", j, 0.2) for i in range(1000) for j in range(4)]
    assert fates == [episode_fate(f"envfail-0-{i}", j, 0.2) for i in range(1000) for j in range(4)]  # no clock
    kinds = Counter(kind for kind, _ in fates)
    assert abs((kinds["raise"] + kinds["hang"]) / 4000 - 0.2) < 0.02 and abs(kinds["raise"] - kinds["hang"]) < 100
    assert {turn for kind, turn in fates if kind != "ok"} == set(range(1, TURNS + 1))
    assert episode_fate("envfail-0-1", 2, 0.0) == ("ok", 0)


def test_bench_env_fail_runs_on_through_failed_episodes(model_dir, tmp_path):
    import argparse

    from rollover.bench import faults

    p = argparse.ArgumentParser()
    faults.add_arguments(p)
    result = faults.main(p.parse_args([
        "--modes", "env_fail", "--steps", "2", "--fail-rates", "0.2", "--env-loops", "sync", "async",
        "--model", model_dir, "--workdir", str(tmp_path), "--json", str(tmp_path / "faults.json")]))
    runs = result["modes"]["env_fail"]["runs"]
    assert [(r["loop"], r["fail_rate"]) for r in runs] == [("sync", 0.2), ("async", 0.2)]
    assert result["env_fail"] == {"aborted": 0, "checks_failed": 0}
    for r in runs:
        assert r["aborted"] == 0 and r["steps_done"] == 2, r.get("log_tail")
        assert r["checks_ok"], r["checks"]  # each failed episode left its group, and nothing else did
        assert r["raised"] > 0 and r["timed_out"] > 0 and r["raised"] + r["timed_out"] == r["failed"]
        assert r["failed"] == r["dropped_samples"]
    sync = runs[0]  # the hash fails no three episodes of one of these groups: none is skipped
    assert sync["skipped_groups"] == 0 and sync["unused"] == 0
    assert sync["kept"] + sync["failed"] == sync["episodes"] == 2 * faults.ENV_PROMPTS * faults.ENV_SAMPLES
    assert json.loads((tmp_path / "faults.json").read_text())["modes"]["env_fail"]["runs"] == runs
