"""The CUDA paths: TorchEngine (eager and CUDA graphs, fp32 and bf16), the trainer, a training
run, and exact resume with deterministic kernels. Skipped where torch sees no GPU (CI); the
rest of the suite checks CPU fp32 numerics and stays on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before this process first uses cuBLAS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from rollover.engine.torch_engine import TorchEngine  # noqa: E402
from rollover.testing import save_tiny_model, tiny_model  # noqa: E402
from rollover.types import Request, SamplingParams  # noqa: E402


def hf_logprobs(model, prompt_ids, response_ids):
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    lp = torch.log_softmax(logits, -1)[len(prompt_ids) - 1 : -1]
    return lp.gather(1, torch.tensor(response_ids)[:, None]).squeeze(1)


def requests(n: int, new_tokens: int, temperature: float = 1.0, tag: str = "r"):
    """Prompts of different lengths and budgets, so the batch shrinks and the attended length
    crosses graph buckets (64, 128) while it runs."""
    return [Request(id=f"{tag}{i}", prompt_ids=list(range(5, 5 + 3 + 7 * i)),
                    sampling=SamplingParams(temperature=temperature, max_new_tokens=new_tokens - 9 * i, seed=i,
                                            ignore_eos=True))
            for i in range(n)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fp32_engine_on_cuda_matches_the_hf_forward(arch):
    model = tiny_model(arch, seed=2)
    with TorchEngine(model, device="cuda", dtype=torch.float32, max_rows=8, max_len=192, eos_token_ids=[]) as eng:
        outs = eng.generate(requests(6, 90))
        assert eng.core.runner._graphs, "no decode step ran through a CUDA graph"
    for out in outs:
        ref = hf_logprobs(model, out.prompt_ids, out.response_ids)
        assert torch.allclose(torch.tensor(out.logprobs, dtype=torch.float64), ref, atol=2e-4), (arch, out.id)


def test_cuda_graphs_give_the_eager_tokens():
    model = tiny_model("llama", seed=4)
    outs = {}
    for graphs in (True, False):
        with TorchEngine(model, device="cuda", dtype=torch.float32, max_rows=8, max_len=192, eos_token_ids=[],
                         cuda_graphs=graphs) as eng:
            outs[graphs] = eng.generate(requests(7, 100, temperature=0.0) + requests(1, 60, tag="s"))
            assert bool(eng.core.runner._graphs) == graphs
    for a, b in zip(outs[True], outs[False]):
        assert a.response_ids == b.response_ids, a.id
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_stop_strings_through_cuda_graphs_cut_each_row_where_the_eager_engine_does():
    """rollout.stop under CUDA graphs: rows leave the graphed batch at the token that completes a
    string, each where its greedy text first holds one; the rows beside them go on as without."""
    from dataclasses import replace

    from rollover.engine.stop import StopStrings
    from rollover.testing import char_tokenizer

    tok = char_tokenizer()
    text = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    model = tiny_model("llama", seed=4)
    with TorchEngine(model, device="cuda", dtype=torch.float32, max_rows=8, max_len=192, eos_token_ids=[],
                     stop_strings=StopStrings(text)) as eng:
        full = eng.generate(requests(6, 100, temperature=0.0))
        stops = {c.id: text(c.response_ids[20:22]) for c in full[::2]}  # every other row gets a string
        cut = eng.generate([replace(r, sampling=replace(r.sampling, stop=(stops[r.id],))) if r.id in stops else r
                            for r in requests(6, 100, temperature=0.0)])
        assert eng.core.runner._graphs, "no decode step ran through a CUDA graph"
    for a, b in zip(full, cut):
        if a.id in stops:
            end = next(i for i in range(len(a.response_ids)) if stops[a.id] in text(a.response_ids[: i + 1]))
            assert b.finish == "stop" and b.response_ids == a.response_ids[: end + 1], a.id
        else:
            assert b.response_ids == a.response_ids, a.id


def test_compiled_decode_through_graphs_gives_the_eager_tokens():
    """compile_decode with CUDA graphs: each bucket's graph records the compiled step; greedy
    tokens equal the eager step's, logprobs to float rounding, and the graphs are the ones used."""
    from torch._dynamo.utils import counters

    model = tiny_model("llama", seed=4)
    outs = {}
    for compiled in (True, False):
        frames = counters["frames"]["ok"]
        with TorchEngine(model, device="cuda", dtype=torch.float32, max_rows=8, max_len=192, eos_token_ids=[],
                         cuda_graphs=compiled, compile_decode=compiled) as eng:
            outs[compiled] = eng.generate(requests(7, 100, temperature=0.0) + requests(1, 60, tag="s"))
            runner = eng.core.runner
            assert bool(runner._graphs) == compiled and (runner.compiled is not None) == compiled
            if compiled:
                assert runner.cuda_graphs  # no capture failed (which would have turned them off)
                assert counters["frames"]["ok"] > frames  # dynamo compiled the step: it did not fall back to eager
                assert min(b for b, _ in runner._graphs) == 2  # a batch of one rides in the two-row graph
    for a, b in zip(outs[True], outs[False]):
        assert a.response_ids == b.response_ids, a.id
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_triton_attention_through_graphs_gives_the_torch_attentions_tokens():
    """attention='triton' on CUDA with graphs (one graph per row bucket: the kernel reads each
    row's length from the device): in fp32 the torch attention's greedy tokens and logprobs; the
    kernel within rounding of float64 attention over each row's own keys in bf16 and fp32, head
    dims 64 and 128."""
    import math

    from rollover.engine.triton_attention import decode_attention

    model = tiny_model("llama", seed=4)
    outs = {}
    for attention in ("triton", "torch"):
        with TorchEngine(model, device="cuda", dtype=torch.float32, max_rows=8, max_len=192, eos_token_ids=[],
                         attention=attention) as eng:
            outs[attention] = eng.generate(requests(7, 100, temperature=0.0) + requests(1, 60, tag="s"))
            runner = eng.core.runner
            assert runner.cuda_graphs and runner.attention.impl == attention
            if attention == "triton":
                assert {lk for _, lk in runner._graphs} == {192}  # every length in one graph per bucket
    for a, b in zip(outs["triton"], outs["torch"]):
        assert a.response_ids == b.response_ids, a.id
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    torch.manual_seed(0)
    for dtype, D, tol in ((torch.bfloat16, 64, 3e-2), (torch.float32, 128, 1e-5), (torch.bfloat16, 128, 3e-2)):
        kc, vc = (torch.randn(6, 3, 300, D, device="cuda", dtype=dtype) for _ in range(2))
        q = torch.randn(5, 9, D, device="cuda", dtype=dtype)
        pos = torch.tensor([0, 5, 63, 64, 250], device="cuda")
        got = decode_attention(q, kc, vc, pos).double().cpu()
        want = torch.empty(5, 9, D, dtype=torch.float64)
        for b in range(5):
            for h in range(9):
                k, v = (c[b, h // 3, : int(pos[b]) + 1].double().cpu() for c in (kc, vc))
                want[b, h] = torch.softmax(k @ q[b, h].double().cpu() / math.sqrt(D), 0) @ v
        assert float((got - want.reshape(5, -1)).abs().max()) < tol, (dtype, D)


def test_admission_beside_graphed_decode_gives_the_eager_tokens():
    """More requests than rows: finished rows are refilled while the others decode, so steps
    admit beside a graphed decode (`separate_admission`); the tokens equal the eager engine's and
    the logprobs the HF forward's."""
    model = tiny_model("llama", seed=5)
    outs = {}
    for graphs in (True, False):
        with TorchEngine(model, device="cuda", dtype=torch.float32, max_rows=4, max_len=192, eos_token_ids=[],
                         cuda_graphs=graphs) as eng:
            assert eng.core.runner.separate_admission == graphs
            outs[graphs] = eng.generate(requests(11, 100, temperature=0.0))
    for a, b in zip(outs[True], outs[False]):
        assert a.response_ids == b.response_ids, a.id
        ref = hf_logprobs(model, a.prompt_ids, a.response_ids)
        assert torch.allclose(torch.tensor(a.logprobs, dtype=torch.float64), ref, atol=2e-4), a.id


def test_seeded_sampling_gives_the_same_tokens_with_graphs_and_eagerly():
    """The graphed step's inputs and the sampler's uniforms reach the device without waiting for
    it (rollover.engine.transfer); seeded sampling at temperature 1 gives the eager engine's tokens."""
    model = tiny_model("llama", seed=6)
    outs = {}
    for graphs in (True, False):
        with TorchEngine(model, device="cuda", dtype=torch.float32, max_rows=4, max_len=192, eos_token_ids=[],
                         cuda_graphs=graphs) as eng:
            outs[graphs] = eng.generate(requests(9, 90, temperature=1.0))
    for a, b in zip(outs[True], outs[False]):
        assert a.response_ids == b.response_ids, a.id
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_copies_without_a_wait_keep_the_stream_order():
    """Values copied to the device behind queued work, and read back in one wait, are the ones
    written, step after step (the caching host allocator keeps each page-locked buffer until its
    copy has run)."""
    from rollover.engine.transfer import to_device, to_host

    dev = torch.device("cuda")
    x = torch.randn(2048, 2048, device=dev)
    for i in range(30):
        y = x @ x  # keeps the stream busy while the next copy is queued
        t = to_device(list(range(i, i + 500)), torch.long, dev)
        got, col = to_host(t * 2, y[:2, 0])
        assert got == [2 * v for v in range(i, i + 500)]
        assert col == pytest.approx((x[:2] @ x[:, 0]).tolist(), rel=1e-3, abs=1e-2)


def test_weight_updates_reach_the_captured_graphs():
    model, other = tiny_model("llama", seed=1), tiny_model("llama", seed=9)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    with TorchEngine(model, device="cuda", dtype=torch.float32, max_rows=4, max_len=96, eos_token_ids=[]) as eng:
        eng.generate([Request(id="warm", prompt_ids=[5, 6, 7], sampling=greedy)])  # captures the buckets
        eng.update_weights(list(other.state_dict().items()), version=1)
        (out,) = eng.generate([Request(id="after", prompt_ids=[5, 6, 7], sampling=greedy)])
    ref = hf_logprobs(other, out.prompt_ids, out.response_ids)
    assert torch.allclose(torch.tensor(out.logprobs, dtype=torch.float64), ref, atol=2e-4)


def test_bf16_engine_tracks_the_fp32_model():
    model = tiny_model("llama", seed=2)
    with TorchEngine(model, device="cuda", dtype=torch.bfloat16, max_rows=8, max_len=192, eos_token_ids=[]) as eng:
        outs = eng.generate(requests(6, 90))
    gaps = torch.cat([(torch.tensor(o.logprobs, dtype=torch.float64) - hf_logprobs(model, o.prompt_ids, o.response_ids)).abs()
                      for o in outs])
    assert gaps.mean() < 0.05 and gaps.max() < 0.5, (gaps.mean(), gaps.max())


@pytest.mark.parametrize("loss", ["sampled", "jsd"])
def test_a_distillation_step_on_cuda_is_the_cpus(tmp_path, loss):
    """On-policy distillation's step on the GPU (float32): the teacher's metric, the loss and the
    gradient norm are the CPU's; a bfloat16 teacher gives them to its precision."""
    from rollover.train.trainer import Trainer
    from test_distill import batch_of, cfg_of

    teacher = str(save_tiny_model(tmp_path / "teacher", "llama", seed=11, hidden_size=48))
    key = "distill/reverse_kl" if loss == "sampled" else "distill/divergence"
    got = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "float32"), ("cuda", "bfloat16")):
        cfg = cfg_of(device=device, **{"distill.teacher": teacher, "distill.loss": loss, "distill.dtype": dtype})
        trainer = Trainer(tiny_model("llama", seed=3), cfg, device=torch.device(device))
        got[device, dtype] = trainer.train_step(batch_of(4))
    cpu, gpu, half = got["cpu", "float32"], got["cuda", "float32"], got["cuda", "bfloat16"]
    for k in (key, "actor/pg_loss", "actor/grad_norm"):
        assert gpu[k] == pytest.approx(cpu[k], rel=1e-3, abs=1e-5), k
    assert half[key] == pytest.approx(cpu[key], rel=0.05, abs=1e-3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama", seed=3))


BF16 = {"rollout.dtype": "bfloat16", "train.dtype": "autocast_bf16"}  # the opt-in; the defaults are float32


def cuda_cfg(model_dir, run_dir, **over):
    from rollover.config import load_config

    base = {
        "device": "cuda", "model": model_dir, "run_dir": str(run_dir), "steps": 4, "seed": 7, "resume": "auto",
        "data.train": "gen:arithmetic?n=120", "data.eval_size": 4, "data.max_prompt_tokens": 64,
        "rollout.prompts_per_step": 3, "rollout.samples_per_prompt": 3, "rollout.max_new_tokens": 12,
        # a tiny random model never answers right: a reward it earns about half the time (a digit 0-4
        # in its reply), so advantages are not all zero and the runs below really train
        "rollout.max_rows": 8, "reward.functions": [{"fn": "format", "kwargs": {"pattern": "[0-4]"}}],
        "train.lr": 1e-3, "eval.every": 0,
        "eval.at_start": False, "checkpoint.every": 2, "logging.progress": False, "logging.tensorboard": False,
    }
    base.update(over)
    return load_config(**base)


def test_a_training_run_on_cuda(model_dir, tmp_path):
    """bf16 engine, bf16-autocast trainer (the opt-in for large models): the run trains, and the
    engine's logprobs stay close to the trainer's."""
    import json

    from rollover.loops.sync import train_sync

    train_sync(cuda_cfg(model_dir, tmp_path / "run", steps=3, **BF16))
    rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert any(r["actor/grad_norm"] > 0 for r in train)  # it trained: the later steps sample from new weights
    assert all(0 < r["perf/peak_device_gb"] < 80 for r in train)  # the step's GPU high-water mark
    for r in train:
        assert torch.isfinite(torch.tensor([r["actor/grad_norm"], r["actor/pg_loss"], r["actor/entropy"]])).all()
        assert 0 <= r["actor/rollout_kl"] < 0.05, r["actor/rollout_kl"]


@pytest.fixture()
def deterministic():
    yield
    torch.use_deterministic_algorithms(False)
    torch.backends.cuda.enable_flash_sdp(True)
    torch.backends.cuda.enable_mem_efficient_sdp(True)


@pytest.mark.parametrize("dtypes", [BF16, {}])
def test_resume_is_exact_on_cuda_with_deterministic_kernels(model_dir, tmp_path, deterministic, dtypes):
    from safetensors.torch import load_file

    from rollover.loops.sync import train_sync

    def weights(run_dir):
        return load_file(str(run_dir / "checkpoints" / "step_000004" / "model" / "model.safetensors"))

    over = {"train.deterministic": True, **dtypes}
    train_sync(cuda_cfg(model_dir, tmp_path / "straight", **over))
    train_sync(cuda_cfg(model_dir, tmp_path / "split", steps=2, **over))  # "killed" after its step-2 checkpoint
    train_sync(cuda_cfg(model_dir, tmp_path / "split", **over))
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "split")
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ
    start = load_file(os.path.join(model_dir, "model.safetensors"))
    assert max(float((a[k] - start[k]).abs().max()) for k in start) > 1e-3  # the weights compared moved


