"""runtime=ray: the engine contract over Ray rollout workers, the router, weight transport,
worker deaths, and the loops on Ray against the local runtime."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

from rollover.rollout.inputs import RolloutInputs
from rollover.config import ConfigError, load_config  # noqa: E402
from rollover.engine.torch_engine import TorchEngine  # noqa: E402
from rollover.loops.async_ import train_async  # noqa: E402
from rollover.loops.build import build_run  # noqa: E402
from rollover.loops.sync import train_sync  # noqa: E402
from rollover.rewards import RewardRunner, build_rewards  # noqa: E402
from rollover.rewards.pool import WorkerStartError  # noqa: E402
from rollover.rollout.april import AprilCollector  # noqa: E402
from rollover.runtime.router import RayEngine  # noqa: E402
from rollover.runtime.weights import ObjectStoreTransport, changed_mask  # noqa: E402
from rollover.testing import assert_provenance, save_tiny_model, tiny_model  # noqa: E402
from rollover.types import Prompt, Request, SamplingParams  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama", seed=11))


def ray_engine(model, workers=2, **ray_over):
    cfg = load_config(runtime="ray", **{"ray.rollout_workers": workers, "rollout.max_rows": 2,
                                        **{f"ray.{k}": v for k, v in ray_over.items()}})
    return RayEngine(cfg, model, weights=list(model.state_dict().items()), device=torch.device("cpu"), max_len=512,
                     eos_token_ids=(2,))


def requests(n, tokens, prefix="r", **sp):
    return [Request(id=f"{prefix}{i}", prompt_ids=[5, 6, 7, 8 + i % 3],
                    sampling=SamplingParams(max_new_tokens=tokens, seed=i, ignore_eos=True, **sp)) for i in range(n)]


def same(a, b, atol=1e-4):
    assert [c.id for c in a] == [c.id for c in b]
    for x, y in zip(a, b):
        assert x.response_ids == y.response_ids and x.versions == y.versions and x.finish == y.finish
        assert max((abs(p - q) for p, q in zip(x.logprobs, y.logprobs)), default=0) < atol


@pytest.fixture(scope="module")
def pair():
    """A tiny model, a local engine and a two-worker Ray engine holding the same weights."""
    m = tiny_model("llama", seed=3)
    local = TorchEngine(m, max_rows=2, max_len=512, eos_token_ids=(2,))
    eng = ray_engine(m, cpus_per_worker=0.5, weight_delta=True)  # the loop tests below start their own workers meanwhile
    yield m, local, eng
    eng.shutdown()
    local.shutdown()


def test_ray_engine_generates_what_the_local_engine_generates(pair):
    m, local, eng = pair
    same(local.generate(requests(6, 24)), eng.generate(requests(6, 24)))
    sampled = requests(4, 16, prefix="s", temperature=0.7, top_p=0.9)
    same(local.generate(sampled), eng.generate(requests(4, 16, prefix="s", temperature=0.7, top_p=0.9)))
    with pytest.raises(ValueError, match="request 'bad'.*unknown token ids"):
        eng.submit(Request(id="bad", prompt_ids=[10**6]))
    assert eng.generate(requests(1, 4, prefix="after"))[0].num_tokens == 4  # the refusal disturbed nothing


def test_a_worker_builds_its_engine_without_importing_transformers(pair):
    """A worker of a model rollover's own forward serves is given the config's attributes, not a
    transformers config: its process never imports transformers (about 4 s of its start)."""
    m, local, eng = pair
    loaded = ray.get([w.handle.__ray_call__.remote(lambda self: "transformers" in __import__("sys").modules)
                      for w in eng._workers])
    assert loaded == [False, False]


def test_abort_and_resume_on_any_worker_is_exact(pair):
    m, local, eng = pair
    ref = local.generate(requests(4, 300, prefix="a"))
    futs = eng.submit_many(requests(4, 300, prefix="a"))
    eng.pause()  # held wherever they are (a worker runs 300 tokens of this model in tens of ms: no sleep is safe)
    parts = eng.abort()
    eng.resume()
    assert sorted(c.id for c in parts) == ["a0", "a1", "a2", "a3"] and all(c.finish == "abort" for c in parts)
    assert [f.result().finish for f in futs] == ["abort"] * 4  # the futures got the same completions
    done = eng.generate([c.resume() for c in sorted(parts, key=lambda c: c.id)])
    same(ref, done)


def test_weight_updates_travel_as_deltas_and_versions_stay_exact(pair):
    m, local, eng = pair
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    sd["lm_head.weight"][0, :3] += 1.0  # 3 elements of one tensor
    sd["model.layers.0.mlp.up_proj.weight"] = tiny_model("llama", seed=4).state_dict()["model.layers.0.mlp.up_proj.weight"]  # whole
    eng.update_weights(sd.items(), version=1)
    rep = eng.last_sync
    assert (rep.sparse_tensors, rep.full_tensors, rep.unchanged_tensors) == (1, 1, len(sd) - 2)
    assert rep.bytes_per_worker == 3 * (4 + 4) + sd["model.layers.0.mlp.up_proj.weight"].numel() * 4
    assert rep.workers == 2 and eng.version == 1
    local.update_weights(sd.items(), version=1)
    a, b = local.generate(requests(4, 12, prefix="v")), eng.generate(requests(4, 12, prefix="v"))
    same(a, b)
    assert all(c.versions == [1] * 12 for c in b)
    local.update_weights(m.state_dict().items(), version=2)  # back, for the tests after this one
    eng.update_weights(m.state_dict().items(), version=2)


def test_bit_comparison_sees_sign_of_zero_and_skips_equal_tensors():
    a = torch.tensor([0.0, 1.0, 2.0], dtype=torch.bfloat16)
    b = torch.tensor([-0.0, 1.0, 3.0], dtype=torch.bfloat16)
    assert changed_mask(b, a).nonzero().squeeze(1).tolist() == [0, 2]
    t = ObjectStoreTransport(torch.bfloat16, delta=True)
    t.initial([("w", a.float())])
    full, deltas, rep = t.update([("w", a.float())], version=1)
    assert (full, deltas, rep.unchanged_tensors, rep.bytes_per_worker) == ({}, None, 1, 0)


@pytest.mark.parametrize("delta", [False, True])
def test_an_update_that_fails_halfway_leaves_the_transport_at_the_old_weights(delta):
    """What a restarted worker loads (`current_refs`) stays the version the workers hold when an
    update fails after some of its tensors went through."""
    t = ObjectStoreTransport(torch.float32, delta=delta)
    old = {"a": torch.zeros(4), "b": torch.ones(4)}
    t.initial(list(old.items()))

    def failing():
        yield "a", torch.full((4,), 7.0)
        raise RuntimeError("the trainer went away")

    with pytest.raises(RuntimeError, match="went away"):
        t.update(failing(), version=1)
    now = {k: ray.get(r) for k, r in t.current_refs().items()}
    assert now.keys() == old.keys() and all(torch.equal(now[k], old[k]) for k in old)
    full, _, _ = t.update([("a", torch.full((4,), 7.0)), ("b", torch.ones(4) * 2)], version=1)  # a whole one lands
    assert torch.equal(ray.get(t.current_refs()["a"]), torch.full((4,), 7.0)) and set(full) <= {"a", "b"}


def test_gloo_transport_carries_updates_exactly_and_regroups_after_a_death():
    m = tiny_model("llama", seed=3)
    local = TorchEngine(m, max_rows=2, max_len=512, eos_token_ids=(2,))
    eng = ray_engine(m, cpus_per_worker=0.5, weight_transport="gloo")
    try:
        assert eng.delta is False
        for v, seed in ((1, 4), (2, 5)):
            sd = tiny_model("llama", seed=seed).state_dict()
            eng.update_weights(sd.items(), version=v)
            local.update_weights(sd.items(), version=v)
            rep = eng.last_sync
            assert rep.full_tensors == len(sd) and rep.fallback_workers == 0 and rep.workers == 2
            assert rep.bytes_per_worker == eng.transport.buffer.numel() >= sum(t.numel() * 4 for t in sd.values())
            same(local.generate(requests(4, 12, prefix=f"v{v}")), eng.generate(requests(4, 12, prefix=f"v{v}")))
        assert eng.transport.generation == 1  # one group served both updates

        # a worker whose transfer failed gets the update from the object store
        real_send = eng.transport.send
        eng.transport.send = lambda: real_send() + [(eng.transport.members[0], RuntimeError("simulated"))]
        sd = tiny_model("llama", seed=6).state_dict()
        eng.update_weights(sd.items(), version=3)
        local.update_weights(sd.items(), version=3)
        eng.transport.send = real_send
        assert eng.last_sync.fallback_workers == 1 and eng.transport.group is None
        out = eng.generate(requests(4, 12, prefix="f"))
        same(local.generate(requests(4, 12, prefix="f")), out)
        assert all(c.versions == [3] * 12 for c in out)

        # a worker whose receive fails on its side (here: the driver sends it nothing and times
        # out nothing) pulls that version from the object store
        from rollover.runtime.collective import chunks

        eng.rc = eng.rc.model_copy(update={"sync_timeout_s": 3.0})
        skipped = []

        def send_all_but_first():
            t = eng.transport
            skipped.append(t.members[0])
            works = [t.group.send([c], 2, tag) for tag, c in enumerate(chunks(t.buffer))]
            for work in works:
                work.wait()
            return []

        eng.transport.send = send_all_but_first
        sd = tiny_model("llama", seed=10).state_dict()
        eng.update_weights(sd.items(), version=4)
        local.update_weights(sd.items(), version=4)
        eng.transport.send = real_send
        eng.rc = eng.rc.model_copy(update={"sync_timeout_s": 300.0})
        assert eng.last_sync.fallback_workers == 1 and skipped[0].alive and eng.restarts == 0
        same(local.generate(requests(4, 12, prefix="u")), eng.generate(requests(4, 12, prefix="u")))

        # a worker killed just before an update: its transfer fails (or, if its death was seen
        # first, a new group forms without it); its replacement is not waited for: it pulls the
        # current version from the object store once up, and joins the group of the update after
        eng.poll_s = 0.02
        eng.kill_worker(0)
        for v, seed in ((5, 7), (6, 8)):
            sd = tiny_model("llama", seed=seed).state_dict()
            t0 = time.time()
            eng.update_weights(sd.items(), version=v)
            local.update_weights(sd.items(), version=v)
            assert time.time() - t0 < 30  # no rendezvous left waiting out its timeout
            deadline = time.time() + 60
            while eng.restarts == 0 and time.time() < deadline:
                time.sleep(0.01)
        assert eng.restarts == 1
        deadline = time.time() + 60
        while not (eng.workers()[0]["ready"] and eng.workers()[0]["version"] == 6) and time.time() < deadline:
            time.sleep(0.01)
        sd = tiny_model("llama", seed=9).state_dict()
        eng.update_weights(sd.items(), version=7)
        local.update_weights(sd.items(), version=7)
        assert eng.transport.generation >= 2
        # a group given up on leaves no rendezvous waiting out its timeout (one that wakes while
        # the interpreter exits aborts the process)
        assert not [t for t in threading.enumerate() if t.name == "rollover-weights-group"]
        assert eng.last_sync.workers == 2 and eng.last_sync.fallback_workers == 0
        out = eng.generate(requests(6, 12, prefix="d"))
        same(local.generate(requests(6, 12, prefix="d")), out)
        assert all(c.versions == [7] * 12 for c in out)
        assert {w["index"]: w["restarts"] for w in eng.workers()} == {0: 1, 1: 0}
    finally:
        eng.shutdown()
        local.shutdown()


def test_gloo_transport_refuses_deltas():
    with pytest.raises(ConfigError, match="ray.weight_delta=true needs ray.weight_transport=object_store"):
        load_config(runtime="ray", **{"ray.weight_transport": "gloo", "ray.weight_delta": True})


def test_requests_of_a_group_stay_on_one_worker_and_load_spreads(pair):
    m, local, eng = pair
    group = [Request(id=f"g{j}", prompt_ids=[9, 9, 9, 9], sampling=SamplingParams(max_new_tokens=8, seed=j))
             for j in range(4)]
    other = [Request(id=f"h{j}", prompt_ids=[7, 7, 7, 7], sampling=SamplingParams(max_new_tokens=8, seed=j))
             for j in range(4)]
    with eng._lock:
        alive = [w for w in eng._workers if w.alive]
        for w in alive:
            w.load = 0
        picks = []
        for r in group + other:
            w = eng.router.pick(r, alive)
            w.load += r.remaining_tokens
            picks.append(w.index)
        for w in alive:
            w.load = 0
    assert len(set(picks[:4])) == 1 and len(set(picks[4:])) == 1 and picks[0] != picks[4]


def test_a_killed_worker_loses_nothing_and_its_replacement_rejoins_at_the_current_version(pair, caplog):
    m, local, eng = pair
    eng.poll_s = 0.02
    ref = local.generate(requests(8, 400, prefix="k"))
    futs = eng.submit_many(requests(8, 400, prefix="k"))
    deadline = time.time() + 30
    while time.time() < deadline:  # kill once worker 0 holds a request mid-way
        with eng._lock:
            mid = [live for live in eng._live.values() if live.worker is not None and live.worker.index == 0 and live.ids]
        if mid:
            break
        time.sleep(0.005)
    assert mid, "no request was seen mid-way on worker 0"
    before = eng.restarts
    with caplog.at_level(logging.INFO, logger="rollover"):
        eng.kill_worker(0)
        got = [f.result(timeout=120) for f in futs]
        deadline = time.time() + 60  # the replacement up (the requests may all have finished on the other)
        while time.time() < deadline and {w["index"]: w for w in eng.workers()}[0]["pid"] is None:
            time.sleep(0.05)
    same(ref, got)  # nothing lost, nothing duplicated: exactly the uninterrupted completions
    assert eng.restarts == before + 1 and eng.resubmitted >= 1
    info = {w["index"]: w for w in eng.workers()}
    assert info[0]["restarts"] == 1 and info[0]["alive"]
    # the log names the death and the replacement, with its pid and node
    assert f"ray: rollout worker 0 replaced: pid {info[0]['pid']} on node {info[0]['node']}, up in " in caplog.text
    same(local.generate(requests(2, 8, prefix="z")), eng.generate(requests(2, 8, prefix="z")))
    eng.poll_s = 0.5


def test_an_update_does_not_wait_for_a_starting_replacement_which_joins_at_the_new_version():
    """A worker killed just before an eager update: the update goes on with the live worker
    (the replacement is not waited for), the replacement pulls that version once it is up, and
    requests routed to it afterwards carry it."""
    m = tiny_model("llama", seed=3)
    local = TorchEngine(m, max_rows=2, max_len=512, eos_token_ids=(2,))
    eng = ray_engine(m, cpus_per_worker=0.5)
    try:
        sd = {k: v.clone() for k, v in m.state_dict().items()}
        sd["lm_head.weight"] += 0.5
        eng.kill_worker(0)
        deadline = time.time() + 30
        while eng.restarts == 0 and time.time() < deadline:  # its death is seen: a replacement is starting
            time.sleep(0.005)
        assert not eng.workers()[0]["ready"]
        eng.update_weights(sd.items(), version=1)
        assert eng.last_sync.workers == 1 and eng.last_sync.joining_workers == 1
        assert eng.last_sync.metrics()["weights/joining_workers"] == 1
        while not (eng.workers()[0]["ready"] and eng.workers()[0]["version"] == 1) and time.time() < deadline:
            time.sleep(0.01)
        assert eng.workers()[0] == {**eng.workers()[0], "alive": True, "ready": True, "version": 1, "restarts": 1}
        local.update_weights(sd.items(), version=1)
        got = eng.generate(requests(6, 8, prefix="j"))
        same(local.generate(requests(6, 8, prefix="j")), got)
        assert all(c.versions == [1] * 8 for c in got)
        assert eng.stats().generated_tokens > 0 and eng.workers()[0]["load"] == 0
    finally:
        eng.shutdown()
        local.shutdown()


def test_placement_that_cannot_fit_is_refused_naming_role_and_numbers():
    m = tiny_model("llama", seed=3)
    with pytest.raises(ConfigError, match=r"rollout workers: 3 x 1 GPU = 3 GPU asked, the cluster has 0 GPU"):
        ray_engine(m, workers=3, gpus_per_worker=1)
    with pytest.raises(ConfigError, match=r"3 x 8 CPU = 24 CPU asked.*largest node has 2 CPU"):
        ray_engine(m, workers=3, cpus_per_worker=8)
    with pytest.raises(ConfigError, match=r"rollout workers: 1 x 1 CPU \+ reward workers: 2 x 1 CPU = 3 CPU asked, "
                                          r"the cluster has 2 CPU"):
        ray_engine(m, workers=1, cpus_per_worker=1, reward_workers=2)
    with pytest.raises(ConfigError, match=r"reward worker: 4 CPU each, the largest node has 2 CPU"):
        ray_engine(m, workers=1, cpus_per_worker=0.5, reward_workers=1, cpus_per_reward_worker=4)
    with pytest.raises(ConfigError, match=r"rollout workers: 1 x 0 GPU \+ reward workers: 2 x 0.5 GPU = 1 GPU asked, "
                                          r"the cluster has 0 GPU.*reward worker: 0.5 GPU each, the largest node has 0"):
        ray_engine(m, workers=1, cpus_per_worker=0.5, reward_workers=2, cpus_per_reward_worker=0, gpus_per_reward_worker=0.5)



# ------------------------------------------------------------------ the loops on Ray
def run_cfg(model_dir, run_dir, **over):
    base = {
        "model": model_dir, "run_dir": str(run_dir), "steps": 3, "seed": 3, "resume": "never",
        "data.train": "gen:arithmetic?n=200", "data.eval_size": 4, "data.max_prompt_tokens": 64,
        "rollout.prompts_per_step": 3, "rollout.samples_per_prompt": 2, "rollout.max_new_tokens": 12,
        "rollout.max_rows": 6, "reward.functions": ["numeric", {"fn": "format", "weight": 0.5, "kwargs": {"pattern": "[0-9]"}}],
        "train.lr": 1e-3, "eval.every": 0, "eval.at_start": False, "eval.samples_per_prompt": 1,
        "checkpoint.every": 0, "logging.progress": False, "logging.tensorboard": False,
        **({"ray.cpus_per_worker": 0.5} if over.get("runtime") == "ray" else {}),
    }
    base.update(over)
    return load_config(**base)


def final_weights(run_dir, step=3):
    return load_file(str(run_dir / "checkpoints" / f"step_{step:06d}" / "model" / "model.safetensors"))


@pytest.mark.parametrize("trainer", ["driver", "actor"])
def test_sync_run_on_ray_with_one_worker_ends_with_the_local_weights(model_dir, tmp_path, trainer):
    stop = {"rollout.stop": ["1", "2"]}  # found by the worker with the driver's tokenizer, as by the local engine
    train_sync(run_cfg(model_dir, tmp_path / "local", **stop))
    # the rewards are scored on a reward worker actor here, on the driver in the local run; with
    # ray.trainer=actor the policy trains in an actor of its own, which writes the checkpoint's model
    run = build_run(run_cfg(model_dir, tmp_path / "ray", runtime="ray", **stop, **{
        "ray.rollout_workers": 1, "ray.reward_workers": 1, "ray.cpus_per_reward_worker": 0.5, "ray.trainer": trainer,
        **({"ray.cpus_for_trainer": 0} if trainer == "actor" else {})}))  # 2 CPUs: the module's engines hold one
    if trainer == "actor":
        assert type(run.trainer).__name__ == "RemoteTrainer" and run.trainer.pid != os.getpid()
        assert not hasattr(run.model, "parameters")  # the driver holds no copy of the policy
    train_sync(run.cfg, run=run)
    assert type(run.rewards.pool).__name__ == "RayRewardPool" and run.rewards.pool.calls >= 3 * 3 * 2 * 2
    a, b = final_weights(tmp_path / "local"), final_weights(tmp_path / "ray")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(x) for x in open(tmp_path / "ray" / "metrics.jsonl") if json.loads(x)["kind"] == "train"]
    assert all(r["weights/bytes_per_worker"] > 0 and r["weights/sent_fraction"] <= 1 for r in rows)
    assert [r["ray/reward_workers_started_total"] for r in rows] == [1, 1, 1]
    if trainer == "actor":  # the first weights came through the driver; every update went from the actor
        assert run.trainer.weight_fetches == 1


def test_a_killed_trainer_actor_stops_the_run_and_the_run_resumes_exactly(model_dir, tmp_path, monkeypatch):
    """ray.trainer=actor: the trainer's process SIGKILLed during step 3 stops the run with an
    error naming the trainer actor; the same command resumes from the step-2 checkpoint and ends
    with the weights of a run that was never interrupted (here the local one). The run has PPO's
    critic (a policy without one resumes the same way, less the critic): the policy and the
    critic both come back from the checkpoint the actor wrote."""
    from rollover.runtime.trainer import RemoteTrainer, TrainerLost

    over = {"algorithm.advantage": "gae", "critic.lr": 1e-2}
    train_sync(run_cfg(model_dir, tmp_path / "local", steps=4, **{"checkpoint.every": 2, **over}))
    cfg = run_cfg(model_dir, tmp_path / "ray", runtime="ray", steps=4, resume="auto", **{
        "checkpoint.every": 2, "ray.rollout_workers": 1, "ray.trainer": "actor", "ray.cpus_for_trainer": 0.5, **over})
    real, calls = RemoteTrainer.train_step, []

    def dying(self, batch):
        calls.append(self.pid)
        if len(calls) == 3:
            os.kill(self.pid, signal.SIGKILL)
        return real(self, batch)

    monkeypatch.setattr(RemoteTrainer, "train_step", dying)
    with pytest.raises(TrainerLost, match=r"trainer actor \(node .*, pid \d+, cpu\) died during train_step.*last checkpoint"):
        train_sync(cfg)
    monkeypatch.setattr(RemoteTrainer, "train_step", real)
    assert sorted(p.name for p in (tmp_path / "ray" / "checkpoints").glob("step_*")) == ["step_000002"]
    train_sync(cfg)  # resume: auto
    a, b = final_weights(tmp_path / "local", 4), final_weights(tmp_path / "ray", 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(x) for x in open(tmp_path / "ray" / "metrics.jsonl") if json.loads(x)["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


def test_trainer_actor_placement_is_checked_and_driver_trainer_refuses_its_options():
    m = tiny_model("llama", seed=3)
    with pytest.raises(ConfigError, match=r"rollout workers: 1 x 0 GPU \+ the trainer actor: 1 GPU = 1 GPU asked, "
                                          r"the cluster has 0 GPU"):
        ray_engine(m, workers=1, trainer="actor", gpus_for_trainer=1)
    with pytest.raises(ConfigError, match=r"trainer actor: 4 CPU, the largest node has 2 CPU"):
        ray_engine(m, workers=1, cpus_per_worker=0.5, trainer="actor", cpus_for_trainer=4)
    with pytest.raises(ConfigError, match=r"ray.gpus_for_trainer place the trainer actor: set ray.trainer=actor"):
        load_config(runtime="ray", **{"ray.gpus_for_trainer": 1})
    with pytest.raises(ConfigError, match=r"device=cuda with ray.trainer=actor: give the trainer actor its GPU"):
        load_config(runtime="ray", device="cuda", **{"ray.trainer": "actor"})


@pytest.mark.parametrize("carry", ["resubmit", "keep_kv"])
def test_april_on_ray_keeps_every_tokens_provenance(model_dir, tmp_path, carry):
    cfg = run_cfg(model_dir, tmp_path, runtime="ray", **{"partial_rollout.carry": carry,
        "ray.rollout_workers": 2, "rollout.ignore_eos": True, "rollout.max_new_tokens": 16, "rollout.max_rows": 2,
        "partial_rollout.enabled": True, "partial_rollout.oversample": 3.0, "partial_rollout.max_carry_steps": 100})
    run = build_run(cfg)
    rng = random.Random(0)
    draw = run.next_groups

    def next_groups(k, version):  # long-tailed budgets, so some samples are carried across versions
        groups = draw(k, version)
        for g in groups:
            g.budgets = [16 if rng.random() < 0.3 else rng.randint(1, 16) for _ in range(g.n)]
        return groups

    run.next_groups = next_groups
    models = {0: tiny_model("llama", seed=11)}
    col = AprilCollector(RolloutInputs.of(run))
    spanned = 0
    try:
        for step in range(4):
            groups, _ = col.collect(step)
            for g in groups:
                for r in g.rollouts:
                    spanned += assert_provenance(r, models)
            models[step + 1] = tiny_model("llama", seed=100 + step)
            run.weights.push(models[step + 1].state_dict().items(), version=step + 1)
    finally:
        col.close()
        run.close()
    assert spanned > 0


@pytest.mark.parametrize("weight_sync", ["eager", "lazy"])
def test_async_run_on_ray_keeps_the_staleness_bound(model_dir, tmp_path, weight_sync):
    cfg = run_cfg(model_dir, tmp_path, runtime="ray", mode="async", steps=4,
                  **{"ray.rollout_workers": 2, "async.max_staleness": 1, "rollout.max_rows": 2,
                     "ray.weight_sync": weight_sync})
    train_async(cfg)
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl") if json.loads(x)["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["staleness/max"] <= 1 and r["staleness/token_lag_max"] <= 1 for r in rows)  # every token, too
    assert all(0 <= r["weights/lagging_workers"] <= 2 for r in rows)
    if weight_sync == "eager":
        assert all(r["weights/lagging_workers"] == 0 for r in rows)


def test_lazy_weight_pulls_keep_every_tokens_version_exact():
    from types import SimpleNamespace

    m0 = tiny_model("llama", seed=3)
    cfg = load_config(runtime="ray", mode="async", **{"ray.rollout_workers": 2, "rollout.max_rows": 2,
                                                      "ray.cpus_per_worker": 0.5, "ray.weight_sync": "lazy"})
    eng = RayEngine(cfg, m0, weights=list(m0.state_dict().items()), device=torch.device("cpu"), max_len=512,
                    eos_token_ids=(2,))
    models, moved = {0: m0}, []
    eng.on_oldest_version(lambda: moved.append(eng.oldest_version))
    reqs = requests(4, 300)
    try:
        futures = eng.submit_many(reqs)
        eng.pause()  # step the workers until requests have tokens of version 0, then load version 1 under them
        deadline = time.monotonic() + 60
        while not (started := [n for n in eng.lengths().values() if n > 0]) and time.monotonic() < deadline:
            eng.resume()
            time.sleep(0.002)
            eng.pause()
        assert started and max(started) < 300  # unfinished: they go on under version 1
        for v in (1, 2, 3):  # versions 2 and 3 land while the requests generate
            models[v] = tiny_model("llama", seed=100 + v)
            assert eng.update_weights(list(models[v].state_dict().items()), version=v) == []
            assert eng.version == v and eng.oldest_version <= v
            if v == 1:
                eng.settle()
                eng.resume()
            deadline = time.monotonic() + 60
            while min(eng.lengths().values(), default=300) < 20 * v and time.monotonic() < deadline:
                time.sleep(0.01)
        done = [f.result(timeout=120) for f in futures]
        eng.settle()  # returns once every worker holds version 3
        assert eng.oldest_version == 3 and moved and moved == sorted(moved)  # never moves backwards
        late = eng.generate(requests(2, 6, prefix="late"))
    finally:
        eng.shutdown()
    spanned = 0
    for r, c in zip(reqs, done):
        spanned += assert_provenance(SimpleNamespace(prompt_ids=r.prompt_ids, response_ids=c.response_ids,
                                                     logprobs=c.logprobs, versions=c.versions, group_id=c.id), models)
        assert c.versions == sorted(c.versions)
    assert spanned >= len(started)  # those started under version 0 went on under later ones
    assert all(v == 3 for c in late for v in c.versions)


def test_a_worker_that_has_not_loaded_holds_the_oldest_version_back():
    from types import SimpleNamespace

    m0, m1 = tiny_model("llama", seed=3), tiny_model("llama", seed=101)
    cfg = load_config(runtime="ray", mode="async", **{"ray.rollout_workers": 2, "rollout.max_rows": 2,
                                                      "ray.cpus_per_worker": 0.5, "ray.weight_sync": "lazy"})
    eng = RayEngine(cfg, m0, weights=list(m0.state_dict().items()), device=torch.device("cpu"), max_len=512,
                    eos_token_ids=(2,))
    pull, held = eng._pull, []

    def holding(w):  # worker 1 is not asked to load (yet): it lags
        if w.index == 1:
            held.append(w)
        else:
            pull(w)

    eng._pull = holding
    try:
        eng.update_weights(list(m1.state_dict().items()), version=1)
        deadline = time.monotonic() + 60
        while eng._workers[0].version < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.version == 1 and eng.oldest_version == 0 and held  # the gate would admit by version 0
        reqs = requests(4, 8, prefix="lag")
        outs = eng.generate(reqs)
        assert {v for c in outs for v in c.versions} == {0, 1}  # each worker samples with what it holds
        for r, c in zip(reqs, outs):
            assert_provenance(SimpleNamespace(prompt_ids=r.prompt_ids, response_ids=c.response_ids, logprobs=c.logprobs,
                                              versions=c.versions, group_id=c.id), {0: m0, 1: m1})
        eng._pull = pull
        with eng._weights_lock:
            pull(held[0])
        eng.settle()
        assert eng.oldest_version == 1
    finally:
        eng.shutdown()


def test_a_worker_dying_with_no_restart_left_fails_its_requests_naming_it():
    m = tiny_model("llama", seed=3)
    eng = ray_engine(m, workers=1, cpus_per_worker=0.5, max_restarts=0)
    try:
        eng.poll_s = 0.02
        futs = eng.submit_many(requests(12, 450, prefix="n"))
        deadline = time.time() + 30
        while time.time() < deadline and not any(live.ids for live in list(eng._live.values())):
            time.sleep(0.005)
        with eng._lock:
            live = set(eng._live)
        eng.kill_worker(0)
        failed = set()
        for i, f in enumerate(futs):
            try:
                f.result(timeout=60)
            except Exception as e:
                assert "rollout worker 0 died after 0 restarts (ray.max_restarts=0) and no worker is left" in str(e)
                failed.add(f"n{i}")
        assert failed and failed <= live  # what had finished stays finished; every live request fails
        with pytest.raises(RuntimeError, match="ray engine stopped: rollout worker 0 died"):
            eng.stats()
    finally:
        eng.shutdown()


def test_requests_sent_while_the_only_worker_restarts_wait_for_its_replacement():
    m = tiny_model("llama", seed=3)
    local = TorchEngine(m, max_rows=2, max_len=512, eos_token_ids=(2,))
    eng = ray_engine(m, workers=1, cpus_per_worker=0.5)
    try:
        eng.kill_worker(0)
        early = eng.generate(requests(2, 10, prefix="e"))  # sent to the dead worker before its death is seen
        assert eng.restarts == 1
        same(local.generate(requests(2, 10, prefix="e")), early)
        eng.kill_worker(0)
        deadline = time.time() + 30
        while eng.restarts == 1 and time.time() < deadline:  # seen: a replacement is starting
            time.sleep(0.005)
        late = eng.generate(requests(3, 10, prefix="w"))  # sent while the replacement starts
        same(local.generate(requests(3, 10, prefix="w")), late)
        assert eng.restarts == 2 and eng.workers()[0]["alive"]
    finally:
        eng.shutdown()
        local.shutdown()


def test_streaming_through_ray_yields_every_token_in_order(pair):
    import asyncio

    m, local, eng = pair

    async def collect(engine, req):
        toks, last = [], None
        async for ev in engine.stream(req):
            if ev.completion is not None:
                last = ev.completion
            else:
                toks.append(ev.token)
        return toks, last

    req = requests(1, 40, prefix="st")[0]
    toks, c = asyncio.run(collect(eng, req))
    assert toks == c.response_ids == local.generate(requests(1, 40, prefix="st"))[0].response_ids


# ------------------------------------------------------------------ reward workers on Ray
FIXTURES = str(Path(__file__).with_name("reward_fixtures.py"))


def ray_rewards(specs, size=1, timeout_s=30.0, on_error="zero"):
    from rollover.runtime.rewards import RayRewardPool

    rewards = build_rewards(specs)
    return RewardRunner(rewards, timeout_s=timeout_s, on_error=on_error,
                        pool=RayRewardPool(rewards, size=size, timeout_s=timeout_s, cpus=0))


def test_reward_workers_on_ray_score_what_the_driver_scores():
    specs = [{"fn": "numeric"}, {"fn": f"{FIXTURES}:scaled_length", "kwargs": {"scale": 0.5}, "weight": 2.0},
             {"fn": f"{FIXTURES}:prefix_match", "weight": 0.25}]  # per sample, with a field and a kwarg; TRL-style
    prompts = [Prompt(id=f"p{i}", text="?", answer=a, fields={"level": i}) for i, a in enumerate(["8", "12", "3"])]
    completions = ["8", "the answer is 12", "no"]

    def outcome(out):
        return [(s.status, s.total, s.scores, s.extras, s.failed) for s in out.samples]

    with RewardRunner(build_rewards(specs)) as local:
        want = local.score(prompts, completions)
    with ray_rewards(specs, size=2) as remote:
        got = remote.score(prompts, completions)
        pids, calls = remote.pool.pids, remote.pool.calls
    assert outcome(got) == outcome(want) and got.failures == [] and want.samples[0].scores["numeric"] == 1.0
    assert pids and os.getpid() not in pids
    assert calls == 3 + 3 + 1  # every call ran on an actor, the unisolated `numeric` too (TRL-style: one per batch)


def test_a_reward_model_loads_on_the_ray_reward_workers_not_in_the_driver(tmp_path):
    from rollover.rewards import model
    from rollover.runtime.rewards import RayRewardPool
    from test_reward_model import save_reward_model

    specs = [{"fn": "reward_model", "kwargs": {"path": save_reward_model(tmp_path / "rm")}}]
    prompts, completions = [Prompt(id="a", text="1+1="), Prompt(id="b", text="2+2=")], ["2", "four"]
    with RewardRunner(build_rewards(specs)) as local:
        want = [s.scores["reward_model"] for s in local.score(prompts, completions).samples]
    model._close()
    rewards = build_rewards(specs, here=False)  # what a run with ray.reward_workers builds
    assert model._SCORERS == {}
    with RewardRunner(rewards, timeout_s=60, pool=RayRewardPool(rewards, size=1, timeout_s=60, cpus=0)) as remote:
        got = [s.scores["reward_model"] for s in remote.score(prompts, completions).samples]
    assert got == pytest.approx(want, abs=1e-5) and model._SCORERS == {}


def test_a_reward_worker_that_dies_or_hangs_fails_only_its_samples_and_is_replaced(tmp_path):
    prompts = [Prompt(id=x, text="?", answer=i) for i, x in enumerate("abcde")]
    with ray_rewards([{"fn": f"{FIXTURES}:misbehaves", "name": "m"}], size=1, timeout_s=3.0) as runner:
        out = runner.score(prompts, ["sigkill", "ok", "spin", "raise", "ok"])
        assert out.totals == [0.0, 1.0, 0.0, 0.0, 1.0]
        assert out.error_counts == {"m": 3} and out.timeout_counts == {"m": 1}
        died, hung, raised = out.failures
        assert died.sample_id == "a#0" and "WorkerDied: reward worker actor (node" in died.error
        assert "died mid-call" in died.error
        assert hung.sample_id == "c#2" and hung.timed_out and "timed out after 3.0 s; reward worker actor" in hung.error
        assert raised.sample_id == "d#3" and raised.error == "ValueError: asked to raise (answer 3)"
        assert runner.pool.started >= 3  # one actor per death, the others kept between calls
        (pid,) = runner.pool.pids
        assert out.samples[4].extras["m/pid"] == pid != os.getpid()

        os.kill(pid, signal.SIGKILL)  # dies while idle: the next call is not blamed for it
        time.sleep(1.0)
        again = runner.score(prompts[:2], ["ok", "ok"])
        assert again.totals == [1.0, 1.0] and again.error_counts == {"m": 0}
        assert runner.pool.pids != [pid]

    gone = tmp_path / "gone.py"
    gone.write_text("def f(completion, answer):\n    return 1.0\n")
    specs = [{"fn": f"{gone}:f"}]
    runner = ray_rewards(specs)
    gone.unlink()
    with runner, pytest.raises(WorkerStartError, match="could not rebuild(.|\n)*FileNotFoundError"):
        runner.score(prompts[:1], ["x"])  # a setup error stops scoring, whatever on_error says


# ------------------------------------------------------------------ environment workers on Ray
ENV_FIXTURES = str(Path(__file__).with_name("env_fixtures.py"))


def env_run_cfg(model_dir, run_dir, **over):
    return run_cfg(model_dir, run_dir, **{
        "data.train": "env", "data.eval_size": 0, "data.max_prompt_tokens": 256, "env.name": "guess_number",
        "env.options": {"low": 1, "high": 8, "max_guesses": 3}, "env.max_total_tokens": 400, "steps": 2,
        "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2, "rollout.max_new_tokens": 6,
        "rollout.max_rows": 8, "reward.functions": ["numeric"], **over})


def test_episodes_with_env_worker_actors_train_as_on_the_driver(model_dir, tmp_path):
    train_sync(env_run_cfg(model_dir, tmp_path / "local"))
    run = build_run(env_run_cfg(model_dir, tmp_path / "ray", runtime="ray", **{
        "ray.rollout_workers": 1, "ray.env_workers": 2, "ray.cpus_per_env_worker": 0.25}))
    train_sync(run.cfg, run=run)
    assert run.env_builder is run.env_workers and run.env_workers.groups_made == 2 * 2  # every group on an actor
    a, b = final_weights(tmp_path / "local", 2), final_weights(tmp_path / "ray", 2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    local, remote = ([json.loads(x) for x in open(tmp_path / d / "metrics.jsonl") if json.loads(x)["kind"] == "train"]
                     for d in ("local", "ray"))
    assert [r["rollout/env/episodes"] for r in remote] == [4, 4] and all(r["rollout/env/failed"] == 0 for r in remote)
    assert [(r["ray/env_workers_started_total"], r["ray/env_worker_deaths_total"]) for r in remote] == [(2, 0), (2, 0)]
    assert [r["reward/mean"] for r in remote] == [r["reward/mean"] for r in local]
    assert any(r["actor/grad_norm"] > 0 for r in local)  # the runs trained: equal weights mean something


def test_agents_on_env_worker_actors_train_as_on_the_driver(model_dir, tmp_path, monkeypatch):
    """env.name: agent, its file named relative to the driver's directory: the actors load it by
    its absolute path (their own directory differs) and train as the driver's episodes do."""
    monkeypatch.chdir(Path(__file__).parents[1])
    over = {"data.train": "gen:arithmetic?n=40", "env.name": "agent", "env.max_turns": 2,
            "env.options": {"fn": "examples/agent_arith.py:retry_agent", "max_attempts": 2}}
    train_sync(env_run_cfg(model_dir, tmp_path / "local", **over))
    run = build_run(env_run_cfg(model_dir, tmp_path / "ray", runtime="ray", **over, **{
        "ray.rollout_workers": 1, "ray.env_workers": 1, "ray.cpus_per_env_worker": 0.25}))
    train_sync(run.cfg, run=run)
    assert run.env_builder is run.env_workers and run.env_workers.groups_made == 2 * 2
    a, b = final_weights(tmp_path / "local", 2), final_weights(tmp_path / "ray", 2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    remote = [json.loads(x) for x in open(tmp_path / "ray" / "metrics.jsonl") if json.loads(x)["kind"] == "train"]
    assert all(r["rollout/env/failed"] == 0 and r["rollout/env/info/attempts"] >= 1 for r in remote)


def test_an_env_worker_that_dies_fails_only_the_episodes_it_held(tmp_path):
    import asyncio

    from rollover.envs.base import Action
    from rollover.envs.builders import make_env_builder
    from rollover.runtime.envs import EnvWorkerDied, EnvWorkerStartError, RayEnvBuilder

    name = f"{ENV_FIXTURES}:Fragile"
    workers = RayEnvBuilder(make_env_builder(name, {}), name, {}, workers=2, cpus=0)
    workers.start()
    first = set(workers.pids)
    assert len(first) == 2 and os.getpid() not in first
    say = Action("hi", (5,), "stop")

    async def episodes():
        # the least-loaded actor takes each new group: doomed and filler on one, fine and raising on the other
        doomed, fine, filler, raising = (workers.make_group(Prompt(id=t, text="?", answer=t), 2)
                                         for t in ("die", "ok", "ok", "raise"))
        for env in (*doomed, *fine, *raising):
            assert await env.initial_observation() == [{"role": "user", "content": f"Task {env.group.prompt.answer}."}]
        outcomes = []
        for env in (*doomed, *fine, *raising):
            try:
                outcomes.append(await env.step(say))
            except Exception as e:
                outcomes.append(e)
        later = workers.make_group(Prompt(id="later", text="?", answer="ok"), 1)
        await later[0].initial_observation()
        (hung,) = workers.make_group(Prompt(id="hang", text="?", answer=f"hang:{tmp_path / 'cancelled'}"), 1)
        await hung.initial_observation()
        with pytest.raises(TimeoutError):  # the episode's step timeout ...
            await asyncio.wait_for(hung.step(say), 1.0)
        return (doomed, fine, filler, raising), outcomes, await later[0].step(say)

    (doomed, fine, filler, raising), outcomes, later = asyncio.run(episodes())
    try:
        a, b = doomed[0].group.slot, fine[0].group.slot
        assert a is not b and filler[0].group.slot is a and raising[0].group.slot is b
        assert all(isinstance(e, EnvWorkerDied) and "environment worker actor (node" in str(e) for e in outcomes[:2])
        assert [o.reward for o in outcomes[2:4]] == [1.0, 1.0]  # the other actor's episodes go on
        for e in outcomes[4:]:  # beside them, an environment's own error fails only its episode, as on the driver
            assert type(e) is RuntimeError and "simulator crashed on 'hi'" in str(e)
            assert "in the environment worker actor" in "".join(e.__notes__)
        assert workers.deaths == 1 and later.reward == 1.0 and workers.metrics()["ray/env_worker_deaths_total"] == 1
        deadline = time.monotonic() + 30
        while not (tmp_path / "cancelled").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "cancelled").exists()  # ... cancels the call on the actor too
        deadline = time.monotonic() + 60
        while len(workers.pids) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert workers.started == 3 and len(workers.pids) == 2 and set(workers.pids) != first  # the dead one replaced
    finally:
        workers.close()

    gone = tmp_path / "gone_env.py"
    gone.write_text((Path(ENV_FIXTURES)).read_text())
    local = make_env_builder(f"{gone}:Fragile", {})
    gone.unlink()
    with pytest.raises(EnvWorkerStartError, match="could not build env(.|\n)*gone_env.py"):
        RayEnvBuilder(local, f"{gone}:Fragile", {}, workers=1, cpus=0).start()


