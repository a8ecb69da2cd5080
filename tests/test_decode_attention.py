"""The native kernels (rollover.engine.cpu.native) against torch's ops: decode attention with its
cache writes and rotary embedding, RMSNorm with the residual add, SiLU-and-multiply, the packed
GEMM; their refusals; and the runner built on them against the HF forward and the torch path."""

from __future__ import annotations

import logging

import pytest
import torch

from rollover.engine import decode_attention as da
from rollover.engine.cpu import native as nk
from rollover.engine.model_runner import ModelRunner
from rollover.testing import tiny_model


def _native_or_skip():
    try:
        return nk.load()
    except RuntimeError as e:  # no C compiler on this machine: the torch path is what runs
        pytest.skip(str(e))


def _case(B, KV, G, D, max_len, positions, seed=0):
    """A cache with random history and one step's q/k/v as views into a fused projection (the
    runner's layout: rows strided, heads adjacent)."""
    g = torch.Generator().manual_seed(seed)
    H = KV * G
    kc, vc = (torch.randn(B + 2, KV, max_len, D, generator=g) for _ in range(2))
    qkv = torch.randn(B, (H + 2 * KV) * D, generator=g)
    q = qkv[:, : H * D].unflatten(-1, (H, D))
    k = qkv[:, H * D : (H + KV) * D].unflatten(-1, (KV, D))
    v = qkv[:, (H + KV) * D :].unflatten(-1, (KV, D))
    return kc, vc, q, k, v, torch.tensor(positions)


@pytest.mark.parametrize("KV,G,D", [(3, 3, 64), (2, 1, 128), (1, 4, 40), (4, 2, 16)])
def test_native_attention_equals_torch_ops_with_its_cache_writes(KV, G, D):
    native = _native_or_skip()
    positions = [0, 7, 30, 12, 31]
    kc, vc, q, k, v, pos = _case(len(positions), KV, G, D, 48, positions)
    plain = da.DecodeAttention(KV * G, KV, D, 48, torch.float32, None)
    fast = da.DecodeAttention(KV * G, KV, D, 48, torch.float32, native)
    kc2, vc2 = kc.clone(), vc.clone()
    ref = plain(kc, vc, q, k, v, plain.setup(pos))
    out = fast(kc2, vc2, q, k, v, fast.setup(pos))
    assert out.shape == ref.shape == (len(positions), KV * G * D)
    assert torch.allclose(out, ref, atol=2e-6, rtol=1e-5), (out - ref).abs().max()
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)  # the new keys and values written, nothing else
    for b, p in enumerate(positions):
        assert torch.equal(kc2[b, :, p], k[b]) and torch.equal(vc2[b, :, p], v[b])


