"""The trainer, packing, the synchronous loop, checkpoints and exact resume (tiny models, CPU)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollover.config import load_config
from rollover.loops.build import build_run
from rollover.loops.sync import train_sync
from rollover.rewards import RewardFailed
from rollover.rollout.stops import TooManyBadSteps
from rollover.testing import save_tiny_model, tiny_model
from rollover.train.batch import TrainBatch, pack
from rollover.types import Rollout


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama", seed=3))


def tiny_cfg(model_dir, run_dir, **over):
    base = {
        "device": "cpu", "model": model_dir, "run_dir": str(run_dir), "steps": 4, "seed": 7, "resume": "auto",
        "data.train": "gen:arithmetic?n=120", "data.eval_size": 6, "data.max_prompt_tokens": 64,
        "rollout.prompts_per_step": 3, "rollout.samples_per_prompt": 3, "rollout.max_new_tokens": 6,
        "rollout.max_rows": 8, "reward.functions": ["numeric", {"fn": "format", "weight": 0.5, "kwargs": {"pattern": "[0-9]"}}],
        "train.lr": 1e-3, "eval.every": 2, "eval.samples_per_prompt": 1, "checkpoint.every": 2,
        "logging.progress": False, "logging.tensorboard": False,
    }
    base.update(over)
    if "epochs" in over:
        del base["steps"]
    return load_config(**base)


def rollout(gid, prompt, resp, adv, mask=None):
    """(a rollout, its advantage)"""
    return Rollout(group_id=gid, prompt_ids=prompt, response_ids=resp, logprobs=[-1.0] * len(resp),
                   versions=[0] * len(resp), loss_mask=mask or [1] * len(resp), finish="stop", reward=0.0), adv


def batch_of(pairs) -> TrainBatch:
    return TrainBatch.from_rollouts([r for r, _ in pairs], [a for _, a in pairs])


def packed_logprobs(model, mb):
    """Logprobs of a micro-batch's response tokens, with the mask the trainer would pass."""
    mask = None
    if mb.allow() is not None:
        allow = mb.allow()[:, None]
        mask = allow if model.config._attn_implementation == "sdpa" else \
            torch.zeros(allow.shape).masked_fill(~allow, torch.finfo(torch.float32).min)
    with torch.no_grad():
        hidden = model.model(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=mask,
                             use_cache=False).last_hidden_state
        return torch.log_softmax(model.lm_head(hidden[mb.sel_row, mb.sel_col]), -1).gather(1, mb.targets[:, None]).squeeze(1)


def step_seeing_gradient(tr, batch):
    """`tr.train_step(batch)` and the gradient its optimizer step saw: (metrics, {name: grad})."""
    seen, real_step = {}, tr.optimizer.step

    def step(*a, **kw):
        seen.update({n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None})
        return real_step(*a, **kw)

    tr.optimizer.step = step
    return tr.train_step(batch), seen


@pytest.mark.parametrize("shared,impl", [(False, "sdpa"), (True, "sdpa"), (True, "eager")])
def test_packing_keeps_sequences_apart(shared, impl):
    model = tiny_model("llama", seed=4)
    model.config._attn_implementation = impl
    rolls = [rollout("a", [5, 6, 7], [8, 9], 1.0), rollout("a", [5, 6, 7], [10, 11, 12], -1.0),
             rollout("b", [20], [21], 0.5), rollout("b", [22, 23, 24, 25], [26, 27, 28, 29], 0.0),
             rollout("b", [20], [], 0.0), rollout("b", [20], [30, 31], 0.0)]
    batch = batch_of(rolls)
    packed = pack(batch, pack_length=32, micro_batch_tokens=32, shared_prefix=shared)
    assert len(packed) == 1 and packed[0].input_ids.shape[0] == 1  # all in one row
    mb = packed[0]
    # shared: prompts [5, 6, 7] and [20] are written once each
    assert mb.slots == (20 if shared else 25) and mb.pad_tokens == 0
    lp = packed_logprobs(model, mb)
    for k, (r, _) in enumerate(rolls):  # each sequence alone, unpacked
        s = mb.seq_index.index(k)
        got = lp[mb.tok_seq == s]
        if not r.response_ids:
            assert got.numel() == 0
            continue
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        with torch.no_grad():
            ref = torch.log_softmax(model(ids).logits[0], -1)[len(r.prompt_ids) - 1 : -1]
        ref = ref.gather(1, torch.tensor(r.response_ids)[:, None]).squeeze(1)
        assert torch.allclose(got, ref, atol=1e-5), k


def test_shared_prefix_padding_sits_at_position_zero_and_sees_only_itself():
    model = tiny_model("llama", seed=4)
    rolls = [rollout("a", [5, 6, 7], [8, 9, 10], 1.0), rollout("a", [5, 6, 7], [11, 12], -1.0),
             rollout("b", [20, 21], [22], 0.5), rollout("b", [20, 21], [23, 24], 0.0)]
    packed = pack(batch_of(rolls), pack_length=8, micro_batch_tokens=16, shared_prefix=True)
    assert len(packed) == 1 and packed[0].input_ids.shape == (2, 8)  # rows of 8 and 5 tokens
    mb = packed[0]
    assert mb.position_ids[1].tolist() == [0, 1, 2, 2, 3, 0, 0, 0]  # prompt, [22], [23, 24], padding
    allow = mb.allow()
    assert allow[1, 5:, 5:].equal(torch.eye(3, dtype=torch.bool)) and not allow[1, 5:, :5].any()
    assert allow[1, 3, :2].all() and not allow[1, 3, 2] and allow[1, 4, 3]  # 23 sees the prompt, not 22; 24 sees 23
    lp = packed_logprobs(model, mb)
    for s, k in enumerate(mb.seq_index):
        r = rolls[k][0]
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([r.prompt_ids + r.response_ids])).logits[0], -1)
        ref = ref[len(r.prompt_ids) - 1: -1].gather(1, torch.tensor(r.response_ids)[:, None]).squeeze(1)
        assert torch.allclose(lp[mb.tok_seq == s], ref, atol=1e-5)


def test_a_group_longer_than_a_row_is_split_and_each_part_repeats_the_prompt():
    model = tiny_model("llama", seed=4)
    prompt = [5, 6, 7, 8]
    rolls = [rollout("a", prompt, [9 + j] * (3 + j), 1.0 - j) for j in range(4)]  # 3 + 4 + 5 + 6 response tokens
    packed = pack(batch_of(rolls), pack_length=12, micro_batch_tokens=12, shared_prefix=True)
    # segments in order: [r0, r1] (4 + 3 + 4 = 11), [r2] (9), [r3] (10); one row each
    assert sorted(sorted(mb.seq_index) for mb in packed) == [[0, 1], [2], [3]]
    assert all(mb.input_ids[0, :4].tolist() == prompt for mb in packed)
    for mb in packed:
        lp = packed_logprobs(model, mb)
        for s, k in enumerate(mb.seq_index):
            r = rolls[k][0]
            with torch.no_grad():
                ref = torch.log_softmax(model(torch.tensor([r.prompt_ids + r.response_ids])).logits[0], -1)[3:-1]
            ref = ref.gather(1, torch.tensor(r.response_ids)[:, None]).squeeze(1)
            assert torch.allclose(lp[mb.tok_seq == s], ref, atol=1e-5)
    with pytest.raises(ValueError, match="sequence 3 has 10 tokens, more than pack_length=9"):
        pack(batch_of(rolls), pack_length=9, micro_batch_tokens=9, shared_prefix=True)
    with pytest.raises(ValueError, match="sequence 0 has an empty prompt"):
        pack(batch_of([rollout("a", [], [3], 1.0)]), pack_length=9, micro_batch_tokens=9, shared_prefix=True)


def test_padding_fraction_reported():
    rolls = [rollout("a", [1] * 5, [2] * 5, 1.0), rollout("a", [1] * 2, [2] * 2, 1.0)]
    mbs = pack(batch_of(rolls), pack_length=10, micro_batch_tokens=20)
    assert sum(m.slots for m in mbs) == 20 and sum(m.pad_tokens for m in mbs) == 6


def test_micro_batch_split_does_not_change_the_update(model_dir, tmp_path):
    from rollover.train.trainer import Trainer

    rolls = [rollout(f"g{i % 3}", [5 + i, 6, 7], [8 + i] * (2 + i % 4), float(i % 3) - 1.0) for i in range(9)]
    grads = []
    for mbt in (64, 16):
        cfg = tiny_cfg(model_dir, tmp_path / f"r{mbt}", **{"train.micro_batch_tokens": mbt, "train.pack_length": 16,
                                                             "data.max_prompt_tokens": 10})
        torch.manual_seed(0)
        model = tiny_model("llama", seed=5)
        tr = Trainer(model, cfg, device=torch.device("cpu"))
        seen = {}
        real_step = tr.optimizer.step

        def step(*a, **kw):  # the accumulated gradient the optimizer sees (Adam's update of a
            # near-zero gradient is ~lr x its sign, so comparing updated weights would amplify
            # float summation-order noise into lr-sized differences)
            seen.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            return real_step(*a, **kw)

        tr.optimizer.step = step
        m = tr.train_step(batch_of(rolls))
        grads.append(seen)
        assert (m["actor/micro_batches"] == 1) == (mbt == 64)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for k in grads[0]:
        assert torch.allclose(grads[0][k], grads[1][k], rtol=1e-4, atol=1e-7), k


