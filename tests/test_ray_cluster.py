"""runtime=ray on a two-node cluster simulated on this machine (Ray's own cluster utilities):
workers spread over nodes, `rollover train` joins a running cluster by its address, and a
driver killed mid-run resumes from its checkpoint as the local runtime does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from rollover.config import ConfigError, load_config  # noqa: E402
from rollover.engine.torch_engine import TorchEngine  # noqa: E402
from rollover.runtime.router import RayEngine  # noqa: E402
from rollover.testing import save_tiny_model, tiny_model  # noqa: E402
from rollover.types import Request, SamplingParams  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.mark.parametrize("transport", ["object_store", "gloo"])
def test_workers_spread_over_nodes_and_generate_what_a_local_engine_does(cluster, transport):
    m = tiny_model("llama", seed=3)
    cfg = load_config(runtime="ray", **{"ray.rollout_workers": 2, "rollout.max_rows": 2,
                                        "ray.weight_transport": transport})
    eng = RayEngine(cfg, m, weights=list(m.state_dict().items()), device=torch.device("cpu"), max_len=128,
                    eos_token_ids=(2,))
    local = TorchEngine(m, max_rows=2, max_len=128, eos_token_ids=(2,))
    try:
        assert len({w["node"] for w in eng.workers()}) == 2  # one CPU per node: one worker each
        reqs = lambda: [Request(id=f"r{i}", prompt_ids=[5, 6 + i % 4], sampling=SamplingParams(max_new_tokens=16, seed=i))
                        for i in range(8)]
        a, b = local.generate(reqs()), eng.generate(reqs())
        assert [c.response_ids for c in a] == [c.response_ids for c in b]
        assert [c.versions for c in b] == [[0] * len(c.response_ids) for c in b]
        sd = tiny_model("llama", seed=4).state_dict()  # an update reaches the workers on both nodes
        local.update_weights(sd.items(), version=1)
        eng.update_weights(sd.items(), version=1)
        assert eng.last_sync.workers == 2 and eng.last_sync.fallback_workers == 0
        a, b = local.generate(reqs()), eng.generate(reqs())
        assert [c.response_ids for c in a] == [c.response_ids for c in b]
        assert [c.versions for c in b] == [[1] * len(c.response_ids) for c in b]
    finally:
        eng.shutdown()
        local.shutdown()


def test_workers_that_fit_in_total_but_not_node_by_node_are_refused(cluster):
    m = tiny_model("llama", seed=3)
    cfg = load_config(runtime="ray", **{"ray.rollout_workers": 3, "ray.cpus_per_worker": 0.6})
    with pytest.raises(ConfigError, match=r"rollout workers: 3 asked, each 0.6 CPU and 0 GPU on one node; the nodes "
                                          r"\(1 CPU/0 GPU, 1 CPU/0 GPU\) hold 2"):
        RayEngine(cfg, m, weights=list(m.state_dict().items()), device=torch.device("cpu"), max_len=128,
                  eos_token_ids=(2,))


def _train_cmd(model_dir, run_dir, address, steps, workers=1):
    return [sys.executable, "-m", "rollover.cli", "train",
            f"model={model_dir}", f"run_dir={run_dir}", f"steps={steps}", "seed=4", "resume=auto",
            "data.train=gen:arithmetic?n=100", "data.eval_size=2", "data.max_prompt_tokens=64",
            "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8",
            "rollout.max_rows=4", "eval.every=0", "eval.at_start=false", "eval.samples_per_prompt=1",
            "checkpoint.every=1", "checkpoint.keep=100", "logging.progress=false", "logging.tensorboard=false",
            # a tiny random model never answers right: a reward it earns about half the time (a digit
            # 0-4 in its reply), so the weights move and the resumed run's equal weights mean something
            "reward.functions=[{fn: format, kwargs: {pattern: '[0-4]'}}]",
            "runtime=ray", f"ray.address={address}", f"ray.rollout_workers={workers}"]


def test_a_driver_joins_the_cluster_and_a_killed_driver_resumes_exactly(cluster, tmp_path):
    model_dir = str(save_tiny_model(tmp_path / "m", "llama", seed=8))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    whole = subprocess.run(_train_cmd(model_dir, tmp_path / "whole", cluster.address, 3), env=env,
                           capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "ray: 1 rollout worker(s) on 1 node(s)" in whole.stderr
    # (one worker: the same requests batched the same way, so both runs compute the same floats)
    # the same run, its driver SIGKILLed once step 1's checkpoint is on disk, then started again
    run_dir = tmp_path / "killed"
    p = subprocess.Popen(_train_cmd(model_dir, run_dir, cluster.address, 3), env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not (run_dir / "checkpoints" / "step_000001").exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    again = subprocess.run(_train_cmd(model_dir, run_dir, cluster.address, 3), env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    a = load_file(str(tmp_path / "whole" / "checkpoints" / "step_000003" / "model" / "model.safetensors"))
    b = load_file(str(run_dir / "checkpoints" / "step_000003" / "model" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [r for r in map(json.loads, open(run_dir / "metrics.jsonl")) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert any(r["actor/grad_norm"] > 0 for r in rows)  # it trained (Adam's moments move every later step)
