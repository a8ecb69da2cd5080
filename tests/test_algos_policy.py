import math

import pytest
import torch

from rollover.algos import (
    POLICY_LOSSES,
    aggregate,
    bapo_bounds,
    bapo_search,
    bapo_tables,
    bapo_update_bounds,
    policy_loss,
)
from rollover.algos.loss_options import check_loss_options, loss_options, old_logprobs_first
from rollover.config import ConfigError, load_config

F64 = torch.float64


def t(values):
    return torch.tensor(values, dtype=F64)


def leaf(values):
    return torch.tensor(values, dtype=F64, requires_grad=True)


def ones_mask(B, T):
    return torch.ones(B, T, dtype=torch.bool)


def loss_and_grad(name, log_ratio, adv, mask=None, behav=None, mode="token-mean", **opts):
    """Per-token loss and d(sum of loss)/d(logp) with old_logp = 0, so logp = log r."""
    logp = leaf(log_ratio)
    mask = ones_mask(*logp.shape) if mask is None else mask
    out = policy_loss(name, logp, torch.zeros_like(logp), adv, mask, behav, **opts)
    aggregate(out.loss_BT, out.mask_BT, mode, num_seqs=logp.shape[0]).backward()
    return out, logp.grad


# ---- PPO -------------------------------------------------------------------------------------


def test_ppo_clip_higher_by_hand():
    r = [1.1, 1.5, 0.5, 0.9]
    out, grad = loss_and_grad(
        "ppo", [[math.log(v) for v in r]], t([[1.0, 1.0, -1.0, -1.0]]),
        eps_low=0.2, eps_high=0.28, mode="seq-mean-token-sum",
    )
    # t0 in range: -A·r; t1 clipped at 1.28; t2 clipped at 0.8; t3 in range
    torch.testing.assert_close(out.loss_BT, t([[-1.1, -1.28, 0.8, 0.9]]))
    # d(-A·r)/d(log r) = -A·r in range, 0 on the clipped branch
    torch.testing.assert_close(grad, t([[-1.1, 0.0, 0.0, 0.9]]))
    assert out.metrics["clip_frac_low"] == 0.25 and out.metrics["clip_frac_high"] == 0.25
    torch.testing.assert_close(out.metrics["ratio_max"], t(1.5))
    expected_kl = sum(v - 1 - math.log(v) for v in r) / 4
    torch.testing.assert_close(out.metrics["approx_kl"], t(expected_kl))


def test_ppo_clip_is_one_sided():
    # A > 0 below the lower bound and A < 0 above the upper bound stay unclipped (pessimism)
    out, grad = loss_and_grad("ppo", [[math.log(0.5), math.log(1.5)]], t([[1.0, -1.0]]), mode="seq-mean-token-sum")
    torch.testing.assert_close(out.loss_BT, t([[-0.5, 1.5]]))
    torch.testing.assert_close(grad, t([[-0.5, 1.5]]))
    assert out.metrics["clip_frac_low"] == 0 and out.metrics["clip_frac_high"] == 0


def test_ppo_dual_clip_caps_negative_advantages_with_zero_gradient():
    out, grad = loss_and_grad(
        "ppo", [[math.log(4.0), math.log(2.0)]], t([[-1.0, -1.0]]), dual_clip=3.0, mode="seq-mean-token-sum"
    )
    torch.testing.assert_close(out.loss_BT, t([[3.0, 2.0]]))
    torch.testing.assert_close(grad, t([[0.0, 2.0]]))
    assert out.metrics["dual_clip_frac"] == 0.5
    with pytest.raises(ValueError, match="dual_clip"):
        loss_and_grad("ppo", [[0.0]], t([1.0]), dual_clip=1.0)


def test_dual_clip_is_trls_two_sided_delta():
    """TRL's `delta` (the unclipped ratio capped at delta, then PPO's min) written out here, against
    ppo with dual_clip=delta: the same per-token loss and gradient when delta > 1 + eps_high."""
    g = torch.Generator().manual_seed(3)
    log_ratio = (torch.rand(5, 40, generator=g, dtype=F64) * 3 - 1.5)  # r in [0.22, 4.5]
    adv = torch.randn(5, 40, generator=g, dtype=F64)
    delta, low, high = 2.0, 0.2, 0.28
    out, grad = loss_and_grad("ppo", log_ratio.tolist(), adv, eps_low=low, eps_high=high, dual_clip=delta,
                              mode="seq-mean-token-sum")
    logp = leaf(log_ratio.tolist())
    r = logp.exp()
    trl_BT = -torch.min(r.clamp(max=delta) * adv, r.clamp(1 - low, 1 + high) * adv)
    trl_BT.sum(dim=1).mean().backward()
    assert ((adv < 0) & (r.detach() > delta)).sum() > 5  # tokens the cap acts on
    torch.testing.assert_close(out.loss_BT, trl_BT.detach())
    torch.testing.assert_close(grad, logp.grad)


def test_ppo_zero_gradient_exactly_where_clipped():
    g = torch.Generator().manual_seed(0)
    log_ratio = (torch.rand(6, 50, generator=g, dtype=F64) - 0.5)  # r in [0.61, 1.65]
    adv = torch.randn(6, 50, generator=g, dtype=F64)
    out, grad = loss_and_grad("ppo", log_ratio.tolist(), adv, eps_low=0.2, eps_high=0.28)
    r = log_ratio.exp()
    clipped = ((adv > 0) & (r > 1.28)) | ((adv < 0) & (r < 0.8))
    assert clipped.any() and (~clipped).any()
    assert torch.equal(grad[clipped], torch.zeros_like(grad[clipped]))
    assert (grad[~clipped] != 0).all()
    torch.testing.assert_close(out.metrics["clip_frac_low"] + out.metrics["clip_frac_high"], clipped.double().mean())