def test_m2po_masks_the_whole_update_whatever_the_micro_batch_split(model_dir, tmp_path):
    """algorithm.m2po_tau: the mask is the update's, over all its loss tokens, not each micro-batch's:
    one micro-batch and several give the same gradient, the same weights and the same M2PO metrics."""
    from rollover.train.trainer import Trainer

    rolls = [rollout(f"g{i % 3}", [5 + i, 6, 7], [8 + i] * (2 + i % 4), float(i % 3) - 1.0) for i in range(9)]
    batch = batch_of(rolls)
    grads, after, metrics = [], [], []
    for mbt in (64, 16):
        cfg = tiny_cfg(model_dir, tmp_path / f"r{mbt}", **{"train.micro_batch_tokens": mbt, "train.pack_length": 16,
                                                             "data.max_prompt_tokens": 10, "algorithm.m2po_tau": 0.04})
        torch.manual_seed(0)
        model = tiny_model("llama", seed=5)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        tr = Trainer(model, cfg, device=torch.device("cpu"))
        if mbt == 64:  # sampled off-policy: the model's logprobs, perturbed token by token
            noise = 0.3 * torch.randn(batch.mask_BT.shape, generator=torch.Generator().manual_seed(1))
            batch.behav_logp_BT = torch.where(batch.mask_BT, tr.logprobs(batch) + noise, 0.0)
        m, seen = step_seeing_gradient(tr, batch)
        assert (m["actor/micro_batches"] == 1) == (mbt == 64)
        grads.append(seen)
        after.append({n: p.detach().clone() for n, p in model.named_parameters()})
        metrics.append(m)
    assert 0 < metrics[0]["actor/m2po_masked_frac"] < 1 and metrics[0]["actor/m2po_m2_after"] <= 0.04
    for k in ("actor/m2po_masked_frac", "actor/masked_frac"):  # the same tokens dropped
        assert metrics[1][k] == pytest.approx(metrics[0][k], rel=1e-12), k
    for k in ("actor/m2po_m2_before", "actor/m2po_m2_after", "actor/pg_loss"):  # old logprobs packed otherwise: ~1e-6
        assert metrics[1][k] == pytest.approx(metrics[0][k], rel=1e-5, abs=1e-9), k
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for k in grads[0]:
        assert torch.allclose(grads[0][k], grads[1][k], rtol=1e-4, atol=1e-7), k
    assert max(float((after[0][k] - start[k]).abs().max()) for k in start) > 0.5 * cfg.train.lr  # the step moved
    # Adam's first step is about lr x sign(gradient): only near-zero gradient elements may differ
    assert max(float((after[0][k] - after[1][k]).abs().max()) for k in start) < 0.05 * cfg.train.lr


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_top_entropy_quantile_trains_the_high_entropy_tokens_only(model_dir, tmp_path, aggregation):
    """algorithm.top_entropy_quantile: the policy term counts the tokens whose entropy (the model's
    own, from a plain forward) is at least torch.quantile's 1 - q quantile of the update's tokens,
    while the KL term and the denominators (the step's tokens, or each sequence's) count every
    token, as in TRL; one micro-batch or several."""
    from rollover.train.trainer import Trainer

    rolls = [rollout(f"g{i % 3}", [5 + i, 6, 7], [8 + i, 3 * i % 11, 9] * (1 + i % 3), float(i % 3) - 1.0)
             for i in range(9)]
    batch = batch_of(rolls)
    q, temperature, kl_coef = 0.3, 0.8, 0.5
    model, ref = tiny_model("llama", seed=5), tiny_model("llama", seed=6)
    # the reference, by hand: entropies and logprobs per sequence, threshold over all loss tokens
    logps, ref_logps, ents = [], [], []
    for r, _ in rolls:
        ids, pick = torch.tensor([r.prompt_ids + r.response_ids]), torch.tensor(r.response_ids)[:, None]
        lp_all = torch.log_softmax(model(ids).logits[0, len(r.prompt_ids) - 1: -1] / temperature, -1)
        logps.append(lp_all.gather(1, pick).squeeze(1))
        ents.append(-(lp_all.exp() * lp_all).sum(-1).detach())
        with torch.no_grad():
            ref_all = torch.log_softmax(ref(ids).logits[0, len(r.prompt_ids) - 1: -1] / temperature, -1)
        ref_logps.append(ref_all.gather(1, pick).squeeze(1))
    threshold = torch.quantile(torch.cat(ents), 1 - q)
    kept = [e >= threshold for e in ents]
    n_tokens = sum(len(e) for e in ents)
    per_token = [-(adv * (lp - lp.detach()).exp() * k) + kl_coef * ((rl - lp).exp() - (rl - lp) - 1)  # ratio 1
                 for (_, adv), lp, rl, k in zip(rolls, logps, ref_logps, kept)]
    pg_per_token = [-(adv * k).detach() for (_, adv), k in zip(rolls, kept)]  # actor/pg_loss: the policy term alone
    if aggregation == "token-mean":
        loss = sum(t.sum() for t in per_token) / n_tokens
        pg_loss = sum(t.sum() for t in pg_per_token) / n_tokens
    else:
        loss = sum(t.sum() / len(t) for t in per_token) / len(per_token)
        pg_loss = sum(t.sum() / len(t) for t in pg_per_token) / len(per_token)
    model.zero_grad()
    loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert 0 < sum(int(k.sum()) for k in kept) < n_tokens
    assert any(not k.any() for k in kept)  # a sequence keeps no token: its KL still counts
    for mbt in (256, 16):
        cfg = tiny_cfg(model_dir, tmp_path / f"r{mbt}", **{
            "train.micro_batch_tokens": mbt, "train.pack_length": 16, "data.max_prompt_tokens": 10,
            "rollout.temperature": temperature, "algorithm.top_entropy_quantile": q, "train.grad_clip": 0.0,
            "algorithm.kl_coef": kl_coef, "algorithm.aggregation": aggregation})
        m = tiny_model("llama", seed=5)
        tr = Trainer(m, cfg, device=torch.device("cpu"), reference=ref)
        metrics, seen = step_seeing_gradient(tr, batch)
        assert (metrics["actor/micro_batches"] == 1) == (mbt == 256)
        assert metrics["actor/entropy_threshold"] == pytest.approx(float(threshold), rel=1e-5)
        assert metrics["actor/entropy_kept_frac"] == pytest.approx(sum(int(k.sum()) for k in kept) / n_tokens)
        assert metrics["actor/loss"] == pytest.approx(float(loss), rel=1e-4)
        assert metrics["actor/pg_loss"] == pytest.approx(float(pg_loss), rel=1e-4, abs=1e-7)
        assert seen.keys() == want.keys()
        for k in want:
            assert torch.allclose(seen[k], want[k], rtol=1e-4, atol=1e-6), (mbt, k, float((seen[k] - want[k]).abs().max()))


def test_vespo_step_weights_each_sequence_by_its_ratio_to_the_engine(model_dir, tmp_path):
    """algorithm.loss=vespo with tis_cap: each sequence's REINFORCE term is weighted by φ(w), w the
    product of its tokens' capped π_old/π_behav (the engine's logprobs are -1 here), computed by
    hand; one micro-batch or several give that gradient."""
    import math

    from rollover.train.trainer import Trainer

    rolls = [rollout(f"g{i % 2}", [5 + i, 6, 7], [8 + i, 3 * i % 11, 9][: 1 + i % 3], float(i % 2) - 0.5)
             for i in range(6)]
    model, cap = tiny_model("llama", seed=5), 1.5
    loss, n_tokens, phis = 0.0, sum(len(r.response_ids) for r, _ in rolls), []
    for i, (r, adv) in enumerate(rolls):
        ids, pick = torch.tensor([r.prompt_ids + r.response_ids]), torch.tensor(r.response_ids)[:, None]
        lp = torch.log_softmax(model(ids).logits[0, len(r.prompt_ids) - 1: -1], -1).gather(1, pick).squeeze(1)
        r.logprobs = [x + 0.4 * ((i + j) % 3 - 1) for j, x in enumerate(lp.tolist())]  # the engine's, off a little
        log_w = sum(math.log(min(math.exp(x - b), cap)) for x, b in zip(lp.tolist(), r.logprobs))
        k, lam = (2.0, 3.0) if adv >= 0 else (3.0, 2.0)
        phis.append(math.exp(lam + k * log_w - lam * math.exp(log_w)))
        loss = loss - (phis[-1] * adv * lp).sum() / n_tokens
    model.zero_grad()
    loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert max(phis) - min(phis) > 0.1  # the sequences are weighted differently
    batch = batch_of(rolls)
    for mbt in (256, 8):
        cfg = tiny_cfg(model_dir, tmp_path / f"r{mbt}", **{
            "train.micro_batch_tokens": mbt, "train.pack_length": 8, "data.max_prompt_tokens": 4,
            "rollout.max_new_tokens": 4, "algorithm.loss": "vespo", "algorithm.tis_cap": cap, "train.grad_clip": 0.0})
        m = tiny_model("llama", seed=5)
        tr = Trainer(m, cfg, device=torch.device("cpu"))
        metrics, seen = step_seeing_gradient(tr, batch)
        assert (metrics["actor/micro_batches"] == 1) == (mbt == 256)
        assert metrics["actor/loss"] == pytest.approx(float(loss), rel=1e-4)
        assert seen.keys() == want.keys()
        for k in want:
            assert torch.allclose(seen[k], want[k], rtol=1e-4, atol=1e-6), (mbt, k, float((seen[k] - want[k]).abs().max()))


def test_opsm_in_a_step_drops_what_the_hand_computed_mask_drops(model_dir, tmp_path):
    """algorithm.opsm_delta: the trainer drops the negative-advantage tokens of the sequences whose
    mean log(behav / pi) over the whole response is above delta (computed here from the policy's own
    logprobs), whatever the micro-batch split, and whatever M2PO leaves of the response."""
    from rollover.train.trainer import Trainer

    rolls = [rollout(f"g{i % 3}", [5 + i, 6, 7], [8 + i] * (2 + i % 4), float(i % 3) - 1.0) for i in range(9)]
    batch = batch_of(rolls)
    got = []
    for mbt in (64, 16):
        cfg = tiny_cfg(model_dir, tmp_path / f"r{mbt}", **{"train.micro_batch_tokens": mbt, "train.pack_length": 16,
                                                             "data.max_prompt_tokens": 10, "algorithm.opsm_delta": 0.2,
                                                             "algorithm.m2po_tau": 0.01})
        tr = Trainer(tiny_model("llama", seed=5), cfg, device=torch.device("cpu"))
        if mbt == 64:  # sampled off-policy: each sequence shifted by its own amount
            shift_B = torch.linspace(-0.5, 0.6, len(batch))[:, None]
            logp = tr.logprobs(batch)
            batch.behav_logp_BT = torch.where(batch.mask_BT, logp + shift_B, 0.0)
            mean_B = ((batch.behav_logp_BT - logp) * batch.mask_BT).sum(1) / batch.mask_BT.sum(1)
            dropped = ((mean_B > 0.2) & (batch.adv_B < 0))[:, None] & batch.mask_BT
            want = float(dropped.sum() / batch.mask_BT.sum())
            assert 0 < want < 0.5
        metrics = tr.train_step(batch)
        assert metrics["actor/m2po_masked_frac"] > 0  # M2PO dropped tokens; OPSM still averages over all
        got.append(metrics["actor/opsm_masked_frac"])
    assert got == pytest.approx([want, want], rel=1e-6)