def test_native_attention_rotates_q_and_k_as_the_runner_does():
    """Given the rotary tables, the kernel rotates q and the key it writes: the same as torch's
    rotation (`ModelRunner._rope`) followed by the kernel without them."""
    native = _native_or_skip()
    KV, G, D, max_len = 2, 3, 64, 40
    kc, vc, q, k, v, pos = _case(4, KV, G, D, max_len, [0, 9, 39, 17])
    runner_like = torch.randn(max_len, D), torch.randn(max_len, D)  # any tables: the arithmetic is what counts
    cos, sin = (t[pos].unsqueeze(-2) for t in runner_like)
    rot = lambda x: torch.addcmul(x * cos, torch.cat([x[..., D // 2 :], x[..., : D // 2]], -1), sin)  # noqa: E731
    fast = da.DecodeAttention(KV * G, KV, D, max_len, torch.float32, native)
    kc2, vc2 = kc.clone(), vc.clone()
    ref = fast(kc, vc, rot(q), rot(k), v, fast.setup(pos))
    out = fast(kc2, vc2, q, k, v, fast.setup(pos), rope=runner_like)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5) and torch.allclose(kc2, kc, atol=1e-6)
    plain = da.DecodeAttention(KV * G, KV, D, max_len, torch.float32, None)
    with pytest.raises(ValueError, match="rotated already"):
        plain(kc, vc, q, k, v, plain.setup(pos), rope=runner_like)


@pytest.mark.parametrize("n,d", [(1, 576), (64, 576), (300, 96), (5, 13)])
def test_native_norm_and_silu_mul_equal_torch_ops(n, d):
    native = _native_or_skip()
    g = torch.Generator().manual_seed(n * d)
    x, r, w = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g), torch.randn(d, generator=g)
    x0 = x.clone()
    h = native.add_rms_norm(x, r, w, 1e-5)
    assert torch.allclose(x, x0 + r, atol=1e-6)  # the residual added in place
    assert torch.allclose(h, torch.nn.functional.rms_norm(x0 + r, (d,), w, 1e-5), atol=1e-5, rtol=1e-5)
    strided = torch.randn(n, 2 * d, generator=g)[:, :d]  # rows apart by more than d
    assert torch.allclose(native.add_rms_norm(strided, None, w, 1e-5),
                          torch.nn.functional.rms_norm(strided, (d,), w, 1e-5), atol=1e-5, rtol=1e-5)
    gu = torch.randn(n, 2 * d, generator=g) * 4
    out = native.silu_mul(gu)
    assert torch.allclose(out, torch.nn.functional.silu(gu[:, :d]) * gu[:, d:], atol=1e-5, rtol=1e-5)


def test_native_attention_takes_a_non_adjacent_head_layout():
    """q whose heads are not head_dim apart is copied before the kernel reads it."""
    native = _native_or_skip()
    kc, vc, q, k, v, pos = _case(3, 2, 2, 16, 20, [4, 9, 2])
    q_odd = torch.randn(3, 16, 4).transpose(1, 2)  # [B, H, D] with stride(-1) != 1
    plain = da.DecodeAttention(4, 2, 16, 20, torch.float32, None)
    fast = da.DecodeAttention(4, 2, 16, 20, torch.float32, native)
    ref = plain(kc.clone(), vc.clone(), q_odd, k, v, plain.setup(pos))
    out = fast(kc.clone(), vc.clone(), q_odd, k, v, fast.setup(pos))
    assert torch.allclose(out, ref, atol=2e-6)


def test_native_attention_refuses_positions_it_would_write_outside_the_cache():
    native = _native_or_skip()
    kc, vc, q, k, v, pos = _case(2, 1, 2, 16, 20, [3, 5])
    fast = da.DecodeAttention(2, 1, 16, 20, torch.float32, native)
    with pytest.raises(ValueError, match="past the cache's 20 tokens"):
        fast.setup(torch.tensor([3, 20]))
    with pytest.raises(ValueError, match="contiguous"):  # a cache the C code would misread
        fast(kc.transpose(2, 3).contiguous().transpose(2, 3), vc, q, k, v, fast.setup(pos))
    before = kc.clone()
    with pytest.raises(ValueError, match="refused its inputs"):  # a caller's attended length below a position
        fast(kc, vc, q, k, v, fast.setup(pos, Lk=5))
    assert torch.equal(kc, before)  # nothing was written


def test_without_a_compiler_the_runner_says_why_and_uses_torch_ops(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("ROLLOVER_CACHE", str(tmp_path))
    nk.load.cache_clear()
    nk._unavailable_said.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="rollover.engine.cpu.native"):
            assert nk.kernels_for(torch.device("cpu"), torch.float32, None) is None
        assert "no-such-cc" in caplog.text and "could not run" in caplog.text
        with pytest.raises(RuntimeError, match="no-such-cc"):
            nk.kernels_for(torch.device("cpu"), torch.float32, True)
    finally:
        nk.load.cache_clear()
    assert nk.kernels_for(torch.device("cpu"), torch.float32, False) is None
    with pytest.raises(ValueError, match="fp32 on a CPU"):
        nk.kernels_for(torch.device("cpu"), torch.bfloat16, True)
    assert nk.kernels_for(torch.device("cpu"), torch.bfloat16, None) is None


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_runner_with_native_attention_matches_the_hf_forward(arch):
    """Decode and the fused admit-while-decoding pass (`mixed`) through the native kernel give
    the HF forward's next-token logits, and the torch path's."""
    _native_or_skip()
    model = tiny_model(arch, seed=3)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13] * 9]
    runners = {flag: ModelRunner(model.config, model.state_dict(), max_rows=4, max_len=64, native_kernels=flag)
               for flag in (True, False)}
    assert runners[True].kernels is not None and runners[False].kernels is None
    assert runners[True].packing == ("native" if runners[True].kernels.gemm_vector_bits >= 512 else "mkl")
    seqs = [list(p) for p in prompts]
    logits = {}
    with torch.inference_mode():
        for flag, r in runners.items():
            r.prefill([0, 1], seqs[:2])
            ids = [list(s) for s in seqs]
            out = []
            for step in range(6):
                toks = torch.tensor([ids[0][-1] + 1 + step, ids[1][-1] + 2])
                pos = torch.tensor([len(ids[0]), len(ids[1])])
                if step == 2:  # the third prompt joins while the two decode
                    lg = r.mixed(toks, pos, [2], [ids[2]])
                    ids[2].append(int(lg[2].argmax()))
                elif step > 2:
                    toks = torch.cat([toks, torch.tensor([ids[2][-1]])])
                    pos = torch.cat([pos, torch.tensor([len(ids[2]) - 1])])
                    lg = r.decode(toks, pos)
                    ids[2].append(int(lg[2].argmax()))
                else:
                    lg = r.decode(toks, pos)
                ids[0].append(int(toks[0]))
                ids[1].append(int(toks[1]))
                out.append(lg)
            logits[flag] = (out, ids)
    (nat, nat_ids), (ref, ref_ids) = logits[True], logits[False]
    assert nat_ids == ref_ids
    for a, b in zip(nat, ref):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the last step's logits against the HF forward over each whole sequence
        for row, seq in enumerate(nat_ids):
            hf = model(torch.tensor([seq[:-1] if row == 2 else seq])).logits[0, -1]
            assert torch.allclose(nat[-1][row], hf, atol=1e-4), (row, (nat[-1][row] - hf).abs().max())


