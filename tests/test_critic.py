"""PPO with a critic (algorithm.advantage=gae) in the trainer: the advantages a step trains on,
the critic's updates, their independence of the micro-batch split, warm-up, and a run's resume."""

from __future__ import annotations

import json

import pytest
import torch

from rollover.algos.gae import masked_whiten
from rollover.testing import save_swapped_tokenizer_model, save_tiny_model, tiny_model
from rollover.train.trainer import Trainer

from test_train import (_final_weights, batch_of, model_dir, rollout, step_seeing_gradient,  # noqa: F401 (a fixture)
                        tiny_cfg, train_sync)


def rewarded_batch():
    """Six sequences of two prompts; their rewards (what the gae estimator hands the trainer)."""
    pairs = []
    for i in range(6):
        r, _ = rollout(f"g{i % 2}", [5 + i % 2, 6, 7], [8 + i, 3 * i % 11, 9, 4][: 2 + i % 3], 0.0)
        r.reward = [1.0, 0.0, 0.5, 1.0, -0.5, 0.0][i]
        pairs.append((r, r.reward))
    return batch_of(pairs)


def trainer(model_dir, run_dir, **over):
    cfg = tiny_cfg(model_dir, run_dir, **{"algorithm.advantage": "gae", "data.max_prompt_tokens": 4,
                                          "rollout.max_new_tokens": 4, "train.pack_length": 8, **over})
    return Trainer(tiny_model("llama", seed=5), cfg, device=torch.device("cpu"))


def test_a_fresh_critic_gives_the_whitened_rewards_and_then_learns_the_returns(model_dir, tmp_path):
    """The head starts at 0, so the first step trains each token on its sequence's reward,
    whitened over the step's tokens. Repeated steps on one batch bring the value loss down to the
    least it can be: before a response's first token the critic has seen only the prompt, which
    the group's samples share, so there its best value is the group's mean reward; after that
    each token's prefix tells the samples apart."""
    batch = rewarded_batch()
    tr = trainer(model_dir, tmp_path / "r", **{"critic.lr": 1e-2, "critic.value_clip": None, "train.lr": 1e-6})
    step = tr.critic.advantages(batch)
    shaped, values, returns, metrics = step.batch, step.values_BT, step.returns_BT, step.metrics
    assert values.eq(0).all() and metrics["critic/values/mean"] == 0.0
    want = masked_whiten(batch.adv_B[:, None].expand_as(batch.mask_BT) * batch.mask_BT, batch.mask_BT)
    torch.testing.assert_close(shaped.adv_BT, want)
    torch.testing.assert_close(returns, batch.adv_B[:, None] * batch.mask_BT)  # gamma = lam = 1
    losses = [tr.train_step(batch)["critic/vf_loss"] for _ in range(30)]
    rewards, group = batch.adv_B, batch.group_index_B
    first = sum(float((rewards[group == g] - rewards[group == g].mean()).square().sum()) for g in (0, 1))
    floor = 0.5 * first / batch.num_tokens  # 0.5 x squared error at the first tokens, over all tokens
    assert losses[0] > 2 * floor and losses[-1] < 1.05 * floor, (floor, losses)


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_the_critics_update_does_not_depend_on_the_micro_batch_split(model_dir, tmp_path):
    """One micro-batch or several: the same value loss and the same gradient for the critic (its
    head set off zero first, so the trunk's gradient is not 0) and for the policy."""
    batch = rewarded_batch()
    seen = []
    for mbt in (256, 8):
        tr = trainer(model_dir, tmp_path / f"r{mbt}", **{"train.micro_batch_tokens": mbt, "train.grad_clip": 0.0})
        with torch.no_grad():
            head = tr.critic.value.head.weight
            head.copy_(torch.linspace(-1, 1, head.numel()).view_as(head))
        grads, real_step = {}, tr.critic.optimizer.step

        def step(*a, tr=tr, grads=grads, real_step=real_step, **kw):
            grads.update({n: p.grad.clone() for n, p in tr.critic.value.trunk.named_parameters()})
            grads["head"] = tr.critic.value.head.weight.grad.clone()
            return real_step(*a, **kw)

        tr.critic.optimizer.step = step
        metrics, policy = step_seeing_gradient(tr, batch)
        assert (metrics["actor/micro_batches"] == 1) == (mbt == 256)
        seen.append((metrics, grads, policy))
    (m1, c1, p1), (m2, c2, p2) = seen
    assert m1["critic/vf_loss"] == pytest.approx(m2["critic/vf_loss"], rel=1e-5)
    # the policy loss is about 0 (advantages centred within groups): float32 sums in two orders differ
    # by ~1e-7 on some CPUs, so the bound is absolute; the gradients below are the real check
    assert m1["actor/pg_loss"] == pytest.approx(m2["actor/pg_loss"], rel=1e-5, abs=1e-6)
    assert float(c1["layers.0.self_attn.q_proj.weight"].abs().max()) > 0
    for grads_1, grads_2 in ((c1, c2), (p1, p2)):
        assert grads_1.keys() == grads_2.keys()
        for name in grads_1:
            torch.testing.assert_close(grads_1[name], grads_2[name], rtol=1e-4, atol=1e-5, msg=name)