def test_ppo_gradcheck():
    old = t([[0.1, -0.3, 0.2], [0.0, 0.5, -1.0]])
    adv = t([[1.0, -2.0, 0.5], [-1.0, 1.5, -0.5]])
    mask = torch.tensor([[True, True, True], [True, True, False]])

    def f(logp):
        out = policy_loss("ppo", logp, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip=3.0)
        return aggregate(out.loss_BT, out.mask_BT)

    # log-ratios .3, -.5, .2, -1.7 (dual-clip region), .1: none near a kink
    logp = (old + t([[0.3, -0.5, 0.2], [1.7, 0.1, 0.0]])).requires_grad_()
    assert torch.autograd.gradcheck(f, (logp,))


# ---- GSPO ------------------------------------------------------------------------------------


def test_gspo_by_hand():
    mask = torch.tensor([[True, True, False], [True, True, True]])
    # seq 0: mean log-ratio 0.1 -> s = e^0.1 = 1.105 > 1.05, A > 0: clipped to 1.05
    # seq 1: mean log-ratio (-.3 + .1 + .05)/3 = -0.05 -> s = e^-0.05, A < 0, within [0.9, 1.05]
    out, grad = loss_and_grad(
        "gspo", [[0.2, 0.0, 9.0], [-0.3, 0.1, 0.05]], t([2.0, -1.0]), mask, eps_low=0.1, eps_high=0.05,
        mode="seq-mean-token-mean",
    )
    s1 = math.exp(-0.05)
    torch.testing.assert_close(out.loss_BT, t([[-2.1, -2.1, 0.0], [s1, s1, s1]]))
    # seq 0 clipped: no gradient; seq 1: d(s·1)/d logp_t = s/3, times 1/num_seqs = 1/2
    torch.testing.assert_close(grad, t([[0.0, 0.0, 0.0], [s1 / 6, s1 / 6, s1 / 6]]))
    assert out.metrics["clip_frac_high"] == 0.4  # 2 of 5 loss tokens


def test_gspo_single_token_equals_token_level_ppo():
    log_ratio = torch.linspace(-0.5, 0.5, 16, dtype=F64)[:, None].tolist()  # r from 0.61 to 1.65
    adv = t([1.0, -1.0] * 8) * torch.linspace(0.5, 2.0, 16, dtype=F64)
    opts = dict(eps_low=0.2, eps_high=0.28)
    ppo_out, ppo_grad = loss_and_grad("ppo", log_ratio, adv, **opts)
    gspo_out, gspo_grad = loss_and_grad("gspo", log_ratio, adv, **opts)
    assert ppo_out.metrics["clip_frac_low"] > 0 and ppo_out.metrics["clip_frac_high"] > 0
    torch.testing.assert_close(gspo_out.loss_BT, ppo_out.loss_BT)
    torch.testing.assert_close(gspo_grad, ppo_grad)


def test_gspo_token_matches_gspo_with_sequence_advantages():
    g = torch.Generator().manual_seed(2)
    log_ratio = (0.2 * torch.randn(8, 6, generator=g, dtype=F64)).tolist()
    adv = torch.randn(8, generator=g, dtype=F64)
    mask = torch.rand(8, 6, generator=g) < 0.8
    opts = dict(eps_low=0.05, eps_high=0.05, mode="seq-mean-token-mean", mask=mask)
    seq_out, seq_grad = loss_and_grad("gspo", log_ratio, adv, **opts)
    tok_out, tok_grad = loss_and_grad("gspo_token", log_ratio, adv, **opts)
    assert 0 < seq_out.metrics["clip_frac_low"] + seq_out.metrics["clip_frac_high"] < 1
    torch.testing.assert_close(tok_out.loss_BT, seq_out.loss_BT)
    torch.testing.assert_close(tok_grad, seq_grad)