@pytest.mark.parametrize("M,N,K", [(1, 5, 3), (3, 100, 33), (8, 48, 64), (9, 49, 17), (64, 960, 576), (130, 200, 40)])
def test_the_packed_gemm_equals_f_linear(M, N, K):
    """Every row count (whole and partial row blocks), widths that fill the last panel or not,
    with and without a bias, rows strided or not."""
    native = _native_or_skip()
    g = torch.Generator().manual_seed(M * 1000 + N)
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    x = torch.randn(M, K + 7, generator=g)[:, 3 : 3 + K]  # rows K + 7 apart
    packed = native.pack(w)
    assert packed.data.numel() == -(-N // native.gemm_panel) * native.gemm_panel * K
    for bias in (None, b):
        # sums of up to 576 products of N(0, 1) values, in another order than MKL's: within 1e-4
        torch.testing.assert_close(native.linear(x, packed, bias), torch.nn.functional.linear(x, w, bias), rtol=1e-4, atol=1e-4)


def test_the_packed_gemm_sums_a_long_row_as_closely_as_mkl():
    """The products are summed in runs of 256, then the runs: one running sum over K = 8,960 was
    8.4e-6 of the output's RMS off the float64 product, MKL 1.6e-6."""
    native = _native_or_skip()
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(8, 8960, generator=g), torch.randn(64, 8960, generator=g)
    exact = x.double() @ w.double().T
    err = (native.linear(x, native.pack(w)).double() - exact).abs().max() / exact.pow(2).mean().sqrt()
    assert err < 3e-6, err


def test_the_packed_gemm_takes_no_rows_and_refuses_other_dims():
    native = _native_or_skip()
    packed = native.pack(torch.randn(10, 6))
    assert native.linear(torch.empty(0, 6), packed).shape == (0, 10)  # as F.linear
    with pytest.raises(ValueError, match="2-D"):
        native.linear(torch.randn(2, 3, 6), packed)


def test_the_packed_gemm_refuses_what_it_would_misread():
    native = _native_or_skip()
    packed = native.pack(torch.randn(10, 6))
    with pytest.raises(ValueError, match=r"\[M, 6\]"):
        native.linear(torch.randn(4, 5), packed)
    with pytest.raises(ValueError, match="fp32"):
        native.linear(torch.randn(4, 6).bfloat16(), packed)
    with pytest.raises(ValueError, match="rows"):
        native.linear(torch.randn(6, 4).T, packed)  # columns strided
    with pytest.raises(ValueError, match="bias"):
        native.linear(torch.randn(4, 6), packed, torch.randn(9))
    with pytest.raises(ValueError, match="fp32"):
        native.pack(torch.randn(10, 6).double())
    with pytest.raises(ValueError, match="packed by"):  # a pack of another size would be read past its end
        native.linear(torch.randn(4, 6), nk.PackedWeight(packed.data[:-1], 10, 6))


def test_the_runner_repacks_its_weights_after_an_update():
    """The native GEMM's packs are copies: after `load_weights` a decode step must multiply by the
    new weights (a runner built on them gives the same logits), not the stale packs."""
    native = _native_or_skip()
    if native.gemm_vector_bits < 512:
        pytest.skip("the native GEMM runs where the CPU has 512-bit vectors")
    old, new = tiny_model("llama", seed=3), tiny_model("llama", seed=4)
    runner = ModelRunner(old.config, old.state_dict(), max_rows=4, max_len=32)
    fresh = ModelRunner(new.config, new.state_dict(), max_rows=4, max_len=32)
    assert runner.packing == "native" and runner.pack_sizes == []
    toks, pos = torch.tensor([5, 6, 7]), torch.tensor([0, 0, 0])
    with torch.inference_mode():
        stale = runner.decode(toks, pos)
        assert runner._packs  # the step packed every matrix it multiplied
        runner.load_weights(new.state_dict().items())
        assert not runner._packs
        torch.testing.assert_close(runner.decode(toks, pos), fresh.decode(toks, pos), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(stale, fresh.decode(toks, pos), atol=1e-3)


def test_native_sampling_draws_what_the_torch_sampler_draws():
    """Same uniforms, same tokens; logprobs within float rounding; temperatures and seeded and
    unseeded rows mixed. Greedy or top-k / top-p batches keep to torch (not tested here)."""
    from rollover.engine.sampler import Sampler
    from rollover.types import SamplingParams

    native = _native_or_skip()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 5000, generator=g) * 3
    params = [SamplingParams(temperature=[1.0, 0.7, 1.3][b % 3], seed=None if b % 4 == 1 else 100 + b) for b in range(64)]
    positions = list(range(64))
    counted = _Counting(native)
    plain, fast = Sampler(torch.device("cpu"), seed=5), Sampler(torch.device("cpu"), seed=5, kernels=counted)
    for step in range(3):  # the unseeded rows draw from each sampler's generator in step
        tok_p, lp_p = plain.sample(logits, params, positions)
        tok_f, lp_f = fast.sample(logits, params, positions)
        # equal here; in general a uniform within rounding of a boundary can pick the neighbour (Sampler's docstring)
        assert torch.equal(tok_f, tok_p)
        assert torch.allclose(lp_f, lp_p, atol=1e-5, rtol=1e-5)
        logits = logits.roll(1, dims=1)
    assert counted.calls == 3  # the kernel drew them, not torch's path


def test_native_sampling_follows_the_softmax():
    """20,000 seeded draws from one row: frequencies within 0.01 of softmax(z / T), and each
    reported logprob is log_softmax(z / T) at the token drawn."""
    from rollover.engine.sampler import Sampler
    from rollover.types import SamplingParams

    native = _native_or_skip()
    z = torch.tensor([2.0, 0.5, -1.0, 1.0, 0.0, -3.0] * 7)  # 42 tokens, repeated mass
    n, T = 20000, 0.8
    probs = torch.softmax(z / T, -1)
    counted = _Counting(native)
    tokens, lps = Sampler(torch.device("cpu"), kernels=counted).sample(
        z.expand(n, -1).contiguous(), [SamplingParams(temperature=T, seed=s) for s in range(n)], [0] * n)
    assert counted.calls == 1
    freq = torch.bincount(tokens, minlength=z.numel()).float() / n
    assert (freq - probs).abs().max() < 0.01
    assert torch.allclose(lps, torch.log_softmax(z / T, -1)[tokens], atol=1e-5)


class _Counting:
    """Native kernels whose `sample` calls are counted."""

    def __init__(self, kernels):
        self.kernels, self.calls = kernels, 0

    def sample(self, *args):
        self.calls += 1
        return self.kernels.sample(*args)


def test_native_sampling_at_a_low_temperature_takes_the_top_token_with_logprob_near_zero():
    """A fused multiply-add in the exponent once made the top token's weight above 1 (logprob
    +0.57 at T=1e-6) and sent draws to the last token; every product is now rounded first."""
    native = _native_or_skip()
    logits = 10 + 4 * torch.randn(64, 4096, generator=torch.Generator().manual_seed(1))
    for T in (1e-4, 1e-5, 1e-6):
        u = torch.rand(64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        tokens, lps = native.sample(logits, torch.full((64,), T), u)
        assert torch.equal(tokens, logits.argmax(-1)), T
        assert (lps <= 0).all() and (lps > -1e-3).all(), (T, lps.min(), lps.max())


def test_a_uniform_next_to_one_never_draws_a_token_without_mass():
    """u * total can round up to the total; both paths then take the last token with mass, not
    the vocabulary's last (here of probability 0)."""
    from rollover.engine.sampler import Sampler
    from rollover.types import SamplingParams

    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(3))
    logits[:, -50:] = float("-inf")
    u = torch.full((4,), 1 - 2.0**-53, dtype=torch.float64)
    plain = Sampler(torch.device("cpu"))
    plain._uniforms = lambda *a: u  # noqa: E731 (the draw under test)
    samplers = [plain]
    try:
        fast = Sampler(torch.device("cpu"), kernels=nk.load())
        fast._uniforms = lambda *a: u  # noqa: E731
        samplers.append(fast)
    except RuntimeError:
        pass
    for sampler in samplers:
        tokens, lps = sampler.sample(logits, [SamplingParams(temperature=1.0)] * 4, [0] * 4)
        assert (tokens < 950).all() and torch.isfinite(lps).all(), (sampler.kernels, tokens, lps)


def test_loading_the_kernels_leaves_flush_to_zero_off():
    """Linked with -ffast-math, GCC adds crtfastmath.o, whose constructor sets flush-to-zero for
    the whole process: a trainer's denormals would read 0 after the engine loaded."""
    _native_or_skip()
    assert (torch.tensor([1e-40]) * 1).item() != 0.0


def test_the_wrappers_refuse_what_the_c_code_would_misread():
    native = _native_or_skip()
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="fp32"):
        native.add_rms_norm(x.bfloat16(), None, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="fp32"):
        native.silu_mul(torch.randn(4, 8).bfloat16())
    with pytest.raises(ValueError, match="V > 0"):
        native.sample(torch.empty(2, 0), None, torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="temperatures"):
        native.sample(torch.randn(2, 5), torch.ones(4)[::2], torch.zeros(2, dtype=torch.float64))
    kc, vc, q, k, v, pos = _case(2, 2, 2, 16, 20, [3, 5])
    att = da.DecodeAttention(4, 2, 16, 20, torch.float32, native)
    setup = att.setup(pos)
    setup.scratch = setup.scratch[:1].expand(setup.scratch.numel())  # one float's storage
    with pytest.raises(ValueError, match="scratch"):
        att(kc, vc, q, k, v, setup)


