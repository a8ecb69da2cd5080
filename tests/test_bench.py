"""The benchmark commands run end to end and write the JSON fields the docs quote (tiny model;
the figures themselves mean nothing here and are not checked)."""

from __future__ import annotations

import json
import tempfile

import pytest

from rollover.cli import main
from rollover.testing import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama", seed=5))


def bench(tmp_path, *argv) -> dict:
    out = tmp_path / "out.json"
    assert main(["bench", *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_bench_engine_fields(model_dir, tmp_path):
    r = bench(tmp_path, "engine", "--model", model_dir, "--prompts", "4", "--new-tokens", "6", "--max-rows", "4",
              "--repeats", "2")
    for k in ("torch_tokens_per_s", "hf_tokens_per_s", "speedup_vs_hf", "flop_limit_tokens_per_s", "fraction_of_limit"):
        assert r[k] > 0, k
    assert r["torch_engine"]["tokens"] == 4 * 6 and len(r["torch_engine"]["runs_tokens_per_s"]) == 2
    assert r["torch_tokens_per_s"] in r["torch_engine"]["runs_tokens_per_s"]
    assert len(r["matmul_flops_each"]) == 3  # the peak before each of the 2 runs and after the last
    assert all(r["matmul_flops"][k] == max(p[k] for p in r["matmul_flops_each"]) for k in r["matmul_flops"])
    assert r["torch_engine"]["prefill_only"]["tokens"] > 0 and r["prefill_fraction_of_peak"] > 0
    assert isinstance(r["limit_suspect"], bool)


def test_bench_april_fields_and_nothing_discarded(model_dir, tmp_path):
    r = bench(tmp_path, "april", "--model", model_dir, "--steps", "2", "--warmup", "1", "--max-new-tokens", "12",
              "--natural-max-new-tokens", "8", "--prompts-per-step", "2", "--samples-per-prompt", "2",
              "--max-rows", "8")
    for w in ("longtail", "natural"):
        res = r[w]
        for k in ("sync_useful_tokens_per_s", "april_useful_tokens_per_s", "speedup", "sync_occupancy",
                  "april_occupancy", "april_keep_kv_useful_tokens_per_s", "speedup_keep_kv"):
            assert res[k] > 0, (w, k)
        assert res["april_discarded_tokens"] == 0 and res["april_keep_kv_discarded_tokens"] == 0
        # enabling APRIL alone on TorchEngine: decoupled PPO, so auto keeps K/V
        assert res["default_carry"] == "keep_kv" and res["speedup_default"] == res["speedup_keep_kv"]
        assert 0 < res["sync_occupancy"] <= 1 and 0 < res["april_occupancy"] <= 1
        assert res["sync"]["samples_per_s"] * res["sync"]["seconds"] == pytest.approx(2 * 2 * 2)  # 2 steps x 2 x 2
        assert res["speedup_default_runs"] == [res["speedup_default"]]  # one repeat


def test_bench_april_repeats_report_the_median_and_every_run(model_dir, tmp_path):
    r = bench(tmp_path, "april", "--model", model_dir, "--steps", "1", "--warmup", "0", "--max-new-tokens", "8",
              "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-rows", "8", "--workload", "longtail",
              "--carry", "keep_kv", "--repeats", "3")
    res = r["longtail"]
    runs = res["speedup_default_runs"]
    assert r["repeats"] == 3 and len(runs) == 3 and len(res["sync_useful_tokens_per_s_runs"]) == 3
    assert res["speedup_default"] == sorted(runs)[1] and res["speedup_default_spread"] == [min(runs), max(runs)]


def test_bench_train_fields(model_dir, tmp_path, monkeypatch):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    r = bench(tmp_path, "train", "--model", model_dir, "--steps", "2", "rollout.max_new_tokens=6")
    assert not list(scratch.glob("rollover-bench-train-*"))  # the run and its final checkpoint are deleted
    assert r["steps_measured"] == 2 and r["seconds_per_step"] > 0
    for phase in ("generate", "reward", "train", "weight_sync"):
        assert r[f"{phase}_s"] >= 0, phase
    assert r["seconds_per_step"] >= r["generate_s"] + r["train_s"]


def test_bench_train_compares_with_the_plain_packing(model_dir, tmp_path):
    r = bench(tmp_path, "train", "--model", model_dir, "--steps", "1", "--compare", "plain", "rollout.max_new_tokens=6")
    assert r["plain"]["overrides"][-1] == "train.shared_prefix=false" and r["plain"]["steps_measured"] == 1
    assert r["speedup_step"] == pytest.approx(r["plain"]["seconds_per_step"] / r["seconds_per_step"])
    assert r["speedup_train"] > 0


def test_bench_async_fields(model_dir, tmp_path):
    r = bench(tmp_path, "async", "--model", model_dir, "--steps", "2", "--warmup", "1", "--max-new-tokens", "6",
              "--etas", "1", "2")
    assert r["sync_samples_per_s"] > 0 and r["april_samples_per_s"] > 0
    assert set(r["async_samples_per_s"]) == {"1", "2"} and all(v > 0 for v in r["async_samples_per_s"].values())
    assert set(r["busy_fraction"]["async_eta1"]) == {"rollout", "data_manager", "trainer"}
    assert all(0 <= v <= 1.0001 for v in r["busy_fraction"]["sync"].values())


@pytest.mark.parametrize("argv,message", [
    (["engine", "--repeats", "0"], "--repeats: must be >= 1, got 0"),
    (["april", "--steps", "x"], "--steps: expected an integer, got 'x'"),
    (["async", "--warmup", "0"], "--warmup: must be >= 1, got 0"),
    (["april", "--samples-per-prompt", "0"], "--samples-per-prompt: must be >= 1, got 0"),
])
def test_bench_rejects_bad_arguments_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_bench_faults_fields_and_clean_resumes(model_dir, tmp_path):
    r = bench(tmp_path, "faults", "--model", model_dir, "--modes", "sync", "async_eta1", "--trials", "1",
              "--kills-per-chain", "1", "--steps", "3", "--hang-s", "120")
    for mode in ("sync", "async_eta1"):
        assert r[mode]["trials"] == 1
        assert r[mode] == {"trials": r[mode]["trials"], "hangs": 0, "lost": 0, "duplicated": 0}
        m = r["modes"][mode]
        assert m["resumed_clean"] == m["trials"] and m["steps_missing"] == m["steps_duplicated"] == 0
    assert r["modes"]["sync"]["weights_equal"] == r["modes"]["sync"]["chains"]


def test_bench_envs_fields_and_complete_episodes(model_dir, tmp_path):
    r = bench(tmp_path, "envs", "--model", model_dir, "--groups", "2", "--samples", "2", "--steps", "2",
              "--max-rows", "4", "--latency-scale", "0.02")
    assert r["speedup"] > 0 and r["env_util_ratio"] > 0 and r["april_speedup"] > 0
    for mode in ("rollout_wise", "batch_sync", "april"):
        m = r[mode]
        assert m["trajectories"] == 2 * 2 * 2 and m["failed_episodes"] == 0, mode  # 2 steps x 2 groups x 2
        assert m["trajectories_per_s"] * m["seconds"] == pytest.approx(8)
        assert 0 < m["env_utilization"] <= 1 and 0 < m["engine_occupancy"] <= 1, mode
        assert m["turns_per_episode"] >= 1 and 0 < m["env_time_share"] < 1, mode
    assert r["identical_trajectories"] == 8  # the core and the naive loop sample the same episodes
    a = r["april"]
    assert a["unused_tokens"] == a["generated_tokens"] - a["used_sampled_tokens"] >= 0
    # alpha = 2: work is left over and kept (groups started or done, or drawn and not yet started: which, the
    # environments' latencies decide)
    assert a["carried_groups"] + a["carried_unstarted_groups"] >= 1 and 0 <= a["resumed_groups"] <= 2


def test_bench_memory_phases(model_dir, tmp_path):
    r = bench(tmp_path, "memory", "--model", model_dir, "--skip-half-b", "--steps", "1",
              "--set", "data.eval_size=2", "eval.samples_per_prompt=1", "rollout.prompts_per_step=2",
              "rollout.max_new_tokens=4")
    m = r["models"]["135m"]
    assert [p["phase"] for p in m["phases"]] == ["build", "generate 1", "train 1", "push 1", "eval"]
    assert r["peak_gb_135m"] == m["peak_gb"] == max(p["peak_gb"] for p in m["phases"]) > 0
    assert all(0 < p["end_gb"] <= m["peak_gb"] + 1e-6 for p in m["phases"])
    assert m["micro_batch_tokens"] >= 1 and m["phases"][2]["micro_batches"] >= 1


@pytest.mark.ray
def test_bench_ray_fields(model_dir, tmp_path):
    """One call for every part (one Ray instance for them all): the local, one-worker, two-worker
    and trainer-actor runs, a killed worker, and each weight-sync transport."""
    ray = pytest.importorskip("ray")
    r = bench(tmp_path, "ray", "--model", model_dir, "--steps", "1", "--updates", "1", "--kill-requests", "8",
              "--trainer-actor")
    assert r["local_samples_per_s"] > 0 and r["ray_samples_per_s"] > 0 and r["ray_two_workers_samples_per_s"] > 0
    assert r["ray_trainer_actor_samples_per_s"] > 0
    assert r["trainer_actor_over_driver"] == r["ray_trainer_actor_samples_per_s"] / r["ray_samples_per_s"]
    assert r["kill"]["complete"] and r["kill"]["restarts"] == int(r["kill"]["killed"])
    assert [(w["transport"], w["dtype"], w["delta"]) for w in r["weight_sync"]] == [
        ("object_store", "float32", True), ("object_store", "float32", False), ("object_store", "bfloat16", True),
        ("object_store", "bfloat16", False), ("gloo", "float32", False), ("gloo", "bfloat16", False)]
    gloo = [w for w in r["weight_sync"] if w["transport"] == "gloo"]
    assert all(w["sent_fraction"] == 1 and w["seconds_per_update"] > 0 for w in gloo)  # whole tensors
    assert all(0 < w["sent_fraction"] <= 1 and w["worker_start_s"] > 0 for w in r["weight_sync"])
    assert not ray.is_initialized()  # the instance the bench started is shut down


def test_bench_engine_nanovllm_workload_and_contention(model_dir, tmp_path):
    from rollover.bench.engine import nanovllm_workload

    prompts, budgets = nanovllm_workload(3)
    assert prompts == nanovllm_workload(3)[0] and all(100 <= len(p) <= 1024 for p in prompts)
    assert all(100 <= b <= 1024 and max(p) <= 10000 for p, b in zip(prompts, budgets))
    r = bench(tmp_path, "engine", "--model", model_dir, "--prompts", "2", "--max-rows", "2", "--repeats", "1",
              "--workload", "nanovllm")
    assert r["workload"] == "nanovllm" and "hf_tokens_per_s" not in r
    assert r["torch_engine"]["tokens"] == sum(nanovllm_workload(2)[1])  # every budget generated, EOS ignored
    r = bench(tmp_path, "engine", "--model", model_dir, "--prompts", "2", "--new-tokens", "4", "--max-rows", "2",
              "--repeats", "1", "--contend")
    assert set(r["tokens_per_s"]) == {"idle", "busy", "busy_niced", "busy_fixed_threads", "busy_niced_fixed_threads"}
    assert all(v > 0 for v in r["tokens_per_s"].values()) and set(r["slowdown"]) == set(r["tokens_per_s"]) - {"idle"}