def test_gspo_token_gradient_is_sequence_ratio_times_token_score():
    # one sequence, per-token advantages, nothing clipped: d ℓ_t / d logp_t = -A_t · s
    out, grad = loss_and_grad(
        "gspo_token", [[0.1, -0.2, 0.4]], t([[1.0, -2.0, 0.5]]), eps_low=0.5, eps_high=0.5, mode="seq-mean-token-sum"
    )
    s = math.exp(0.1)
    torch.testing.assert_close(out.loss_BT, t([[-s, 2 * s, -0.5 * s]]))
    torch.testing.assert_close(grad, t([[-s, 2 * s, -0.5 * s]]))


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_averages_unclamped_token_log_ratios(name):
    # one token's log-ratio (25) is beyond the ±20 token clamp; the sequence mean is not
    mask = torch.tensor([[True, True, True, True, False], [True, True, True, True, True]])
    log_ratio = [[25.0, -0.5, -1.0, -23.4, 30.0], [0.1, -0.2, 0.3, 0.0, 0.05]]  # 30.0 is padding
    adv = t([-1.0, 1.0])
    out, grad = loss_and_grad(name, log_ratio, adv, mask, eps_low=0.2, eps_high=0.2, mode="seq-mean-token-mean")
    mean0 = (25.0 - 0.5 - 1.0 - 23.4) / 4  # 0.025; a token clamp to 20 would give -1.225
    mean1 = 0.25 / 5
    s0, s1 = math.exp(mean0), math.exp(mean1)
    torch.testing.assert_close(out.metrics["ratio_max"], t(max(s0, s1)))
    # A < 0, s0 in [0.8, 1.2]: ℓ = -A·s0 on every loss token, unclipped
    torch.testing.assert_close(out.loss_BT, t([[s0] * 4 + [0.0], [-s1] * 5]))
    # seq-mean-token-mean of a row whose L tokens all hold -A·s is -A·s / 2 (two rows), and
    # d s / d logp_t = s / L on each of its loss tokens (a token clamp would make this 0)
    torch.testing.assert_close(grad, t([[s0 / 8] * 4 + [0.0], [-s1 / 10] * 5]))
    assert out.metrics["clip_frac_low"] == 0 and out.metrics["clip_frac_high"] == 0


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_clamps_the_sequence_mean(name):
    # mean log-ratio 24 > 20: the ratio is e^20 and, beyond the clamp, no gradient
    mask = ones_mask(2, 2)
    out, grad = loss_and_grad(name, [[26.0, 22.0], [0.0, 0.2]], t([-1.0, -1.0]), mask, eps_low=0.2, eps_high=0.2,
                              mode="seq-mean-token-mean")
    torch.testing.assert_close(out.loss_BT[0], t([math.exp(20.0)] * 2))
    torch.testing.assert_close(grad[0], t([0.0, 0.0]))
    assert (grad[1] != 0).all()


def test_gspo_rejects_token_advantages():
    with pytest.raises(ValueError, match="gspo_token"):
        loss_and_grad("gspo", [[0.0, 0.0]], t([[1.0, 1.0]]))