def test_a_model_outside_the_attention_kernels_range_runs_on_torch_ops(caplog):
    """17 query heads a kv head: past the kernel's buffers, so the runner keeps to torch's ops
    (and says so) rather than failing at its first decode step; requiring them is refused."""
    model = tiny_model("llama", seed=4, hidden_size=68, num_attention_heads=17, num_key_value_heads=1)
    nk._unavailable_said.cache_clear()
    with caplog.at_level(logging.WARNING, logger="rollover.engine.cpu.native"):
        runner = ModelRunner(model.config, model.state_dict(), max_rows=2, max_len=32)
    assert runner.kernels is None and "17 query heads" in caplog.text
    with torch.inference_mode():
        runner.prefill([0], [[5, 6, 7]])
        out = runner.decode(torch.tensor([8]), torch.tensor([3]))
    with torch.no_grad():
        hf = model(torch.tensor([[5, 6, 7, 8]])).logits[0, -1]
    assert torch.allclose(out[0], hf, atol=1e-4)
    with pytest.raises(ValueError, match="at most 16 query heads"):
        ModelRunner(model.config, model.state_dict(), max_rows=2, max_len=32, native_kernels=True)


def test_a_cached_library_that_does_not_load_is_built_again(tmp_path, monkeypatch):
    _native_or_skip()
    monkeypatch.setenv("ROLLOVER_CACHE", str(tmp_path))
    nk.load.cache_clear()
    try:
        lib = nk.build()
        lib.write_bytes(b"truncated")
        kernels = nk.load()
        assert lib.stat().st_size > 1000 and kernels.silu_mul(torch.zeros(1, 2)).shape == (1, 1)
    finally:
        nk.load.cache_clear()