def test_an_env_worker_makes_one_environment_for_a_resample():
    """RayEnvBuilder.make_one(prompt, n, j): one environment on an actor, by the builder's own
    make_one (guess_number) or the j-th of a group made there (a builder without one)."""
    import asyncio

    from rollover.envs.base import Action
    from rollover.envs.builders import make_env_builder
    from rollover.runtime.envs import RayEnvBuilder

    for name, prompt in (("guess_number", Prompt(id="g", text="?", answer=3)),
                         (f"{ENV_FIXTURES}:Fragile", Prompt(id="f", text="?", answer="ok"))):
        workers = RayEnvBuilder(make_env_builder(name, {}), name, {}, workers=1, cpus=0)
        workers.start()
        try:
            env = workers.make_one(prompt, 4, 2)

            async def episode():
                opening = await env.initial_observation()
                return opening, await env.step(Action("3", (5,), "stop"))

            opening, result = asyncio.run(episode())
            assert opening and workers.groups_made == 1 and env.group.only == 2
            assert result.reward == 1.0 and result.done  # the right guess; Fragile's "ok" task: one step, reward 1
            if name != "guess_number":  # a sys.exit in a step comes back as that step's error; the actor lives on
                env = workers.make_one(Prompt(id="x", text="?", answer="exit"), 4, 1)
                with pytest.raises(SystemExit):
                    asyncio.run(episode())
                env = workers.make_one(prompt, 4, 0)
                assert asyncio.run(episode())[1].reward == 1.0 and workers.metrics()["ray/env_workers_started_total"] == 1
        finally:
            workers.close()


