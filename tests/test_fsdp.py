"""The sharded trainer (train.parallel=fsdp): N FSDP2 rank processes on gloo train as one trainer.

One step at world size 2 and 4 gives the one-process trainer's loss, gradient norm and weights
for every aggregation, with mini-batches, stand-in passes (a rank with fewer micro-batches or no
sequence at all) and LoRA; runs end with the one-process run's weights; a checkpoint written at
world size 4 resumes at world size 2; a killed rank ends the call with an error naming it."""

from __future__ import annotations

import copy
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollover.config import ConfigError, load_config
from rollover.loops.build import build_run
from rollover.loops.sync import train_sync
from rollover.testing import save_tiny_model, tiny_model
from rollover.train.batch import TrainBatch
from rollover.train.fsdp import split_batch
from rollover.train.ranks import RankLost, ShardedTrainer
from rollover.train.lora import apply_lora
from rollover.train.trainer import Trainer
from rollover.types import Rollout


def cfg_of(**over):
    base = {"device": "cpu", "model": "unused", "run_dir": "unused", "data.train": "gen:arithmetic?n=10",
            "rollout.samples_per_prompt": 3, "rollout.max_new_tokens": 8, "train.lr": 1e-2, "train.parallel": "fsdp"}
    base.update(over)
    return load_config(**base)


