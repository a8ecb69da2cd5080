"""The optimal token baseline (algorithm.advantage=otb): its arithmetic against a plain loop
over the paper's formula, its groups with no signal, split groups, importance weights, and the
trainer's use of it."""

import math

import pytest
import torch

from rollover.algos import token_baseline as otb


def by_hand(returns, groups, logp, sum_sq, mask, weight=None, eps=1e-8):
    """B_t = Σ G W_t / (Σ W_t + eps) over a group's samples reaching t, W_t = Σ_{j<=t} (1 - 2π_j + Σπ²_j)
    (times w_j² with importance weights); advantage G - B_t. Loops, no tensors' algebra."""
    B, T = len(returns), len(mask[0])
    W = [[0.0] * T for _ in range(B)]
    for i in range(B):
        run = 0.0
        for t in range(T):
            if mask[i][t]:
                term = 1 - 2 * math.exp(logp[i][t]) + sum_sq[i][t]
                run += term * (1.0 if weight is None else weight[i][t] ** 2)
            W[i][t] = run
    adv = [[0.0] * T for _ in range(B)]
    for g in set(groups):
        rows = [i for i in range(B) if groups[i] == g]
        if len(rows) < 2 or len({returns[i] for i in rows}) == 1:
            continue
        for t in range(T):
            num = sum(returns[i] * W[i][t] for i in rows if mask[i][t])
            den = sum(W[i][t] for i in rows if mask[i][t])
            for i in rows:
                if mask[i][t]:
                    adv[i][t] = returns[i] - num / (den + eps)
    return adv


def case(seed=0, B=7, T=6):
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(B, T, 5, generator=g) * 2, dim=-1)
    picked = torch.randint(0, 5, (B, T), generator=g)
    logp = probs.gather(2, picked[..., None]).squeeze(2).log()
    sum_sq = probs.square().sum(-1)
    lengths = torch.tensor([6, 3, 5, 1, 6, 4, 2])[:B]
    mask = torch.arange(T)[None] < lengths[:, None]
    returns = torch.tensor([1.0, 0.0, 0.5, 1.0, 2.0, 2.0, 0.0])[:B]
    groups = torch.tensor([4, 4, 4, 4, 9, 9, 2])[:B]  # 9: equal returns; 2: one sample
    return returns, groups, logp, sum_sq, mask


def run(returns, groups, logp, sum_sq, mask, weight=None, split=None):
    energy = otb.path_energy(logp, sum_sq - logp.exp().square(), mask, weight)  # Σπ² over the other ids
    if split is None:
        sums = otb.group_sums(returns, groups, energy, mask)
    else:  # the same groups held in two parts, as two ranks would
        parts = [otb.group_sums(returns[rows], groups[rows], energy[rows], mask[rows]) for rows in split]
        sums = otb.merge(parts)
    return otb.token_advantages(returns, groups, mask, sums)


def test_the_baseline_is_the_energy_weighted_return_at_each_position():
    returns, groups, logp, sum_sq, mask = case()
    adv, info = run(returns, groups, logp, sum_sq, mask)
    want = by_hand(returns.tolist(), groups.tolist(), logp.tolist(), sum_sq.tolist(), mask.tolist())
    torch.testing.assert_close(adv, torch.tensor(want), rtol=1e-5, atol=1e-6)
    assert (adv[~mask] == 0).all()
    assert info["baseline_tokens"] == float(mask[:4].sum())  # group 4's tokens only


def test_groups_with_no_signal_get_exactly_zero():
    returns, groups, logp, sum_sq, mask = case()
    adv, _ = run(returns, groups, logp, sum_sq, mask)
    assert torch.equal(adv[4:], torch.zeros_like(adv[4:]))  # equal returns (9), one sample (2)
    reached = mask[:4].sum(0)  # how many of group 4's responses reach each position
    assert (adv[:4][mask[:4] & (reached > 1)] != 0).all()
    assert abs(float(adv[0, 5])) < 1e-6 and reached[5] == 1  # past every peer's end a response is its own baseline (verl's default)


def test_a_certain_path_weighs_nothing_in_its_peers_baseline():
    """A sample whose every token had probability 1 has energy 0: the baseline is the others' alone."""
    returns = torch.tensor([1.0, 0.0, 5.0])
    groups = torch.zeros(3, dtype=torch.long)
    mask = torch.ones(3, 2, dtype=torch.bool)
    logp = torch.tensor([[-0.7, -1.2], [-0.3, -2.0], [0.0, 0.0]])
    sum_sq = torch.tensor([[0.4, 0.3], [0.6, 0.2], [1.0, 1.0]])
    adv, _ = run(returns, groups, logp, sum_sq, mask)
    w = 1 - 2 * logp[:2].exp() + sum_sq[:2]
    W = w.cumsum(1)
    base = (returns[:2, None] * W).sum(0) / W.sum(0)
    torch.testing.assert_close(adv[2], 5.0 - base)
    assert float(adv[2].min()) > 4.0  # the certain sample's own reward of 5 is not in its baseline


