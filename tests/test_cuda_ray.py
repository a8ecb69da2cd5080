"""The Ray runtime on one GPU: a rollout worker actor and the trainer share the device, a
fraction of it each (`ray.gpus_per_worker`, `ray.gpus_for_trainer`). Skipped without a GPU or
without Ray (CI has neither GPU). `ROLLOVER_TEST_DEVICE=cpu` runs the same tests on a CPU with CPU
workers (no GPU shares), to try them before a GPU is lent (benchmarks/gpu/ray.sh)."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before this process (and Ray's workers) use cuBLAS
DEVICE = os.environ.get("ROLLOVER_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
pytestmark = [pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU"), pytest.mark.ray]
ray = pytest.importorskip("ray")

from safetensors.torch import load_file  # noqa: E402

from rollover.config import load_config  # noqa: E402
from rollover.loops.async_ import train_async  # noqa: E402
from rollover.loops.build import build_run  # noqa: E402
from rollover.loops.sync import train_sync  # noqa: E402
from rollover.testing import save_tiny_model  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_gpu_ray():
    ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama", seed=3))


def cfg_for(model_dir, run_dir, **over):
    base = {
        "device": DEVICE, "model": model_dir, "run_dir": str(run_dir), "steps": 3, "seed": 7,
        "data.train": "gen:arithmetic?n=120", "data.eval_size": 4, "data.max_prompt_tokens": 64,
        "rollout.prompts_per_step": 3, "rollout.samples_per_prompt": 3, "rollout.max_new_tokens": 12,
        "rollout.max_rows": 8, "reward.functions": [{"fn": "format", "kwargs": {"pattern": "[0-4]"}}],
        # a GPU's same bits need deterministic kernels; a CPU try-out, the same thread counts as test_ray's
        "train.lr": 1e-3, "train.deterministic": DEVICE == "cuda", "eval.every": 0, "eval.at_start": False,
        "checkpoint.every": 3, "logging.progress": False, "logging.tensorboard": False,
    }
    base.update(over)
    return load_config(**base)


def gpus(share: float) -> float:
    return share if DEVICE == "cuda" else 0.0  # a CPU try-out: CPU workers


def on_ray(**over):
    return {"runtime": "ray", "ray.rollout_workers": 1, "ray.gpus_per_worker": gpus(0.5), "ray.cpus_per_worker": 1,
            **over}


def final_weights(run_dir):
    return load_file(str(run_dir / "checkpoints" / "step_000003" / "model" / "model.safetensors"))


def train_rows(run_dir):
    return [r for r in map(json.loads, open(run_dir / "metrics.jsonl")) if r["kind"] == "train"]


@pytest.mark.parametrize("trainer", ["driver", "actor"])
def test_a_worker_sharing_the_gpu_with_the_trainer_trains_the_local_runs_weights(model_dir, tmp_path, trainer):
    """Half the GPU for the worker's engine, the trainer beside it (in the driver, or an actor
    holding the other half): the run ends with the weights of the same run on the local runtime,
    bit for bit (deterministic kernels), and every step's update reached the worker."""
    train_sync(cfg_for(model_dir, tmp_path / "local"))
    extra = {"ray.trainer": "actor", "ray.gpus_for_trainer": gpus(0.5),
             "ray.cpus_for_trainer": 1 if DEVICE == "cuda" else 0} if trainer == "actor" else {}
    run = build_run(cfg_for(model_dir, tmp_path / "ray", **on_ray(**extra)))
    assert run.engine.worker_device == DEVICE
    train_sync(run.cfg, run=run)
    a, b = final_weights(tmp_path / "local"), final_weights(tmp_path / "ray")
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ
    start = load_file(os.path.join(model_dir, "model.safetensors"))
    assert max(float((a[k] - start[k]).abs().max()) for k in start) > 1e-4  # the weights compared moved
    rows = train_rows(tmp_path / "ray")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["weights/bytes_per_worker"] > 0 and r["timing_s/weight_sync"] > 0 for r in rows)


def test_async_on_a_shared_gpu_keeps_the_staleness_bound(model_dir, tmp_path):
    """Two workers of a quarter GPU each generate while the trainer in the driver trains on the
    same GPU: every step trains within η = 1, every token included."""
    cfg = cfg_for(model_dir, tmp_path, mode="async", steps=4, **on_ray(**{
        "ray.rollout_workers": 2, "ray.gpus_per_worker": gpus(0.25), "async.max_staleness": 1, "train.deterministic": False}))
    train_async(cfg)
    rows = train_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert any(r["actor/grad_norm"] > 0 for r in rows)
    assert all(r["staleness/max"] <= 1 and r["staleness/token_lag_max"] <= 1 for r in rows)
    assert torch.isfinite(torch.tensor([[r["actor/grad_norm"], r["actor/pg_loss"]] for r in rows])).all()
