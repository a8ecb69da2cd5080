"""Memory-saving paths give the plain path's results: chunked logprobs (loss and gradients),
micro-batches sized from a budget, and an engine that frees its packed weights."""

from __future__ import annotations

import pytest
import torch

from rollover.engine.torch_engine import TorchEngine
from rollover.testing import tiny_model
from rollover.train import memory
from rollover.train.trainer import Trainer
from rollover.types import Request, SamplingParams
from test_train import batch_of, rollout, tiny_cfg


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rollover.testing import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama", seed=3))


def step_gradients(model_dir, run_dir, rolls=None, attention="sdpa", model_over=None, **over) -> tuple[dict, dict]:
    """The gradient the optimizer sees in one train step, and the step's metrics."""
    cfg = tiny_cfg(model_dir, run_dir, **{"train.pack_length": 16, "data.max_prompt_tokens": 10,
                                          "algorithm.entropy_coef": 0.01, **over})
    model = tiny_model("llama", seed=5, **(model_over or {}))
    model.config._attn_implementation = attention
    tr = Trainer(model, cfg, device=torch.device("cpu"))
    seen = {}
    real_step = tr.optimizer.step

    def step(*a, **kw):
        seen.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        return real_step(*a, **kw)

    tr.optimizer.step = step
    rolls = rolls or [rollout(f"g{i % 3}", [5 + i, 6, 7], [8 + i] * (2 + i % 4), float(i % 3) - 1.0) for i in range(9)]
    return seen, tr.train_step(batch_of(rolls))


@pytest.mark.parametrize("extra", [{}, {"algorithm.kl_coef": 0.1}], ids=["plain", "kl"])
def test_chunked_logits_give_the_same_loss_and_gradients(model_dir, tmp_path, extra):
    whole, m_whole = step_gradients(model_dir, tmp_path / "a", **{"train.logit_chunk_tokens": 0, **extra})
    chunked, m_chunked = step_gradients(model_dir, tmp_path / "b", **{"train.logit_chunk_tokens": 4, **extra})
    assert whole.keys() == chunked.keys() and whole
    for k in whole:
        torch.testing.assert_close(chunked[k], whole[k], rtol=1e-5, atol=1e-7)
    for k in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert m_chunked[k] == pytest.approx(m_whole[k], rel=1e-5), k
    assert m_whole["actor/entropy"] > 0  # the entropy bonus is in the gradient (entropy_coef 0.01)


@pytest.mark.parametrize("model_over", [{"pad_token_id": 0}, {"tie_word_embeddings": True}],
                         ids=["padding-row", "tied-head"])
def test_embedding_gradient_by_rows_equals_the_dense_one(model_dir, tmp_path, monkeypatch, model_over):
    from rollover.train import forward as trainer_mod

    calls = []
    real_apply = trainer_mod.RowGradEmbedding.apply
    monkeypatch.setattr(trainer_mod.RowGradEmbedding, "apply", lambda *a: calls.append(1) or real_apply(*a))
    over = {"train.micro_batch_tokens": 16}  # several micro-batches add into one .grad
    rows, m_rows = step_gradients(model_dir, tmp_path / "a", model_over=model_over, **over)
    assert len(calls) == m_rows["actor/micro_batches"] > 1
    monkeypatch.setattr(trainer_mod, "row_grad_applies", lambda embedding: False)
    dense, m_dense = step_gradients(model_dir, tmp_path / "b", model_over=model_over, **over)
    assert len(calls) == m_rows["actor/micro_batches"]  # the dense run used torch's own lookup
    assert rows.keys() == dense.keys() and rows
    for k in rows:
        torch.testing.assert_close(rows[k], dense[k], rtol=1e-5, atol=1e-7)
    emb = rows["model.embed_tokens.weight"]
    assert emb.abs().sum() > 0
    if "pad_token_id" in model_over:  # the padding row gets nothing, as in nn.Embedding
        assert emb[0].abs().sum() == 0 and emb[1:].abs().sum() > 0
    else:  # the tied head's gradient and the rows' share one .grad
        assert "lm_head.weight" not in rows
    assert m_rows["actor/grad_norm"] == pytest.approx(m_dense["actor/grad_norm"], rel=1e-5)