def test_an_env_worker_whose_event_loop_freezes_is_killed_and_replaced(monkeypatch):
    import asyncio

    from rollover.envs.base import Action
    from rollover.envs.builders import make_env_builder
    from rollover.runtime import envs as env_workers_module
    from rollover.runtime.envs import EnvWorkerDied, RayEnvBuilder

    monkeypatch.setattr(env_workers_module, "HANG_PING_S", 2.0)
    name = f"{ENV_FIXTURES}:Fragile"
    workers = RayEnvBuilder(make_env_builder(name, {}), name, {}, workers=1, cpus=0)
    workers.start()
    (first,) = workers.pids
    say = Action("hi", (5,), "stop")

    async def episodes():
        frozen, beside = workers.make_group(Prompt(id="f", text="?", answer="freeze"), 2)
        await frozen.initial_observation()
        await beside.initial_observation()
        with pytest.raises(TimeoutError):  # the episode's step timeout; the actor's loop stays blocked
            await asyncio.wait_for(frozen.step(say), 1.0)
        with pytest.raises(EnvWorkerDied):  # its neighbour on the blocked actor fails when the actor is killed
            await asyncio.wait_for(beside.step(say), 60)
        (later,) = workers.make_group(Prompt(id="later", text="?", answer="ok"), 1)
        await asyncio.wait_for(later.initial_observation(), 60)
        return await asyncio.wait_for(later.step(say), 60)

    try:
        later = asyncio.run(episodes())
        assert later.reward == 1.0 and later.info["pid"] != first
        assert workers.hung == 1 and workers.deaths == 1 and workers.started == 2
        assert workers.metrics()["ray/env_workers_hung_total"] == 1 and workers.pids == [later.info["pid"]]
    finally:
        workers.close()