@pytest.mark.parametrize("corrected, estimator", [(False, "k3"), (True, "k3"), (False, "k3+")])
def test_kl_gradient_with_and_without_the_importance_weight_is_the_hand_computed_one(model_dir, tmp_path, corrected,
                                                                                      estimator):
    """algorithm.kl_is_correction: the KL term's gradient is that of mean(r x k3), r = pi / pi_old
    with its gradient (DeepSeek-V3.2), against mean(k3) without; zero advantages leave the KL alone.
    kl_estimator=k3+ (verl's): k3's value, k2's gradient."""
    from rollover.train.trainer import Trainer

    rolls = [rollout(f"g{i % 3}", [5 + i, 6, 7], [8 + i, 4, 2 + i][: 2 + i % 2], 0.0) for i in range(6)]
    model, ref = tiny_model("llama", seed=5), tiny_model("llama", seed=6)
    total, n = 0.0, 0
    for r, _ in rolls:
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        pick = lambda m: torch.log_softmax(m(ids).logits[0, len(r.prompt_ids) - 1: -1], -1).gather(  # noqa: E731
            1, torch.tensor(r.response_ids)[:, None]).squeeze(1)
        logp, ref_logp = pick(model), pick(ref).detach()
        k3 = (ref_logp - logp).exp() - (ref_logp - logp) - 1
        if estimator == "k3+":
            k2 = 0.5 * (ref_logp - logp).square()
            k3 = k2 + (k3 - k2).detach()
        total = total + ((logp - logp.detach()).exp() * k3 if corrected else k3).sum()
        n += len(r.response_ids)
    (0.3 * total / n).backward()
    want = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    cfg = tiny_cfg(model_dir, tmp_path / "r", **{"algorithm.kl_coef": 0.3, "algorithm.kl_is_correction": corrected,
                                                  "algorithm.kl_estimator": estimator, "train.grad_clip": 0.0})
    m = tiny_model("llama", seed=5)
    tr = Trainer(m, cfg, device=torch.device("cpu"), reference=ref)
    metrics, seen = step_seeing_gradient(tr, batch_of(rolls))
    if not corrected:  # k3's value under either gradient
        assert metrics["actor/kl"] == pytest.approx(float(total) / n, rel=1e-5)
    assert seen.keys() == want.keys()
    for k in want:
        assert torch.allclose(seen[k], want[k], rtol=1e-4, atol=1e-7), k


@pytest.mark.parametrize("mini_batches,epochs", [(1, 1), (3, 1), (3, 2)])
def test_a_steps_counts_are_the_steps_whatever_its_updates(model_dir, tmp_path, mini_batches, epochs):
    """actor/loss_tokens is the step's loss tokens, counted once however many updates train them
    (mini-batches, epochs); actor/micro_batches is the step's forward-backward passes."""
    from rollover.train.trainer import Trainer

    rolls = [rollout(f"g{i % 3}", [5 + i, 6, 7], [8 + i] * (2 + i % 4), float(i % 3) - 1.0) for i in range(9)]
    batch = batch_of(rolls)
    cfg = tiny_cfg(model_dir, tmp_path / "r", **{"train.mini_batches": mini_batches, "train.ppo_epochs": epochs})
    m = Trainer(tiny_model("llama", seed=5), cfg, device=torch.device("cpu")).train_step(batch)
    assert m["actor/loss_tokens"] == batch.num_tokens == 30
    assert m["actor/micro_batches"] == mini_batches * epochs  # one pass per update: each fits one micro-batch


@pytest.mark.parametrize("target", [100.0, 0.0])
def test_adaptive_entropy_control_moves_the_coefficient_and_gates_the_bonus(model_dir, tmp_path, target):
    """algorithm.entropy_target (Skywork-OR1): the bonus is off until an update measures an entropy at
    or below the target; each update moves the coefficient by the delta toward more bonus (entropy
    at or below the target) or less, within the bounds; the trainer's state carries it. Zero
    advantages: the loss is the bonus alone, -coefficient x mean entropy."""
    from rollover.train.trainer import Trainer

    rolls = [rollout(f"g{i % 3}", [5 + i, 6, 7], [8 + i] * (2 + i % 4), 0.0) for i in range(9)]
    cfg = tiny_cfg(model_dir, tmp_path / "r", **{"algorithm.entropy_coef": 0.1, "algorithm.entropy_target": target,
                                                  "algorithm.entropy_coef_delta": 0.05, "algorithm.entropy_coef_max": 0.2})
    tr = Trainer(tiny_model("llama", seed=5), cfg, device=torch.device("cpu"))
    applied, coefs = [], []
    for _ in range(4):
        m = tr.train_step(batch_of(rolls))
        applied.append(m["actor/entropy_coef"])
        coefs.append(tr.entropy_coef)
        assert tr.last_entropy == pytest.approx(m["actor/entropy"], rel=1e-6)
        assert m["actor/loss"] == pytest.approx(-applied[-1] * m["actor/entropy"], rel=1e-5, abs=1e-9)
        assert m["actor/pg_loss"] == 0.0  # the policy term alone: no advantage, no loss
    if target:  # the entropy is below 100: up to the bound, and on from the second update
        assert applied == pytest.approx([0.0, 0.15, 0.2, 0.2]) and coefs == pytest.approx([0.15, 0.2, 0.2, 0.2])
    else:  # above 0: down to the lower bound, never on
        assert applied == [0.0] * 4 and coefs == pytest.approx([0.05, 0.0, 0.0, 0.0])
    before = (tr.entropy_coef, tr.last_entropy)  # an update with no loss token measures nothing
    tr.train_step(batch_of([rollout(f"g{i % 3}", [5 + i, 6, 7], [8 + i] * 2, 0.0, mask=[0, 0]) for i in range(9)]))
    assert (tr.entropy_coef, tr.last_entropy) == before
    resumed = Trainer(tiny_model("llama", seed=5), cfg, device=torch.device("cpu"))
    resumed.load_state_dict(tr.state_dict())
    assert (resumed.entropy_coef, resumed.last_entropy) == (tr.entropy_coef, tr.last_entropy)


def test_the_learning_rate_logged_is_the_one_each_update_stepped_with(model_dir, tmp_path):
    """train.warmup_steps=2, schedule=linear over 4 updates: the updates step at 1/2, 1, 1 and 1/2
    of lr (warm-up (u+1)/2, then linear decay), and `actor/lr` is that rate, read before the
    scheduler moves on to the next update's."""
    from rollover.train.trainer import Trainer

    rolls = [rollout(f"g{i % 3}", [5 + i, 6, 7], [8 + i] * (2 + i % 4), float(i % 3) - 1.0) for i in range(9)]
    cfg = tiny_cfg(model_dir, tmp_path / "r", **{"train.warmup_steps": 2, "train.schedule": "linear"})
    tr = Trainer(tiny_model("llama", seed=5), cfg, device=torch.device("cpu"))
    logged, stepped = [], []
    for _ in range(4):
        stepped.append(tr.optimizer.param_groups[0]["lr"])  # what optimizer.step() will use
        logged.append(tr.train_step(batch_of(rolls))["actor/lr"])
    assert stepped == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4]) and logged == stepped


def test_a_resumed_run_follows_its_own_schedule(model_dir, tmp_path):
    """A finished run of 3 steps (linear decay to 0) resumed with steps=6 goes on along the 6-step
    schedule: its 4th update at 1 - 3/6 of lr, not at the 0 the 3-step schedule had reached (the
    rate saved in the optimizer's state), and a changed lr is the new base; the same config
    resumes at the rate saved."""
    from rollover.train.trainer import Trainer

    rolls = [rollout(f"g{i % 3}", [5 + i, 6, 7], [8 + i] * (2 + i % 4), float(i % 3) - 1.0) for i in range(9)]

    def trainer(steps, lr=1e-3):
        cfg = tiny_cfg(model_dir, tmp_path / "r", steps=steps, **{"train.schedule": "linear", "train.lr": lr})
        return Trainer(tiny_model("llama", seed=5), cfg, device=torch.device("cpu"))

    straight, rates = trainer(3), []
    for i in range(3):
        rates.append(straight.train_step(batch_of(rolls))["actor/lr"])
        if i == 0:
            after_one = straight.state_dict()
    same = trainer(3)  # resumed mid-schedule under the same config: the rates of the run never stopped, exactly
    same.load_state_dict(after_one)
    assert [same.train_step(batch_of(rolls))["actor/lr"] for _ in range(2)] == rates[1:]
    tr = straight
    longer = trainer(6)
    longer.load_state_dict(tr.state_dict())
    assert longer.train_step(batch_of(rolls))["actor/lr"] == pytest.approx(5e-4)
    faster = trainer(6, lr=2e-3)
    faster.load_state_dict(tr.state_dict())
    assert faster.train_step(batch_of(rolls))["actor/lr"] == pytest.approx(1e-3)


def test_ref_sync_mixes_the_policy_into_the_reference_every_n_steps(model_dir, tmp_path):
    """algorithm.ref_sync_every=2, ref_mixup_alpha=0.3: after step 2 (not step 1) the reference is
    0.3 x the policy + 0.7 x the old reference; the trainer's state carries it to a new trainer."""
    from rollover.train.trainer import Trainer

    rolls = [rollout(f"g{i % 3}", [5 + i, 6, 7], [8 + i] * (2 + i % 4), float(i % 3) - 1.0) for i in range(9)]
    cfg = tiny_cfg(model_dir, tmp_path / "r", **{"algorithm.kl_coef": 0.2, "algorithm.ref_sync_every": 2,
                                                  "algorithm.ref_mixup_alpha": 0.3})
    start = {n: p.detach().clone() for n, p in tiny_model("llama", seed=5).named_parameters()}
    tr = Trainer(tiny_model("llama", seed=5), cfg, device=torch.device("cpu"))
    ref = lambda trainer: {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}  # noqa: E731
    tr.train_step(batch_of(rolls))
    assert all(torch.equal(ref(tr)[n], start[n]) for n in start)
    tr.train_step(batch_of(rolls))
    policy = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    assert max(float((policy[n] - start[n]).abs().max()) for n in start) > 1e-4  # the policy moved
    for n in start:
        torch.testing.assert_close(ref(tr)[n], 0.3 * policy[n] + 0.7 * start[n])
    resumed = Trainer(tiny_model("llama", seed=5), cfg, device=torch.device("cpu"))
    resumed.load_state_dict(tr.state_dict())
    assert resumed.steps_trained == 2 and all(torch.equal(ref(resumed)[n], ref(tr)[n]) for n in start)


