import math

import pytest
import torch

from rollover.algos import ADVANTAGES, compute_advantages

R3 = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
G3 = torch.tensor([0, 0, 0])


def close(actual, expected):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=1e-6, atol=1e-9)


def test_grpo_by_hand():
    # mean 2/3; unbiased var ((1/3)² + (2/3)² + (1/3)²) / 2 = 1/3
    std = math.sqrt(1 / 3)
    adv, info = compute_advantages("grpo", R3, G3)
    close(adv, [(1 / 3) / (std + 1e-6), (-2 / 3) / (std + 1e-6), (1 / 3) / (std + 1e-6)])
    assert info == {"num_groups": 1, "singleton_groups": 0, "zero_std_groups": 0}


def test_grpo_eps_is_an_option():
    adv, _ = compute_advantages("grpo", R3, G3, eps=1e-4)  # TRL's epsilon
    close(adv[1], (-2 / 3) / (math.sqrt(1 / 3) + 1e-4))


def test_grpo_batch_std_scales_every_group_by_the_steps_spread():
    rewards, groups = torch.tensor([1.0, 0.0, 1.0, 0.2, 0.1, 0.5, 0.5]), torch.tensor([0, 0, 0, 1, 1, 2, 2])
    adv, info = compute_advantages("grpo_batch_std", rewards, groups)
    std = float(rewards.std(unbiased=True))
    close(adv, [(1 / 3) / (std + 1e-6), (-2 / 3) / (std + 1e-6), (1 / 3) / (std + 1e-6),
                0.05 / (std + 1e-6), -0.05 / (std + 1e-6), 0.0, 0.0])  # the flat group: 0
    assert info["zero_std_groups"] == 1


def test_drgrpo_by_hand():
    adv, _ = compute_advantages("drgrpo", R3, G3)
    close(adv, [1 / 3, -2 / 3, 1 / 3])


def test_rloo_is_reward_minus_mean_of_the_others():
    adv, _ = compute_advantages("rloo", R3, G3)
    close(adv, [1 - 0.5, 0 - 1.0, 1 - 0.5])


def test_reinforce_pp_baseline_whitens_over_the_batch():
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1])
    # group-centred: [0.5, -0.5, 1, -1]; batch mean 0; unbiased var (0.25+0.25+1+1)/3
    adv, _ = compute_advantages("reinforce_pp_baseline", rewards, groups)
    close(adv, torch.tensor([0.5, -0.5, 1.0, -1.0], dtype=torch.float64) / math.sqrt(2.5 / 3 + 1e-8))


def test_gapo_even_window_uses_the_midpoint_median():
    rewards = torch.tensor([1.0, 0.0, 0.2, 0.1], dtype=torch.float64)
    # sorted [0, .1, .2, 1], k = 2, widths .1, .1, .8 -> first window [0, .1], Q = .05
    dev = torch.tensor([0.95, -0.05, 0.15, 0.05], dtype=torch.float64)
    adv, _ = compute_advantages("gapo", rewards, torch.zeros(4, dtype=torch.long))
    close(adv, dev / (math.sqrt(0.93 / 3) + 1e-6))


def test_gapo_odd_window_ignores_the_outlier():
    rewards = torch.tensor([5.0, 1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    # sorted [0, 1, 1, 1, 5], k = 3, tightest window [1, 1, 1], Q = 1; Σ dev² = 16 + 1 = 17
    adv, _ = compute_advantages("gapo", rewards, torch.zeros(5, dtype=torch.long))
    close(adv, torch.tensor([4.0, 0.0, -1.0, 0.0, 0.0], dtype=torch.float64) / (math.sqrt(17 / 4) + 1e-6))


def test_gapo_takes_the_first_of_equally_short_windows():
    rewards = torch.tensor([3.0, 2.0, 1.0, 0.0], dtype=torch.float64)
    # every window of 2 has width 1; the first, [0, 1], gives Q = 0.5
    adv, _ = compute_advantages("gapo", rewards, torch.zeros(4, dtype=torch.long), eps=0.0)
    dev = torch.tensor([2.5, 1.5, 0.5, -0.5], dtype=torch.float64)
    close(adv, dev / math.sqrt((dev**2).sum() / 3))


def test_reinforce_pp_whitens_over_the_batch_without_a_group_baseline():
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0, 2.0], dtype=torch.float64)
    adv, info = compute_advantages("reinforce_pp", rewards, torch.arange(5))  # one sample a prompt
    close(adv, (rewards - 1.4) / math.sqrt(((rewards - 1.4) ** 2).sum() / 4 + 1e-8))
    assert info["singleton_groups"] == 5 and (adv != 0).all()  # singletons keep their signal
    flat, _ = compute_advantages("reinforce_pp", torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1]))
    assert flat[0] > 0 > flat[2]  # an all-equal group still compares with the batch


