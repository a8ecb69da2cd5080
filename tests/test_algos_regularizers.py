import math

import pytest
import torch

from rollover.algos import KL_ESTIMATORS, entropy_bonus, entropy_from_logits, kl_penalty

F64 = torch.float64


def t(values):
    return torch.tensor(values, dtype=F64)


# ---- KL --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "estimator, expected, grad",
    [
        # logp = log .5, ref = log .25: x = ref - logp = -log 2
        ("k1", math.log(2), 1.0),
        ("k2", 0.5 * math.log(2) ** 2, math.log(2)),  # d/dlogp ½(ref - logp)² = logp - ref
        ("k3", 0.5 + math.log(2) - 1, 1 - 0.5),  # d/dlogp (e^x - x - 1) = 1 - e^x
    ],
)
def test_kl_estimators_by_hand(estimator, expected, grad):
    logp = t([[math.log(0.5)]]).requires_grad_()
    kl = kl_penalty(logp, t([[math.log(0.25)]]), estimator)
    kl.sum().backward()
    torch.testing.assert_close(kl, t([[expected]]))
    torch.testing.assert_close(logp.grad, t([[grad]]))


def test_kl_is_zero_at_the_reference():
    logp = t([[-0.3, -2.0]])
    for estimator in KL_ESTIMATORS:
        assert torch.equal(kl_penalty(logp, logp, estimator), torch.zeros_like(logp))


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_gradcheck(estimator):
    ref = t([[-0.5, -1.2, -0.1]])
    logp = t([[-0.7, -0.9, -0.3]]).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: kl_penalty(x, ref, estimator), (logp,))


def test_k2_grad_keeps_the_value_and_takes_k2s_gradient():
    ref = t([[-0.5, -3.0]])
    logp = t([[-0.7, -0.4]]).requires_grad_()
    kl = kl_penalty(logp, ref, "k3", k2_grad=True)
    kl.sum().backward()
    torch.testing.assert_close(kl, kl_penalty(logp.detach(), ref, "k3"))
    torch.testing.assert_close(logp.grad, logp.detach() - ref)


@pytest.mark.parametrize("fill", [-math.inf, math.nan])
@pytest.mark.parametrize("estimator, k2_grad", [("k1", False), ("k2", False), ("k3", False), ("k3", True)])
def test_a_masked_positions_inf_or_nan_reaches_no_gradient(estimator, k2_grad, fill):
    """Padded positions may hold -inf or nan (as algorithms.md says): once the mask drops their
    values, every estimator's gradient is finite, and the loss tokens' gradients are as without them."""
    mask = torch.tensor([[True, True, False], [True, False, False]])
    base = t([[-0.7, -0.9, -0.3], [-1.1, -0.2, -0.4]])
    grads = []
    for pad in (fill, 0.0):
        logp = base.masked_fill(~mask, pad).requires_grad_()
        ref = (base - 0.3).masked_fill(~mask, pad)
        kl = kl_penalty(logp, ref, estimator, k2_grad=k2_grad)
        torch.where(mask, kl, 0.0).sum().backward()
        grads.append(logp.grad)
    assert torch.isfinite(grads[0]).all()
    torch.testing.assert_close(grads[0], grads[1])


def test_unknown_estimator_raises():
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(t([[0.0]]), t([[0.0]]), "k4")


# ---- entropy ---------------------------------------------------------------------------------


def test_entropy_by_hand():
    logits = t([[[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -math.inf, -math.inf], [5.0, -math.inf, -math.inf, -math.inf]]])
    ent = entropy_from_logits(logits)
    assert ent.shape == (1, 3)
    torch.testing.assert_close(ent, t([[math.log(4), math.log(2), 0.0]]))
    # p = [e/(e+1), 1/(e+1)]
    p = math.e / (math.e + 1)
    expected = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    torch.testing.assert_close(entropy_from_logits(t([[[1.0, 0.0]]])), t([[expected]]))
    with pytest.raises(ValueError, match="B, T, V"):
        entropy_from_logits(t([[1.0, 0.0]]))


def test_entropy_gradient_is_finite_with_masked_vocabulary():
    logits = t([[[0.3, -1.0, -math.inf], [2.0, -math.inf, 0.5]]]).requires_grad_()
    entropy_from_logits(logits).sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[torch.isinf(logits)] == 0).all()


def test_entropy_gradcheck_across_chunks():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=g, dtype=F64).requires_grad_()
    # chunk_size 2 over T = 3: one full block and one partial per row
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z, chunk_size=2), (logits,))


def test_entropy_matches_plain_autograd_on_a_sliced_view():
    g = torch.Generator().manual_seed(1)
    full = (3 * torch.randn(3, 9, 50, generator=g)).requires_grad_()
    weights = torch.randn(3, 4, generator=g)
    logits = full[:, 2:6]  # response positions cut out of a longer sequence: not contiguous
    assert not logits.is_contiguous()
    (entropy_from_logits(logits, chunk_size=3) * weights).sum().backward()
    chunked_grad = full.grad.clone()
    full.grad = None
    logp = torch.log_softmax(logits, -1)
    plain = -(logp.exp() * logp).sum(-1)
    (plain * weights).sum().backward()
    torch.testing.assert_close(entropy_from_logits(logits.detach()), plain.detach())
    torch.testing.assert_close(chunked_grad, full.grad)


def test_entropy_of_bf16_logits_is_computed_in_float32():
    logits = torch.randn(2, 3, 7, dtype=torch.bfloat16, requires_grad=True)
    ent = entropy_from_logits(logits)
    assert ent.dtype == torch.float32
    torch.testing.assert_close(ent, entropy_from_logits(logits.detach().float()))
    ent.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_entropy_bonus_lowers_the_loss_as_entropy_rises():
    torch.testing.assert_close(entropy_bonus(t([[1.0, 2.0]]), 0.01), t([[-0.01, -0.02]]))


def test_top_entropy_mask_keeps_the_tokens_at_or_above_the_quantile():
    from rollover.algos import top_entropy_mask

    ent = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.7, 0.2, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)  # 7.0 is not a loss token
    loss_ent = ent[mask]  # 0.1 0.9 0.5 0.3 0.7 0.2 0.0
    for q in (0.0, 0.25, 0.5, 0.9, 1.0):
        keep, m = top_entropy_mask(ent, mask, q)
        threshold = torch.quantile(loss_ent, 1 - q)
        assert torch.equal(keep, mask & (ent >= threshold)), q
        assert float(m["entropy_threshold"]) == pytest.approx(float(threshold))
        assert float(m["entropy_kept_frac"]) == pytest.approx(float((loss_ent >= threshold).double().mean()))
    keep, _ = top_entropy_mask(ent, mask, 0.5)  # 7 loss tokens: the median is 0.3
    assert keep.tolist() == [[False, True, True, False], [True, True, False, False]]
    assert top_entropy_mask(ent, mask, 0.0)[0].sum() == 1  # the highest-entropy loss token only
    assert torch.equal(top_entropy_mask(ent, mask, 1.0)[0], mask)
    # two ranks, each with its rows: the threshold over both, the rows each rank kept
    halves = [(ent[:1], mask[:1]), (ent[1:], mask[1:])]
    every = torch.cat([e[m] for e, m in halves])
    got = [top_entropy_mask(e, m, 0.5, gather=lambda x: (every, 0))[0] for e, m in halves]
    assert torch.equal(torch.cat(got), keep)
    with pytest.raises(ValueError, match="quantile"):
        top_entropy_mask(ent, mask, 1.5)