def test_bapo_picks_its_bounds_once_per_update_whatever_the_micro_batch_split(model_dir, tmp_path):
    """algorithm.loss=bapo: the bounds are chosen once per update over all its loss tokens, not per
    micro-batch: one micro-batch and several give the same bounds, loss, gradients and weights. Two
    updates (train.mini_batches=2): the second's ratios are off 1 (the first moved the weights)."""
    from rollover.train.trainer import Trainer

    # negative advantages dominate the update, not every micro-batch: the bounds leave their start
    rolls = [rollout(f"g{i % 4}", [5 + i, 6, 7], [8 + i] * (2 + i % 4), float((3 * i) % 5) - 2.5) for i in range(12)]
    batch = batch_of(rolls)
    grads, after, metrics = [], [], []
    for mbt in (64, 16):
        cfg = tiny_cfg(model_dir, tmp_path / f"r{mbt}", **{"train.micro_batch_tokens": mbt, "train.pack_length": 16,
                                                             "data.max_prompt_tokens": 10, "train.mini_batches": 2,
                                                             "algorithm.loss": "bapo", "train.lr": 0.02})
        torch.manual_seed(0)
        model = tiny_model("llama", seed=5)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        tr = Trainer(model, cfg, device=torch.device("cpu"))
        seen, real_step = [], tr.optimizer.step

        def step(*a, **kw):  # each update's gradient the optimizer sees (see the tests above)
            seen.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            return real_step(*a, **kw)

        tr.optimizer.step = step
        m = tr.train_step(batch)
        assert (m["actor/micro_batches"] == 2) == (mbt == 64)  # the step's passes: one an update, or more
        grads.append(seen)
        after.append({n: p.detach().clone() for n, p in model.named_parameters()})
        metrics.append(m)
    # the means over the two updates: off the start bounds (0.6, 1.2) in some update, and inside their ranges
    assert metrics[0]["actor/bapo_c_low"] > 0.6 or metrics[0]["actor/bapo_c_high"] > 1.2
    assert 0.6 <= metrics[0]["actor/bapo_c_low"] <= 0.9 and 1.2 <= metrics[0]["actor/bapo_c_high"] <= 3.0
    assert metrics[0]["actor/ratio_max"] > 1.2 or metrics[0]["actor/clip_frac_low"] > 0  # the second update's r are off 1
    for k in ("actor/bapo_c_low", "actor/bapo_c_high"):
        assert metrics[1][k] == metrics[0][k], k
    for k in ("actor/bapo_pos_share", "actor/pg_loss", "actor/clip_frac_low", "actor/clip_frac_high"):
        assert metrics[1][k] == pytest.approx(metrics[0][k], rel=1e-5, abs=1e-7), k
    assert len(grads[0]) == len(grads[1]) == 2
    (first0, second0), (first1, second1) = grads
    assert first0.keys() == first1.keys() == second0.keys() == second1.keys() and first0
    for k in first0:
        assert torch.allclose(first0[k], first1[k], rtol=1e-4, atol=1e-7), k
        # the first Adam step (about lr x sign) moved tiny-gradient elements a little apart: the second
        # update's gradients agree to 1e-3 of their largest (bounds picked per micro-batch: ~1)
        assert float((second0[k] - second1[k]).abs().max()) <= 1e-3 * float(second0[k].abs().max()), k
    assert max(float((after[0][k] - start[k]).abs().max()) for k in start) > 0.5 * cfg.train.lr  # the step moved
    assert max(float((after[0][k] - after[1][k]).abs().max()) for k in start) < 0.05 * cfg.train.lr


def test_running_out_of_device_memory_halves_the_micro_batch_and_redoes_the_update(model_dir, tmp_path):
    """An update whose micro-batch exceeds what the device holds (here: a forward that raises
    torch.OutOfMemoryError above 32 tokens) is redone at half the size, down to one row; the
    gradient is the one a trainer set to that size computes, and the checkpoint keeps the size."""
    from rollover.train.trainer import Trainer

    rolls = [rollout(f"g{i % 3}", [5 + i, 6, 7], [8 + i] * (2 + i % 4), float(i % 3) - 1.0) for i in range(9)]

    def trainer(mbt, limit=None):
        cfg = tiny_cfg(model_dir, tmp_path / f"r{mbt}-{limit}", **{"train.micro_batch_tokens": mbt,
                                                                    "train.pack_length": 16, "data.max_prompt_tokens": 10})
        torch.manual_seed(0)
        tr = Trainer(tiny_model("llama", seed=5), cfg, device=torch.device("cpu"))
        seen, real_step, real_forward = {}, tr.optimizer.step, tr._forward

        def step(*a, **kw):
            seen.update({n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None})
            return real_step(*a, **kw)

        def forward(model, mb, *a, **kw):
            if limit is not None and mb.input_ids.numel() > limit:
                raise torch.OutOfMemoryError("planted: the micro-batch does not fit")
            return real_forward(model, mb, *a, **kw)

        tr.optimizer.step, tr._forward = step, forward
        return tr, seen

    tr, seen = trainer(64, limit=32)
    m = tr.train_step(batch_of(rolls))
    assert tr.micro_batch_tokens == 32 and m["skipped_step"] == 0
    ref, ref_seen = trainer(32)
    ref.train_step(batch_of(rolls))
    assert seen.keys() == ref_seen.keys() and seen
    for k in seen:
        assert torch.allclose(seen[k], ref_seen[k], rtol=1e-5, atol=1e-8), k
    fresh, _ = trainer(64)
    fresh.load_state_dict(tr.state_dict())
    assert fresh.micro_batch_tokens == 32
    other, _ = trainer(48)  # a run resumed with another size keeps its own
    other.load_state_dict(tr.state_dict())
    assert other.micro_batch_tokens == 48
    tight, _ = trainer(64, limit=8)  # not even one row of 16 fits: the error stands
    with pytest.raises(torch.OutOfMemoryError):
        tight.train_step(batch_of(rolls))
    assert tight.micro_batch_tokens == 16
    late, _ = trainer(64)  # in the optimizer step (not repeatable, not helped by smaller micro-batches)
    late.optimizer.step = lambda *a, **kw: (_ for _ in ()).throw(torch.OutOfMemoryError("planted"))
    with pytest.raises(torch.OutOfMemoryError):
        late.train_step(batch_of(rolls))
    assert late.micro_batch_tokens == 64
    rank, _ = trainer(64, limit=32)  # a sharded trainer's rank: its peers wait in their collectives, so it cannot redo alone
    rank.sharded = True
    with pytest.raises(RuntimeError, match=r"out of device memory at train.micro_batch_tokens=64: the sharded .*give a "
                                           r"smaller train.micro_batch_tokens"):
        rank.train_step(batch_of(rolls))
    assert rank.micro_batch_tokens == 64


def test_rollout_kl_is_the_k3_estimate_of_the_sampler_trainer_mismatch(model_dir, tmp_path):
    from rollover.train.trainer import Trainer

    rolls = [rollout("g", [5, 6, 7], [8, 9, 10], 1.0), rollout("g", [5, 6, 7], [11, 12], -1.0)]  # sampled at logprob -1
    cfg = tiny_cfg(model_dir, tmp_path, **{"train.pack_length": 16, "data.max_prompt_tokens": 10})
    tr = Trainer(tiny_model("llama", seed=5), cfg, device=torch.device("cpu"))
    batch = batch_of(rolls)
    log_r = tr.logprobs(batch)[batch.mask_BT] + 1.0  # log(trainer / sampler) per token
    expected = float((log_r.exp() - 1 - log_r).mean())
    assert tr.train_step(batch)["actor/rollout_kl"] == pytest.approx(expected, rel=1e-4) and expected > 0


def test_sync_run_end_to_end_and_engine_matches_trainer(model_dir, tmp_path):
    cfg = tiny_cfg(model_dir, tmp_path / "run", steps=2)
    run = build_run(cfg)
    from rollover.loops.sync import make_collector
    from rollover.loops.batch import train_batch_from

    collector = make_collector(run)
    groups, _ = collector.collect(0)
    batch, _ = train_batch_from(groups, cfg)
    # behaviour logprobs from the engine equal the trainer's forward on the same tokens
    assert torch.allclose(run.trainer.logprobs(batch)[batch.mask_BT], batch.behav_logp_BT[batch.mask_BT], atol=1e-4)
    run.trainer.train_step(batch)
    run.engine.update_weights(run.trainer.named_weights(), version=1)
    groups, _ = collector.collect(1)
    batch, _ = train_batch_from(groups, cfg)
    assert (batch.versions_BT[batch.mask_BT] == 1).all()
    assert torch.allclose(run.trainer.logprobs(batch)[batch.mask_BT], batch.behav_logp_BT[batch.mask_BT], atol=1e-4)
    run.close()

    result = train_sync(tiny_cfg(model_dir, tmp_path / "full", steps=3))
    rows = [json.loads(line) for line in open(tmp_path / "full" / "metrics.jsonl")]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    for key in ("reward/mean", "accuracy", "actor/grad_norm", "actor/entropy", "timing_s/generate", "timing_s/train",
                "timing_s/weight_sync", "response_length/clip_ratio", "rewards/numeric/mean", "actor/lr",
                "actor/rollout_kl"):
        assert key in train_rows[0], key
    # the push into the in-process engine reports what it handed over, as the Ray transports do
    n_bytes = sum(t.numel() * t.element_size() for t in tiny_model_state(model_dir).values())
    assert all(r["weights/bytes_per_worker"] == n_bytes and r["weights/full_tensors"] > 0 for r in train_rows)
    # an fp32 engine samples from the trainer's own distribution: no rollout-training mismatch to speak of
    assert all(0 <= r["actor/rollout_kl"] < 1e-6 for r in train_rows)
    assert {r["step"] for r in rows if r["kind"] == "eval"} == {0, 2, 3}
    assert "eval/accuracy" in result
    # the final checkpoint is loadable with from_pretrained
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "checkpoints" / "step_000003" / "model")


def tiny_model_state(model_dir) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).state_dict()


def _final_weights(run_dir, step):
    return load_file(str(run_dir / "checkpoints" / f"step_{step:06d}" / "model" / "model.safetensors"))


@pytest.mark.parametrize("extra", [{}, {"algorithm.dynamic_sampling": True}])
def test_resume_is_exact(model_dir, tmp_path, extra):
    straight = tmp_path / "straight"
    train_sync(tiny_cfg(model_dir, straight, steps=4, **extra))
    split = tmp_path / "split"
    train_sync(tiny_cfg(model_dir, split, steps=2, **extra))  # "killed" after its step-2 checkpoint
    train_sync(tiny_cfg(model_dir, split, steps=4, **extra))  # resume: auto
    a, b = _final_weights(straight, 4), _final_weights(split, 4)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    rows = lambda d: [json.loads(x) for x in open(d / "metrics.jsonl")]  # noqa: E731
    ra, rb = rows(straight), rows(split)
    assert [(r["step"], r["kind"]) for r in ra] == [(r["step"], r["kind"]) for r in rb]  # no duplicate steps
    assert [r.get("reward/mean") for r in ra] == [r.get("reward/mean") for r in rb]


def test_an_epoch_is_a_pass_over_the_prompts_a_selection_draws():
    """selection.candidates x prompts_per_step prompts are drawn a step when a selection policy
    chooses among them: 40 prompts, 3 a step, 2 candidates each: ceil(40 / 6) = 7 steps an
    epoch, not ceil(40 / 3) = 14 (which would pass over the data twice)."""
    from rollover.loops.prompts import _steps_from_epochs

    def steps(**over):
        cfg = load_config(model="m", run_dir="r", epochs=1, **{"rollout.prompts_per_step": 3, **over})
        _steps_from_epochs(cfg, 40)
        return cfg.steps

    assert steps() == 14
    assert steps(**{"selection.policy": "thompson", "selection.candidates": 2}) == 7
    assert steps(**{"selection.allocation": "xrpo"}) == 14  # the data order: nothing passed over