def test_critic_warmup_trains_the_critic_alone_first(model_dir, tmp_path):
    batch = rewarded_batch()
    tr = trainer(model_dir, tmp_path / "r", **{"critic.warmup_steps": 1, "critic.lr": 1e-2})
    policy = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    head = tr.critic.value.head.weight.detach().clone()
    metrics = tr.train_step(batch)
    assert metrics["critic/warmup"] == 1.0 and "actor/pg_loss" not in metrics
    assert all(torch.equal(p, policy[n]) for n, p in tr.model.named_parameters())
    assert not torch.equal(tr.critic.value.head.weight, head)
    metrics = tr.train_step(batch)
    assert "critic/warmup" not in metrics and "actor/pg_loss" in metrics
    assert any(not torch.equal(p, policy[n]) for n, p in tr.model.named_parameters())


def test_the_kl_penalty_in_the_reward_is_each_tokens_and_its_weight_adapts(model_dir, tmp_path):
    """algorithm.kl_in_reward: with the critic's values 0 and gamma = lam = 1, each token's return
    is the sequence's reward less kl_in_reward times the KL (log pi_old - log pi_ref) of that token
    and those after it. Under adaptive control the weight moves by at most 20% x sequences /
    horizon a step: down while the KL is under the target (the first step: policy = reference),
    up once it is above."""
    batch = rewarded_batch()
    tr = trainer(model_dir, tmp_path / "r", **{"algorithm.kl_in_reward": 0.1, "critic.lr": 1e-2,
                                               "algorithm.kl_in_reward_target": 1e-6,
                                               "algorithm.kl_in_reward_horizon": len(batch)})
    g = torch.Generator().manual_seed(2)
    ref = -torch.rand(batch.mask_BT.shape, generator=g) * batch.mask_BT
    old = ref + torch.rand(batch.mask_BT.shape, generator=g) * batch.mask_BT  # a KL above the target
    step = tr.critic.advantages(batch, old, ref)
    kl = (old - ref) * batch.mask_BT
    to_go = kl.flip(1).cumsum(1).flip(1)  # each token's KL and the later ones'
    torch.testing.assert_close(step.returns_BT, (batch.adv_B[:, None] - 0.1 * to_go) * batch.mask_BT)
    per_seq = kl.sum(1) / batch.mask_BT.sum(1)
    assert step.metrics["critic/kl_in_reward"] == pytest.approx(float(per_seq.mean()))
    assert step.metrics["critic/kl_in_reward_coef"] == 0.1 and tr.critic.kl_coef == pytest.approx(0.12)
    tr.critic.kl_coef = 0.1
    coefs, kls = [], []
    for _ in range(3):
        m = tr.train_step(batch)
        coefs.append(m["critic/kl_in_reward_coef"])
        kls.append(m["critic/kl_in_reward"])
    assert kls[0] == 0.0 and kls[1] > 1e-6  # the first step's policy is the reference
    assert coefs == pytest.approx([0.1, 0.08, 0.096])