@pytest.mark.parametrize("over", [
    {"partial_rollout.enabled": True, "partial_rollout.carry": "keep_kv", "algorithm.loss": "decoupled_ppo"},
    {"partial_rollout.enabled": True, "partial_rollout.carry": "resubmit"},
    {"mode": "async", "async.max_staleness": 1},
], ids=["april_keep_kv", "april_resubmit", "async"])
def test_april_and_async_runs_on_cuda(model_dir, tmp_path, over):
    """APRIL (both carry modes) and the async loop on CUDA with graphs: every step trains, with
    finite statistics and engine logprobs close to the trainer's."""
    import json

    from rollover.loops.async_ import train_async
    from rollover.loops.sync import train_sync

    cfg = cuda_cfg(model_dir, tmp_path / "run", steps=3, **{"rollout.max_new_tokens": 24}, **over)
    (train_async if cfg.mode == "async" else train_sync)(cfg)
    rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert any(r["actor/grad_norm"] > 0 for r in train)
    for r in train:
        assert torch.isfinite(torch.tensor([r["actor/grad_norm"], r["actor/pg_loss"]])).all()
        assert 0 <= r["actor/rollout_kl"] < 0.05, r["actor/rollout_kl"]


@pytest.mark.vllm
def test_vllm_in_a_rank_sleeps_while_the_rank_trains(tmp_path_factory, tmp_path):
    """rollout.engine=vllm with train.colocate on the GPU: vLLM runs on the rank's device, sleeps
    (level 2) while the rank trains, wakes for each step's weights, and the run trains with the
    engine's logprobs close to the trainer's."""
    import json

    pytest.importorskip("vllm")
    from rollover.loops.build import build_run
    from rollover.loops.sync import train_sync

    model_dir = str(save_tiny_model(tmp_path_factory.mktemp("m") / "vllm", "llama", seed=3, num_attention_heads=2,
                                    num_key_value_heads=1))
    cfg = cuda_cfg(model_dir, tmp_path / "run", steps=3, **{
        "train.parallel": "fsdp", "train.ranks": 1, "train.colocate": True, "rollout.engine": "vllm",
        "rollout.engine_options": {"enforce_eager": True}})
    run = build_run(cfg)
    held, push = [], run.weights.push

    def after_training(*a, **k):  # the engine's weight bytes while the rank trained, before the push
        held.append([st["engine_weight_bytes_in_step"] for st in run.trainer.stats()])
        return push(*a, **k)

    run.weights.push = after_training
    train_sync(cfg, run=run)
    assert held == [[0]] * 3
    train = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert any(r["actor/grad_norm"] > 0 for r in train)
    assert all(0 <= r["actor/rollout_kl"] < 0.05 for r in train), [r["actor/rollout_kl"] for r in train]