def test_epochs_set_the_steps_from_the_training_prompts(model_dir, tmp_path):
    """epochs=0.1 over 111 training prompts (120 less every row of the 6 held-out questions), 3 a
    step: ceil(11.1 / 3) = 4 steps, recorded as steps; the same run given more epochs goes on
    from its checkpoint."""
    import yaml

    run = tmp_path / "r"
    train_sync(tiny_cfg(model_dir, run, epochs=0.1, **{"eval.every": 0}))
    steps = lambda: [r["step"] for r in map(json.loads, open(run / "metrics.jsonl")) if r["kind"] == "train"]  # noqa: E731
    assert steps() == [1, 2, 3, 4]
    epochs = [r["data/epochs"] for r in map(json.loads, open(run / "metrics.jsonl")) if r["kind"] == "train"]
    assert epochs == [pytest.approx(3 * k / 111) for k in (1, 2, 3, 4)]  # 3 prompts a step of 111
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    assert recorded["steps"] == 4 and recorded["epochs"] is None
    train_sync(tiny_cfg(model_dir, run, epochs=0.2, **{"eval.every": 0}))  # ceil(22.2 / 3) = 8
    assert steps() == list(range(1, 9))


def test_reinforce_pp_trains_one_sample_a_prompt(model_dir, tmp_path):
    """algorithm.advantage=reinforce_pp with samples_per_prompt=1: every group is a singleton, and
    each still trains (its reward against the step's)."""
    run = tmp_path / "r"
    train_sync(tiny_cfg(model_dir, run, steps=2, **{"rollout.samples_per_prompt": 1, "rollout.prompts_per_step": 6,
                                                    "algorithm.advantage": "reinforce_pp", "eval.every": 0,
                                                    "rollout.temperature": 1.5}))
    rows = [r for r in map(json.loads, open(run / "metrics.jsonl")) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    assert any(r["actor/pg_loss"] != 0 for r in rows)  # the singletons carried a signal
    assert any(r["reward/std"] > 0 for r in rows) and all(r["actor/grad_norm"] > 0 for r in rows if r["reward/std"] > 0)


def test_remax_trains_each_sample_against_its_prompts_greedy_answer(model_dir, tmp_path):
    """algorithm.advantage=remax: each group's first request decodes greedily; its answer is scored,
    logged as the baseline and never trained, and each sample's advantage is its reward less it."""
    run = tmp_path / "r"
    train_sync(tiny_cfg(model_dir, run, steps=2, **{"rollout.samples_per_prompt": 2, "algorithm.advantage": "remax",
                                                    "eval.every": 0, "rollout.temperature": 1.5, "logging.samples": 1}))
    rows = [r for r in map(json.loads, open(run / "metrics.jsonl")) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2] and all("reward/greedy_mean" in r for r in rows)
    ledger = [json.loads(line) for line in open(run / "trained_groups.jsonl")]
    assert all(g["samples"] == 2 for step in ledger for g in step["groups"])  # the greedy answer is not trained
    greedy_rewards, advantages = [], []
    for step in (1, 2):
        samples = [json.loads(line) for line in open(run / "samples" / f"step_{step:06d}.jsonl")][1:]
        for gid in {r["group"] for r in samples}:
            mine = [r for r in samples if r["group"] == gid]
            greedy = [r for r in mine if r["sample"] == "greedy"]
            assert len(greedy) == 1 and not greedy[0]["trained"] and greedy[0]["dropped"] == "greedy"
            for r in mine:
                if r is not greedy[0]:
                    assert r["trained"] and r["advantage"] == pytest.approx(r["reward"] - greedy[0]["reward"], abs=1e-6)
            greedy_rewards.append(greedy[0]["reward"])
            advantages += [r["advantage"] for r in mine if r is not greedy[0]]
        assert rows[step - 1]["reward/greedy_mean"] == pytest.approx(
            sum(greedy_rewards[-3:]) / 3, abs=1e-6)  # 3 prompts a step
    assert any(a != 0 for a in advantages)  # some samples scored other than their greedy answer


@pytest.mark.parametrize("advantage, loss", [("opo", None), ("gpg", "reinforce"), ("grpo_passk", None), ("otb", None)])
def test_verls_other_estimators_train(model_dir, tmp_path, advantage, loss):
    """opo (its lengths from the samples' loss masks), gpg with the plain policy gradient, pass@k
    and the optimal token baseline train through the loop: a step with a signal moves the weights."""
    run = tmp_path / "r"
    over = {"algorithm.advantage": advantage, "eval.every": 0, "rollout.temperature": 1.5, "steps": 2,
            **({"algorithm.loss": loss} if loss else {})}
    train_sync(tiny_cfg(model_dir, run, **over))
    rows = [r for r in map(json.loads, open(run / "metrics.jsonl")) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    assert any(r["actor/grad_norm"] > 0 for r in rows) and all(r["actor/clip_frac_high"] == 0 for r in rows if loss)
    assert all(r.get("otb/path_energy", 0) > 0 for r in rows) == (advantage == "otb")


def test_remax_greedy_request_and_its_checks():
    from dataclasses import replace

    from rollover.config import ConfigError
    from rollover.rollout.groups import PendingGroup
    from rollover.types import Prompt, SamplingParams

    pg = PendingGroup(id="g0", prompt=Prompt(id="p", messages=[]), prompt_ids=[1, 2], serial=0, n=3, start_version=0,
                      greedy_first=True)
    sp = SamplingParams(temperature=0.9, top_p=0.8)
    assert pg.request(0, sp, 7).sampling.temperature == 0.0
    assert [pg.request(j, sp, 7).sampling.temperature for j in (1, 2)] == [0.9, 0.9]
    assert replace(pg, greedy_first=False).request(0, sp, 7).sampling.temperature == 0.9
    with pytest.raises(ConfigError, match="remax with selection.dars"):
        load_config(model="unused", run_dir="unused", **{"algorithm.advantage": "remax", "selection.dars": "equal"})
    with pytest.raises(ConfigError, match="env.credit=gigpo .* algorithm.advantage=opo"):
        load_config(model="unused", run_dir="unused", **{"algorithm.advantage": "opo", "env.name": "countdown",
                                                         "env.credit": "gigpo"})


def test_a_misspelt_engine_option_is_named_with_the_engines_options(model_dir, tmp_path):
    from rollover.config import ConfigError

    with pytest.raises(ConfigError, match="TorchEngine has no option 'gpu_mem'; its options: max_prefill_tokens"):
        build_run(tiny_cfg(model_dir, tmp_path / "r", **{"rollout.engine_options": {"gpu_mem": 0.5}}))


def test_a_model_name_that_names_nothing_fails_at_once_saying_why(tmp_path, monkeypatch):
    from rollover.models import resolve_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on a machine without the hub: no download's retries
    with pytest.raises(ValueError, match=r"'models/tiny': no such local path \(.*models/tiny\), and as a hub id it is "
                                         "not in the Hugging Face cache and the hub cannot be reached"):
        resolve_model("models/tiny")
    with pytest.raises(ValueError, match="the embedded smollm2-135m-instruct is this model"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="'nothing' is no local path .* no hub id .* and no alias"):
        resolve_model("nothing")
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # the hub may be reachable only through it
    assert resolve_model("owner/model") == "owner/model"


def fail_from_step(monkeypatch, step: int, flags: dict) -> dict:
    """flags["fail"] turns true once the sync loop has recorded step `step` (flags["after"])."""
    import rollover.loops.sync as sync_mod

    real = sync_mod.record_step
    flags.update(fail=False, after=step)

    def record(run, at, *a, **k):
        real(run, at, *a, **k)
        flags["fail"] = at >= flags["after"]

    monkeypatch.setattr(sync_mod, "record_step", record)
    return flags


def test_reward_errors_raise_zero_skip(model_dir, tmp_path, monkeypatch):
    import rollover.rewards.builtins as builtins

    calls = {"n": 0}

    def flaky(completion, answer, **kw):
        calls["n"] += 1
        if calls["n"] % 4 == 0:
            raise RuntimeError("judge unavailable")
        return 1.0

    monkeypatch.setattr(builtins, "flaky_test_reward", flaky, raising=False)
    fn = [{"fn": "rollover.rewards.builtins:flaky_test_reward", "name": "flaky"}]
    with pytest.raises(RewardFailed, match=r"'flaky' failed .*judge unavailable \(the run stopped in its first step: "
                                           r"nothing was trained\)") as info:
        train_sync(tiny_cfg(model_dir, tmp_path / "raise", steps=1, **{"reward.functions": fn, "eval.at_start": False}))
    assert repr(info.value.__cause__) == "RuntimeError('judge unavailable')"  # the reward's own, as documented
    # failing in step 4 under APRIL: its requests carried in the engine cannot be set back, so
    # the latest checkpoint is step 2's
    fail_from_step(monkeypatch, 3, calls)
    monkeypatch.setattr(builtins, "flaky_test_reward", lambda *a, **k: 1 / 0 if calls["fail"] else 1.0)
    with pytest.raises(RewardFailed, match=r"ZeroDivisionError.*\(the run stopped after step 3; its latest checkpoint is "
                                           r"step 2, so a resume trains step 3 again"):
        train_sync(tiny_cfg(model_dir, tmp_path / "late", **{"reward.functions": fn, "eval.at_start": False,
                                                             "partial_rollout.enabled": True,
                                                             "partial_rollout.oversample": 1.0}))
    monkeypatch.undo()
    monkeypatch.setattr(builtins, "flaky_test_reward", flaky, raising=False)
    calls["n"] = 0
    train_sync(tiny_cfg(model_dir, tmp_path / "zero", steps=1, **{"reward.functions": fn, "reward.on_error": "zero",
                                                                   "eval.at_start": False, "eval.every": 0}))
    row = next(json.loads(x) for x in open(tmp_path / "zero" / "metrics.jsonl") if '"train"' in x)
    assert row["rollout/rewards/flaky/errors"] >= 1 and row["rollout/reward_errors"] >= 1
    calls["n"] = 0
    train_sync(tiny_cfg(model_dir, tmp_path / "skip", steps=1, **{"reward.functions": fn, "reward.on_error": "skip",
                                                                   "eval.at_start": False, "eval.every": 0}))
    row = next(json.loads(x) for x in open(tmp_path / "skip" / "metrics.jsonl") if '"train"' in x)
    # a skipped sample leaves its group, which trains on the rest (tests/test_failed_samples.py)
    assert row["rollout/dropped_samples"] == row["rollout/rewards/flaky/errors"] >= 1
    assert row["groups"] == 3 - row["rollout/skipped_groups"]


def test_a_reward_timeout_and_its_stuck_thread_reach_the_runs_metrics(model_dir, tmp_path, monkeypatch):
    """The first call hangs past reward.timeout_s: counted as its function's timeout (and error),
    and its abandoned thread, alive until released, as reward/stuck_threads."""
    import threading

    import rollover.rewards.builtins as builtins

    release, calls = threading.Event(), {"n": 0}

    def slow(completion, answer, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            release.wait(60)
        return 1.0

    monkeypatch.setattr(builtins, "slow_test_reward", slow, raising=False)
    fn = [{"fn": "rollover.rewards.builtins:slow_test_reward", "name": "slow"}]
    try:
        train_sync(tiny_cfg(model_dir, tmp_path, steps=1, **{"reward.functions": fn, "reward.on_error": "zero",
                                                             "reward.timeout_s": 0.5, "eval.at_start": False,
                                                             "eval.every": 0}))
    finally:
        release.set()
    row = next(json.loads(x) for x in open(tmp_path / "metrics.jsonl") if '"train"' in x)
    assert row["rollout/rewards/slow/timeouts"] == row["rollout/rewards/slow/errors"] == 1
    assert row["reward/stuck_threads"] == 1


@pytest.mark.parametrize("extra", [{}, {"selection.policy": "thompson"}])
def test_a_reward_failing_mid_step_saves_the_steps_trained_and_the_resume_is_exact(model_dir, tmp_path, monkeypatch,
                                                                                    extra):
    """reward.on_error=raise in step 4's collection, 2 steps after the last checkpoint: the state
    from before that collection is saved as step 3's checkpoint, and a resume with a reward that
    no longer fails trains as a run that never stopped (same data, prompt choices and weights)."""
    import rollover.rewards.builtins as builtins

    calls = fail_from_step(monkeypatch, 3, {})

    def parity(completion, answer, **kw):
        if calls["fail"]:
            raise ZeroDivisionError("judge crashed")
        return float(len(completion) % 2)

    monkeypatch.setattr(builtins, "parity_test_reward", parity, raising=False)
    cfg = lambda d: tiny_cfg(model_dir, tmp_path / d, **{"reward.functions": ["rollover.rewards.builtins:parity_test_reward"],  # noqa: E731
                                                         "eval.at_start": False, "checkpoint.every": 2, **extra})
    with pytest.raises(RewardFailed, match=r"judge crashed \(a checkpoint of step 3 was saved: a resume continues from it\)"):
        train_sync(cfg("split"))
    assert sorted(p.name for p in (tmp_path / "split" / "checkpoints").glob("step_*")) == ["step_000002", "step_000003"]
    calls.update(fail=False, after=10**9)
    train_sync(cfg("split"))  # resume: auto, from step 3
    train_sync(cfg("straight"))
    a, b = _final_weights(tmp_path / "straight", 4), _final_weights(tmp_path / "split", 4)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    rows = lambda d: [(r["step"], r["kind"], r.get("reward/mean"), r.get("samples_consumed_total"))  # noqa: E731
                      for r in map(json.loads, open(tmp_path / d / "metrics.jsonl"))]
    assert rows("split") == rows("straight")


def test_nan_loss_skips_then_stops_with_checkpoint(model_dir, tmp_path, monkeypatch):
    import rollover.train.trainer as trainer_mod

    real = trainer_mod.aggregate
    monkeypatch.setattr(trainer_mod, "aggregate", lambda *a, **k: real(*a, **k) * float("nan"))
    cfg = tiny_cfg(model_dir, tmp_path / "nan", steps=5, **{"train.max_bad_steps": 2, "eval.at_start": False})
    before = tiny_model("llama", seed=3).state_dict()
    with pytest.warns(RuntimeWarning, match="non-finite"):
        with pytest.raises(TooManyBadSteps, match="2 steps in a row"):
            train_sync(cfg)
    saved = _final_weights(tmp_path / "nan", 2)
    for k, v in saved.items():  # nothing was applied
        assert torch.equal(v, before[k]), k


def test_lora_targets_are_checked_against_the_model():
    """A misspelt target beside a valid one names no module (peft drops it without a word); a
    tied embedding or head would be merged into both while training adapts one."""
    pytest.importorskip("peft")
    from rollover.train.lora import apply_lora

    with pytest.raises(ValueError, match=r"'k_prj' names no module of this model; its modules' names end in: .*k_proj"):
        apply_lora(tiny_model("llama", seed=5), {"r": 4, "target_modules": ["q_proj", "k_prj"]})
    for target in ("embed_tokens", "lm_head"):
        with pytest.raises(ValueError, match=f"'{target}' is one of the input embedding and output head this model ties"):
            apply_lora(tiny_model("llama", seed=5, tie_word_embeddings=True), {"r": 4, "target_modules": ["q_proj", target]})
    # a regular expression is matched by peft: what it adapted is checked
    with pytest.raises(ValueError, match=r"'.\*\(embed_tokens\|q_proj\)' adapts .*embed_tokens, one of the input embedding"):
        apply_lora(tiny_model("llama", seed=5, tie_word_embeddings=True), {"r": 4, "target_modules": ".*(embed_tokens|q_proj)"})
    apply_lora(tiny_model("llama", seed=5, tie_word_embeddings=False), {"r": 4, "target_modules": ["q_proj", "embed_tokens"]})
    apply_lora(tiny_model("llama", seed=5, tie_word_embeddings=True), {"r": 4, "target_modules": ".*(q_proj|v_proj)"})
    apply_lora(tiny_model("llama", seed=5, tie_word_embeddings=True), {"r": 4})  # all-linear: the head is not adapted


def test_a_lora_checkpoint_resumes_only_under_its_own_adapters_shape(tmp_path):
    """An adapter goes on with the rank, scale and targets it was saved with: another train.lora
    was recorded as applied under --allow-config-change and silently ignored."""
    from rollover.config import ConfigError, dump_config
    from rollover.loops.resume import check_lora_matches

    saved = {"train.lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}}
    ckpt = tmp_path / "checkpoints" / "step_000002"
    (ckpt / "adapter").mkdir(parents=True)
    (ckpt / "config.yaml").write_text(dump_config(load_config(model="m", run_dir="r", **saved)))
    check_lora_matches(load_config(model="m", run_dir="r", **{"train.lora": {"r": 4, "alpha": 8, "dropout": 0.0,
                                                                            "target_modules": ["v_proj", "q_proj"]}}), ckpt)
    with pytest.raises(ConfigError, match=r"holds an adapter of train.lora=\{'r': 4.*this config's is \{'r': 8.*own shape"):
        check_lora_matches(load_config(model="m", run_dir="r", **{"train.lora": {"r": 8, "alpha": 8,
                                                                                "target_modules": ["q_proj", "v_proj"]}}), ckpt)


def test_lora_run_syncs_merged_weights(model_dir, tmp_path):
    pytest.importorskip("peft")
    cfg = tiny_cfg(model_dir, tmp_path / "lora", steps=2, **{"train.lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                                                            "train.lr": 5e-2})
    run = build_run(cfg)
    from rollover.loops.sync import make_collector
    from rollover.loops.batch import train_batch_from

    collector = make_collector(run)
    base = {n: p.detach().clone() for n, p in run.trainer.model.named_parameters() if "lora_" not in n}
    groups, _ = collector.collect(0)
    batch, _ = train_batch_from(groups, cfg)
    run.trainer.train_step(batch)
    for _ in range(3):  # merging in and out in place rounds: the frozen base drifted from the checkpoint's
        weights = run.trainer.named_weights()
    assert all(torch.equal(p, base[n]) for n, p in run.trainer.model.named_parameters() if "lora_" not in n)
    run.engine.update_weights(weights, version=1)
    groups, _ = collector.collect(1)
    batch, _ = train_batch_from(groups, cfg)
    got = run.trainer.logprobs(batch)[batch.mask_BT]
    assert torch.allclose(got, batch.behav_logp_BT[batch.mask_BT], atol=1e-4)
    trainable = [n for n, p in run.trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    run.close()


def test_bad_rows_skip_and_long_prompts_rejected(model_dir, tmp_path):
    from rollover.config import ConfigError

    data = tmp_path / "d.jsonl"
    rows = [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": 5, "answer": "x"}, {"answer": "3"}] + [
        {"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(20)]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ValueError, match="d.jsonl line 2"):
        build_run(tiny_cfg(model_dir, tmp_path / "r1", **{"data.train": str(data)}))
    run = build_run(tiny_cfg(model_dir, tmp_path / "r2", **{"data.train": str(data), "data.on_bad_row": "skip"}))
    assert run.data_skipped == 2
    run.close()
    with pytest.raises(ConfigError, match="data.max_prompt_tokens"):
        build_run(tiny_cfg(model_dir, tmp_path / "r3", **{"data.train": str(data), "data.on_bad_row": "skip",
                                                          "data.max_prompt_tokens": 10}))


def test_cli_train_eval_plot(model_dir, tmp_path, capsys):
    from rollover.cli import main

    run_dir = tmp_path / "run"
    over = [f"model={model_dir}", f"run_dir={run_dir}", "steps=2", "seed=7", "data.train=gen:arithmetic?n=60",
            "data.eval_size=4", "data.max_prompt_tokens=64", "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4", "rollout.max_rows=4",
            "reward.functions=[numeric]", "eval.every=0", "eval.samples_per_prompt=1", "checkpoint.every=2",
            "logging.progress=false", "logging.tensorboard=false"]
    assert main(["train", *over]) == 0
    out = capsys.readouterr().out
    assert "done: step 2" in out and "held-out accuracy" in out
    ckpt = run_dir / "checkpoints" / "step_000002"
    assert (ckpt / "DONE").exists()

    assert main(["eval", *over, "--checkpoint", str(ckpt)]) == 0
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines() if ": " in line)
    assert 0.0 <= float(lines["eval/accuracy"]) <= 1.0 and int(lines["eval/samples"]) == 4
    assert float(lines["eval/pass_at_k"]) == float(lines["eval/accuracy"])  # k = eval.samples_per_prompt = 1

    assert main(["plot", str(run_dir), "--out", str(tmp_path / "figs")]) == 0
    pngs = capsys.readouterr().out.split()
    assert pngs and all(p.endswith(".png") and Path(p).parent == tmp_path / "figs" for p in pngs)
    assert main(["eval", *over, "rollout.max_new_tokenz=4"]) == 2
    assert "max_new_tokens" in capsys.readouterr().err


def test_loss_metrics_are_means_over_their_own_tokens_and_maxima_over_any_split():
    """metric_sums: a split's sums give the whole's metrics, each mean over its own token set
    (given, IS-looked-at, kept), maxima the largest, neither reported over no token."""
    from rollover.train.metric_sums import add_metrics, mean_metrics, reduce_sums

    parts = [({"masked_frac": 0.5, "is_clip_frac": 0.25, "clip_frac_high": 0.5, "ratio_max": 1.5},
              {"masked_frac": 4, "is": 4, "": 2}),
             ({"masked_frac": 0.0, "is_clip_frac": 1.0, "clip_frac_high": 0.0, "ratio_max": 9.0},
              {"masked_frac": 2, "is": 2, "": 0}),  # nothing kept: its ratio_max is no value
             ({"masked_frac": 0.0, "is_clip_frac": 0.0, "clip_frac_high": 1.0, "ratio_max": 1.2},
              {"masked_frac": 2, "is": 2, "": 2})]
    ranks = [{}, {}]
    for i, (m, n) in enumerate(parts):
        add_metrics(ranks[i % 2], m, n)
    got = mean_metrics(reduce_sums(ranks))
    assert got["masked_frac"] == pytest.approx((0.5 * 4) / 8)
    assert got["is_clip_frac"] == pytest.approx((0.25 * 4 + 1.0 * 2) / 8)
    assert got["clip_frac_high"] == pytest.approx((0.5 * 2 + 1.0 * 2) / 4)
    assert got["ratio_max"] == 1.5
    none = {}
    add_metrics(none, {"ratio_max": 3.0, "approx_kl": 0.1}, {"masked_frac": 1, "is": 1, "": 0})
    assert mean_metrics(none) == {}  # neither a max nor a mean over no token is a value


def test_dropout_is_off_while_training_unless_asked_for(model_dir, tmp_path):
    """train.disable_dropout (default): a model with attention dropout gives the trainer the same
    logprobs on every pass (those of the model without dropout), and its config keeps its rate."""
    from rollover.train.trainer import Trainer, disable_dropout

    batch = batch_of([rollout("g", [5, 6, 7], [8, 9, 10, 11], 1.0), rollout("g", [5, 6, 7], [12, 13], -1.0)])
    over = {"train.pack_length": 16, "data.max_prompt_tokens": 10}
    plain = Trainer(tiny_model("llama", seed=5), tiny_cfg(model_dir, tmp_path / "p", **over), device=torch.device("cpu"))
    model = tiny_model("llama", seed=5, attention_dropout=0.5)
    tr = Trainer(model, tiny_cfg(model_dir, tmp_path / "a", **over), device=torch.device("cpu"))
    assert model.training and model.config.attention_dropout == 0.5
    first = tr.logprobs(batch)
    assert torch.equal(first, tr.logprobs(batch)) and torch.allclose(first, plain.logprobs(batch), atol=1e-6)
    kept = Trainer(tiny_model("llama", seed=5, attention_dropout=0.5),
                   tiny_cfg(model_dir, tmp_path / "k", **over, **{"train.disable_dropout": False}),
                   device=torch.device("cpu"))
    torch.manual_seed(0)
    noisy = kept.logprobs(batch)
    assert not torch.allclose(noisy, kept.logprobs(batch)) and not torch.allclose(noisy, first)

    from transformers import PersimmonConfig, PersimmonForCausalLM

    # Persimmon reads its attention dropout from its config in the forward: the inner modules get a
    # copy at 0, the model's own config (what save_pretrained writes) keeps the rate
    persimmon = PersimmonForCausalLM(PersimmonConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=2, num_attention_heads=4, attention_dropout=0.5,
                                                     max_position_embeddings=64)).train()
    assert "config.attention_dropout=0.5" in disable_dropout(persimmon)
    x = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        assert torch.equal(persimmon(x).logits, persimmon(x).logits)
    assert persimmon.config.attention_dropout == 0.5 and persimmon.model.config.attention_dropout == 0.0
    persimmon.save_pretrained(tmp_path / "persimmon")
    assert json.loads((tmp_path / "persimmon" / "config.json").read_text())["attention_dropout"] == 0.5

    class Block(torch.nn.Module):  # a rate kept as a number, as some architectures do
        def __init__(self):
            super().__init__()
            self.hidden_dropout, self.resid_pdrop, self.scale = 0.1, 0.2, 0.5
            self.drop = torch.nn.Dropout(0.3)

    block = Block()
    assert disable_dropout(block) == ["hidden_dropout=0.1", "resid_pdrop=0.2", "Dropout=0.3"]
    assert (block.hidden_dropout, block.resid_pdrop, block.drop.p, block.scale) == (0.0, 0.0, 0.0, 0.5)
    assert disable_dropout(block) == []
    with pytest.raises(ValueError, match=r"train.lora.dropout=0.1 would be set to 0 by train.disable_dropout"):
        tiny_cfg(model_dir, tmp_path / "l", **{"train.lora": {"r": 4, "alpha": 8, "dropout": 0.1}})
    tiny_cfg(model_dir, tmp_path / "l", **{"train.lora": {"r": 4, "alpha": 8, "dropout": 0.1}, "train.disable_dropout": False})


def test_pass_at_k_is_the_share_of_prompts_with_a_correct_sample():
    from rollover.rollout.groups import pass_at_k

    assert pass_at_k([[False, True, False], [False, False, False], [True, True, True], [False, False, True]]) == 0.75
    assert pass_at_k([]) == 0.0


def test_a_held_out_file_gives_eval_size_prompts_that_fit_whatever_its_first_rows(model_dir, tmp_path):
    """data.eval with data.on_bad_row=skip: prompts over data.max_prompt_tokens are passed over, and
    the held-out set is the first eval_size that fit (of each named set), not fewer, nor none."""
    rows = [{"prompt": "x" * 200, "answer": "1"} for _ in range(3)] + [{"prompt": f"{i}+1=", "answer": str(i + 1)}
                                                                       for i in range(10)]
    path = tmp_path / "held.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    for held, want in ((str(path), [f"held:{i}" for i in range(3, 7)]),
                       ({"a": str(path), "b": str(path)}, [f"{n}/held:{i}" for n in "ab" for i in range(3, 7)])):
        run = build_run(tiny_cfg(model_dir, tmp_path / "r", **{"data.eval": held, "data.eval_size": 4,
                                                               "data.on_bad_row": "skip"}), record=False)
        try:
            assert [p.id for p in run.eval_prompts] == want
        finally:
            run.close()


def test_several_held_out_sets_are_reported_together_and_each_on_its_own(model_dir, tmp_path):
    """data.eval as {name: source}: every set's first eval_size prompts, ids under the set's name
    (the same file twice does not collide), eval/<name>/* beside the whole's; a single source with
    a data_source column (verl's) is split by it."""
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "data_source": "even" if i % 2 == 0 else "odd"}
            for i in range(8)]
    path = tmp_path / "held.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    over = {"data.eval_size": 3, "eval.samples_per_prompt": 2,
            "reward.functions": [{"fn": "format", "kwargs": {"pattern": "[0-9]"}}]}
    run = build_run(tiny_cfg(model_dir, tmp_path / "two", **over, **{"data.eval": {"a": str(path), "b": str(path)}}),
                    record=False)
    try:
        assert [p.id.split("/")[0] for p in run.eval_prompts] == ["a"] * 3 + ["b"] * 3
        m = run.evaluate(0)
    finally:
        run.close()
    assert m["eval/samples"] == m["eval/a/samples"] + m["eval/b/samples"] == 12
    for k in ("accuracy", "reward_mean"):  # the whole is the sets' mean, weighted by their samples
        assert m[f"eval/{k}"] == pytest.approx((m[f"eval/a/{k}"] * 6 + m[f"eval/b/{k}"] * 6) / 12)
    assert m["eval/pass_at_k"] == pytest.approx((m["eval/a/pass_at_k"] + m["eval/b/pass_at_k"]) / 2)
    run = build_run(tiny_cfg(model_dir, tmp_path / "one", **{**over, "data.eval": str(path), "data.eval_size": 8}),
                    record=False)
    try:
        m = run.evaluate(0)
    finally:
        run.close()
    assert m["eval/even/samples"] == m["eval/odd/samples"] == 8 and "eval/a/samples" not in m
    run = build_run(tiny_cfg(model_dir, tmp_path / "named", **{**over, "data.eval": {2024: str(path)}}), record=False)
    try:  # one named set is reported by its name too (a YAML year is a name)
        m = run.evaluate(0)
    finally:
        run.close()
    assert m["eval/2024/samples"] == m["eval/samples"] == 6
    with pytest.raises(ValueError, match=r"set names \['a/b'\]: each must be a non-blank string without '/'"):
        tiny_cfg(model_dir, tmp_path / "bad", **{"data.eval": {"a/b": str(path)}})


def test_maj_at_k_scores_each_prompts_most_common_answer():
    from rollover.rollout.groups import maj_at_k

    prompts = [
        [("so \\boxed{4}", True), ("\\boxed{ 4.0 }", True), ("\\boxed{5}", False)],  # 4 twice: right
        [("<answer>7</answer>", False), ("it is 7", False), ("\\boxed{6}", True)],  # 7 twice: wrong
        [("It is 8", False), ("The answer is 7.", True), ("3 + 4 = 7", True), ("So the sum is 7", True)],  # 7 thrice
        [("\\boxed{yes}", True), ("<answer> Yes. </answer>", True), ("no idea", False), ("none", False)],  # text
        [("\\boxed{1}", False), ("\\boxed{2}", True)],  # a tie: the first seen, wrong
        [("no number", True)],  # no answer to vote for: wrong
        [],  # every sample failed: wrong
    ]
    assert maj_at_k(prompts) == pytest.approx(3 / 7)


def test_the_best_checkpoint_by_an_evaluation_metric_is_kept_and_exported(model_dir, tmp_path, capsys):
    """checkpoint.best: every checkpoint holds its step's evaluation; the best one by the metric
    stays beside the last `keep`, and export / eval --best take it."""
    from rollover.cli import main

    run_dir = tmp_path / "run"
    cfg = tiny_cfg(model_dir, run_dir, steps=4, **{"eval.every": 1, "checkpoint.every": 1, "checkpoint.keep": 1,
                                                    "checkpoint.best": "eval/response_length", "checkpoint.best_mode": "min",
                                                    "rollout.max_new_tokens": 8})
    train_sync(cfg)
    evals = {r["step"]: r for r in map(json.loads, open(run_dir / "metrics.jsonl")) if r["kind"] == "eval"}
    lengths = {s: evals[s]["eval/response_length"] for s in (1, 2, 3, 4)}
    best = min(lengths, key=lambda s: (lengths[s], s))
    assert best != 4  # the best is not the latest here: two checkpoints stay
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert kept == sorted({f"step_{best:06d}", "step_000004"})
    for name in kept:
        saved = json.loads((run_dir / "checkpoints" / name / "eval.json").read_text())
        assert saved["eval/response_length"] == pytest.approx(lengths[int(name[5:])])
    assert main(["export", str(run_dir), str(tmp_path / "out"), "--best"]) == 0
    assert f"exported {run_dir / 'checkpoints' / f'step_{best:06d}'}" in capsys.readouterr().out
    assert main(["eval", str(run_dir), "--best"]) == 0
    assert f"step_{best:06d} (step {best}) [--best]" in capsys.readouterr().out
    held = tmp_path / "held.jsonl"  # evaluated on other held-out data than the run carved for itself
    held.write_text("\n".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) for i in range(3)))
    assert main(["eval", str(run_dir), f"data.eval={held}"]) == 0
    assert "eval/samples: " in capsys.readouterr().out


@pytest.mark.parametrize("over,message", [
    ({"checkpoint.best": "accuracy"}, "names an evaluation metric"),
    ({"checkpoint.best": "eval/accuracy", "eval.every": 2, "checkpoint.every": 3}, "must be a multiple of eval.every=2"),
    ({"checkpoint.best": "eval/accurcy"}, r"checkpoint.best=eval/accurcy is not among the evaluation's metrics: .*eval/accuracy"),
])
def test_a_best_metric_that_cannot_be_kept_is_refused_before_the_run(model_dir, tmp_path, over, message):
    from rollover.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match=message):
        build_run(tiny_cfg(model_dir, tmp_path / "run", **over))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_named_training_sources_are_mixed_at_their_weights_and_held_out_per_source(model_dir, tmp_path):
    """data.train: {name: source} with data.train_weights: prompt ids under their source's name,
    the mix drawn by weight, the held-out prompts carved from each reported per source."""
    for name, n in (("small", 30), ("big", 300)):
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps({"prompt": f"{name} {i}+1=", "answer": str(i + 1)})
                                                          for i in range(n)))
    over = {"data.train": {"small": str(tmp_path / "small.jsonl"), "big": str(tmp_path / "big.jsonl")},
            "data.train_weights": {"small": 1, "big": 1}, "data.eval_size": 40, "eval.samples_per_prompt": 1}
    run = build_run(tiny_cfg(model_dir, tmp_path / "run", **over), record=False)
    try:
        drawn = [p.id for p in run.train_iter.next_batch(400)]
        held = {p.id for p in run.eval_prompts}
        m = run.evaluate(0)
    finally:
        run.close()
    share = sum(i.startswith("small/") for i in drawn) / len(drawn)
    assert abs(share - 0.5) < 0.08  # equal weights: half each, though one source is ten times the other
    assert {i.split("/")[0] for i in held} == {"small", "big"} and not held & set(drawn)  # carved from each, apart
    assert m["eval/small/samples"] + m["eval/big/samples"] == m["eval/samples"] == len(held)
    from rollover.loops.sync import train_sync

    train_sync(tiny_cfg(model_dir, tmp_path / "trained", **over, steps=2))
    for row in (r for r in map(json.loads, open(tmp_path / "trained" / "metrics.jsonl")) if r["kind"] == "train"):
        assert row.get("source/small/samples", 0) + row.get("source/big/samples", 0) == row["samples"]
        parts = [(row[f"source/{n}/reward_mean"], row[f"source/{n}/samples"]) for n in ("small", "big")
                 if f"source/{n}/samples" in row]
        assert sum(r * k for r, k in parts) / row["samples"] == pytest.approx(row["reward/mean"], rel=1e-5)
    with pytest.raises(ValueError, match=r"data.train_weights names \['a'\]; data.train has one source"):
        tiny_cfg(model_dir, tmp_path / "bad", **{"data.train_weights": {"a": 1}})