def inputs(name: str, rewards: torch.Tensor) -> dict:
    """What an estimator takes besides the rewards (lengths for opo, baselines for remax)."""
    if name == "opo":
        return {"lengths_B": torch.arange(1, rewards.numel() + 1, dtype=torch.float32)}
    if name == "remax":
        return {"baselines_B": torch.full_like(rewards, 0.25)}
    return {}


@pytest.mark.parametrize("name", sorted(set(ADVANTAGES) - {"reinforce_pp", "gae", "otb", "remax", "grpo_passk"}))
def test_singleton_and_flat_groups_get_zero_and_are_counted(name):
    # group 7: informative; group 3: all equal (0.1 is not exact in binary); group 9: one sample
    rewards = torch.tensor([0.1, 1.0, 0.1, 0.0, 0.1, 0.4, 2.0])
    groups = torch.tensor([3, 7, 3, 7, 3, 7, 9])
    adv, info = compute_advantages(name, rewards, groups, **inputs(name, rewards))
    assert info == {"num_groups": 3, "singleton_groups": 1, "zero_std_groups": 1}
    assert torch.equal(adv[[0, 2, 4, 6]], torch.zeros(4))
    assert (adv[[1, 3, 5]] != 0).all()
    assert adv[1] > adv[5] > adv[3]  # ordering within the informative group survives


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_group_order_and_ids_do_not_matter(name):
    rewards = torch.tensor([0.0, 1.0, 0.5, 2.0, 1.0, 0.0])
    groups = torch.tensor([42, 5, 42, 5, 42, 5])
    perm = torch.tensor([3, 0, 5, 2, 1, 4])
    more = inputs(name, rewards)
    adv, _ = compute_advantages(name, rewards, groups, **more)
    adv_perm, _ = compute_advantages(name, rewards[perm], groups[perm] * 100 + 1, **{k: v[perm] for k, v in more.items()})
    torch.testing.assert_close(adv_perm, adv[perm])


def test_opo_baseline_is_the_length_weighted_mean():
    rewards = torch.tensor([1.0, 0.0, 1.0, 2.0, 0.0], dtype=torch.float64)
    lengths = torch.tensor([10, 30, 60, 0, 5])
    # group 0: (10·1 + 30·0 + 60·1) / 100 = 0.7; group 1 (lengths 0 and 5): (0·2 + 5·0) / 5 = 0
    adv, _ = compute_advantages("opo", rewards, torch.tensor([0, 0, 0, 1, 1]), lengths_B=lengths)
    close(adv, [0.3, -0.7, 0.3, 2.0, 0.0])
    masked, _ = compute_advantages("opo", rewards[:2], torch.tensor([0, 0]), lengths_B=torch.tensor([0, 0]))
    close(masked, [0.5, -0.5])  # every token masked: the plain mean
    with pytest.raises(ValueError, match="lengths_B must be >= 0"):
        compute_advantages("opo", rewards[:2], torch.tensor([0, 0]), lengths_B=torch.tensor([3, -1]))
    with pytest.raises(TypeError):
        compute_advantages("opo", rewards, torch.zeros(5, dtype=torch.long))  # the lengths are not optional


def test_gpg_scales_the_group_baseline_by_the_steps_share_of_nonzero_rewards():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.0], dtype=torch.float64)
    # 6 samples, 2 with a nonzero reward: alpha = 3; group means 1/3 and 1/6
    adv, _ = compute_advantages("gpg", rewards, torch.tensor([0, 0, 0, 1, 1, 1]))
    close(adv, [3 * (2 / 3), 3 * (-1 / 3), 3 * (-1 / 3), 3 * (-1 / 6), 3 * (1 / 3), 3 * (-1 / 6)])
    zero, _ = compute_advantages("gpg", torch.zeros(4), torch.tensor([0, 0, 1, 1]))
    assert torch.equal(zero, torch.zeros(4))  # no nonzero reward: alpha's divisor is 1, not 0