def test_a_real_out_of_memory_halves_the_micro_batch(model_dir, tmp_path):
    """The device itself runs out of memory (a per-process cap between the peak of the whole
    update in one micro-batch and that of a quarter of it): the update is redone at smaller
    micro-batches and goes through, with the gradient of a trainer set to the size it ended at."""
    import gc

    from rollover.train.batch import TrainBatch
    from rollover.train.trainer import Trainer
    from rollover.types import Rollout

    n, resp = 128, 250
    rolls = [Rollout(group_id=f"g{i % 16}", prompt_ids=[5 + i % 7, 6, 7], response_ids=[8 + i % 9] * resp,
                     logprobs=[-1.0] * resp, versions=[0] * resp, loss_mask=[1] * resp, finish="length", reward=0.0)
             for i in range(n)]
    batch = TrainBatch.from_rollouts(rolls, [float(i % 3) - 1.0 for i in range(n)])
    whole = n * 256

    def run(mbt):
        """(trainer, the gradient its optimizer saw, peak reserved bytes) after one update"""
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        cfg = cuda_cfg(model_dir, tmp_path / f"r{mbt}", **{"train.micro_batch_tokens": mbt, "train.pack_length": 256,
                                                            "train.shared_prefix": False})
        model = tiny_model("llama", seed=5, hidden_size=256, intermediate_size=512)
        tr = Trainer(model, cfg, device=torch.device("cuda"))
        seen, real_step = {}, tr.optimizer.step

        def step(*a, **kw):
            seen.update({k: p.grad.detach().float().cpu() for k, p in tr.model.named_parameters() if p.grad is not None})
            return real_step(*a, **kw)

        tr.optimizer.step = step
        m = tr.train_step(batch)
        assert m["skipped_step"] == 0
        return tr, seen, torch.cuda.max_memory_reserved()

    _, _, peak_whole = run(whole)
    _, _, peak_quarter = run(whole // 4)
    assert peak_whole > 1.5 * peak_quarter, (peak_whole, peak_quarter)  # the micro-batch is what fills memory
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        torch.cuda.set_per_process_memory_fraction((peak_whole + peak_quarter) / 2 / total)
        capped, seen, _ = run(whole)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert capped.micro_batch_tokens in (whole // 2, whole // 4), capped.micro_batch_tokens
    _, ref, _ = run(capped.micro_batch_tokens)
    assert seen.keys() == ref.keys() and seen
    for k in seen:
        assert torch.allclose(seen[k], ref[k], rtol=2e-2, atol=1e-5), k


def test_m2po_cuts_the_same_mask_on_cuda():
    """M2PO's exact cut with the values on the GPU (bins built there, sums on the CPU)."""
    from rollover.algos import m2po_update_mask

    g = torch.Generator().manual_seed(3)
    old = torch.randint(0, 6, (9, 5), generator=g).double() / 10  # ties at the cut
    given = torch.rand(9, 5, generator=g) < 0.9
    group = torch.tensor([4, 1, 3, 0, 2, 4, 1, 3, 0])
    cpu, cpu_m = m2po_update_mask(old, torch.zeros_like(old), given, group, tau=0.03)
    gpu, gpu_m = m2po_update_mask(old.cuda(), torch.zeros_like(old).cuda(), given.cuda(), group.cuda(), tau=0.03)
    assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu) and 0 < float(cpu_m["m2po_masked_frac"]) < 1
    assert all(torch.equal(gpu_m[k].cpu(), v) for k, v in cpu_m.items())


def test_a_reward_model_scores_on_cuda_as_on_the_cpu(tmp_path):
    from rollover.rewards import RewardRunner, build_rewards
    from rollover.types import Prompt
    from test_reward_model import save_reward_model

    path = save_reward_model(tmp_path / "rm")
    prompts = [Prompt(id=str(i), text=f"{i}+{i}=") for i in range(5)]
    completions = [str(2 * i) * (i + 1) for i in range(5)]
    scores = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "float32"), ("auto", "auto")):
        spec = {"fn": "reward_model", "name": "rm", "kwargs": {"path": path, "device": device, "dtype": dtype,
                                                                "batch_size": 2}}
        with RewardRunner(build_rewards([spec]), timeout_s=60) as runner:
            scores[device] = [s.scores["rm"] for s in runner.score(prompts, completions).samples]
    assert scores["cuda"] == pytest.approx(scores["cpu"], abs=1e-4)
    assert scores["auto"] == pytest.approx(scores["cpu"], abs=5e-2)  # bf16 on the GPU


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt2"])
def test_transformers_forward_on_cuda_matches_the_models_forward(arch):
    """Architectures outside rollover's own forward run on the GPU through transformers' forward
    over the engine's cache (`rollover.engine.hf_runner`): fp32 logprobs equal the model's."""
    model = tiny_model(arch, seed=2)
    with TorchEngine(model, device="cuda", max_rows=4, max_len=160, eos_token_ids=[]) as eng:
        assert eng.core.runner.arch == "generic"
        outs = eng.generate(requests(6, 40))
    for out in outs:
        ref = hf_logprobs(model, out.prompt_ids, out.response_ids)
        assert torch.allclose(torch.tensor(out.logprobs, dtype=torch.float64), ref, atol=2e-4), (arch, out.id)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "llava"])