def test_resuming_from_an_earlier_checkpoint_sets_the_later_ones_aside(model_dir, tmp_path):
    """A run resumed at step 2 of 4 drops the metrics after step 2 and sets checkpoints 3 and 4
    aside (moved, not deleted): the continuation's own step 3 and its best are what the run dir
    holds, never the abandoned branch's."""
    from rollover.train.checkpoint import best_checkpoint, checkpoint_dir

    run = tmp_path / "run"
    over = {"checkpoint.every": 1, "checkpoint.keep": 10, "eval.every": 1}
    train_sync(tiny_cfg(model_dir, run, steps=4, **over))
    old_3 = (checkpoint_dir(run) / "step_000003" / "state.pt").read_bytes()
    train_sync(tiny_cfg(model_dir, run, steps=3, resume=str(checkpoint_dir(run) / "step_000002"), **over))
    assert sorted(p.name for p in checkpoint_dir(run).glob("step_*")) == ["step_000001", "step_000002", "step_000003"]
    aside = list((run / "checkpoints_set_aside").glob("after_step_2-*"))
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["step_000003", "step_000004"]
    assert (aside[0] / "step_000003" / "state.pt").read_bytes() == old_3  # the old branch's, kept whole
    assert best_checkpoint(run, "eval/accuracy").parent == checkpoint_dir(run)
    assert [r["step"] for r in map(json.loads, open(run / "metrics.jsonl")) if r["kind"] == "train"] == [1, 2, 3]