def test_a_group_split_over_holders_gives_what_the_whole_gives():
    returns, groups, logp, sum_sq, mask = case(seed=3)
    whole, _ = run(returns, groups, logp, sum_sq, mask)
    # the second part's rows are shorter: their sums cover fewer positions until merged
    split = [torch.tensor([0, 4, 2, 6]), torch.tensor([1, 3, 5])]
    parts, _ = run(returns, groups, logp, sum_sq, mask, split=split)
    torch.testing.assert_close(parts, whole)
    energy = otb.path_energy(logp, sum_sq - logp.exp().square(), mask)
    short = otb.group_sums(returns[[1, 3]], groups[[1, 3]], energy[[1, 3], :3], mask[[1, 3], :3])
    merged = otb.merge([short, otb.group_sums(returns[[0, 2]], groups[[0, 2]], energy[[0, 2]], mask[[0, 2]])])
    assert merged[4].count == 4 and len(merged[4].energy_T) == 6


def test_the_energy_keeps_its_digits_where_the_policy_is_nearly_certain():
    """1 - 2π + Σπ² rounds to 0 in float32 once 1 - π is below about 1e-4; (1 - π)² + Σ_{v≠y} π_v²
    keeps it: a path's energy and so its weight in the baseline stay right."""
    for gap in (1e-3, 1e-4, 1e-5):
        p = torch.tensor([1 - gap, gap / 2, gap / 2], dtype=torch.float64)
        want = float((1 - p[0]) ** 2 + p[1] ** 2 + p[2] ** 2)  # ‖e_0 − π‖², in float64
        got = otb.path_energy(p[:1].log().float()[None], p[1:].square().sum().float()[None, None],
                              torch.ones(1, 1, dtype=torch.bool))
        assert float(got) == pytest.approx(want, rel=1e-3), gap


def test_importance_weights_enter_squared():
    returns, groups, logp, sum_sq, mask = case(seed=5)
    weight = torch.rand(mask.shape, generator=torch.Generator().manual_seed(1)) * 2
    adv, _ = run(returns, groups, logp, sum_sq, mask, weight)
    want = by_hand(returns.tolist(), groups.tolist(), logp.tolist(), sum_sq.tolist(), mask.tolist(), weight.tolist())
    torch.testing.assert_close(adv, torch.tensor(want), rtol=1e-5, atol=1e-6)
    plain, _ = run(returns, groups, logp, sum_sq, mask)
    assert not torch.allclose(adv, plain)


def test_the_estimator_passes_the_returns_and_counts_groups_with_no_signal():
    from rollover.algos.advantages import compute_advantages

    rewards = torch.tensor([0.1, 1.0, 0.1, 0.0, 0.1, 0.4, 2.0])
    adv, info = compute_advantages("otb", rewards, torch.tensor([3, 7, 3, 7, 3, 7, 9]))
    assert torch.equal(adv, rewards)  # the trainer makes each token's advantage from them
    assert info == {"num_groups": 3, "singleton_groups": 1, "zero_std_groups": 1}


@pytest.mark.parametrize("bad, match", [
    ({"distill.teacher": "x", "distill.loss": "jsd"}, "distill.teacher with algorithm.advantage=otb"),
    ({"env.credit": "reward_to_go", "env.name": "guess_number"}, "env.credit"),
    ({"algorithm.loss": "gspo", "algorithm.aggregation": "seq-mean-token-mean"}, "gspo_token"),
    ({"downsample.keep": 2}, "downsample"),
])
def test_what_otb_does_not_combine_with_is_refused(bad, match):
    from rollover.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=match):
        load_config(**{"device": "cpu", "model": "unused", "run_dir": "unused", "algorithm.advantage": "otb", **bad})