def test_gspo_gradcheck():
    # gspo_token and cispo are left out on purpose: their stop-gradients make the gradient
    # differ from the derivative of the loss value, so finite differences cannot check them.
    old = t([[0.1, -0.3, 0.2], [0.0, 0.5, -1.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])

    def f(logp):
        out = policy_loss("gspo", logp, old, t([1.0, -2.0]), mask, eps_low=0.2, eps_high=0.2)
        return aggregate(out.loss_BT, out.mask_BT, "seq-mean-token-mean")

    logp = (old + t([[0.3, -0.2, 0.1], [0.05, -0.1, 0.0]])).requires_grad_()
    assert torch.autograd.gradcheck(f, (logp,))


# ---- CISPO -----------------------------------------------------------------------------------


def test_cispo_keeps_gradient_of_clipped_tokens():
    logp = leaf([[math.log(1.5), math.log(0.5), math.log(1.1)]])
    adv = t([1.0])
    out = policy_loss("cispo", logp, torch.zeros_like(logp), adv, ones_mask(1, 3), eps_low=0.2, eps_high=0.28)
    out.loss_BT.sum().backward()
    # weights sg(clip(r)) = [1.28, 0.8, 1.1]; loss -w·A·logp, gradient -w·A
    torch.testing.assert_close(out.loss_BT, t([[-1.28 * math.log(1.5), -0.8 * math.log(0.5), -1.1 * math.log(1.1)]]))
    torch.testing.assert_close(logp.grad, t([[-1.28, -0.8, -1.1]]))
    assert out.metrics["clip_frac_high"] == pytest.approx(1 / 3)
    assert out.metrics["clip_frac_low"] == pytest.approx(1 / 3)


def test_cispo_default_has_no_lower_bound():
    logp = leaf([[math.log(0.1)]])
    out = policy_loss("cispo", logp, torch.zeros_like(logp), t([-1.0]), ones_mask(1, 1))
    out.loss_BT.sum().backward()
    torch.testing.assert_close(logp.grad, t([[0.1]]))


def test_cispo_gradcheck_where_every_weight_is_clipped():
    # With every weight clipped to a constant, the loss is -c·A·logp: smooth, gradcheck applies.
    old = t([[0.1, -0.3, 0.2]])

    def f(logp):
        out = policy_loss("cispo", logp, old, t([[1.0, -2.0, 0.5]]), ones_mask(1, 3), eps_low=0.2, eps_high=0.2)
        return out.loss_BT.sum()

    logp = (old + t([[0.5, -0.4, 0.3]])).requires_grad_()  # every r outside [0.8, 1.2]
    assert torch.autograd.gradcheck(f, (logp,))


# ---- decoupled PPO ---------------------------------------------------------------------------


def test_decoupled_ppo_with_behaviour_equal_to_proximal_is_ppo():
    g = torch.Generator().manual_seed(3)
    log_ratio = (torch.rand(4, 7, generator=g, dtype=F64) - 0.5).tolist()
    adv = torch.randn(4, generator=g, dtype=F64)
    mask = torch.rand(4, 7, generator=g) < 0.7
    opts = dict(eps_low=0.2, eps_high=0.28, dual_clip=3.0, mask=mask)
    ppo_out, ppo_grad = loss_and_grad("ppo", log_ratio, adv, **opts)
    dec_out, dec_grad = loss_and_grad("decoupled_ppo", log_ratio, adv, behav=torch.zeros(4, 7, dtype=F64), **opts)
    assert torch.equal(dec_out.loss_BT, ppo_out.loss_BT)
    assert torch.equal(dec_grad, ppo_grad)
    assert torch.equal(dec_out.mask_BT, ppo_out.mask_BT)
    assert dec_out.metrics["is_weight_mean"] == 1.0


def test_decoupled_ppo_weights_and_masks_by_behaviour_ratio():
    # proximal (old) = 0; behaviour log-probs make w = π_prox/π_behav = [2, 0.5, 8]
    behav = t([[-math.log(2.0), math.log(2.0), -math.log(8.0)]])
    out, grad = loss_and_grad("decoupled_ppo", [[0.1, 0.1, 0.1]], t([1.0]), behav=behav, mode="seq-mean-token-sum")
    r = math.exp(0.1)
    torch.testing.assert_close(out.loss_BT, t([[-2 * r, -0.5 * r, 0.0]]))
    torch.testing.assert_close(grad, t([[-2 * r, -0.5 * r, 0.0]]))
    assert out.mask_BT.tolist() == [[True, True, False]]
    torch.testing.assert_close(out.metrics["masked_frac"], t(1 / 3))
    # truncate mode keeps the token with weight capped at 5
    out, _ = loss_and_grad("decoupled_ppo", [[0.1, 0.1, 0.1]], t([1.0]), behav=behav, is_mode="truncate")
    torch.testing.assert_close(out.loss_BT, t([[-2 * r, -0.5 * r, -5 * r]]))


def test_decoupled_ppo_needs_behaviour_logprobs():
    with pytest.raises(ValueError, match="behav_logp_BT"):
        loss_and_grad("decoupled_ppo", [[0.0]], t([1.0]))


# ---- BAPO ------------------------------------------------------------------------------------


def test_bapo_raises_the_lower_bound_first():
    # P = 1·1.0; N = 0.72 + 0.95 -> share 0.375. c_low 0.65, 0.70 keep r = .72; 0.75 drops it:
    # share 1/1.95 = 0.513 >= 0.5.
    ratio = t([[1.0, 0.72, 0.95]])
    adv = t([[1.0, -1.0, -1.0]])
    c_low, c_high, share = bapo_bounds(ratio, adv, ones_mask(1, 3))
    assert (c_low, c_high) == (pytest.approx(0.75), 1.2)
    assert share == pytest.approx(1 / 1.95)
    out, grad = loss_and_grad("bapo", ratio.log().tolist(), adv, mode="seq-mean-token-sum")
    # r = .72 < c_low with A < 0: clipped to 0.75, no gradient
    torch.testing.assert_close(out.loss_BT, t([[-1.0, 0.75, 0.95]]))
    torch.testing.assert_close(grad, t([[-1.0, 0.0, 0.95]]))
    torch.testing.assert_close(out.metrics["bapo_c_low"], t(0.75))


def test_bapo_then_raises_the_upper_bound():
    # negatives at .95 survive any c_low <= .9; P grows once c_high reaches 1.42
    ratio = t([[1.42, 1.0, 0.95, 0.95]])
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    c_low, c_high, share = bapo_bounds(ratio, adv, ones_mask(1, 4))
    assert c_low == 0.9 and c_high == pytest.approx(1.45)
    assert share == pytest.approx(2.42 / (2.42 + 1.9))


def test_bapo_keeps_start_bounds_when_balanced():
    assert bapo_bounds(t([[1.0, 1.0]]), t([[1.0, -0.5]]), ones_mask(1, 2)) == (0.6, 1.2, pytest.approx(2 / 3))


def test_bapo_gradcheck():
    old = t([[0.1, -0.3, 0.2, 0.0]])
    adv = t([[1.0, -2.0, 0.5, -1.0]])

    def f(logp):
        return policy_loss("bapo", logp, old, adv, ones_mask(1, 4)).loss_BT.sum()

    logp = (old + t([[0.1, -0.05, 0.3, 0.02]])).requires_grad_()
    assert torch.autograd.gradcheck(f, (logp,))


def random_bapo_batch(seed, B=6, T=7, neg=0.0):
    g = torch.Generator().manual_seed(seed)
    ratio = (0.5 * torch.randn(B, T, generator=g, dtype=F64)).exp()  # spread over both bounds' ranges
    adv = torch.randn(B, T, generator=g, dtype=F64) - neg
    mask = torch.rand(B, T, generator=g) < 0.8
    return ratio, adv, mask


GRIDS = [{}, {"low_start": 0.5, "low_max": 0.95, "high_start": 1.1, "high_max": 2.0, "step": 0.07, "target_pos_share": 0.6}]


@pytest.mark.parametrize("grid", GRIDS)
def test_bapo_tables_and_search_are_bapo_bounds(grid):
    moved = 0
    for seed in range(40):
        ratio, adv, mask = random_bapo_batch(seed, neg=0.4 * (seed % 3))
        P, N = bapo_tables(ratio, adv, mask, **grid)
        assert P.dtype == N.dtype == F64 and P.device.type == N.device.type == "cpu"
        whole = bapo_bounds(ratio, adv, mask, **grid)
        assert bapo_search(P, N, **grid) == whole
        moved += whole[:2] != (grid.get("low_start", 0.6), grid.get("high_start", 1.2))
        # the tables add up over parts of the batch (micro-batches, ranks): the halves' sum searches to the whole's bounds
        halves = [bapo_tables(ratio[rows], adv[rows], mask[rows], **grid) for rows in (slice(0, 2), slice(2, None))]
        P2, N2 = (halves[0][i] + halves[1][i] for i in range(2))
        torch.testing.assert_close(P2, P)
        torch.testing.assert_close(N2, N)
        c_low, c_high, share = bapo_search(P2, N2, **grid)
        assert (c_low, c_high) == whole[:2] and share == pytest.approx(whole[2], rel=1e-12)
    assert moved > 10  # the searches went somewhere


def test_bapo_tables_by_hand():
    # the second test above: P over highs 1.2, 1.25, ..., 3.0; N over lows 0.6, ..., 0.9
    P, N = bapo_tables(t([[1.42, 1.0, 0.95, 0.95]]), t([[1.0, 1.0, -1.0, -1.0]]), ones_mask(1, 4))
    assert len(P) == 37 and len(N) == 7
    assert P[:5].tolist() == [1.0] * 5 and P[5:].tolist() == pytest.approx([2.42] * 32)
    assert N.tolist() == pytest.approx([1.9] * 7)
    with pytest.raises(ValueError, match="tables of 37 and 7"):
        bapo_search(P[:-1], N)


def test_bapo_with_given_bounds_clips_there_and_update_bounds_split_as_the_whole():
    g = torch.Generator().manual_seed(6)
    old = 0.1 * torch.randn(6, 5, generator=g, dtype=F64)
    logp = old + 0.4 * torch.randn(6, 5, generator=g, dtype=F64)
    adv = torch.randn(6, generator=g, dtype=F64) - 0.1
    mask = torch.rand(6, 5, generator=g) < 0.9
    behav = old + 0.3 * torch.randn(6, 5, generator=g, dtype=F64)
    opts = {"is_level": "token", "is_mode": "mask", "is_cap": 1.3, "dual_clip": 3.0}  # IS masks some tokens
    whole = policy_loss("bapo", logp, old, adv, mask, behav, **opts)
    assert whole.mask_BT.sum() < mask.sum()
    bounds = (float(whole.metrics["bapo_c_low"]), float(whole.metrics["bapo_c_high"]))
    assert bounds == (0.9, pytest.approx(1.5))  # both moved, c_high inside its range
    # the update's bounds from its parts' tables, summed as ranks would: those bapo picks over the whole
    parts = [slice(0, 3), slice(3, None)]
    tables = {}
    for i, rows in enumerate(parts):
        bapo_update_bounds(logp[rows], old[rows], adv[rows], mask[rows], behav[rows],
                           reduce=lambda x, i=i: tables.setdefault(i, x), **opts)
    total = tables[0] + tables[1]
    for rows in parts:
        got = bapo_update_bounds(logp[rows], old[rows], adv[rows], mask[rows], behav[rows], reduce=lambda x: total, **opts)
        assert got[:2] == bounds and got[2] == pytest.approx(float(whole.metrics["bapo_pos_share"]), rel=1e-12)
    assert bapo_update_bounds(logp, old, adv, mask, behav, **opts)[:2] == bounds
    # and each part clipped at the given bounds: the parts' losses add up to the whole's
    given = [policy_loss("bapo", logp[rows], old[rows], adv[rows], mask[rows], behav[rows], bounds=bounds, **opts)
             for rows in parts]
    torch.testing.assert_close(torch.cat([o.loss_BT for o in given]), whole.loss_BT)
    assert all(o.metrics["bapo_c_low"] == bounds[0] and o.metrics["bapo_c_high"] == bounds[1] for o in given)
    assert all(math.isnan(o.metrics["bapo_pos_share"]) for o in given)
    # bounds not picked per part: a part alone would pick others
    assert any(bapo_update_bounds(logp[rows], old[rows], adv[rows], mask[rows], behav[rows], **opts)[:2] != bounds
               for rows in parts)
    with pytest.raises(ValueError, match="clip bounds"):
        policy_loss("bapo", logp, old, adv, mask, bounds=(1.1, 1.5))


def test_bapo_bounds_are_not_a_loss_option():
    """The trainer picks them per update (and would overwrite them): a config setting them is refused."""
    with pytest.raises(ConfigError, match="chosen by the trainer"):
        load_config(**{"device": "cpu", "model": "unused", "run_dir": "unused", "algorithm.loss": "bapo",
                       "algorithm.loss_options": {"bounds": [0.8, 1.5]}})
    a = load_config(**{"device": "cpu", "model": "unused", "run_dir": "unused", "algorithm.loss": "bapo",
                       "algorithm.tis_cap": 2.0}).algorithm
    assert check_loss_options(a) is None
    assert not old_logprobs_first("bapo", loss_options(a))  # truncating IS masks nothing: r = 1, no pass
    assert old_logprobs_first("bapo", {"is_level": "token", "is_mode": "mask"})  # its mask is old's
    assert not old_logprobs_first("ppo", {"is_level": "token", "is_mode": "mask"})
    assert old_logprobs_first("ppo", {"m2po_tau": 0.04})


# ---- SAPO ------------------------------------------------------------------------------------


def test_sapo_by_hand_and_its_gradient_is_the_on_policy_one_at_ratio_one():
    log_r = [[0.0, math.log(1.5), math.log(0.5), math.log(3.0)]]
    adv = t([[1.0, 1.0, -1.0, -2.0]])
    out, grad = loss_and_grad("sapo", log_r, adv, mode="seq-mean-token-sum", tau_pos=1.0, tau_neg=2.0)
    r, a = torch.tensor(log_r, dtype=F64).exp(), adv
    tau = torch.where(a > 0, 1.0, 2.0)
    gate = torch.sigmoid(tau * (r - 1))
    assert torch.allclose(out.loss_BT, -a * gate * 4 / tau)
    assert torch.allclose(grad, -a * 4 * gate * (1 - gate) * r)  # d/dlog r
    assert grad[0, 0].item() == pytest.approx(-1.0)  # r = 1: the policy gradient itself
    assert (grad != 0).all()  # no token loses its gradient
    weight = (grad / -a)[0].tolist()  # 1, then r's own growth (1.41 at r = 1.5), then the gate's decay
    assert weight[1] == pytest.approx(1.41, abs=0.01) and weight[3] == pytest.approx(0.212, abs=0.001)
    # the gate's factor 4σ(1-σ) is below 1/2 for r = 3 (A < 0, tau 2: 0.07) only; r = 0.5 (0.79) is not
    assert out.metrics["clip_frac_low"].item() == pytest.approx(0.25)
    assert out.metrics["clip_frac_high"].item() == 0.0
    far, far_grad = loss_and_grad("sapo", [[math.log(20.0)]], t([1.0]))
    assert 0 < far_grad.abs().item() < 1e-5  # far off-policy (float64): damped smoothly, not cut by a bound


def test_sapo_takes_no_clip_bounds_and_gradchecks():
    a = load_config(model="unused", run_dir="unused", **{"algorithm.loss": "sapo"}).algorithm
    assert "eps_low" not in loss_options(a) and check_loss_options(a) is None
    logp = leaf([[-0.3, -1.2, -0.7]])
    old, adv = t([[-0.5, -0.9, -0.7]]), t([[0.5, -1.5, 1.0]])
    torch.autograd.gradcheck(lambda lp: policy_loss("sapo", lp, old, adv, ones_mask(1, 3), tau_neg=1.5).loss_BT.sum(),
                             (logp,))
    with pytest.raises(ValueError, match="temperatures must be positive"):
        policy_loss("sapo", logp, old, adv, ones_mask(1, 3), tau_pos=0.0)
    with pytest.raises(ConfigError, match="algorithm.dual_clip=3.0 for algorithm.loss=sapo: .*dual_clip"):
        load_config(model="unused", run_dir="unused", **{"algorithm.loss": "sapo", "algorithm.dual_clip": 3.0})


def test_reinforce_is_minus_advantage_times_logp_with_no_clip():
    log_r = [[0.0, math.log(3.0), math.log(0.2)]]
    adv = t([[1.0, 2.0, -1.0]])
    out, grad = loss_and_grad("reinforce", log_r, adv, mode="seq-mean-token-sum")
    assert torch.allclose(out.loss_BT, -adv * t(log_r))  # old_logp = 0, so logp = log r
    assert torch.allclose(grad, -adv)  # far from r = 1 too: nothing clips or weights it
    assert out.metrics["ratio_max"].item() == pytest.approx(3.0)
    # π_old/π_behav = exp(0 - behav): 1, e (capped at 2) and 1/e
    capped, capped_grad = loss_and_grad("reinforce", log_r, adv, behav=t([[0.0, -1.0, 1.0]]), mode="seq-mean-token-sum",
                                        is_level="token", is_mode="truncate", is_cap=2.0)
    assert torch.allclose(capped_grad, -adv * t([[1.0, 2.0, math.exp(-1.0)]]))
    a = load_config(model="unused", run_dir="unused", **{"algorithm.loss": "reinforce"}).algorithm
    assert "eps_low" not in loss_options(a) and check_loss_options(a) is None
    with pytest.raises(ConfigError, match="algorithm.dual_clip=3.0 for algorithm.loss=reinforce"):
        load_config(model="unused", run_dir="unused", **{"algorithm.loss": "reinforce", "algorithm.dual_clip": 3.0})


def test_reinforce_warns_where_no_ratio_corrects_it():
    """Several updates a step, or stale samples without importance weights, are named; one
    update in sync mode, and stale samples with tis_cap, are not."""
    from rollover.algos.loss_options import loss_caveats

    def caveats(**over):
        return loss_caveats(load_config(model="unused", run_dir="unused", **{"algorithm.loss": "reinforce", **over}))

    assert caveats() == [] and caveats(**{"algorithm.loss": "ppo", "train.ppo_epochs": 2}) == []
    assert caveats(**{"mode": "async", "algorithm.tis_cap": 2.0}) == []
    (several,) = caveats(**{"train.ppo_epochs": 2, "train.mini_batches": 2})
    assert several.startswith("algorithm.loss=reinforce with 4 updates a step")
    (stale,) = caveats(mode="async")
    assert "in async mode trains samples of older policies without importance weights" in stale
    (april,) = caveats(**{"partial_rollout.enabled": True})
    assert "in APRIL" in april
    # nothing stale reaches the loss, or the policy term has no advantage
    assert caveats(mode="async", **{"async.max_staleness": 0}) == []
    assert caveats(**{"partial_rollout.enabled": True, "partial_rollout.max_carry_steps": 0,
                      "partial_rollout.score_lag": 0}) == []
    assert caveats(**{"train.ppo_epochs": 2, "distill.teacher": "t", "distill.outcome_weight": 0.0,
                      "rollout.samples_per_prompt": 1}) == []


def test_bapo_warns_where_stale_samples_reach_it_uncorrected_and_april_recomputes_their_kv():
    """BAPO's ratio is to the weights an update starts from (recomputed), so in async mode or
    APRIL a stale token is clipped as if the current policy had sampled it: named, unless tis_cap
    weights it; APRIL's auto carry does not count BAPO as correcting older tokens."""
    from rollover.algos.loss_options import loss_caveats

    def cfg(**over):
        return load_config(model="unused", run_dir="unused", **{"algorithm.loss": "bapo", **over})

    assert loss_caveats(cfg()) == [] and loss_caveats(cfg(**{"train.ppo_epochs": 2})) == []
    (stale,) = loss_caveats(cfg(mode="async"))
    assert stale.startswith("algorithm.loss=bapo in async mode") and "algorithm.tis_cap" in stale
    (april,) = loss_caveats(cfg(**{"partial_rollout.enabled": True}))
    assert april.startswith("algorithm.loss=bapo in APRIL")
    assert loss_caveats(cfg(mode="async", **{"algorithm.tis_cap": 2.0})) == []
    assert loss_caveats(cfg(mode="async", **{"algorithm.loss": "ppo"})) == []
    carry, why = cfg(**{"partial_rollout.enabled": True}).april_carry
    assert carry == "resubmit" and "algorithm.loss=bapo without tis_cap" in why
    carry, why = cfg(**{"partial_rollout.enabled": True, "algorithm.tis_cap": 2.0}).april_carry
    assert carry == "keep_kv" and "algorithm.tis_cap corrects" in why


def test_sapo_under_another_aggregation_than_its_papers_is_named():
    """SAPO's paper, TRL and verl aggregate it seq-mean-token-mean; rollover's default is token-mean."""
    from rollover.algos.loss_options import loss_caveats

    def cfg(**over):
        return load_config(model="unused", run_dir="unused", **{"algorithm.loss": "sapo", **over})

    (said,) = loss_caveats(cfg())
    assert said.startswith("algorithm.loss=sapo with aggregation=token-mean: SAPO's paper, TRL and verl")
    assert loss_caveats(cfg(**{"algorithm.aggregation": "seq-mean-token-mean"})) == []


# ---- VESPO -----------------------------------------------------------------------------------


def vespo_weight(log_w, adv, k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0):
    """φ(w) = e^λ · w^k · e^{-λw} for one sequence (arXiv 2602.10693), by hand."""
    k, lam = (k_pos, lam_pos) if adv >= 0 else (k_neg, lam_neg)
    w = math.exp(log_w)
    return math.exp(lam) * w ** k * math.exp(-lam * w)


def test_vespo_by_hand_each_sequence_weighted_by_its_ratio():
    log_r = [[0.1, -0.3, 0.05], [0.4, 0.2, 0.0], [0.0, 0.0, 0.0]]
    adv = t([1.0, -2.0, 0.5])
    mask = torch.tensor([[True, True, False], [True, True, True], [True, True, True]])
    out, grad = loss_and_grad("vespo", log_r, adv, mask=mask, mode="seq-mean-token-sum")
    phi = [vespo_weight(-0.2, 1.0), vespo_weight(0.6, -2.0), 1.0]  # the last is on-policy: φ(1) = 1
    for i in range(3):
        for j in range(3):
            expected = -phi[i] * adv[i].item() * log_r[i][j] if mask[i, j] else 0.0
            assert out.loss_BT[i, j].item() == pytest.approx(expected, rel=1e-9, abs=1e-12)
            # φ carries no gradient: d/dlogp is -φ·A (over 3 sequences: seq-mean)
            assert grad[i, j].item() == pytest.approx(-phi[i] * adv[i].item() / 3 if mask[i, j] else 0.0, rel=1e-9)
    assert phi[0] > 1.1 and phi[1] > 1.1  # φ peaks at w = k/λ (2/3 for A >= 0, 3/2 for A < 0), not at 1
    assert out.metrics["phi_mean"].item() == pytest.approx((2 * phi[0] + 3 * phi[1] + 3) / 8)


def test_vespo_folds_token_importance_weights_into_the_sequence_ratio():
    logp = leaf([[-0.5, -1.0]])
    old, behav, adv = t([[-0.6, -1.0]]), t([[-0.4, -1.5]]), t([1.0])
    out = policy_loss("vespo", logp, old, adv, ones_mask(1, 2), behav, is_level="token", is_mode="truncate",
                      is_cap=1.5)
    rho = [min(math.exp(-0.6 + 0.4), 1.5), min(math.exp(-1.0 + 1.5), 1.5)]  # π_old/π_behav, capped
    log_w = (0.1 + 0.0) + math.log(rho[0]) + math.log(rho[1])
    phi = vespo_weight(log_w, 1.0)
    torch.testing.assert_close(out.loss_BT, t([[-phi * -0.5, -phi * -1.0]]))  # not multiplied by ρ again
    masked = policy_loss("vespo", logp, old, adv, ones_mask(1, 2), behav, is_level="token", is_mode="mask", is_cap=1.5)
    assert masked.mask_BT.tolist() == [[True, False]]  # ρ = e^0.5 > 1.5 leaves the mask ...
    assert masked.metrics["phi_mean"].item() < 1e-9  # ... with ratio 0 in w, as TRL's token_mask: the sequence fades
    plain = policy_loss("vespo", logp, old, adv, ones_mask(1, 2), behav)  # no options: w = π/π_behav, uncapped
    phi = vespo_weight((-0.5 + 0.4) + (-1.0 + 1.5), 1.0)
    torch.testing.assert_close(plain.loss_BT, t([[-phi * -0.5, -phi * -1.0]]))
    with pytest.raises(ValueError, match="token level only"):
        policy_loss("vespo", logp, old, adv, ones_mask(1, 2), behav, is_level="sequence")
    with pytest.raises(ValueError, match="k_neg must be >= 0"):
        policy_loss("vespo", logp, old, adv, ones_mask(1, 2), k_neg=-1.0)


def test_vespo_takes_no_clip_bounds_and_far_sequences_fade():
    a = load_config(model="unused", run_dir="unused", **{"algorithm.loss": "vespo"}).algorithm
    assert "eps_low" not in loss_options(a) and check_loss_options(a) is None
    a = load_config(model="unused", run_dir="unused", **{"algorithm.loss": "vespo", "algorithm.tis_cap": 2.0}).algorithm
    assert check_loss_options(a) is None
    with pytest.raises(ConfigError, match="algorithm.dual_clip=3.0 for algorithm.loss=vespo"):
        load_config(model="unused", run_dir="unused", **{"algorithm.loss": "vespo", "algorithm.dual_clip": 3.0})
    _, near = loss_and_grad("vespo", [[0.01] * 4], t([1.0]))
    _, far = loss_and_grad("vespo", [[0.5] * 4], t([1.0]))  # w = e^2
    assert near.abs().min() > 0.9 * 0.25 and 0 < far.abs().max() < 1e-3 * 0.25
    out = policy_loss("vespo", leaf([[0.5, 0.5], [-2.0, -2.0], [0.0, 0.0]]), torch.zeros(3, 2, dtype=F64),
                      t([1.0, 1.0, 1.0]), ones_mask(3, 2))
    assert out.metrics["clip_frac_high"].item() == pytest.approx(1 / 3)  # w = e: φ = 0.04
    assert out.metrics["clip_frac_low"].item() == pytest.approx(1 / 3)  # w = e^-4: φ = 0.006


# ---- LUSPO -----------------------------------------------------------------------------------


def test_luspo_is_gspo_summed_over_each_sequences_tokens():
    """TRL's loss_type="luspo" (arXiv 2602.05261): GSPO's sequence loss times the sequence's length,
    averaged over sequences, which is rollover's gspo under the seq-mean-token-sum aggregation."""
    g = torch.Generator().manual_seed(0)
    logp0, old = -torch.rand(4, 6, generator=g, dtype=F64), -torch.rand(4, 6, generator=g, dtype=F64)
    adv = torch.randn(4, generator=g, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]]).bool()
    ours = logp0.clone().requires_grad_()
    out = policy_loss("gspo", ours, old, adv, mask, eps_low=0.2, eps_high=0.28)
    aggregate(out.loss_BT, out.mask_BT, "seq-mean-token-sum", num_seqs=4).backward()
    theirs = logp0.clone().requires_grad_()  # TRL's formula, written out
    m = mask.to(F64)
    s = torch.exp(((theirs - old) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True))
    per_seq = -torch.min(s * adv[:, None], s.clamp(0.8, 1.28) * adv[:, None])
    (per_seq * m.sum(1, keepdim=True)).mean().backward()
    torch.testing.assert_close(ours.grad, theirs.grad)
    assert ours.grad.abs().sum() > 0
    luspo = {"algorithm.loss": "gspo", "algorithm.aggregation": "seq-mean-token-sum"}
    assert load_config(model="unused", run_dir="unused", **luspo).algorithm.aggregation == "seq-mean-token-sum"
    with pytest.raises(ConfigError, match="seq-mean-token-mean \\(GSPO\\) or seq-mean-token-sum \\(LUSPO"):
        load_config(model="unused", run_dir="unused", **{**luspo, "algorithm.aggregation": "token-mean"})