def test_checkpoint_retention_counts_the_best_among_the_newest(tmp_path):
    """keep=2 with checkpoint.best: the best stays, and is one of the two when it is among the newest."""
    from rollover.train import checkpoint

    model = tiny_model("llama", seed=1)
    kept = []
    for step, acc in enumerate((0.1, 0.2, 0.9, 0.5, 0.3, 0.2), start=1):
        checkpoint.save(tmp_path, step, model=model, tokenizer=None, trainer_state={}, extra={}, keep=2,
                        evaluation={"eval/accuracy": acc}, best=("eval/accuracy", "max"))
        kept.append(sorted(int(p.name[5:]) for p in (tmp_path / "checkpoints").glob("step_*")))
    assert kept == [[1], [1, 2], [2, 3], [3, 4], [3, 4, 5], [3, 5, 6]]
    assert checkpoint.best_checkpoint(tmp_path, "eval/accuracy").name == "step_000003"


def test_checkpoint_retention_keeps_every_checkpoint_while_fewer_than_keep_exist(tmp_path):
    """keep=5 with fewer than five checkpoints removes none of them."""
    from rollover.train import checkpoint

    model = tiny_model("llama", seed=1)
    for step in (2, 4, 6, 8):
        checkpoint.save(tmp_path, step, model=model, tokenizer=None, trainer_state={}, extra={}, keep=5)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == [
        "step_000002", "step_000004", "step_000006", "step_000008"]
    import os

    mask = os.umask(0o022)
    os.umask(mask)
    step = tmp_path / "checkpoints" / "step_000008"  # readable as the run's metrics are (not mkdtemp's 0700)
    assert step.stat().st_mode & 0o777 == 0o777 & ~mask
    assert all(f.stat().st_mode & 0o777 == 0o666 & ~mask for f in step.rglob("*") if f.is_file())