@pytest.mark.parametrize("attention,extra", [("sdpa", {}), ("sdpa", {"algorithm.kl_coef": 0.1}),
                                             ("eager", {"train.ppo_epochs": 2})], ids=["sdpa", "sdpa-kl", "eager-2-epochs"])
def test_shared_prefix_packing_gives_the_plain_loss_and_gradients(model_dir, tmp_path, attention, extra):
    # three groups of 4 samples sharing their prompt (group 2's responses need two rows of 24),
    # a masked token (an inserted environment token) and an empty response
    rolls = []
    for g in range(3):
        prompt = [5 + g, 6, 7, 8 + g][: 2 + g]
        for j in range(4):
            resp = [9 + j + g] * (2 + (j + g) % 4 + 4 * (g == 2))
            mask = [1] * len(resp)
            mask[len(resp) // 2] = 0
            rolls.append(rollout(f"g{g}", prompt, resp, float(j) - 1.5, mask=mask))
    rolls.append(rollout("g0", [5, 6], [], 0.0))
    over = {"train.pack_length": 24, "train.micro_batch_tokens": 48, **extra}
    plain, m_plain = step_gradients(model_dir, tmp_path / "a", rolls, attention, **{"train.shared_prefix": False, **over})
    shared, m_shared = step_gradients(model_dir, tmp_path / "b", rolls, attention, **{"train.shared_prefix": True, **over})
    assert plain.keys() == shared.keys() and plain
    for k in plain:
        torch.testing.assert_close(shared[k], plain[k], rtol=1e-4, atol=1e-6)
    for k in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/loss_tokens"):
        assert m_shared[k] == pytest.approx(m_plain[k], rel=1e-5), k
    assert m_shared["actor/micro_batches"] < m_plain["actor/micro_batches"]  # fewer token positions


def test_shared_prefix_rows_default_to_a_whole_group(model_dir, tmp_path):
    from rollover.train.trainer import default_pack_length

    cfg = tiny_cfg(model_dir, tmp_path, **{"data.max_prompt_tokens": 10, "rollout.max_new_tokens": 6,
                                           "rollout.samples_per_prompt": 3})
    assert default_pack_length(cfg, shared_prefix=False) == 16
    assert default_pack_length(cfg, shared_prefix=True) == 10 + 3 * 6
    cfg = tiny_cfg(model_dir, tmp_path, **{"data.max_prompt_tokens": 10, "rollout.max_new_tokens": 6,
                                           "rollout.samples_per_prompt": 16})
    assert default_pack_length(cfg, shared_prefix=True) == 4 * 16  # capped at 4 x the longest sequence
    cfg = tiny_cfg(model_dir, tmp_path, **{"data.max_prompt_tokens": 10, "rollout.max_new_tokens": 6,
                                           "rollout.samples_per_prompt": 16, "train.micro_batch_tokens": 40})
    assert default_pack_length(cfg, shared_prefix=True) == 40  # never above the user's micro-batch
    small = tiny_cfg(model_dir, tmp_path, **{"data.max_prompt_tokens": 10, "rollout.max_new_tokens": 6,
                                             "rollout.samples_per_prompt": 16, "train.activation_memory_gb": 1e-6})
    assert Trainer(tiny_model("llama", seed=5), small, device=torch.device("cpu")).pack_length == 16  # a row fits the budget
    model = tiny_model("llama", seed=5)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.warns(RuntimeWarning, match="does not take an explicit mask"):
        tr = Trainer(model, cfg, device=torch.device("cpu"))
    assert not tr.shared_prefix and tr.pack_length == 16
    model = tiny_model("llama", seed=5)
    model.config.sliding_window = 32  # shorter than a 40-token row: an explicit mask would ignore it
    with pytest.warns(RuntimeWarning, match="a sliding window of 32 < rows of 40"):
        assert not Trainer(model, cfg, device=torch.device("cpu")).shared_prefix
    model.config.sliding_window = 40
    assert Trainer(model, cfg, device=torch.device("cpu")).shared_prefix


def test_a_micro_batch_without_response_tokens_trains(model_dir, tmp_path):
    cfg = tiny_cfg(model_dir, tmp_path, **{"train.pack_length": 16, "train.micro_batch_tokens": 16,
                                           "data.max_prompt_tokens": 10})
    tr = Trainer(tiny_model("llama", seed=5), cfg, device=torch.device("cpu"))
    rolls = [rollout("g", [5] * 8, [9] * 6, 1.0), rollout("g", [5] * 14, [], -1.0)]  # 14 + 14 > 16: two micro-batches
    m = tr.train_step(batch_of(rolls))
    assert m["actor/micro_batches"] == 2 and m["actor/loss_tokens"] == 6 and m["skipped_step"] == 0


def test_chunked_logprobs_without_grad_equal_the_whole(model_dir, tmp_path):
    rolls = [rollout("g", [5, 6, 7], [8, 9, 10, 11, 12], 1.0), rollout("g", [5, 6], [13, 14], -1.0)]
    out = []
    for chunk in (0, 3):
        cfg = tiny_cfg(model_dir, tmp_path / f"c{chunk}", **{"train.logit_chunk_tokens": chunk})
        out.append(Trainer(tiny_model("llama", seed=5), cfg, device=torch.device("cpu")).logprobs(batch_of(rolls)))
    torch.testing.assert_close(out[1], out[0])


def test_micro_batches_are_sized_from_the_activation_budget(model_dir, tmp_path):
    config = tiny_model("llama", seed=5).config
    h, inter, layers, heads = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_attention_heads
    per_token = 4 * layers * (18 * h + 6 * inter + 2 * heads * 16)  # by hand, row length 16
    assert memory.activation_bytes_per_token(config, 16, checkpointing=False) == per_token
    budget_gb = 40 * per_token * 16 / 1e9 + 1e-12  # exactly 40 rows of 16 tokens
    assert memory.micro_batch_tokens_for(config, budget_gb, 16, checkpointing=False) == 40 * 16
    assert memory.micro_batch_tokens_for(config, 1e-9, 16, checkpointing=False) == 16  # never below one row
    cfg = tiny_cfg(model_dir, tmp_path, **{"train.pack_length": 16, "data.max_prompt_tokens": 10,
                                           "train.activation_memory_gb": budget_gb})
    assert Trainer(tiny_model("llama", seed=5), cfg, device=torch.device("cpu")).micro_batch_tokens == 640
    cfg = tiny_cfg(model_dir, tmp_path, **{"train.pack_length": 16, "data.max_prompt_tokens": 10,
                                           "train.micro_batch_tokens": 32})
    assert Trainer(tiny_model("llama", seed=5), cfg, device=torch.device("cpu")).micro_batch_tokens == 32


def test_an_engine_that_released_its_packs_generates_the_same_tokens():
    model = tiny_model("llama", seed=6)
    reqs = lambda: [Request(id=f"r{i}", prompt_ids=[3 + i, 4, 5], sampling=SamplingParams(max_new_tokens=6, temperature=0.0))
                    for i in range(8)]  # noqa: E731
    with TorchEngine(model, device="cpu", max_rows=8, max_len=32) as engine:
        runner = engine.core.runner
        before = engine.generate(reqs())
        assert runner._packs or runner.packing is None  # a full decode batch used the packs (where packed)
        engine.release_memory()
        assert not runner._packs and runner._k is None  # idle: packs and KV cache freed
        after = engine.generate(reqs())
        assert runner._k is not None
    assert [c.response_ids for c in after] == [c.response_ids for c in before]
    for a, b in zip(after, before):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)