def test_first_fit_packing_of_workers_into_nodes():
    from rollover.runtime import _packs

    nodes = [{"CPU": 9.0}] * 3
    assert _packs(nodes, [(3.0, 0.0)] * 9) and not _packs(nodes, [(3.0, 0.0)] * 10)
    assert not _packs([{"CPU": 4.0, "GPU": 1.0}, {"CPU": 4.0}], [(1.0, 1.0), (1.0, 1.0)])  # one GPU in all


def test_env_workers_need_a_multi_turn_run_and_lazy_pulls_need_async():
    with pytest.raises(ConfigError, match="ray.env_workers needs a multi-turn run"):
        load_config(runtime="ray", **{"ray.env_workers": 1})
    with pytest.raises(ConfigError, match="ray.weight_sync=lazy needs mode: async"):
        load_config(runtime="ray", **{"ray.weight_sync": "lazy"})
    with pytest.raises(ConfigError, match="needs ray.weight_transport=object_store and ray.weight_delta unset"):
        load_config(runtime="ray", mode="async", **{"ray.weight_sync": "lazy", "ray.weight_delta": True})
    with pytest.raises(ConfigError, match="ray.weight_sync=lazy loads under running requests"):
        load_config(runtime="ray", mode="async", **{"ray.weight_sync": "lazy", "rollout.inflight_weight_update": "abort"})
    with pytest.raises(ConfigError, match="ray.reward_workers scores reward.functions"):
        load_config(runtime="ray", **{"ray.reward_workers": 1, "env.name": "guess_number", "data.train": "env"})