def batch_of(groups: int, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    rolls, advs = [], []
    for gi in range(groups):
        prompt = torch.randint(3, 60, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(3):
            n = int(torch.randint(2, 8, (1,), generator=g))
            mask = [1] * n if gi != 1 else [1] * (n - 1) + [0]  # one group with a masked token
            rolls.append(Rollout(group_id=f"g{gi}", prompt_ids=prompt, response_ids=torch.randint(3, 60, (n,), generator=g).tolist(),
                                 logprobs=(-torch.rand(n, generator=g) - 0.5).tolist(), versions=[0] * n, loss_mask=mask,
                                 finish="stop", reward=0.0))
            advs.append(float(torch.randn(1, generator=g)))
    return TrainBatch.from_rollouts(rolls, advs)


def weights(trainer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in trainer.named_weights()}


def assert_same_update(plain: dict, sharded: dict, start: dict, lr: float) -> None:
    """The sharded step moved every weight as the one-process step did. Adam's first steps are
    about lr per element whatever the gradient's size, so an element whose gradient is near Adam's
    eps turns float sums in another order into a visible move: such elements may be off by up to
    a quarter of lr, one in ten thousand of them at most; every other is within 5% of lr."""
    assert plain.keys() == sharded.keys()
    moved = max(float((plain[k] - start[k]).abs().max()) for k in plain)
    assert moved > 0.5 * lr  # the step did something
    diff = {k: (plain[k] - sharded[k]).abs() for k in plain}
    numel = sum(d.numel() for d in diff.values())
    assert max(float(d.max()) for d in diff.values()) < 0.25 * lr
    off = {k: int((d >= 0.05 * lr).sum()) for k, d in diff.items()}
    assert sum(off.values()) <= max(1, numel // 10_000), {k: n for k, n in off.items() if n}
    assert sum(float(d.sum()) for d in diff.values()) / numel < 1e-3 * lr


def test_split_batch_keeps_groups_whole_and_balances_tokens():
    b = batch_of(6)
    shares = split_batch(b, 2)
    assert sorted(i for s in shares for i in s) == list(range(len(b)))
    for s in shares:  # whole groups
        gs = {int(b.group_index_B[i]) for i in s}
        assert all(int(b.group_index_B[i]) in gs for i in range(len(b)) if i in s)
        assert sum(1 for i in range(len(b)) if int(b.group_index_B[i]) in gs) == len(s)
    tokens = [sum(len(b.prompt_ids[i]) + len(b.response_ids[i]) for i in s) for s in shares]
    group_tokens = max(sum(len(b.prompt_ids[i]) + len(b.response_ids[i]) for i in range(len(b)) if int(b.group_index_B[i]) == g)
                       for g in range(6))
    assert abs(tokens[0] - tokens[1]) <= group_tokens
    one = batch_of(1)  # fewer groups than ranks: by sequences, one rank left empty
    assert sorted(map(len, split_batch(one, 4))) == [0, 1, 1, 1]


@pytest.mark.parametrize("world,over", [
    (2, {"algorithm.aggregation": "token-mean"}),
    (2, {"algorithm.aggregation": "drgrpo", "train.mini_batches": 2}),
    (2, {"algorithm.aggregation": "seq-mean-token-sum", "algorithm.kl_coef": 0.1}),  # and a sharded reference model
    (4, {"algorithm.aggregation": "seq-mean-token-mean", "train.micro_batch_tokens": 32, "train.pack_length": 16, "data.max_prompt_tokens": 8, "train.shared_prefix": False}),
])
def test_a_step_at_world_size_n_equals_one_trainers(world, over):
    cfg = cfg_of(**{"train.ranks": world, **over})
    model = tiny_model("llama", seed=3)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    plain = Trainer(copy.deepcopy(model), cfg, device=torch.device("cpu"))
    sharded = ShardedTrainer(copy.deepcopy(model), cfg, pad_id=0)
    try:
        # the second batch has one group: at world size 4 one rank trains no sequence (stand-in passes)
        for b in ([batch_of(5)] if world == 2 else [batch_of(5), batch_of(1, seed=1)]):
            mp, ms = plain.train_step(b), sharded.train_step(b)
            for k in ("actor/pg_loss", "actor/loss", "actor/grad_norm", "actor/entropy", "actor/rollout_kl",
                      "actor/masked_frac", "actor/clip_frac_high", *(["actor/kl"] if cfg.algorithm.kl_coef else [])):
                assert ms[k] == pytest.approx(mp[k], rel=1e-5, abs=1e-7), k
            assert ms["actor/loss_tokens"] == mp["actor/loss_tokens"] == b.num_tokens  # the step's, once
            assert_same_update(weights(plain), weights(sharded), start, cfg.train.lr)
            start = weights(plain)
    finally:
        sharded.close()


@pytest.mark.parametrize("world,sp,arch,over", [
    (2, 2, "llama", {"algorithm.kl_coef": 0.1}),  # one sequence-parallel group; shared-prefix rows; a sharded reference
    (4, 2, "llama", {"algorithm.loss": "gspo", "algorithm.aggregation": "seq-mean-token-mean", "train.mini_batches": 2,
                     "train.shared_prefix": False, "train.gradient_checkpointing": True}),  # two groups of two
    (4, 4, "llama", {"train.micro_batch_tokens": 32, "train.pack_length": 16, "data.max_prompt_tokens": 8,
                     "train.shared_prefix": False}),  # 2 K/V heads over 4 ranks: repeated; several micro-batches
    (2, 2, "gpt2", {}),  # dropout rates in its config: its modules read a copy (train.disable_dropout)
])
def test_a_sequence_parallel_step_equals_one_trainers(world, sp, arch, over):
    """train.sequence_parallel: each rank runs 1/sp of every row, attention trades heads for
    positions, and the step is the one-process trainer's (loss, metrics, update)."""
    cfg = cfg_of(**{"train.ranks": world, "train.sequence_parallel": sp, **over})
    model = tiny_model(arch, seed=3)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    plain = Trainer(copy.deepcopy(model), cfg, device=torch.device("cpu"))
    sharded = ShardedTrainer(copy.deepcopy(model), cfg, pad_id=0)
    try:
        for b in (batch_of(5), batch_of(1, seed=1)):  # the second: one group, so one sequence-parallel group idles
            mp, ms = plain.train_step(b), sharded.train_step(b)
            for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/rollout_kl", "actor/masked_frac",
                      "actor/loss_tokens", *(["actor/kl"] if cfg.algorithm.kl_coef else [])):
                assert ms[k] == pytest.approx(mp[k], rel=1e-4, abs=1e-7), k
            # GPT-2's key bias cannot change the attention (softmax ignores a shift): its gradient is
            # float noise, which Adam moves by about lr either way (so also at sequence_parallel 1)
            noise = (lambda w: {k: v for k, v in w.items() if not k.endswith("attn.c_attn.bias")})
            assert_same_update(noise(weights(plain)), noise(weights(sharded)), noise(start), cfg.train.lr)
            start = weights(plain)
    finally:
        sharded.close()


@pytest.mark.parametrize("sp", [2, 1])
def test_an_otb_step_on_ranks_equals_one_trainers(sp):
    """algorithm.advantage=otb at world size 4: a group whose samples several ranks hold (a step of
    fewer groups than ranks) gets the baselines of its whole sums, a rank given no sequence takes
    part, and groups kept whole need no exchange; in two sequence-parallel groups Σπ² is gathered
    as the logprobs are. The step is the one-process trainer's."""
    cfg = cfg_of(**{"train.ranks": 4, "train.sequence_parallel": sp, "algorithm.advantage": "otb"})
    model = tiny_model("llama", seed=3)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    plain = Trainer(copy.deepcopy(model), cfg, device=torch.device("cpu"))
    sharded = ShardedTrainer(copy.deepcopy(model), cfg, pad_id=0)
    try:
        one = batch_of(1, seed=2)
        shares = split_batch(one, 4 // sp)
        assert sum(bool(s) for s in shares) > 1 and (sp == 2 or not all(shares))  # split; with sp 1 a rank idles
        for b in (one, batch_of(3)):
            mp, ms = plain.train_step(b), sharded.train_step(b)
            for k in ("actor/pg_loss", "actor/grad_norm", "otb/path_energy", "otb/baseline_mean"):
                assert ms[k] == pytest.approx(mp[k], rel=1e-4, abs=1e-7), k
            assert_same_update(weights(plain), weights(sharded), start, cfg.train.lr)
            start = weights(plain)
    finally:
        sharded.close()


def test_per_token_advantages_train_on_ranks_as_on_one_trainer():
    """env.credit=reward_to_go hands the trainer an advantage per token (TrainBatch.adv_BT): the
    ranks take their rows of it and train as one trainer does, over two mini-batches."""
    cfg = cfg_of(**{"train.ranks": 2, "algorithm.aggregation": "token-mean", "train.mini_batches": 2})
    model = tiny_model("llama", seed=3)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    b = batch_of(5)
    b.adv_BT = torch.randn(b.mask_BT.shape, generator=torch.Generator().manual_seed(4))
    per_sample = b.select(list(range(len(b))))
    per_sample.adv_BT = None
    ignored = Trainer(copy.deepcopy(model), cfg, device=torch.device("cpu")).train_step(per_sample)
    plain = Trainer(copy.deepcopy(model), cfg, device=torch.device("cpu"))
    sharded = ShardedTrainer(copy.deepcopy(model), cfg, pad_id=0)
    try:
        mp, ms = plain.train_step(b), sharded.train_step(b)
        assert mp["actor/pg_loss"] != pytest.approx(ignored["actor/pg_loss"], abs=1e-4)  # the per-token ones count
        for k in ("actor/pg_loss", "actor/grad_norm", "actor/masked_frac"):
            assert ms[k] == pytest.approx(mp[k], rel=1e-5, abs=1e-7), k
        assert_same_update(weights(plain), weights(sharded), start, cfg.train.lr)
    finally:
        sharded.close()


@pytest.mark.parametrize("lora,over", [
    (None, {}),
    ({"r": 4, "alpha": 8}, {}),
    (None, {"train.sequence_parallel": 2}),  # each rank's values over its slice of every row, gathered
    (None, {"critic.model": "other"}),  # read by rank 0 alone, the other rank taking its tensors
    ({"r": 4, "alpha": 8}, {"critic.model": "other"}),
], ids=["full", "lora", "sequence_parallel", "critic_model", "critic_model_lora"])
def test_ppo_with_a_critic_at_world_size_2_equals_one_trainers(lora, over, tmp_path):
    """algorithm.advantage=gae on the ranks: the critic sharded as the policy is, its values over
    each rank's sequences, the advantages whitened and the value loss normalised over both
    ranks' tokens, the KL penalty in the reward from a sharded reference with its adaptive weight
    over both ranks' sequences. Two steps (the second's values come from the first's critic
    update, its KL from the first's policy update) give one trainer's critic and policy metrics
    and the same policy update; with LoRA, the critic's own adapter on the sharded base; with
    critic.model, a critic of another size from its own checkpoint."""
    if "critic.model" in over:
        over = {**over, "critic.model": str(save_tiny_model(tmp_path / "critic", seed=11, hidden_size=48))}
    cfg = cfg_of(**{"train.ranks": 2, "algorithm.advantage": "gae", "critic.lr": 1e-3, "train.mini_batches": 2,
                    "algorithm.kl_in_reward": 0.1, "algorithm.kl_in_reward_target": 1e-6,  # a sharded reference
                    **({"train.lora": lora} if lora else {}), **over})
    model = tiny_model("llama", seed=3) if lora is None else apply_lora(tiny_model("llama", seed=3), lora)
    plain = Trainer(copy.deepcopy(model), cfg, device=torch.device("cpu"))
    assert plain.critic.value.head.in_features == (48 if "critic.model" in over else 64)
    start = weights(plain)
    sharded = ShardedTrainer(copy.deepcopy(model), cfg, pad_id=0)
    try:
        b = batch_of(5)  # its advantages stand for the rewards the gae estimator hands the trainer
        for step in (1, 2):
            mp, ms = plain.train_step(b), sharded.train_step(b)
            for k in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/values/mean",
                      "critic/returns/mean", "critic/advantages/mean", "critic/grad_norm", "actor/pg_loss",
                      "actor/grad_norm", "critic/kl_in_reward", "critic/kl_in_reward_coef",
                      *(["critic/vf_explained_var"] if step == 2 else [])):
                # step 2 is looser: its returns carry the KL of a policy whose Adam step the split moves
                # by up to 5% of lr (assert_same_update's bound), and Adam turns the rounding of the
                # critic's near-zero gradients (LoRA's B starts at 0) into whole steps of critic.lr
                assert ms[k] == pytest.approx(mp[k], rel=1e-4 if step == 1 else 2e-3, abs=1e-6 if step == 1 else 5e-4), \
                    (step, k)
            assert (mp["critic/values/mean"] != 0) == (step == 2) == (mp["critic/kl_in_reward"] != 0)
            assert_same_update(weights(plain), weights(sharded), start, cfg.train.lr)
            start = weights(plain)
    finally:
        sharded.close()


@pytest.mark.parametrize("world,over", [
    (2, {"train.mini_batches": 2}),
    (4, {"train.micro_batch_tokens": 32, "train.pack_length": 16, "data.max_prompt_tokens": 8, "train.shared_prefix": False}),
])
def test_an_m2po_step_at_world_size_n_equals_one_trainers(world, over):
    """algorithm.m2po_tau: the ranks cut one mask over the whole update's tokens, the one a single
    trainer cuts, and report its metrics once (not summed over the ranks)."""
    cfg = cfg_of(**{"train.ranks": world, "algorithm.m2po_tau": 0.04, **over})
    model = tiny_model("llama", seed=3)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    plain = Trainer(copy.deepcopy(model), cfg, device=torch.device("cpu"))
    sharded = ShardedTrainer(copy.deepcopy(model), cfg, pad_id=0)
    try:
        # the second batch has one group: at world size 4 one rank trains no sequence
        for b in [batch_of(5), batch_of(1, seed=1)]:
            # sampled off-policy: the model's logprobs, perturbed token by token, so some tokens go
            noise = 0.3 * torch.randn(b.mask_BT.shape, generator=torch.Generator().manual_seed(2))
            b.behav_logp_BT = torch.where(b.mask_BT, plain.logprobs(b) + noise, 0.0)
            mp, ms = plain.train_step(b), sharded.train_step(b)
            assert 0 < mp["actor/m2po_masked_frac"] < 1
            for k in ("actor/pg_loss", "actor/grad_norm", "actor/masked_frac", "actor/m2po_masked_frac",
                      "actor/m2po_m2_before", "actor/m2po_m2_after"):
                assert ms[k] == pytest.approx(mp[k], rel=1e-5, abs=1e-7), k
            assert_same_update(weights(plain), weights(sharded), start, cfg.train.lr)
            start = weights(plain)
    finally:
        sharded.close()


def test_a_top_entropy_step_at_world_size_2_equals_one_trainers():
    """algorithm.top_entropy_quantile: the ranks share one entropy threshold over the whole update's
    tokens, the one a single trainer finds, and keep the same tokens."""
    cfg = cfg_of(**{"train.ranks": 2, "train.mini_batches": 2, "algorithm.top_entropy_quantile": 0.25})
    model = tiny_model("llama", seed=3)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    plain = Trainer(copy.deepcopy(model), cfg, device=torch.device("cpu"))
    sharded = ShardedTrainer(copy.deepcopy(model), cfg, pad_id=0)
    try:
        b = batch_of(6)
        mp, ms = plain.train_step(b), sharded.train_step(b)
        assert 0.2 < mp["actor/entropy_kept_frac"] < 0.35
        for k in ("actor/pg_loss", "actor/masked_frac", "actor/entropy_threshold", "actor/entropy_kept_frac"):
            assert ms[k] == pytest.approx(mp[k], rel=1e-5, abs=1e-7), k
        assert ms["actor/grad_norm"] == pytest.approx(mp["actor/grad_norm"], rel=1e-4)  # sums in another order
        assert_same_update(weights(plain), weights(sharded), start, cfg.train.lr)
    finally:
        sharded.close()


def test_a_reference_sync_at_world_size_2_moves_the_reference_as_one_trainer():
    """algorithm.ref_sync_every: the ranks move their shards of the KL reference as one trainer moves
    its reference: the same KL to it on the next steps, the same weights."""
    cfg = cfg_of(**{"train.ranks": 2, "algorithm.kl_coef": 0.5, "algorithm.ref_sync_every": 1,
                    "algorithm.ref_mixup_alpha": 0.5})
    model = tiny_model("llama", seed=3)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    plain = Trainer(copy.deepcopy(model), cfg, device=torch.device("cpu"))
    sharded = ShardedTrainer(copy.deepcopy(model), cfg, pad_id=0)
    try:
        for seed in range(3):
            b = batch_of(4, seed=seed)
            mp, ms = plain.train_step(b), sharded.train_step(b)
            assert ms["actor/kl"] == pytest.approx(mp["actor/kl"], rel=1e-4, abs=1e-9)
            assert_same_update(weights(plain), weights(sharded), start, cfg.train.lr)
            start = weights(plain)
        # one trainer's reference is the hand-computed mix, and not the starting model
        assert mp["actor/kl"] > 0
        ref = dict(plain.ref_model.named_parameters())
        assert max(float((ref[n] - model.state_dict()[n]).abs().max()) for n in ref) > 1e-3
    finally:
        sharded.close()


@pytest.mark.parametrize("world,over", [
    (2, {"train.mini_batches": 2}),
    (4, {"train.micro_batch_tokens": 32, "train.pack_length": 16, "data.max_prompt_tokens": 8, "train.shared_prefix": False,
         "train.ppo_epochs": 2, "algorithm.loss_options": {"is_level": "token", "is_mode": "mask", "is_cap": 1.3}}),
])
def test_a_bapo_step_at_world_size_n_equals_one_trainers(world, over):
    """algorithm.loss=bapo: the ranks add up their tables and pick one pair of bounds per update, the
    one a single trainer picks over all the update's loss tokens, and report them once (not summed).
    A step's second update (mini-batches, epochs) measures its ratios, off 1, in one no-grad pass
    (stand-in passes on a rank with no sequence); with IS in mask mode the tables skip its tokens."""
    cfg = cfg_of(**{"train.ranks": world, "algorithm.loss": "bapo", **over})
    model = tiny_model("llama", seed=3)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    plain = Trainer(copy.deepcopy(model), cfg, device=torch.device("cpu"))
    sharded = ShardedTrainer(copy.deepcopy(model), cfg, pad_id=0)
    try:
        # the second batch has one group: at world size 4 one rank trains no sequence
        for b in [batch_of(5), batch_of(1, seed=1)]:
            b.adv_B = b.adv_B - 0.3  # negative advantages dominate: the bounds leave their start
            noise = 0.3 * torch.randn(b.mask_BT.shape, generator=torch.Generator().manual_seed(2))
            b.behav_logp_BT = torch.where(b.mask_BT, plain.logprobs(b) + noise, 0.0)
            mp, ms = plain.train_step(b), sharded.train_step(b)
            assert mp["actor/bapo_c_low"] > 0.6 or mp["actor/bapo_c_high"] > 1.2
            assert mp["actor/bapo_c_low"] <= 0.9 and mp["actor/bapo_c_high"] <= 3.0 and 0 <= mp["actor/bapo_pos_share"] <= 1
            for k in ("actor/bapo_c_low", "actor/bapo_c_high"):
                assert ms[k] == mp[k], k
            # every loss metric is a mean over its own tokens (after IS masking, or before), or a max
            for k in ("actor/pg_loss", "actor/grad_norm", "actor/masked_frac", "actor/bapo_pos_share",
                      "actor/clip_frac_low", "actor/clip_frac_high", "actor/ratio_mean", "actor/ratio_max",
                      "actor/approx_kl", *(("actor/is_ratio_mean", "actor/is_ratio_max", "actor/is_clip_frac",
                                            "actor/is_weight_mean") if cfg.algorithm.loss_options else ())):
                assert ms[k] == pytest.approx(mp[k], rel=1e-5, abs=1e-7), k
            assert_same_update(weights(plain), weights(sharded), start, cfg.train.lr)
            start = weights(plain)
    finally:
        sharded.close()


def test_bf16_mixed_precision_and_gradient_checkpointing_at_world_size_2():
    """train.dtype=autocast_bf16 (FSDP's bf16 passes, fp32 master weights and reductions) with
    gradient checkpointing: the step's loss and gradient norm within bf16's precision of one
    trainer's under bf16 autocast, and the weights stay float32."""
    cfg = cfg_of(**{"train.ranks": 2, "train.dtype": "autocast_bf16", "train.gradient_checkpointing": True})
    model = tiny_model("llama", seed=3)
    plain = Trainer(copy.deepcopy(model), cfg, device=torch.device("cpu"))
    sharded = ShardedTrainer(copy.deepcopy(model), cfg, pad_id=0)
    try:
        b = batch_of(4)
        mp, ms = plain.train_step(b), sharded.train_step(b)
        assert ms["actor/pg_loss"] == pytest.approx(mp["actor/pg_loss"], rel=0.05, abs=2e-3)
        assert ms["actor/grad_norm"] == pytest.approx(mp["actor/grad_norm"], rel=0.05)
        got = weights(sharded)
        assert all(t.dtype == torch.float32 for t in got.values())
        # Adam's first step is about lr x sign(gradient): elements whose bf16 gradients differ in sign move apart
        diff = torch.cat([(got[k] - w).abs().flatten() for k, w in weights(plain).items()])
        assert float((diff > 0.5 * cfg.train.lr).float().mean()) < 0.05
    finally:
        sharded.close()


@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj", "embed_tokens"]], ids=["default", "embedding"])
def test_lora_step_at_world_size_2_equals_one_trainers(targets):
    lora = {"r": 4, "alpha": 8, **({"target_modules": targets} if targets else {})}
    cfg = cfg_of(**{"train.ranks": 2, "train.lora": lora})
    model = apply_lora(tiny_model("llama", seed=3), cfg.train.lora)
    plain = Trainer(copy.deepcopy(model), cfg, device=torch.device("cpu"))
    start = weights(plain)
    sharded = ShardedTrainer(copy.deepcopy(model), cfg, pad_id=0)
    try:
        assert sharded.is_peft
        b = batch_of(4)
        mp, ms = plain.train_step(b), sharded.train_step(b)
        assert ms["actor/pg_loss"] == pytest.approx(mp["actor/pg_loss"], rel=1e-5)
        assert ms["actor/grad_norm"] == pytest.approx(mp["actor/grad_norm"], rel=1e-5)
        got, want = weights(sharded), weights(plain)
        assert got.keys() == want.keys() and not any("lora_" in k for k in got)
        assert max(float((got[k] - want[k]).abs().max()) for k in got) < 1e-6  # merged, as the engine gets them
        assert max(float((want[k] - start[k]).abs().max()) for k in want) > 1e-4
        if targets:  # the embedding's own adapter is merged too
            key = "model.embed_tokens.weight"
            assert float((want[key] - start[key]).abs().max()) > 1e-4
    finally:
        sharded.close()


def test_a_step_with_fewer_groups_than_mini_batches_makes_one_update_per_group():
    """Dynamic sampling out of rounds or dropped groups can leave a step fewer groups than
    train.mini_batches: no empty update (it had no loss to report), the same step as one update."""
    start = tiny_model("llama", seed=3)
    one = Trainer(copy.deepcopy(start), cfg_of(**{"train.mini_batches": 1}), device=torch.device("cpu"))
    two = Trainer(copy.deepcopy(start), cfg_of(**{"train.mini_batches": 2}), device=torch.device("cpu"))
    m1, m2 = one.train_step(batch_of(1)), two.train_step(batch_of(1))
    assert m1.keys() == m2.keys() and m1["actor/pg_loss"] == m2["actor/pg_loss"]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(one.named_weights(), two.named_weights()))
    # the schedule counts the update not made: it stands where a full step of 2 updates puts it
    assert two.scheduler.last_epoch == 2 and one.scheduler.last_epoch == 1


def test_a_killed_rank_ends_the_call_with_an_error_naming_it():
    cfg = cfg_of(**{"train.ranks": 2, "train.collective_timeout_s": 60})
    sharded = ShardedTrainer(tiny_model("llama", seed=3), cfg, pad_id=0)
    try:
        os.kill(sharded.procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RankLost, match=r"trainer rank 1 of 2 died \(killed by signal 9\) during train_step"):
            sharded.train_step(batch_of(3))
        assert time.monotonic() - t0 < 20  # not the collective timeout
        assert not any(p.is_alive() for p in sharded.procs)  # its peer is stopped too
    finally:
        sharded.close()


def test_a_ranks_own_error_is_the_one_reported_and_every_later_call_says_so():
    """A rank that raises takes its peers' collectives down with it: the error reported is its
    own traceback, not a peer's "connection closed"; after it every call raises the same."""
    from rollover.train.fsdp import split_batch

    cfg = cfg_of(**{"train.ranks": 2, "train.collective_timeout_s": 60})
    sharded = ShardedTrainer(tiny_model("llama", seed=3), cfg, pad_id=0)
    try:
        batch = batch_of(3)
        shares = [batch.select(ix) for ix in split_batch(batch, 2)]
        groups = batch.group_index_B.unique().tolist()
        with sharded._lock:  # rank 1 gets a share it cannot train
            sharded._send(0, ("train_step", shares[0], groups, False), "train_step")
            sharded._send(1, ("train_step", "not a batch", groups, False), "train_step")
            with pytest.raises(RankLost, match=r"trainer rank 1 failed during train_step: AttributeError: ") as lost:
                sharded._recv(0, "train_step")
            assert "\n" not in str(lost.value) and "Traceback (most recent call last)" in lost.value.traceback
        with pytest.raises(RankLost, match=r"trainer rank 1 failed during train_step"):
            sharded.train_step(batch)
    finally:
        sharded.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama", seed=3))


def run_cfg(model_dir, run_dir, **over):
    base = {
        "device": "cpu", "model": model_dir, "run_dir": str(run_dir), "steps": 4, "seed": 7, "resume": "auto",
        "data.train": "gen:arithmetic?n=120", "data.eval_size": 4, "data.max_prompt_tokens": 64,
        "rollout.prompts_per_step": 4, "rollout.samples_per_prompt": 3, "rollout.max_new_tokens": 6,
        "rollout.max_rows": 8,
        # a tiny random model never answers right: a reward it earns about half the time (a digit 0-4 in
        # its reply), so advantages are not all zero and the weights move (what the runs below compare)
        "reward.functions": [{"fn": "format", "kwargs": {"pattern": "[0-4]"}}], "train.lr": 1e-3, "eval.every": 0, "eval.at_start": False,
        "checkpoint.every": 2, "logging.progress": False, "logging.tensorboard": False,
    }
    base.update(over)
    return load_config(**base)


def final_weights(run_dir, step=4) -> dict:
    d = run_dir / "checkpoints" / f"step_{step:06d}" / "model"
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def assert_trained(model_dir, weights: dict) -> None:
    """The run changed the weights (an equality of two runs' weights means something)."""
    start = load_file(str(Path(model_dir) / "model.safetensors"))
    assert max(float((weights[k] - start[k]).abs().max()) for k in start) > 1e-3


@pytest.mark.parametrize("april,sp", [(False, 1), (True, 1), (False, 2)], ids=["sync", "april", "sequence-parallel"])
def test_a_run_at_world_size_2_ends_with_one_trainers_weights(model_dir, tmp_path, april, sp):
    over = {"partial_rollout.enabled": True, "partial_rollout.oversample": 1.5} if april else {}
    train_sync(run_cfg(model_dir, tmp_path / "one", **over))
    train_sync(run_cfg(model_dir, tmp_path / "two", **{"train.parallel": "fsdp", "train.ranks": 2,
                                                      "train.sequence_parallel": sp, **over}))
    one, two = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    assert one.keys() == two.keys()
    assert_trained(model_dir, one)
    assert max(float((one[k] - two[k]).abs().max()) for k in one) < 5e-5
    assert (tmp_path / "two" / "checkpoints" / "step_000004" / "sharded" / ".metadata").exists()


def test_sequence_parallel_refuses_a_model_whose_heads_do_not_split(model_dir, tmp_path):
    cfg = run_cfg(model_dir, tmp_path / "r", **{"train.parallel": "fsdp", "train.ranks": 3, "train.sequence_parallel": 3})
    with pytest.raises(ConfigError, match="sequence_parallel=3: the model's 4 attention heads do not split evenly over 3"):
        build_run(cfg)


def test_a_world_size_4_checkpoint_resumes_at_world_size_2(model_dir, tmp_path):
    whole = tmp_path / "whole"
    train_sync(run_cfg(model_dir, whole, **{"train.parallel": "fsdp", "train.ranks": 2}))
    cut = tmp_path / "cut"
    # small weight buckets: the checkpoint's model is several safetensors files and an index
    train_sync(run_cfg(model_dir, cut, steps=2, **{"train.parallel": "fsdp", "train.ranks": 4, "train.weight_bucket_mb": 0.02}))
    train_sync(run_cfg(model_dir, cut, **{"train.parallel": "fsdp", "train.ranks": 2}))
    # equal weights need the optimizer's moments back, resharded from 4 ranks to 2 (a fresh AdamW moves further)
    a, b = final_weights(whole), final_weights(cut)
    assert_trained(model_dir, a)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 5e-5
    rows = [r for r in map(__import__("json").loads, open(cut / "metrics.jsonl")) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # a sharded checkpoint needs sharded ranks, even where a config change is allowed
    with pytest.raises(ConfigError, match=r"train.parallel: \"fsdp\" -> \"none\""):
        train_sync(run_cfg(model_dir, cut, steps=6))
    with pytest.raises(ConfigError, match=r"written by sharded trainer ranks \(train.parallel=fsdp\)"):
        build_run(run_cfg(model_dir, cut, steps=6), allow_config_change=True)


@pytest.mark.parametrize("colocate,lora", [(False, None), (True, None), (False, {"r": 4, "alpha": 8})],
                         ids=["driver-engine", "colocated", "lora"])
def test_a_gae_run_on_ranks_resumes_its_critic_and_ends_with_one_trainers_weights(model_dir, tmp_path, colocate, lora):
    """PPO with a critic at world size 2, killed after its step-2 checkpoint and resumed (the
    critic's shards and optimizer state from the sharded checkpoint, its schedule from the
    trainer state), ends with the weights of one trainer that ran straight through; with the
    ranks' own engines too, and with LoRA (the critic's adapter and head in the shards, not its
    frozen base)."""
    # with LoRA a smaller critic.lr: Adam turns the rounding of its adapter's near-zero first gradients (B starts
    # at 0) into whole steps of critic.lr, which at 1e-2 part the ranks from one trainer by 2.6e-4; at 1e-4, 3e-8
    over = {"algorithm.advantage": "gae", "critic.lr": 1e-4 if lora else 1e-2, **({"train.lora": lora} if lora else {})}
    train_sync(run_cfg(model_dir, tmp_path / "one", **over))
    ranks = {"train.parallel": "fsdp", "train.ranks": 2, "train.colocate": colocate, **over}
    train_sync(run_cfg(model_dir, tmp_path / "cut", steps=2, **ranks))
    train_sync(run_cfg(model_dir, tmp_path / "cut", **ranks))
    one, cut = final_weights(tmp_path / "one"), final_weights(tmp_path / "cut")
    if lora:  # one trainer's LoRA checkpoint holds its adapter; the ranks' hold the merged model
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        adapter = tmp_path / "one" / "checkpoints" / "step_000004" / "adapter"
        merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(adapter)).merge_and_unload()
        one = {k: v for k, v in merged.state_dict().items() if k in cut}
    assert_trained(model_dir, one)
    assert max(float((one[k] - cut[k]).abs().max()) for k in one) < (1e-6 if lora else 5e-5)
    rows = [r for r in map(__import__("json").loads, open(tmp_path / "cut" / "metrics.jsonl")) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["critic/values/mean"] != 0


@pytest.mark.parametrize("parallel,sync", [("none", False), ("fsdp", False), ("none", True), ("fsdp", True)])
def test_a_resumed_run_keeps_its_kl_reference(model_dir, tmp_path, parallel, sync):
    """algorithm.kl_coef: the reference is the starting model, also after a resume (which loads
    the checkpoint's policy): the resumed run ends where the uninterrupted one does. With
    algorithm.ref_sync_every the reference moves every step and the checkpoint keeps it."""
    over = {"algorithm.kl_coef": 0.5, "train.lr": 1e-2, "train.parallel": parallel,
            "train.ranks": 2 if parallel == "fsdp" else 1}
    if sync:
        over.update({"algorithm.ref_sync_every": 1, "algorithm.ref_mixup_alpha": 0.5})
    train_sync(run_cfg(model_dir, tmp_path / "whole", **over))
    train_sync(run_cfg(model_dir, tmp_path / "cut", steps=2, **over))
    train_sync(run_cfg(model_dir, tmp_path / "cut", **over))
    a, b = final_weights(tmp_path / "whole"), final_weights(tmp_path / "cut")
    assert_trained(model_dir, a)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 5e-5
    kl = [[r["actor/kl"] for r in map(__import__("json").loads, open(d / "metrics.jsonl")) if r["kind"] == "train"]
          for d in (tmp_path / "whole", tmp_path / "cut")]
    assert kl[0][2] > 0 and kl[0] == pytest.approx(kl[1], rel=1e-4)


def test_ray_trainer_rank_actors_train_as_one_trainer(model_dir, tmp_path):
    """runtime=ray: the ranks are Ray actors (counted by the placement check), the run ends with
    the local one-trainer run's weights, with a rollout worker or with the ranks' own engines."""
    ray = pytest.importorskip("ray")
    train_sync(run_cfg(model_dir, tmp_path / "one"))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # one for every part
    try:
        _ray_rank_actors(model_dir, tmp_path, final_weights(tmp_path / "one"))
    finally:
        ray.shutdown()


def test_a_dead_rank_actor_leaves_the_ray_it_started_up_until_the_run_closes():
    """The rank actors' group started Ray: a dead rank stops the ranks at once, but Ray goes only
    when the run closes, after its rollout workers, which would otherwise see it gone, take
    themselves for lost and start another Ray to replace themselves."""
    ray = pytest.importorskip("ray")
    from rollover.runtime.trainer_group import RayShardedTrainer

    assert not ray.is_initialized()
    cfg = cfg_of(runtime="ray", **{"train.ranks": 2, "ray.trainer": "actor", "ray.cpus_for_trainer": 0.5,
                                   "ray.num_cpus": 2, "train.collective_timeout_s": 60})
    group = RayShardedTrainer(tiny_model("llama", seed=3), cfg, pad_id=0)
    try:
        os.kill(group.pids[1], signal.SIGKILL)
        with pytest.raises(RankLost, match=r"trainer rank 1 of 2 \(a Ray actor\) died during train_step"):
            group.train_step(batch_of(3))
        assert ray.is_initialized() and not group.actors
    finally:
        group.close()
    assert not ray.is_initialized()


def _ray_rank_actors(model_dir, tmp_path, one):
    # the ranks' buckets reach the worker as bit-level deltas against the weights it holds
    train_sync(run_cfg(model_dir, tmp_path / "ray", runtime="ray", **{
        "train.parallel": "fsdp", "train.ranks": 2, "ray.rollout_workers": 1, "ray.trainer": "actor",
        "ray.cpus_for_trainer": 0.5, "ray.weight_delta": True}))
    rows = [r for r in map(__import__("json").loads, open(tmp_path / "ray" / "metrics.jsonl")) if r["kind"] == "train"]
    # every fp32 weight moves in a step, so the deltas carry them all; a wrong delta would change what the
    # worker generates and so the weights trained, compared with the one-trainer run below
    assert all(0 < r["weights/sent_fraction"] <= 1 for r in rows)
    two = final_weights(tmp_path / "ray")
    assert one.keys() == two.keys()
    assert_trained(model_dir, one)
    assert max(float((one[k] - two[k]).abs().max()) for k in one) < 5e-5
    # colocated: each rank actor's own engine generates (its completions over TCP to the driver), no
    # rollout worker starts, and the run still trains the one-trainer run's weights
    train_sync(run_cfg(model_dir, tmp_path / "co", runtime="ray", **{
        "train.parallel": "fsdp", "train.ranks": 2, "ray.trainer": "actor", "ray.cpus_for_trainer": 0.5,
        "train.colocate": True}))
    co = final_weights(tmp_path / "co")
    assert max(float((one[k] - co[k]).abs().max()) for k in one) < 5e-5
    with pytest.raises(ConfigError, match="set ray.trainer=actor"):
        run_cfg(model_dir, tmp_path / "x", runtime="ray", **{"train.parallel": "fsdp", "train.ranks": 2})
    # a rank actor killed: the next call ends at once with an error naming it, never waiting on its peer
    from rollover.runtime.trainer_group import RayShardedTrainer

    cfg = cfg_of(runtime="ray", **{"train.ranks": 2, "ray.trainer": "actor", "ray.cpus_for_trainer": 0.5,
                                   "train.collective_timeout_s": 60})
    group = RayShardedTrainer(tiny_model("llama", seed=3), cfg, pad_id=0)
    try:
        os.kill(group.pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RankLost, match=r"trainer rank 1 of 2 \(a Ray actor\) died during train_step"):
            group.train_step(batch_of(3))
        assert time.monotonic() - t0 < 30
    finally:
        group.close()
    # ... and while its own engine generates (train.colocate): the requests fail naming it
    from rollover.runtime.colocated import ColocatedEngines
    from rollover.types import Request, SamplingParams

    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"colocate": True})})
    group = RayShardedTrainer(tiny_model("llama", seed=3), cfg, pad_id=0)
    try:
        engines = ColocatedEngines(group, cfg, max_len=64, eos_token_ids=[], vocab_size=group.architecture.config.vocab_size)
        os.kill(group.pids[1], signal.SIGKILL)
        with pytest.raises(RankLost, match=r"trainer rank 1 of 2"):
            futures = engines.submit_many([Request(id=f"r{i}", prompt_ids=[5, 6, 7],
                                                   sampling=SamplingParams(max_new_tokens=200, ignore_eos=True))
                                           for i in range(4)])
            for f in futures:
                f.result(timeout=60)
    finally:
        group.close()
    # ... and one whose engine stops answering is taken for hung past the engines' timeout
    group = RayShardedTrainer(tiny_model("llama", seed=3), cfg, pad_id=0)
    try:
        engines = ColocatedEngines(group, cfg, max_len=64, eos_token_ids=[], vocab_size=group.architecture.config.vocab_size)
        engines._timeout_s = 3  # train.collective_timeout_s, shortened for the engines' calls only
        os.kill(group.pids[1], signal.SIGSTOP)
        with pytest.raises(RankLost, match=r"trainer rank 1 of 2 gave no answer to engine_call stats within 3 s "
                                           r"\(from train.collective_timeout_s\): taken for hung"):
            engines.stats()
    finally:
        _kill_quietly(group.pids[1])
        group.close()