def test_resident_memory_is_read_and_its_peak_restarts():
    if memory.rss_gb() is None:
        pytest.skip("no /proc/self/status here")
    block = torch.ones(64 * 2**20 // 4)  # 64 MB, touched
    peak = memory.peak_rss_gb()
    assert peak >= memory.rss_gb() - 1e-3 and peak > 0.064
    del block
    memory.release()
    if memory.reset_peak():
        assert memory.peak_rss_gb() <= peak


def test_the_sync_loop_holds_one_copy_of_the_weights(model_dir, tmp_path):
    from rollover.loops.batch import train_batch_from
    from rollover.loops.build import build_run
    from rollover.loops.sync import make_collector

    run = build_run(tiny_cfg(model_dir, tmp_path / "run", steps=2, **{"eval.every": 0}))
    views = run.engine.core.runner.views
    params = dict(run.trainer.model.named_parameters())
    assert params and all(views[n].data_ptr() == p.data_ptr() for n, p in params.items())
    before = {n: p.detach().clone() for n, p in params.items()}
    collector = make_collector(run)
    groups, _ = collector.collect(0)
    batch, _ = train_batch_from(groups, run.cfg)
    runner = run.engine.core.runner
    assert runner._packs or runner.packing is None  # generation packed the weights
    run.trainer.train_step(batch)
    assert not runner._packs  # the optimizer step made the packs stale: dropped at once
    changed = [n for n, p in params.items() if not torch.equal(p, before[n])]
    assert changed and all(torch.equal(views[n], params[n]) for n in changed)  # the step wrote the engine's weights
    run.weights.push(run.trainer.named_weights(), version=1)
    # what the engine now generates is what an engine given a copy of the trained weights generates
    reqs = lambda: [Request(id=f"r{i}", prompt_ids=[3 + i, 4, 5], sampling=SamplingParams(max_new_tokens=6, temperature=0.0))
                    for i in range(4)]  # noqa: E731
    shared = run.engine.generate(reqs())
    copy = {n: p.detach().clone() for n, p in params.items()}
    with TorchEngine(run.trainer.model, device="cpu", state_dict=copy, max_rows=8, max_len=32,
                     eos_token_ids=run.engine.core.eos_token_ids) as fresh:
        alone = fresh.generate(reqs())
    assert [c.response_ids for c in shared] == [c.response_ids for c in alone]
    assert [lp for c in shared for lp in c.logprobs] == pytest.approx([lp for c in alone for lp in c.logprobs], abs=1e-5)
    assert all(v == 1 for c in shared for v in c.versions)
    run.close()


def test_async_and_lora_runs_keep_their_own_copy(model_dir, tmp_path):
    from rollover.loops.build import build_run

    for over in ({"mode": "async"}, {"train.lora": {"r": 2, "alpha": 4}}):
        run = build_run(tiny_cfg(model_dir, tmp_path / str(len(over)) / next(iter(over)), **{"eval.every": 0, **over}))
        views = run.engine.core.runner.views
        ptrs = {v.data_ptr() for v in views.values()}
        assert not any(p.data_ptr() in ptrs for p in run.trainer.model.parameters()), over
        run.close()


def test_lending_weights_refuses_a_model_that_differs():
    model = tiny_model("llama", seed=6)
    other = tiny_model("llama", seed=7)
    with TorchEngine(model, device="cpu", max_rows=4, max_len=32) as engine:
        with pytest.raises(ValueError, match="holds other values than the engine's weight"):
            engine.lend_weights(other)
        assert all(p.data_ptr() not in {v.data_ptr() for v in engine.core.runner.views.values()}
                   for p in other.parameters())  # nothing was rebound
        assert engine.lend_weights(model) == sum(p.numel() * 4 for p in model.parameters())


def test_released_weights_hold_no_memory_refuse_to_generate_and_come_back_with_every_weight():
    """`release_weights` (colocated engines while their ranks train): the weights' memory goes,
    a request before every weight is back fails naming a missing one (the engine keeps serving),
    and once all are loaded the engine generates what an engine built on those weights does."""
    model, new = tiny_model("llama", seed=6), tiny_model("llama", seed=8)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    ask = Request(id="q", prompt_ids=[5, 6, 7], sampling=greedy)
    with TorchEngine(new, device="cpu", max_rows=4, max_len=32, eos_token_ids=[]) as fresh:
        expected = fresh.generate([ask])[0].response_ids
    with TorchEngine(model, device="cpu", max_rows=4, max_len=32, eos_token_ids=[]) as engine:
        held = engine.weight_bytes()
        assert held == sum(p.numel() * 4 for p in model.parameters())
        engine.generate([ask])  # packs and cache exist
        assert engine.release_weights() == held and engine.weight_bytes() == 0
        named = list(new.named_parameters())
        engine.update_weights(named[:3], version=1, inflight="keep")  # a first bucket only
        missing = len(engine.core.runner.views) - 3
        with pytest.raises(RuntimeError, match=rf"and {missing} are not loaded again yet, e.g. 'lm_head\.weight'"):
            engine.generate([ask])
        engine.update_weights(named[3:], version=1, inflight="continue")
        assert engine.weight_bytes() == held
        assert engine.generate([ask])[0].response_ids == expected


def test_weights_lent_to_a_trainer_are_not_released():
    model = tiny_model("llama", seed=6)
    with TorchEngine(model, device="cpu", max_rows=4, max_len=32) as engine:
        engine.lend_weights(model)
        with pytest.raises(RuntimeError, match="views of these weights"):
            engine.release_weights()


def test_weights_are_not_released_under_running_sequences():
    model = tiny_model("llama", seed=6)
    long = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
    with TorchEngine(model, device="cpu", max_rows=4, max_len=420, eos_token_ids=[]) as engine:
        fut = engine.submit(Request(id="long", prompt_ids=[5, 6], sampling=long))
        while not engine.lengths():
            pass
        with pytest.raises(RuntimeError, match="sequences are decoding; pause the engine first"):
            engine.release_weights()
        engine.pause()
        assert engine.release_weights() > 0  # paused: its K/V stays, the weights go
        named = list(model.named_parameters())
        engine.update_weights(named, version=1, inflight="keep")
        engine.resume()
        assert len(fut.result(timeout=60).response_ids) == 400


def test_the_engine_holds_one_pack_and_replaces_it_only_after_batches_stay_on_another_rung():
    from rollover.engine.model_runner import ModelRunner
    from rollover.engine.cpu.weight_packs import PACK_SWITCH_STEPS

    model = tiny_model("llama", seed=6)
    # MKL's ladder: where the native GEMM does not run (no compiler, no 512-bit vectors, bf16)
    runner = ModelRunner(model.config, model.state_dict(), max_rows=8, max_len=16, native_kernels=False)
    if not runner.pack_sizes:
        pytest.skip("no MKL packed GEMM in this torch build")
    assert runner.pack_sizes == [4, 6, 8]  # 8 x (1, 3/4, 1/2); 3 rows or fewer multiply plainly
    used = []
    real_decode = runner._decode

    def spy(tokens, positions, *a):
        used.append((runner._pack_for, tokens.shape[0]))
        return real_decode(tokens, positions, *a)

    def step(n):
        tokens, positions = torch.arange(3, 3 + n), torch.zeros(n, dtype=torch.long)
        runner._decode = spy
        packed = runner.decode(tokens, positions)
        runner._decode = real_decode
        plain = runner._decode(tokens, positions)  # no pack in flight: the plain GEMM
        torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-5)
        return sorted(runner._packs), used[-1]

    assert step(8) == ([8], (8, 8))
    for _ in range(PACK_SWITCH_STEPS - 1):
        assert step(5) == ([8], (8, 8))  # padded up to the held pack
    assert step(5) == ([6], (6, 6))  # on the 6-row rung for long enough: the snug pack replaced it
    assert step(6) == ([6], (6, 6))
    assert step(4) == ([6], (6, 6))  # another rung again: padded to the held pack, which is kept
    assert step(6) == ([6], (6, 6))  # back on the held rung: the count of steps off it starts again
    for _ in range(PACK_SWITCH_STEPS - 1):
        assert step(7) == ([6], (None, 7))  # a batch the held pack cannot take: plain, the pack kept
    assert step(7) == ([8], (8, 8))  # and replaced once the batch has stayed above it
    assert step(3) == ([8], (None, 3))  # three rows or fewer: plain GEMM, the pack is kept
    runner.drop_packs()
    assert step(5) == ([6], (6, 6))  # nothing held (after a weight update): the snug pack at once