def test_a_resumed_trainer_keeps_an_adaptive_kl_weight_and_takes_a_fixed_one_from_its_config(model_dir, tmp_path):
    batch = rewarded_batch()
    adaptive = {"algorithm.kl_in_reward": 0.05, "algorithm.kl_in_reward_target": 1e-6,
                "algorithm.kl_in_reward_horizon": len(batch)}
    tr = trainer(model_dir, tmp_path / "a", **adaptive)
    tr.train_step(batch)
    moved = tr.critic.kl_coef
    assert moved == pytest.approx(0.04)  # the first step's KL is 0: under the target
    state = tr.state_dict()
    again = trainer(model_dir, tmp_path / "b", **adaptive)
    again.load_state_dict(state)
    assert again.critic.kl_coef == moved
    fixed = trainer(model_dir, tmp_path / "c", **{"algorithm.kl_in_reward": 0.1})
    fixed.load_state_dict(state)
    assert fixed.critic.kl_coef == 0.1


def test_a_lora_policys_critic_trains_an_adapter_of_its_own_and_its_head(model_dir, tmp_path):
    """train.lora with gae: the critic's trunk starts as the base model (the policy's adapter left
    out), under an adapter of its own; only that adapter and the head train, the base stays."""
    from rollover.train.lora import apply_lora

    lora = {"r": 4, "alpha": 8}
    cfg = tiny_cfg(model_dir, tmp_path / "r", **{"algorithm.advantage": "gae", "train.lora": lora, "critic.lr": 1e-2,
                                                 "data.max_prompt_tokens": 4, "rollout.max_new_tokens": 4,
                                                 "train.pack_length": 8})
    policy = apply_lora(tiny_model("llama", seed=5), lora)
    with torch.no_grad():  # the policy's adapter away from zero: the policy is not its base
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    tr = Trainer(policy, cfg, device=torch.device("cpu"))
    value = tr.critic.value
    trainable = {n for n, p in value.named_parameters() if p.requires_grad}
    assert any("lora_" in n for n in trainable) and {"head.weight", "head.bias"} <= trainable
    assert all("lora_" in n or n.startswith("head.") for n in trainable)
    ids, pos = torch.tensor([[5, 6, 7, 8]]), torch.arange(4)[None]
    with torch.no_grad():
        base = tiny_model("llama", seed=5).model(input_ids=ids, position_ids=pos).last_hidden_state
        mine = value.trunk(input_ids=ids, position_ids=pos).last_hidden_state
        theirs = tr.model.get_base_model().model(input_ids=ids, position_ids=pos).last_hidden_state
    torch.testing.assert_close(mine, base)
    assert float((theirs - base).abs().max()) > 1e-3
    frozen = {n: p.detach().clone() for n, p in value.named_parameters() if not p.requires_grad}
    batch = rewarded_batch()
    losses = [tr.train_step(batch)["critic/vf_loss"] for _ in range(8)]
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(torch.equal(p, frozen[n]) for n, p in value.named_parameters() if not p.requires_grad)
    assert any(float(p.detach().abs().max()) > 0 for n, p in value.named_parameters() if "lora_B" in n)
    kept = tr.state_dict()["critic"]["value"]
    assert set(kept) == trainable  # the frozen base is not in the checkpoint


def reward_model_dir(path, num_labels=1, **overrides):
    """A tiny one-label sequence classifier (a reward model) with the test tokenizer, its score
    head away from zero."""
    from transformers import AutoModelForSequenceClassification

    from rollover.testing import char_tokenizer, tiny_config

    torch.manual_seed(13)
    scorer = AutoModelForSequenceClassification.from_config(tiny_config("llama", num_labels=num_labels, **overrides))
    with torch.no_grad():
        for p in scorer.parameters():
            p.normal_(0.0, 0.1)
    scorer.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return scorer.eval(), str(path)