@pytest.mark.parametrize("april", [False, True], ids=["sync", "april"])
def test_colocated_engines_in_the_ranks_generate_and_train_as_one_trainer(model_dir, tmp_path, april):
    """train.colocate: each rank's own engine generates its share of the step's requests (both
    ranks get work), frees its weights while the ranks train and loads the new ones from its own
    gather. Sync: the run trains the weights the one-trainer run with one engine trains (seeded
    sampling: the same tokens wherever they are generated). APRIL (sequences paused across the
    step keep their K/V, not their weights): which requests finish before the step's stop depends
    on how far each engine got, so the run is not the one-engine run's; it trains, every step."""
    over = {"partial_rollout.enabled": True, "partial_rollout.oversample": 1.5} if april else {}
    over["rollout.stop"] = ["1", "2"]  # found by the ranks' engines with the driver's tokenizer
    cfg = run_cfg(model_dir, tmp_path / "co", **{"train.parallel": "fsdp", "train.ranks": 2, "train.colocate": True,
                                                   **over})
    run = build_run(cfg)
    from rollover.runtime.colocated import ColocatedEngines

    assert isinstance(run.engine, ColocatedEngines)
    per_rank = []
    release = run.engine.release_memory

    def before_training():  # what each rank's engine generated so far, as the loop hands the devices to training
        per_rank.append([st.generated_tokens for st in run.engine._each("stats")])
        release()

    run.engine.release_memory = before_training
    held = []  # each rank's engine weight bytes while it trained, read before the push brings them back
    push = run.weights.push

    def after_training(*a, **k):
        held.append([st["engine_weight_bytes_in_step"] for st in run.trainer.stats()])
        return push(*a, **k)

    run.weights.push = after_training
    train_sync(cfg, run=run)
    assert len(per_rank) == 4 and all(n > 0 for n in per_rank[-1])
    assert held == [[0, 0]] * 4
    co = final_weights(tmp_path / "co")
    assert_trained(model_dir, co)
    rows = [r for r in map(__import__("json").loads, open(tmp_path / "co" / "metrics.jsonl")) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    if not april:
        train_sync(run_cfg(model_dir, tmp_path / "one", **over))
        one = final_weights(tmp_path / "one")
        assert max(float((one[k] - co[k]).abs().max()) for k in one) < 5e-5


@pytest.mark.vllm
def test_vllm_engines_in_the_ranks_generate_and_train_as_one_vllm_engine(tmp_path_factory, tmp_path):
    """rollout.engine=vllm with train.colocate: each rank starts vLLM on its device from its own
    gather (vLLM's random start-up weights replaced), takes its share of the requests, and loads
    each step's weights from its own gather in staged buckets. Seeded vLLM sampling does not
    depend on the batch, so the run trains the weights of the run with one vLLM engine beside
    the same two ranks. (On a CPU vLLM cannot sleep: the weights stay while the ranks train.)"""
    pytest.importorskip("vllm")
    model_dir = str(save_tiny_model(tmp_path_factory.mktemp("m") / "vllm", "llama", seed=3, num_attention_heads=2,
                                    num_key_value_heads=1,  # head_dim 32: vLLM's CPU attention needs >= 32
                                    tie_word_embeddings=True))  # as SmolLM2 and Qwen2.5-0.5B
    over = {"train.parallel": "fsdp", "train.ranks": 2, "steps": 2, "rollout.engine": "vllm",
            "rollout.engine_options": {"enforce_eager": True}, "train.weight_bucket_mb": 0.05}
    cfg = run_cfg(model_dir, tmp_path / "co", **over, **{"train.colocate": True})
    run = build_run(cfg)
    per_rank = []
    release = run.engine.release_memory

    def before_training():
        per_rank.append([st.generated_tokens for st in run.engine._each("stats")])
        release()

    run.engine.release_memory = before_training
    train_sync(cfg, run=run)
    assert len(per_rank) == 2 and all(n > 0 for n in per_rank[-1])
    co = final_weights(tmp_path / "co", step=2)
    assert_trained(model_dir, co)
    train_sync(run_cfg(model_dir, tmp_path / "one", **over))
    one = final_weights(tmp_path / "one", step=2)
    assert max(float((one[k] - co[k]).abs().max()) for k in one) < 5e-5


@pytest.mark.vllm
def test_ranks_with_vllm_end_when_the_driver_is_killed(tmp_path_factory, tmp_path):
    """The driver SIGKILLed (out of memory, say) with vLLM in its ranks: each rank sees its pipe
    end, stops its vLLM (whose engine process would otherwise keep the rank from exiting) and
    exits; nothing of theirs is left running."""
    import json
    import subprocess
    import sys

    psutil = pytest.importorskip("psutil")
    pytest.importorskip("vllm")
    model_dir = str(save_tiny_model(tmp_path_factory.mktemp("m") / "vllm", "llama", seed=3, num_attention_heads=2,
                                    num_key_value_heads=1))
    over = {"train.parallel": "fsdp", "train.ranks": 2, "train.colocate": True, "rollout.engine": "vllm",
            "rollout.engine_options": {"enforce_eager": True}}
    script = tmp_path / "driver.py"
    script.write_text(
        "import json, sys, time\n"
        "from rollover.config import load_config\n"
        "from rollover.loops.build import build_run\n"
        "if __name__ == '__main__':\n"
        "    run = build_run(load_config(**json.loads(sys.argv[1])))\n"
        "    print('PIDS', *[p.pid for p in run.trainer.procs], flush=True)\n"
        "    time.sleep(600)\n")
    cfg = {"device": "cpu", "model": model_dir, "run_dir": str(tmp_path / "run"), "steps": 2, "seed": 7,
           "data.train": "gen:arithmetic?n=120", "data.eval_size": 6, "data.max_prompt_tokens": 64,
           "rollout.max_new_tokens": 6, "rollout.max_rows": 8, "logging.progress": False,
           "logging.tensorboard": False, **over}
    driver = subprocess.Popen([sys.executable, str(script), json.dumps(cfg)], stdout=subprocess.PIPE, text=True)
    try:
        line = next((x for x in driver.stdout if x.startswith("PIDS")), None)
        assert line is not None, f"the driver ended without starting its ranks (exit {driver.wait()}; its stderr above)"
        ranks = [psutil.Process(int(x)) for x in line.split()[1:]]
        theirs = ranks + [c for r in ranks for c in r.children(recursive=True)]
        assert len(theirs) > len(ranks)  # the ranks' vLLM processes
        driver.kill()
        _, alive = psutil.wait_procs(theirs, timeout=60)
        assert not alive, f"still running after the driver's death: {[p.name() for p in alive]}"
    finally:
        driver.kill()
        driver.wait()


def test_a_rank_waiting_for_peers_ends_when_the_driver_is_killed_while_ranks_start(tmp_path):
    """The driver SIGKILLed after starting one rank of two: that rank waits in the start's
    rendezvous for a peer that never comes, where the pipe's end cannot reach it; it ends soon
    after the driver (not at train.collective_timeout_s), and the fork server it came from too."""
    import subprocess
    import sys

    psutil = pytest.importorskip("psutil")
    script = tmp_path / "driver.py"
    script.write_text(
        "import time\n"
        "import torch.multiprocessing as mp\n"
        "from rollover.config import load_config\n"
        "from rollover.testing import tiny_model\n"
        "from rollover.train.rank_server import _rank_main\n"
        "from rollover.train.ranks import _free_port, _rank_context\n"
        "if __name__ == '__main__':\n"
        "    cfg = load_config(device='cpu', model='unused', run_dir='unused', **{'data.train': 'gen:arithmetic?n=10',\n"
        "                      'train.parallel': 'fsdp', 'train.ranks': 2, 'train.collective_timeout_s': 600})\n"
        "    model = tiny_model('llama', seed=3)\n"
        "    ctx = _rank_context(mp, model, False)\n"
        "    parent, child = ctx.Pipe()\n"
        "    p = ctx.Process(target=_rank_main, args=(0, 2, f'tcp://127.0.0.1:{_free_port()}', cfg, model, 0, 1, child),\n"
        "                    daemon=True)\n"
        "    p.start()\n"
        "    print('PID', p.pid, flush=True)\n"
        "    time.sleep(600)\n")
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = next((x for x in driver.stdout if x.startswith("PID")), None)
        assert line is not None, f"the driver ended without starting its rank (exit {driver.wait()})"
        rank = psutil.Process(int(line.split()[1]))
        server = rank.parent()
        time.sleep(2)  # the rank is in the rendezvous
        assert rank.is_running() and "forkserver" in " ".join(server.cmdline())
        driver.kill()
        driver.wait()
        t0 = time.monotonic()
        _, alive = psutil.wait_procs([rank, server], timeout=60)
        assert not alive, "the rank (or its fork server) outlived the driver"
        assert time.monotonic() - t0 < 30
    finally:
        driver.kill()
        driver.wait()


def test_colocated_engines_that_keep_their_weights_hold_them_through_the_step(model_dir, tmp_path):
    cfg = run_cfg(model_dir, tmp_path, steps=1, **{"train.parallel": "fsdp", "train.ranks": 2, "train.colocate": True,
                                                   "train.colocate_free_weights": False})
    run = build_run(cfg)
    held, push = [], run.weights.push

    def after_training(*a, **k):
        held.append([st["engine_weight_bytes_in_step"] for st in run.trainer.stats()])
        return push(*a, **k)

    run.weights.push = after_training
    train_sync(cfg, run=run)
    whole = sum(v.numel() * 4 for v in final_weights(tmp_path, step=1).values())
    assert held == [[whole, whole]]


def test_colocate_is_refused_where_it_cannot_run(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="train.colocate runs an engine in every trainer rank: it needs train.parallel=fsdp"):
        run_cfg(model_dir, tmp_path, **{"train.colocate": True})
    with pytest.raises(ConfigError, match="async mode needs engines of their own"):
        run_cfg(model_dir, tmp_path, mode="async", **{"train.parallel": "fsdp", "train.ranks": 2, "train.colocate": True})
    with pytest.raises(ConfigError, match="train.colocate_free_weights applies to the ranks' own engines"):
        run_cfg(model_dir, tmp_path, **{"train.colocate_free_weights": False})
    # vLLM in the ranks sleeps while they train, which frees the K/V that APRIL's keep_kv keeps
    vllm = {"train.parallel": "fsdp", "train.ranks": 2, "train.colocate": True, "rollout.engine": "vllm",
            "partial_rollout.enabled": True, "algorithm.tis_cap": 2.0}
    with pytest.raises(ConfigError, match="frees the K/V that keep_kv keeps"):
        run_cfg(model_dir, tmp_path, **vllm, **{"partial_rollout.carry": "keep_kv"})
    assert run_cfg(model_dir, tmp_path, **vllm).april_carry[0] == "resubmit"  # auto: what it would have kept
    with pytest.raises(ConfigError, match="the trainer rank actors generate and no rollout worker starts"):
        run_cfg(model_dir, tmp_path, runtime="ray", **{"train.parallel": "fsdp", "train.ranks": 2, "ray.trainer": "actor",
                                                       "train.colocate": True, "ray.rollout_workers": 2})
    assert run_cfg(model_dir, tmp_path, **vllm, **{"train.colocate_free_weights": False}).april_carry[0] == "keep_kv"


def test_a_rank_killed_with_its_engine_ends_the_run_naming_it(model_dir, tmp_path):
    cfg = run_cfg(model_dir, tmp_path, **{"train.parallel": "fsdp", "train.ranks": 2, "train.colocate": True,
                                          "train.collective_timeout_s": 60})
    run = build_run(cfg)
    os.kill(run.trainer.procs[1].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"trainer rank 1 of 2 died"):
        train_sync(cfg, run=run)
    assert time.monotonic() - t0 < 30


def test_a_rank_whose_engine_hangs_ends_the_call_naming_it(model_dir, tmp_path):
    """A rank that stops answering (its process stopped here; a hung engine alike) is not waited on
    for ever: past the engines' timeout (train.collective_timeout_s) the call ends with an error
    naming the rank and the call, and the ranks are stopped."""
    cfg = run_cfg(model_dir, tmp_path, **{"train.parallel": "fsdp", "train.ranks": 2, "train.colocate": True,
                                          "train.collective_timeout_s": 60})
    run = build_run(cfg)
    procs = list(run.trainer.procs)
    run.engine._timeout_s = 3  # the ranks' own collectives keep 60 s: a busy host starts them slowly
    try:
        os.kill(procs[1].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RankLost, match=r"trainer rank 1 of 2 gave no answer to engine_call stats within 3 s "
                                           r"\(from train.collective_timeout_s\): taken for hung"):
            run.engine.stats()
        assert 3 <= time.monotonic() - t0 < 20
        for p in procs:
            p.join(timeout=15)
        assert [p.is_alive() for p in procs] == [False, False]
        with pytest.raises(RuntimeError, match="gave no answer"):  # whoever calls next is told why
            run.engine.stats()
    finally:
        _kill_quietly(procs[1].pid)
        run.close()


def test_a_rank_hung_in_a_weight_load_is_named_not_the_peer_that_timed_out(model_dir, tmp_path):
    """A rank stopped while the ranks gather the weights for their engines: its peer's gather
    gives up after train.collective_timeout_s with a collective error, and the error names the
    silent rank as hung, not the peer."""
    cfg = run_cfg(model_dir, tmp_path, **{"train.parallel": "fsdp", "train.ranks": 2, "train.colocate": True,
                                          "train.collective_timeout_s": 20})
    run = build_run(cfg)
    procs = list(run.trainer.procs)
    try:
        os.kill(procs[1].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RankLost, match=r"trainer rank 1 of 2 gave no answer during engine_load while the "
                                           r"collectives of its peers gave up waiting for it"):
            run.engine.load_from_ranks(1)
        assert time.monotonic() - t0 < 40  # the peer's 20 s, before the driver's own 40
        for p in procs:
            p.join(timeout=15)
        assert [p.is_alive() for p in procs] == [False, False]
    finally:
        _kill_quietly(procs[1].pid)
        run.close()


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def torchrun(model_dir, run_dir, *extra: str, steps: int = 4):
    """`torchrun --nproc-per-node 2 -m rollover.cli train` with run_cfg's settings, started."""
    import subprocess
    import sys

    from rollover.train.ranks import _free_port

    cfg = run_cfg(model_dir, run_dir, steps=steps)
    args = [f"{k}={v}" for k, v in (("device", "cpu"), ("model", model_dir), ("run_dir", run_dir), ("steps", steps),
                                     ("seed", cfg.seed), ("data.train", cfg.data.train))]
    args += ["data.eval_size=4", "data.max_prompt_tokens=64", "rollout.prompts_per_step=4",
             "rollout.samples_per_prompt=3", "rollout.max_new_tokens=6", "rollout.max_rows=8",
             "reward.functions=[{fn: format, kwargs: {pattern: '[0-4]'}}]", "train.lr=1e-3", "eval.every=0",
             "eval.at_start=false", "checkpoint.every=2", "logging.progress=false", "logging.tensorboard=false",
             "train.parallel=fsdp", *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           "-m", "rollover.cli", "train", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def wait_for_a_step(job, run_dir, limit_s: float = 300) -> None:
    """Until the torchrun job has trained a step (it must not end before)."""
    import json

    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + limit_s
    while not (metrics.exists() and any(json.loads(x)["kind"] == "train" for x in metrics.read_text().splitlines())):
        assert job.poll() is None and time.monotonic() < deadline, job.stdout.read() if job.poll() is not None else ""
        time.sleep(0.5)


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    """The LM head is the embedding, as in most small real models (Qwen2.5-0.5B, SmolLM2)."""
    return str(save_tiny_model(tmp_path_factory.mktemp("m") / "tied", "llama", seed=3, tie_word_embeddings=True))


def test_torchrun_ranks_train_as_the_ranks_the_command_starts(tied_model_dir, tmp_path):
    """Under torchrun, RANK 0 drives and the other process is trainer rank 1 (it builds only the
    model's structure, tied LM head included, and takes rank 0's weights, and the critic's: the
    run has PPO's critic, which a run without one leaves out): the run ends with the weights of
    the same run with `train.ranks=2`."""
    over = {"algorithm.advantage": "gae", "critic.lr": 1e-2}
    job = torchrun(tied_model_dir, tmp_path / "torchrun", *(f"{k}={v}" for k, v in over.items()))
    out, _ = job.communicate(timeout=600)
    assert job.returncode == 0, out
    assert "trainer: 2 FSDP ranks" in out
    train_sync(run_cfg(tied_model_dir, tmp_path / "spawned", **{"train.parallel": "fsdp", "train.ranks": 2, **over}))
    a, b = final_weights(tmp_path / "torchrun"), final_weights(tmp_path / "spawned")
    assert_trained(tied_model_dir, a)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 5e-5


def test_a_stop_signal_to_torchrun_ends_the_step_with_a_checkpoint(model_dir, tmp_path):
    """torchrun passes SIGTERM to every process: the trainer ranks wait for the driver, which
    finishes its step and saves it."""
    job = torchrun(model_dir, tmp_path / "r", steps=200)
    wait_for_a_step(job, tmp_path / "r")
    job.send_signal(signal.SIGTERM)
    out, _ = job.communicate(timeout=120)
    assert "stopped after step" in out and "with a checkpoint" in out, out
    assert list((tmp_path / "r" / "checkpoints").glob("step_*/sharded/.metadata"))


def test_a_killed_torchrun_rank_ends_the_job_naming_it(model_dir, tmp_path):
    job = torchrun(model_dir, tmp_path / "r", steps=200)
    wait_for_a_step(job, tmp_path / "r")
    rank1 = next(pid for pid in map(int, os.popen(f"pgrep -f 'rollover.cli train.*{tmp_path}'").read().split())
                 if b"RANK=1\0" in open(f"/proc/{pid}/environ", "rb").read())
    os.kill(rank1, signal.SIGKILL)
    t0 = time.monotonic()
    out, _ = job.communicate(timeout=120)
    assert job.returncode != 0 and time.monotonic() - t0 < 60
    assert "trainer rank 1 of 2 died" in out, out  # the driver's own word, not only torchrun's summary


def test_torchrun_needs_the_sharded_trainer(monkeypatch, capsys, tmp_path):
    from rollover.cli import main

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(["train", f"run_dir={tmp_path / 'r'}", "steps=1"]) == 2
    err = capsys.readouterr().err
    assert "torchrun started 4 processes, which are the trainer's ranks: set train.parallel=fsdp" in err
    assert main(["train", f"run_dir={tmp_path / 'r'}", "steps=1", "train.parallel=fsdp", "runtime=ray",
                 "ray.trainer=actor"]) == 2
    assert "runtime=ray places rank actors of its own" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    # train.ranks left unset is the world size, checked as such (sequence parallelism divides it);
    # ranks given otherwise are refused, naming the key
    from rollover.cli import _torchrun_config

    cfg = _torchrun_config(None, [f"run_dir={tmp_path / 'r'}", "train.parallel=fsdp", "train.sequence_parallel=2"], 4)
    assert (cfg.train.ranks, cfg.train.sequence_parallel) == (4, 2)
    assert _torchrun_config(None, [f"run_dir={tmp_path / 'r'}", "train.parallel=fsdp", "train.sequence_parallel=2",
                                   "train.ranks=6"], 4) is None
    assert "train.ranks" in capsys.readouterr().err
    assert _torchrun_config(None, [f"run_dir={tmp_path / 'r'}", "train.parallel=fsdp", "train.ranks=3"], 4) is None
    assert "torchrun started 4 processes" in capsys.readouterr().err
    for given in (["train.ranks=2", "data.instruction=Answer: a: b"], ["train={ranks: 2}"]):  # read as load_config does
        assert _torchrun_config(None, [f"run_dir={tmp_path / 'r'}", "train.parallel=fsdp", "train.sequence_parallel=4",
                                       *given], 4) is None
        assert "train.ranks" in capsys.readouterr().err


def test_the_ranks_devices_are_checked_before_anything_starts():
    """Each rank the command starts takes cuda:r: more ranks than GPUs, or a device index the ranks
    would not use, are refused naming the key; CPU offload on CPU ranks is refused (it had failed
    inside every rank pinning memory without a GPU). torchrun and Ray place ranks themselves."""
    from rollover.loops.build import check_rank_devices

    def check(device, count=4, torchrun=False, **over):
        cfg = load_config(model="m", run_dir="r", device=device, **{"train.parallel": "fsdp", "train.ranks": 4, **over})
        check_rank_devices(cfg, torch.device(device), count, torchrun)

    check("cuda")
    check("cuda:0")
    check("cuda", count=8, **{"train.fsdp_offload": True})
    check("cpu")
    with pytest.raises(ConfigError, match=r"train.ranks=4: torch sees 2 CUDA devices here and each rank needs one"):
        check("cuda", count=2)
    check("cuda", count=2, torchrun=True)  # per node: torchrun's LOCAL_RANK picks the GPU
    check("cuda", count=2, runtime="ray", **{"ray.trainer": "actor", "ray.gpus_for_trainer": 1})
    with pytest.raises(ConfigError, match=r"device='cuda:1' with train.parallel=fsdp: the ranks take cuda:0 to cuda:3"):
        check("cuda:1")
    with pytest.raises(ConfigError, match=r"train.fsdp_offload .* on device='cpu' \(cpu\) they are in CPU memory already"):
        check("cpu", **{"train.fsdp_offload": True})


def test_a_checkpoint_resumes_only_as_it_was_trained_lora_or_every_weight(tmp_path):
    """The sharded trainer saves a LoRA run's weights merged (no adapter/), so its config says how
    it trained: resuming it without train.lora, or a full fine-tune with train.lora, is refused
    with the way to start a new run from it (it had failed inside the ranks: a missing key)."""
    from rollover.config import dump_config
    from rollover.loops.resume import check_lora_matches as _check_lora_matches

    lora = {"train.lora": {"r": 4, "alpha": 8}}
    for name, over in (("lora", lora), ("full", {})):
        ckpt = tmp_path / name / "checkpoints" / "step_000002"
        ckpt.mkdir(parents=True)
        (ckpt / "config.yaml").write_text(dump_config(load_config(model="m", run_dir="r", **over)))
    _check_lora_matches(load_config(model="m", run_dir="r", **lora), tmp_path / "lora" / "checkpoints" / "step_000002")
    _check_lora_matches(load_config(model="m", run_dir="r"), tmp_path / "full" / "checkpoints" / "step_000002")
    with pytest.raises(ConfigError, match=r"holds a LoRA adapter but train.lora is unset.*rollover export RUN_DIR OUT"):
        _check_lora_matches(load_config(model="m", run_dir="r"), tmp_path / "lora" / "checkpoints" / "step_000002")
    with pytest.raises(ConfigError, match=r"was trained without LoRA \(every weight\) but train.lora is set.*model=.*/model"):
        _check_lora_matches(load_config(model="m", run_dir="r", **lora), tmp_path / "full" / "checkpoints" / "step_000002")


def test_a_ranks_error_line_is_its_exception_even_when_the_message_runs_on():
    """CUDA's and NCCL's messages end in advice on lines of their own: the one line of a rank's
    failure is the exception's first line, chained exceptions' last."""
    from rollover.train.ranks import _last_line

    tb = ('Traceback (most recent call last):\n  File "x.py", line 1, in f\n    g()\nValueError: first\n\n'
          'During handling of the above exception, another exception occurred:\n\n'
          'Traceback (most recent call last):\n  File "y.py", line 2, in g\n    h()\n'
          'torch.AcceleratorError: CUDA error: device-side assert triggered\n'
          'CUDA kernel errors might be asynchronously reported at some other API call.\n'
          'Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n')
    assert _last_line(tb) == "torch.AcceleratorError: CUDA error: device-side assert triggered"
    assert _last_line('Traceback (most recent call last):\n  File "z.py", line 3, in k\nKeyboardInterrupt\n') == \
        "KeyboardInterrupt"