@pytest.mark.parametrize("tis", [False, True])
def test_a_trainer_step_takes_the_gradient_of_the_hand_computed_token_advantages(tmp_path, tis):
    """The trainer's pass gives each token's π and Σπ² from the policy before the step (at the
    rollout temperature), and the update's gradient is the policy gradient of the advantages
    computed from them by hand; the same with one micro-batch or several. With truncated IS
    (algorithm.tis_cap) each token's term in the energy is weighted by its IS weight squared and
    its loss by the weight."""
    from rollover.config import load_config
    from rollover.testing import tiny_model
    from rollover.train.batch import TrainBatch
    from rollover.train.trainer import Trainer
    from rollover.types import Rollout

    rewards = [1.0, 0.0, 0.5, 2.0, 2.0, 2.0, 0.0, 1.0, 1.0]  # group g1: equal, no signal
    seqs = [([5 + i // 3, 6, 7], [8 + i, 3 * i % 11, 9][: 1 + i % 3] * 2) for i in range(9)]
    temperature, cap = 0.8, 2.0
    model = tiny_model("llama", seed=5)
    logps, sums = [], []
    for prompt, response in seqs:
        ids = torch.tensor([prompt + response])
        lp_all = torch.log_softmax(model(ids).logits[0, len(prompt) - 1: -1] / temperature, -1)
        logps.append(lp_all.gather(1, torch.tensor(response)[:, None]).squeeze(1))
        sums.append(lp_all.detach().exp().square().sum(-1))
    # the sampler's logprobs: 3x below the policy's at even positions (weight capped at 2), e^0.5 above at odd
    behav = [lp.detach() + torch.where(torch.arange(len(lp)) % 2 == 0, -math.log(3.0), 0.5) for lp in logps] if tis \
        else [torch.full_like(lp, -1.0) for lp in logps]
    weights = [(lp.detach() - b).exp().clamp(max=cap) if tis else torch.ones_like(lp) for lp, b in zip(logps, behav)]
    rolls = [Rollout(group_id=f"g{i // 3}", prompt_ids=p, response_ids=r, logprobs=behav[i].tolist(),
                     versions=[0] * len(r), loss_mask=[1] * len(r), finish="stop", reward=rewards[i])
             for i, (p, r) in enumerate(seqs)]
    batch = TrainBatch.from_rollouts(rolls, rewards)  # the estimator hands the trainer the rewards
    T = max(len(lp) for lp in logps)
    pad = (lambda xs: [x.tolist() + [0.0] * (T - len(x)) for x in xs])
    mask = [[1] * len(lp) + [0] * (T - len(lp)) for lp in logps]
    adv = by_hand(rewards, [i // 3 for i in range(9)], pad([lp.detach() for lp in logps]), pad(sums), mask,
                  pad(weights) if tis else None)
    n_tokens = sum(len(lp) for lp in logps)
    loss = sum(-(torch.tensor(adv[i][: len(lp)]) * w * (lp - lp.detach()).exp()).sum()
               for i, (lp, w) in enumerate(zip(logps, weights))) / n_tokens
    model.zero_grad()
    loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert all(a == 0 for row in adv[3:6] for a in row) and any(a != 0 for row in adv[:3] for a in row)
    for mbt in (256, 16):
        cfg = load_config(**{"device": "cpu", "model": "unused", "run_dir": str(tmp_path), "rollout.samples_per_prompt": 3,
                             "rollout.max_new_tokens": 6, "train.micro_batch_tokens": mbt, "train.pack_length": 16,
                             "rollout.temperature": temperature, "algorithm.advantage": "otb", "train.grad_clip": 0.0,
                             "data.max_prompt_tokens": 10, **({"algorithm.tis_cap": cap} if tis else {})})
        tr = Trainer(tiny_model("llama", seed=5), cfg, device=torch.device("cpu"))
        seen, real_step = {}, tr.optimizer.step
        tr.optimizer.step = lambda *a, **kw: (seen.update({n: p.grad.clone() for n, p in tr.model.named_parameters()
                                                            if p.grad is not None}), real_step(*a, **kw))[1]
        metrics = tr.train_step(batch)
        assert (metrics["actor/micro_batches"] == 1) == (mbt == 256)
        assert metrics["actor/pg_loss"] == pytest.approx(float(loss.detach()), rel=1e-4)
        energy = [float(((1 - 2 * lp.detach().exp() + s) * w.square()).sum()) for lp, s, w in zip(logps, sums, weights)]
        assert metrics["otb/path_energy"] == pytest.approx(sum(energy) / 9, rel=1e-4)
        assert seen.keys() == want.keys()
        for k in want:
            assert torch.allclose(seen[k], want[k], rtol=1e-4, atol=1e-6), (mbt, k)


def test_a_trainer_given_no_sequence_reports_nothing(tmp_path):
    """A sharded trainer's rank may be given no sequence of a step: its part is empty, not an error."""
    from rollover.config import load_config
    from rollover.testing import tiny_model
    from rollover.train.batch import TrainBatch
    from rollover.train.trainer import Trainer

    cfg = load_config(**{"device": "cpu", "model": "unused", "run_dir": str(tmp_path), "algorithm.advantage": "otb"})
    tr = Trainer(tiny_model("llama", seed=5), cfg, device=torch.device("cpu"))
    empty = TrainBatch.from_rollouts([], [])
    batch, metrics = tr._token_baseline(empty, torch.zeros(0, 0), torch.zeros(0, 0))
    assert metrics == {} and batch.adv_BT.shape == (0, 0)
