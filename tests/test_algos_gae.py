"""PPO with a critic: GAE over the trained tokens, whitening, and the clipped value loss, by hand."""

import pytest
import torch

from rollover.algos import compute_advantages
from rollover.algos.gae import explained_variance, gae, masked_whiten, value_loss


def by_hand(reward, values, gamma, lam):
    """GAE over one sequence's trained tokens (values before each), reward at the last."""
    n, adv, last = len(values), [0.0] * len(values), 0.0
    for t in range(n - 1, -1, -1):
        nxt = values[t + 1] if t + 1 < n else 0.0
        r = reward if t == n - 1 else 0.0
        last = r + gamma * nxt - values[t] + gamma * lam * last
        adv[t] = last
    return adv, [a + v for a, v in zip(adv, values)]


def test_with_gamma_and_lambda_one_each_tokens_advantage_is_the_reward_less_its_value():
    values = torch.tensor([[0.1, 0.4, -0.2, 0.0], [0.5, 0.3, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    adv, ret = gae(torch.tensor([1.0, -1.0]), values, mask)
    torch.testing.assert_close(adv, torch.tensor([[0.9, 0.6, 1.2, 1.0], [-1.5, -1.3, 0.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, 0.0, 0.0]]))


def test_tokens_out_of_the_loss_are_skipped_not_scored():
    """An environment's reply inside the response (mask 0) is not a state: the recursion runs over
    the trained tokens in order, the reward at the last of them."""
    gamma, lam = 0.9, 0.8
    values = torch.tensor([[0.2, 9.0, -0.3, 0.5, 7.0], [0.0, 0.0, 0.0, 0.0, 0.0], [0.6, 0.1, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    adv, ret = gae(torch.tensor([2.0, 3.0, -1.0]), values, mask, gamma=gamma, lam=lam)
    a0, r0 = by_hand(2.0, [0.2, -0.3, 0.5], gamma, lam)
    a2, r2 = by_hand(-1.0, [0.6, 0.1], gamma, lam)
    torch.testing.assert_close(adv, torch.tensor([[a0[0], 0, a0[1], a0[2], 0], [0.0] * 5, [a2[0], a2[1], 0, 0, 0]]))
    torch.testing.assert_close(ret, torch.tensor([[r0[0], 0, r0[1], r0[2], 0], [0.0] * 5, [r2[0], r2[1], 0, 0, 0]]))


def test_shapes_that_do_not_match_are_refused():
    with pytest.raises(ValueError, match="do not match"):
        gae(torch.zeros(2), torch.zeros(3, 4), torch.ones(3, 4, dtype=torch.bool))


def test_whitening_is_over_the_masked_tokens_only():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    w = masked_whiten(x, mask)
    kept = torch.tensor([1.0, 2.0, 3.0, 4.0])
    torch.testing.assert_close(w[mask], (kept - 2.5) / kept.std(unbiased=True), rtol=1e-6, atol=1e-6)
    assert w[~mask].eq(0).all()
    torch.testing.assert_close(masked_whiten(torch.tensor([[5.0, 1.0]]), torch.tensor([[1, 0]])),
                               torch.tensor([[0.0, 0.0]]))  # one token: centred only


def test_value_loss_clips_a_prediction_around_the_old_value():
    old, ret, mask = torch.tensor([[0.0, 0.0, 0.0]]), torch.tensor([[2.0, 2.0, -1.0]]), torch.ones(1, 3, dtype=torch.bool)
    v = torch.tensor([[1.0, 0.2, -0.9]])
    loss, m = value_loss(v, old, ret, mask, clip=0.5)
    # token 0: plain (1-2)^2 = 1, clipped (0.5-2)^2 = 2.25 -> 2.25; token 1 inside the clip: 3.24;
    # token 2: plain 0.01, clipped (-0.5+1)^2 = 0.25 -> 0.25
    torch.testing.assert_close(loss, 0.5 * torch.tensor([[2.25, 3.24, 0.25]]))
    assert float(m["vf_clipfrac"]) == pytest.approx(2 / 3)
    plain, m = value_loss(v, old, ret, mask, clip=None)
    torch.testing.assert_close(plain, 0.5 * torch.tensor([[1.0, 3.24, 0.01]]))
    assert float(m["vf_clipfrac"]) == 0.0


def test_explained_variance_is_one_for_a_perfect_critic_and_zero_for_the_mean():
    ret = torch.tensor([[1.0, 0.0, 2.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    assert explained_variance(ret, ret, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(ret, 1.0), ret, mask) == pytest.approx(0.0, abs=1e-6)


def test_the_gae_estimator_passes_the_rewards_to_the_critic():
    rewards = torch.tensor([1.0, 1.0, 0.0])
    adv, info = compute_advantages("gae", rewards, torch.tensor([0, 0, 1]))
    assert torch.equal(adv, rewards) and info["zero_std_groups"] == 0


def test_a_reward_on_every_token_enters_each_delta():
    """A per-token reward (the KL penalty in the reward) adds to each trained token's r_t, the
    sequence's reward to its last; a token out of the loss contributes nothing."""
    gamma, lam = 0.9, 0.8
    values = torch.tensor([[0.2, 9.0, -0.3, 0.5]])
    mask = torch.tensor([[1, 0, 1, 1]], dtype=torch.bool)
    per_token = torch.tensor([[-0.1, 5.0, -0.2, -0.05]])
    adv, ret = gae(torch.tensor([1.0]), values, mask, gamma=gamma, lam=lam, token_rewards_BT=per_token)
    r, v = [-0.1, -0.2, -0.05 + 1.0], [0.2, -0.3, 0.5]
    want, last = [0.0] * 3, 0.0
    for t in (2, 1, 0):
        last = r[t] + gamma * (v[t + 1] if t < 2 else 0.0) - v[t] + gamma * lam * last
        want[t] = last
    torch.testing.assert_close(adv, torch.tensor([[want[0], 0.0, want[1], want[2]]]))
    torch.testing.assert_close(ret, torch.tensor([[want[0] + v[0], 0.0, want[1] + v[1], want[2] + v[2]]]))