@pytest.mark.parametrize("kind", ["causal_lm", "reward_model"])
def test_a_critic_from_another_checkpoint_starts_as_that_model(model_dir, tmp_path, kind):
    """critic.model: the critic's trunk is the checkpoint's (here of another width than the
    policy's), under a head at zero for a causal LM, or under a reward model's own score head, so
    that the first values are the reward model's score of each prefix; then it trains."""
    if kind == "reward_model":
        source, path = reward_model_dir(tmp_path / "rm", hidden_size=48)
        trunk_of = source.model
    else:
        path = str(save_tiny_model(tmp_path / "lm", seed=11, hidden_size=48))
        from transformers import AutoModelForCausalLM

        trunk_of = AutoModelForCausalLM.from_pretrained(path).model
    tr = trainer(model_dir, tmp_path / "r", **{"critic.model": path, "critic.lr": 3e-3})
    value = tr.critic.value
    ids, pos = torch.tensor([[5, 6, 7, 8, 9]]), torch.arange(5)[None]
    with torch.no_grad():
        want = trunk_of(input_ids=ids, position_ids=pos).last_hidden_state
        torch.testing.assert_close(value.trunk(input_ids=ids, position_ids=pos).last_hidden_state, want)
    batch = rewarded_batch()
    values = tr.critic.advantages(batch).values_BT
    if kind == "causal_lm":
        assert values.eq(0).all()
    else:  # the value before response token j is the score at the position before it
        with torch.no_grad():
            for i in range(len(batch)):
                seq = torch.tensor([batch.prompt_ids[i] + batch.response_ids[i]])
                scores = source.score(source.model(input_ids=seq).last_hidden_state)[0, :, 0]
                n, p = len(batch.response_ids[i]), len(batch.prompt_ids[i])
                torch.testing.assert_close(values[i, :n], scores[p - 1: p - 1 + n], rtol=1e-4, atol=1e-5)
    losses = [tr.train_step(batch)["critic/vf_loss"] for _ in range(10)]
    assert losses[-1] < 0.6 * losses[0], losses


@pytest.mark.parametrize("make, options, match", [
    (save_swapped_tokenizer_model, {}, r"another tokenizer than the policy's \(token 'a' is"),
    (lambda d: reward_model_dir(d, num_labels=2)[1], {}, "sequence classifier with 2 labels"),
    (lambda d: save_tiny_model(d, max_position_embeddings=16), {}, "a context of 16 tokens; the run's sequences reach 40"),
    (lambda d: save_tiny_model(d, "gpt2"), {}, "is a gpt2 model: the critic must be of the Llama, Mistral or Qwen families"),
    (lambda d: save_tiny_model(d, hidden_size=48, num_attention_heads=3, num_key_value_heads=1),
     {"sequence_parallel": 2}, "attention heads"),
    (lambda d: save_tiny_model(d), {"lora": {"r": 4, "target_modules": ["no_such_proj"]}}, "no_such_proj"),
    (lambda d: d / "absent", {}, "not a model with a tokenizer"),
])
def test_a_critic_checkpoint_that_cannot_judge_the_policys_tokens_is_refused(model_dir, tmp_path, make, options, match):
    from rollover.models import load_tokenizer
    from rollover.train.critic import check_critic_model

    path = str(make(tmp_path / "critic"))
    with pytest.raises(ValueError, match=match):
        check_critic_model(path, load_tokenizer(model_dir), tiny_model("llama").config, 40, **options)