def test_a_batch_is_padded_to_a_pack_only_where_that_beats_the_plain_gemm():
    from rollover.engine.model_runner import ModelRunner
    from rollover.engine.cpu.weight_packs import PACK_SWITCH_STEPS

    model = tiny_model("llama", seed=6)

    def runner_of(rows):
        return ModelRunner(model.config, model.state_dict(), max_rows=rows, max_len=16, native_kernels=False)

    def step(runner, n):
        runner.decode(torch.arange(3, 3 + n), torch.zeros(n, dtype=torch.long))
        return sorted(runner._packs)

    r = runner_of(32)
    if not r.pack_sizes:
        pytest.skip("no MKL packed GEMM in this torch build")
    assert r.pack_sizes == [4, 8, 12, 16, 24, 32]
    assert step(r, 32) == [32]
    seen, real = [], r._decode

    def spy(tokens, positions, *a):  # which pack each step ran on
        seen.append((r._pack_for, tokens.shape[0]))
        return real(tokens, positions, *a)

    r._decode = spy
    for _ in range(PACK_SWITCH_STEPS - 1):
        step(r, 20)
    assert set(seen) == {(None, 20)} and sorted(r._packs) == [32]  # 20 rows padded to 32 would be slower: plain
    step(r, 20)
    assert seen[-1] == (24, 24)  # then the snug pack
    big = runner_of(256)  # its lowest rung is 32 rows
    assert step(big, 20) == [] and step(big, 28) == [32]  # 20 rows would pad by 60%: plain; 28 by 14%: packed