def test_prompts_with_images_on_cuda_match_the_models_forward_and_the_trainer(arch):
    """A vision-language model on the GPU: the engine's fp32 logprobs given the images are the
    model's own forward's (Qwen's 3-D positions included) and the trainer's."""
    import copy

    from rollover.config import load_config
    from rollover.data.media import MediaRenderer, placeholder_ids
    from rollover.testing import tiny_vl_model, vl_processor
    from rollover.train.batch import TrainBatch
    from rollover.train.trainer import Trainer
    from rollover.types import Rollout
    from PIL import Image

    model = tiny_vl_model(arch, seed=1)
    renderer = MediaRenderer(vl_processor(arch))
    g = torch.Generator().manual_seed(0)
    prompts = [renderer.render([{"role": "user", "content": "Which color?"}],
                               [Image.fromarray((torch.rand(56, 56, 3, generator=g) * 255).to(torch.uint8).numpy())],
                               where=str(i)) for i in range(3)]
    reqs = [Request(id=f"g{i}/{j}", prompt_ids=ids, media=m,
                    sampling=SamplingParams(temperature=1.0, max_new_tokens=16, seed=3 * i + j, ignore_eos=True))
            for i, (ids, m) in enumerate(prompts) for j in range(2)]
    with TorchEngine(model, device="cuda", max_rows=8, max_len=128) as eng:
        outs = eng.generate(reqs)
    for r, c in zip(reqs, outs):
        full = torch.tensor([r.prompt_ids + c.response_ids])
        kw = dict(r.media.inputs)
        if "image_grid_thw" in kw:
            kw["mm_token_type_ids"] = (full == model.config.image_token_id).int()
        with torch.no_grad():
            logits = model(input_ids=full, **kw).logits[0].float()
        logits[:, placeholder_ids(model.config)] = float("-inf")
        lp = torch.log_softmax(logits, -1)[len(r.prompt_ids) - 1: -1].gather(1, torch.tensor(c.response_ids)[:, None])
        assert torch.allclose(torch.tensor(c.logprobs), lp.squeeze(1), atol=2e-4), (arch, r.id)
    rolls = [Rollout(group_id=r.id.split("/")[0], prompt_ids=r.prompt_ids, response_ids=c.response_ids,
                     logprobs=c.logprobs, versions=c.versions, loss_mask=[1] * len(c.response_ids), finish=c.finish,
                     reward=0.0, media=r.media) for r, c in zip(reqs, outs)]
    batch = TrainBatch.from_rollouts(rolls, [0.0] * len(rolls))
    cfg = load_config(**{"device": "cuda", "model": "unused", "run_dir": "unused", "data.train": "gen:arithmetic?n=10",
                         "rollout.samples_per_prompt": 2, "rollout.max_new_tokens": 16})
    trainer = Trainer(copy.deepcopy(model), cfg, device=torch.device("cuda"))
    m = batch.mask_BT
    assert torch.allclose(trainer.logprobs(batch)[m].cpu(), batch.behav_logp_BT[m], atol=2e-4)