def test_a_local_instance_starts_beside_a_dead_clusters_record(tmp_path):
    """ray.init() without an address joins the cluster Ray last recorded on this machine
    (/tmp/ray/ray_current_cluster) and waits forever where it has died; an unset ray.address
    starts a local instance instead."""
    import subprocess
    import sys

    record = Path("/tmp/ray/ray_current_cluster")
    saved = record.read_text() if record.exists() else None
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text("192.0.2.1:6379")  # nothing answers there
    script = ("from types import SimpleNamespace\nimport ray\nfrom rollover.runtime import start_ray\n"
              "started = start_ray(SimpleNamespace(ray=SimpleNamespace(address=None, num_cpus=1, dashboard=False)))\n"
              "print(started, ray.cluster_resources().get('CPU'))\nray.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    finally:
        if saved is None:
            record.unlink(missing_ok=True)
        else:
            record.write_text(saved)
    assert out.stdout.split() == ["True", "1.0"], out.stderr[-2000:]


def test_prompts_with_images_on_a_ray_worker_train_as_in_the_driver(tmp_path):
    """A vision-language model's rollout worker gets each request's images (also when a request
    moves): a run ends with the weights of the same run whose engine is in the driver."""
    from test_vision_language import _cfg

    from rollover.testing import save_tiny_vl_model

    model_dir = save_tiny_vl_model(tmp_path / "llava", seed=3)
    (tmp_path / "rw.py").write_text("def varied(completion, answer, **_):\n    return float(len(completion) % 3)\n")
    over = {"reward.functions": [f"{tmp_path / 'rw.py'}:varied"], "eval.every": 0, "train.lr": 1e-2}
    train_sync(_cfg(tmp_path / "local", model_dir, **over))
    train_sync(_cfg(tmp_path / "ray", model_dir, runtime="ray", **over, **{"ray.rollout_workers": 1}))
    a, b = final_weights(tmp_path / "local" / "run", 2), final_weights(tmp_path / "ray" / "run", 2)
    start = load_file(str(model_dir / "model.safetensors"))
    assert max(float((a[k] - start[k]).abs().max()) for k in a) > 1e-3  # it trained
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