def test_grpo_passk_trains_only_each_groups_best_sample_by_its_lead():
    rewards = torch.tensor([0.2, 1.0, 0.5, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    adv, info = compute_advantages("grpo_passk", rewards, groups)
    std0 = float(rewards[:4].std())
    close(adv, [0.0, (1.0 - 0.5) / (std0 + 1e-6), 0.0, 0.0, 0.0, 0.0, 0.0])  # group 1: a tie for the best
    assert info["zero_std_groups"] == 0
    single, info = compute_advantages("grpo_passk", torch.tensor([1.0]), torch.tensor([0]))
    assert single.tolist() == [0.0] and info["singleton_groups"] == 1


def test_remax_subtracts_each_samples_greedy_baseline_and_keeps_singletons():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1, 2])
    baselines = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    adv, info = compute_advantages("remax", rewards, groups, baselines_B=baselines)
    close(adv, [1.0, 0.0, 0.0, 0.0, -1.0])  # group 1 agrees with its greedy answer: no signal
    assert info == {"num_groups": 3, "singleton_groups": 1, "zero_std_groups": 1}
    flat, info = compute_advantages("remax", torch.tensor([1.0, 1.0]), torch.tensor([0, 0]),
                                    baselines_B=torch.tensor([0.0, 0.0]))
    assert flat.tolist() == [1.0, 1.0] and info["zero_std_groups"] == 0  # equal samples still beat the greedy one
    with pytest.raises(ValueError, match="baselines_B has non-finite"):
        compute_advantages("remax", rewards[:2], groups[:2], baselines_B=torch.tensor([0.0, float("nan")]))


def test_bad_inputs_fail_loudly():
    with pytest.raises(ValueError, match="non-finite"):
        compute_advantages("grpo", torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(TypeError, match="floating-point"):
        compute_advantages("grpo", torch.tensor([1, 0]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="same \\[B\\]"):
        compute_advantages("grpo", torch.tensor([1.0, 0.0]), torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages("ppo", R3, G3)
    with pytest.raises(TypeError):
        compute_advantages("drgrpo", R3, G3, eps=1e-6)  # drgrpo has no std, hence no eps


def test_turn_advantages_are_the_episode_advantage_less_the_reward_before_the_turn():
    from rollover.algos.advantages import turn_advantages

    # rewards [0.2, 0, 1]: G = [1.2, 1, 1] (gamma 1); [0.45, 0.5, 1] (gamma 0.5)
    assert turn_advantages(0.5, [0.2, 0.0, 1.0]) == pytest.approx([0.5, 0.3, 0.3])
    assert turn_advantages(0.5, [0.2, 0.0, 1.0], gamma=0.5) == pytest.approx([0.5, 0.55, 1.05])
    assert turn_advantages(-0.3, [0.0, 0.0, 1.0]) == [-0.3] * 3  # a reward at the end only
    assert turn_advantages(1.0, []) == []


def test_gdpo_normalises_each_function_in_its_group_then_the_sum_over_the_batch():
    """By hand with statistics.stdev: group 0 has a function that abstains once; group 1 is a
    singleton; group 2 is flat in both functions (both get 0, as every estimator gives them)."""
    import statistics

    from rollover.algos.advantages import gdpo

    nan = float("nan")
    scores = torch.tensor([[1.0, 0.0], [0.0, 10.0], [1.0, nan], [0.0, 0.0], [1.0, 3.0], [1.0, 3.0]], dtype=torch.float64)
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    adv, info = gdpo(scores, weights, torch.tensor([7, 7, 7, 3, 5, 5]))

    def z(values):
        m, s = statistics.mean(values), statistics.stdev(values)
        return [(v - m) / (s + 1e-6) for v in values]

    f0, f1 = z([1.0, 0.0, 1.0]), z([0.0, 10.0])
    x = [f0[0] + 0.5 * f1[0], f0[1] + 0.5 * f1[1], f0[2], 0.0, 0.0, 0.0]
    m, s = statistics.mean(x), statistics.stdev(x)
    want = [(v - m) / (s + 1e-6) for v in x[:3]] + [0.0, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(want, rel=1e-9)
    assert info == {"num_groups": 3, "singleton_groups": 1, "zero_std_groups": 1}
    # one function: GRPO's group normalisation, then a batch whitening (a rescaled GRPO)
    one = torch.tensor([[0.0], [1.0], [1.0], [2.0], [5.0], [2.0]], dtype=torch.float64)
    gid = torch.tensor([0, 0, 0, 1, 1, 1])
    grpo_adv, _ = compute_advantages("grpo", one[:, 0], gid)
    got, _ = gdpo(one, torch.tensor([1.0], dtype=torch.float64), gid)
    assert got.tolist() == pytest.approx((grpo_adv / grpo_adv.std()).tolist(), rel=1e-5)  # eps apart
    with pytest.raises(ValueError, match="infinite"):
        gdpo(torch.tensor([[float("inf")], [1.0]]), torch.tensor([1.0]), torch.tensor([0, 0]))