def test_a_critic_checkpoint_is_read_whole_and_kept_across_resumes(model_dir, tmp_path):
    """A tokenizer with tokens beyond the policy's (a reward model's added padding) is fine; a
    checkpoint lacking some of the critic's weights is refused rather than started at random;
    a run cannot resume into a critic of another network than the one its checkpoint trained."""
    from safetensors.torch import load_file, save_file

    from rollover.config import ConfigError
    from rollover.models import load_tokenizer
    from rollover.testing import char_tokenizer
    from rollover.train.critic import check_critic_model, value_model_from

    wider = save_tiny_model(tmp_path / "wider", vocab_size=120)
    char_tokenizer(extra=("<pad2>",)).save_pretrained(wider)
    check_critic_model(str(wider), load_tokenizer(model_dir), tiny_model("llama").config, 40)  # no error
    weights = load_file(str(wider / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(wider / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 of the critic's weights \(e.g. layers.1.mlp.up_proj.weight\)"):
        value_model_from(str(wider))
    other = str(save_tiny_model(tmp_path / "other", seed=11, hidden_size=48))
    state = trainer(model_dir, tmp_path / "a", **{"critic.model": other}).state_dict()
    with pytest.raises(ConfigError, match=r"started from critic.model=.*other', this run's from a copy of the policy"):
        trainer(model_dir, tmp_path / "b").load_state_dict(state)


@pytest.mark.parametrize("lora,critic_model", [(None, False), ({"r": 4, "alpha": 8}, False), (None, True)],
                         ids=["full", "lora", "reward_model_critic"])
def test_a_gae_run_trains_one_sample_a_prompt_and_resumes_exactly(model_dir, tmp_path, lora, critic_model):
    """PPO with a critic needs no group: one sample a prompt trains. Killed after its step-2
    checkpoint and resumed, the run ends with the weights of a run never stopped (the critic, its
    optimizer and the adaptive KL weight come back from the checkpoint: without them steps 3-4
    would differ); also with a critic from a reward model's checkpoint (critic.model)."""
    over = {"algorithm.advantage": "gae", "rollout.samples_per_prompt": 1, "rollout.prompts_per_step": 6,
            "critic.lr": 1e-2, "rollout.temperature": 1.5, "eval.every": 0,
            "algorithm.kl_in_reward": 0.05, "algorithm.kl_in_reward_target": 1e-4,  # its moving weight resumes too
            **({"train.lora": lora} if lora else {}),
            **({"critic.model": reward_model_dir(tmp_path / "rm", hidden_size=48)[1]} if critic_model else {})}
    straight, split = tmp_path / "straight", tmp_path / "split"
    train_sync(tiny_cfg(model_dir, straight, steps=4, **over))
    train_sync(tiny_cfg(model_dir, split, steps=2, **over))
    train_sync(tiny_cfg(model_dir, split, steps=4, **over))
    rows = [r for r in map(json.loads, open(straight / "metrics.jsonl")) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["critic/grad_norm"] > 0 for r in rows) and rows[-1]["critic/values/mean"] != 0

    if lora:  # a LoRA run's checkpoint holds the adapter: exact too (the frozen base never moves)
        from safetensors.torch import load_file

        a, b = (load_file(str(d / "checkpoints" / "step_000004" / "adapter" / "adapter_model.safetensors"))
                for d in (straight, split))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    else:
        a, b = _final_weights(straight, 4), _final_weights(split, 4)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_episodes_train_with_a_critic_over_their_sampled_tokens_only(model_dir, tmp_path, monkeypatch):
    """A multi-turn run with gae: the environment's replies inside a response are out of the loss,
    and the critic's values, advantages and returns are 0 there (they are not states); on the
    sampled tokens each advantage is the return less the value, whitened (gamma = lam = 1). The
    head is set off zero so that the values differ from token to token."""
    from rollover.train.critic import Critic
    from test_env_training import env_cfg

    seen, real_advantages, real_init = [], Critic.advantages, Critic.__init__

    def init(self, *args):
        real_init(self, *args)
        with torch.no_grad():
            self.value.head.weight.copy_(torch.randn(self.value.head.weight.shape, generator=torch.Generator().manual_seed(0)))

    def spy(self, batch, *kl):
        step = real_advantages(self, batch, *kl)
        seen.append((batch.mask_BT.clone(), batch.versions_BT.clone(), step.batch.adv_BT.clone(),
                     step.values_BT.clone(), step.returns_BT.clone()))
        return step

    monkeypatch.setattr(Critic, "__init__", init)
    monkeypatch.setattr(Critic, "advantages", spy)
    train_sync(env_cfg(model_dir, tmp_path, **{"algorithm.advantage": "gae", "rollout.samples_per_prompt": 1,
                                               "rollout.prompts_per_step": 4}))
    assert len(seen) == 2
    inserted = 0
    for mask, versions, adv, values, returns in seen:
        inserted += int(((versions < 0) & ~mask).sum())  # an environment's reply inside a response
        for x in (adv, values, returns):
            assert x[~mask].eq(0).all()
        assert values[mask].std() > 0
        torch.testing.assert_close(adv, masked_whiten(returns - values, mask))
    assert inserted > 0


def test_each_turns_reward_reaches_the_critic_where_it_was_earned(model_dir, tmp_path, monkeypatch):
    """env.credit=reward_to_go with gae: each turn's reward sits on its last trained token, so the
    return the critic learns at a token (gamma = lam = 1) is what that turn and the later ones
    earned, not the episode's whole reward; every turn's reward is on a trained token (none lost)."""
    from pathlib import Path

    from rollover.train.critic import Critic
    from test_env_training import env_cfg

    seen, real_advantages = [], Critic.advantages

    def spy(self, batch, *kl):
        step = real_advantages(self, batch, *kl)
        seen.append((batch.mask_BT.clone(), batch.adv_B.clone(), batch.adv_BT.clone(), step.returns_BT.clone()))
        return step

    monkeypatch.setattr(Critic, "advantages", spy)
    fixtures = Path(__file__).with_name("env_fixtures.py")
    train_sync(env_cfg(model_dir, tmp_path, steps=1, **{
        "env.name": f"{fixtures}:Shaped", "env.options": {}, "env.credit": "reward_to_go", "env.inline": True,
        "algorithm.advantage": "gae", "rollout.samples_per_prompt": 1, "rollout.prompts_per_step": 4,
        "rollout.max_new_tokens": 4, "logging.samples": 1}))
    (mask, adv_B, rewards_BT, returns_BT), = seen
    assert adv_B.eq(0).all() and rewards_BT[~mask].eq(0).all()
    assert (rewards_BT != 0).sum(1).max() > 1  # rewards earned at more than one turn of an episode
    to_go_BT = rewards_BT.flip(1).cumsum(1).flip(1)  # what is earned at or after each token
    torch.testing.assert_close(returns_BT[mask], to_go_BT[mask])
    from rollover.metrics.samples import samples_path

    samples = [json.loads(x) for x in open(samples_path(tmp_path, 1))][1:]
    totals = sorted(sum(t["reward"] for t in s["turns"]) for s in samples)
    assert sorted(rewards_BT.sum(1).tolist()) == pytest.approx(totals)  # no turn's reward lost


def test_a_turn_without_trained_tokens_puts_its_reward_on_the_last_trained_token_before_it_or_none():
    from rollover.rollout.episodes import turn_rewards
    from rollover.types import Group, Prompt, Rollout

    def episode(mask, spans, rewards):
        r = Rollout(group_id="g", prompt_ids=[1], response_ids=[2] * len(mask), logprobs=[0.0] * len(mask),
                    versions=[0] * len(mask), loss_mask=mask, finish="stop")
        r.turns = [{"span": s, "reward": w} for s, w in zip(spans, rewards)]
        return r

    # turn 1: tokens 0-1, env reply 2, turn 2: tokens 3-4 (masked out), env reply 5, turn 3: token 6
    a = episode([1, 1, 0, 0, 0, 0, 1], [[0, 2], [3, 5], [6, 7]], [0.5, 0.25, 1.0])
    b = episode([0, 0, 0, 1], [[0, 2], [3, 4]], [0.75, 0.5])  # a first turn with nothing trained (APRIL's masked stale turn)
    adv_B, per_token, info = turn_rewards([Group(id="g", prompt=Prompt(id="p", text="?"), prompt_ids=[1], rollouts=[a, b])])
    assert adv_B.tolist() == [0.0, 0.0] and info["num_groups"] == 1
    assert per_token == [[0.0, 0.75, 0.0, 0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.5]]  # b's first reward: no decision trained led to it
