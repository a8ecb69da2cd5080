import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollover.algos import AGGREGATIONS, aggregate, masked_max, masked_mean, policy_loss

F64 = torch.float64

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]], dtype=F64)
MASK = torch.tensor([[True, True, True], [True, False, False]])


@pytest.mark.parametrize(
    "mode, counts, expected",
    [
        ("token-mean", {}, (1 + 2 + 3 + 4) / 4),
        ("token-mean", {"num_tokens": 8}, 10 / 8),
        ("seq-mean-token-mean", {}, (6 / 3 + 4 / 1) / 2),
        ("seq-mean-token-mean", {"num_seqs": 4}, (2 + 4) / 4),
        ("seq-mean-token-sum", {}, (6 + 4) / 2),
        ("seq-mean-token-sum", {"num_seqs": 5}, 10 / 5),
        ("drgrpo", {"max_len": 8}, 10 / (2 * 8)),
        ("drgrpo", {"max_len": 8, "num_seqs": 1}, 10 / 8),  # verl's seq-mean-token-sum-norm
    ],
)
def test_modes_by_hand(mode, counts, expected):
    torch.testing.assert_close(aggregate(LOSS, MASK, mode, **counts), torch.tensor(expected, dtype=F64))


def test_masked_positions_are_ignored_even_if_not_finite():
    loss = LOSS.clone()
    loss[1, 1:] = float("nan")
    for mode in AGGREGATIONS:
        assert torch.isfinite(aggregate(loss, MASK, mode, max_len=3))


def test_empty_rows_and_batches():
    mask = torch.tensor([[True, True, True], [False, False, False]])
    # the empty row counts in num_seqs and contributes 0
    torch.testing.assert_close(aggregate(LOSS, mask, "seq-mean-token-mean"), torch.tensor(1.0, dtype=F64))
    empty = torch.zeros_like(mask)
    assert aggregate(LOSS, empty, "token-mean") == 0


def test_masked_mean_and_max():
    assert masked_mean(LOSS, MASK) == 2.5
    assert masked_max(LOSS, MASK) == 4.0
    assert masked_max(-LOSS, MASK) == -1.0
    nothing = torch.zeros_like(MASK)
    assert masked_mean(LOSS, nothing) == 0 and masked_max(LOSS, nothing) == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_len"):
        aggregate(LOSS, MASK, "drgrpo")
    with pytest.raises(ValueError, match="unknown aggregation mode 'mean'"):
        aggregate(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match="num_tokens must be > 0"):
        aggregate(LOSS, MASK, "token-mean", num_tokens=0)
    with pytest.raises(ValueError, match="same \\[B, T\\]"):
        aggregate(LOSS, MASK[:, :2])


@st.composite
def split_batches(draw):
    B = draw(st.integers(1, 7))
    T = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    cuts = sorted(draw(st.sets(st.integers(1, B - 1), max_size=B - 1))) if B > 1 else []
    return B, T, seed, [0, *cuts, B]


@settings(max_examples=40, deadline=None)
@given(split_batches(), st.sampled_from(AGGREGATIONS), st.sampled_from(["ppo", "gspo", "cispo"]))
def test_micro_batches_add_up_to_the_full_batch(split, mode, loss_name):
    """A trainer passes the step's global counts to every micro-batch; summing the micro-batch
    losses (and back-propagating each) must give the full batch's loss and gradient."""
    B, T, seed, bounds = split
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g, dtype=F64)).requires_grad_()
    old = logp.detach() + 0.3 * (torch.rand(B, T, generator=g, dtype=F64) - 0.5)
    adv = torch.randn(B, generator=g, dtype=F64)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[0, 0] = True  # the step has at least one loss token
    counts = dict(num_tokens=int(mask.sum()), num_seqs=B, max_len=T + 3)
    opts = dict(eps_low=0.1, eps_high=0.1)

    def loss_of(rows):
        out = policy_loss(loss_name, logp[rows], old[rows], adv[rows], mask[rows], **opts)
        return aggregate(out.loss_BT, out.mask_BT, mode, **counts)

    full = loss_of(slice(0, B))
    (full_grad,) = torch.autograd.grad(full, logp)
    total = torch.zeros((), dtype=F64)
    for lo, hi in zip(bounds, bounds[1:]):
        micro = loss_of(slice(lo, hi))
        micro.backward()
        total = total + micro.detach()
    torch.testing.assert_close(total, full.detach())
    torch.testing.assert_close(logp.grad, full_grad)


def test_local_denominators_would_break_micro_batching():
    # The bug the global counts prevent: per-micro-batch token means averaged over micro-batches.
    loss = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    full = aggregate(loss, mask, "token-mean")
    local = (aggregate(loss[:1], mask[:1]) + aggregate(loss[1:], mask[1:])) / 2
    global_ = aggregate(loss[:1], mask[:1], num_tokens=4) + aggregate(loss[1:], mask[1:], num_tokens=4)
    assert local != full
    torch.testing.assert_close(global_, full)