def test_bf16_autocast_training_stays_near_the_fp32_step(model_dir, tmp_path):
    fp32, m32 = step_gradients(model_dir, tmp_path / "a", **{"train.dtype": "float32"})
    bf16, m16 = step_gradients(model_dir, tmp_path / "b", **{"train.dtype": "autocast_bf16"})
    assert fp32.keys() == bf16.keys() and fp32
    assert all(torch.isfinite(g).all() for g in bf16.values())
    num = sum(float((bf16[k] - fp32[k]).norm() ** 2) for k in fp32) ** 0.5
    den = sum(float(fp32[k].norm() ** 2) for k in fp32) ** 0.5
    assert num / den < 0.05  # bf16 rounding (8-bit mantissa), not a different gradient
    assert any(not torch.equal(bf16[k], fp32[k]) for k in fp32)  # and it did run in bf16
    assert m16["actor/pg_loss"] == pytest.approx(m32["actor/pg_loss"], abs=2e-2)


def test_large_blocks_come_back_from_the_heap_without_page_faults(monkeypatch):
    """After `large_blocks_from_the_heap` (the trainer calls it on a CPU), a freed 64 MB block is
    reused as it is: glibc's default maps each one afresh, and the kernel faults in its 16,384
    pages again every time."""
    import resource

    monkeypatch.setenv("ROLLOVER_MALLOC_DEFAULTS", "0")
    assert memory.large_blocks_from_the_heap() is False  # the opt-out leaves the allocator alone
    monkeypatch.delenv("ROLLOVER_MALLOC_DEFAULTS")
    if not memory.large_blocks_from_the_heap():
        pytest.skip("not glibc")
    faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # noqa: E731
    torch.ones(16 * 2**20).sum()  # 64 MB, touched, then freed
    before = faults()
    for _ in range(5):
        torch.ones(16 * 2**20).sum()
    assert faults() - before < 2_000, faults() - before  # fresh mappings: about 5 x 16,384