# ---- shared behaviour ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_padding_values_never_reach_loss_or_gradient(name):
    logp = leaf([[-0.5, -1.0, float("-inf")], [-0.2, float("nan"), float("nan")]])
    old = t([[-0.6, -0.9, float("nan")], [-0.25, float("-inf"), 0.0]])
    behav = t([[-0.6, -0.9, float("inf")], [-0.25, float("nan"), 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    out = policy_loss(name, logp, old, t([1.0, -1.0]), mask, behav)
    aggregate(out.loss_BT, out.mask_BT).backward()
    assert torch.isfinite(out.loss_BT).all() and torch.isfinite(logp.grad).all()
    assert (out.loss_BT[~mask] == 0).all() and (logp.grad[~mask] == 0).all()
    assert (logp.grad[mask] != 0).all()
    assert all(torch.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_metrics_are_detached_scalars(name):
    logp = leaf([[-0.5, -1.0]])
    out = policy_loss(name, logp, logp.detach() + 0.1, t([1.0]), ones_mask(1, 2), logp.detach(), m2po_tau=1.0)
    for key, value in out.metrics.items():
        assert value.dim() == 0 and not value.requires_grad, key
    expected = {"ratio_mean", "ratio_max", "approx_kl", "clip_frac_low", "clip_frac_high", "masked_frac"}
    assert expected <= out.metrics.keys()


def test_bad_calls_fail_loudly():
    logp, adv, mask = leaf([[0.0, 0.0]]), t([1.0]), ones_mask(1, 2)
    with pytest.raises(ValueError, match="unknown policy loss 'grpo'"):
        policy_loss("grpo", logp, logp.detach(), adv, mask)
    with pytest.raises(TypeError, match="clip_ratio"):
        policy_loss("ppo", logp, logp.detach(), adv, mask, clip_ratio=0.2)
    with pytest.raises(ValueError, match="adv must be"):
        policy_loss("ppo", logp, logp.detach(), t([1.0, 2.0]), mask)
    with pytest.raises(ValueError, match="old_logp_BT"):
        policy_loss("ppo", logp, t([[0.0]]), adv, mask)
    with pytest.raises(ValueError, match="clip bounds"):
        policy_loss("ppo", logp, logp.detach(), adv, mask, eps_low=1.5)
    with pytest.raises(ValueError, match="behav_logp_BT"):
        policy_loss("ppo", logp, logp.detach(), adv, mask, is_level="token")