def test_a_damaged_eval_json_is_passed_over_by_the_best_and_named(tmp_path, caplog):
    """An empty or non-JSON eval.json (a write cut short) is not the best and stops nothing: the
    next save's retention and `best_checkpoint` pass over it, with a warning naming the file."""
    from rollover.train import checkpoint

    model = tiny_model("llama", seed=1)
    for step, acc in ((1, 0.9), (2, 0.5)):
        checkpoint.save(tmp_path, step, model=model, tokenizer=None, trainer_state={}, extra={}, keep=2,
                        evaluation={"eval/accuracy": acc}, best=("eval/accuracy", "max"))
    damaged = tmp_path / "checkpoints" / "step_000001" / "eval.json"
    damaged.write_text("")
    with caplog.at_level(logging.WARNING, logger="rollover"):
        checkpoint.save(tmp_path, 3, model=model, tokenizer=None, trainer_state={}, extra={}, keep=2,
                        evaluation={"eval/accuracy": 0.1}, best=("eval/accuracy", "max"))
    assert f"{damaged} is damaged" in caplog.text
    assert checkpoint.best_checkpoint(tmp_path, "eval/accuracy").name == "step_000002"
    # it might have been the best: kept beside keep=2, and said so
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_000001", "step_000002",
                                                                                "step_000003"]
    assert "checkpoint step_000001 is kept beside checkpoint.keep=2: its eval.json does not read back" in caplog.text
    assert checkpoint.read_evaluation(damaged.parent) is None


def test_a_prompts_only_dataset_trains_with_a_reward_that_needs_no_answer(model_dir, tmp_path):
    """data.require_answer=false: rows without an answer train and evaluate; the reward sees
    answer None and scores every sample (none an error)."""
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say something about {i}"}) + "\n" for i in range(30)))
    cfg = tiny_cfg(model_dir, tmp_path / "r", **{"data.train": str(data), "data.require_answer": False, "steps": 2,
                                                  "reward.functions": [{"fn": "format", "kwargs": {"pattern": "[0-9]"}}]})
    train_sync(cfg)
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2 and all(r["rollout/rewards/format/errors"] == 0 and r["rollout/reward_errors"] == 0 for r in steps)
    assert any("eval/accuracy" in r for r in rows)
    groups = [json.loads(line) for line in (tmp_path / "r" / "trained_groups.jsonl").read_text().splitlines()]
    assert [g["step"] for g in groups] == [1, 2] and all(x["prompt"].startswith("p:") for g in groups for x in g["groups"])


def test_a_loop_refuses_a_config_of_the_other_mode_a_foreign_run_and_an_evaluations_run(model_dir, tmp_path):
    """The loop a config is trained with follows its mode; a run handed to the loop was built
    from the config it is given, to be trained (record=False builds one that only evaluates)."""
    from rollover.config import ConfigError
    from rollover.loops.async_ import train_async

    cfg = tiny_cfg(model_dir, tmp_path / "a", steps=1)
    with pytest.raises(ConfigError, match=r"mode='sync'.*train this config with rollover.loops.sync.train_sync"):
        train_async(cfg)
    with pytest.raises(ConfigError, match=r"mode='async'.*rollover.loops.async_.train_async"):
        train_sync(tiny_cfg(model_dir, tmp_path / "b", mode="async"))
    with pytest.raises(TypeError, match=r"rollover.loops.sync.train_sync takes a Config, got dict: .*load_config"):
        train_sync({"model": model_dir, "run_dir": str(tmp_path / "b")})
    run = build_run(cfg)
    try:
        other = tiny_cfg(model_dir, tmp_path / "c", steps=2, **{"rollout.samples_per_prompt": 2})
        with pytest.raises(ValueError, match=r"built from another config .*differ in rollout, run_dir, steps"):
            train_sync(other, run=run)
    finally:
        run.close()
    run = build_run(cfg, record=False)
    try:
        with pytest.raises(ValueError, match="record=False, for evaluation"):
            train_sync(cfg, run=run)
    finally:
        run.close()
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()  # nothing was started for them
