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
    # the empty row is not a sequence of the step: it adds 0 and is not counted
    torch.testing.assert_close(aggregate(LOSS, mask, "seq-mean-token-mean"), torch.tensor(6 / 3, dtype=F64))
    torch.testing.assert_close(aggregate(LOSS, mask, "seq-mean-token-sum"), torch.tensor(6.0, dtype=F64))
    empty = torch.zeros_like(mask)
    for mode in AGGREGATIONS:
        assert aggregate(LOSS, empty, mode, max_len=3) == 0


def test_fully_masked_row_is_left_out_of_the_sequence_count_by_hand():
    # row 1 lost every token (stale, truncated or entropy-masked); its loss values are ignored
    loss = torch.tensor([[1.0, 2.0, 3.0, 6.0], [50.0, 50.0, 50.0, 50.0], [4.0, 8.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[True, True, True, False], [False, False, False, False], [True, True, False, False]])
    num_seqs = int(mask.any(dim=1).sum())  # what the trainer counts over the step
    assert num_seqs == 2
    expected = {
        "seq-mean-token-mean": ((1 + 2 + 3) / 3 + (4 + 8) / 2) / 2,  # 4.0, not 8/3
        "seq-mean-token-sum": (6 + 12) / 2,  # 9.0, not 6.0
        "drgrpo": (6 + 12) / (2 * 4),
    }
    for mode, value in expected.items():
        want = torch.tensor(value, dtype=F64)
        torch.testing.assert_close(aggregate(loss, mask, mode, num_seqs=num_seqs, max_len=4), want)
        torch.testing.assert_close(aggregate(loss, mask, mode, max_len=4), want)  # local count: the same
        # split so that one micro-batch is only the masked row: it adds exactly 0
        parts = [aggregate(loss[rows], mask[rows], mode, num_seqs=num_seqs, max_len=4)
                 for rows in (slice(0, 1), slice(1, 2), slice(2, 3))]
        assert parts[1] == 0
        torch.testing.assert_close(sum(parts), want)


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
    mask[torch.rand(B, generator=g) < 0.3] = False  # fully masked rows (stale, truncated)
    mask[0, 0] = True  # the step has at least one loss token
    counts = dict(num_tokens=int(mask.sum()), num_seqs=int(mask.any(dim=1).sum()), max_len=T + 3)
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


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_trainer_leaves_fully_masked_rows_out_of_the_sequence_count(tmp_path, mode):
    """A rollout whose loss mask is all zeros (stale, truncated, entropy-masked) changes neither
    the trainer's loss nor its gradient, whatever the micro-batch split."""
    from rollover.config import load_config
    from rollover.testing import tiny_model
    from rollover.train.batch import TrainBatch
    from rollover.train.trainer import Trainer
    from rollover.types import Rollout

    def rollout(gid, prompt, resp, adv, mask=None):
        return Rollout(group_id=gid, prompt_ids=prompt, response_ids=resp, logprobs=[-1.0] * len(resp),
                       versions=[0] * len(resp), loss_mask=mask or [1] * len(resp), finish="stop", reward=0.0), adv

    kept = [rollout("a", [5, 6], [7, 8, 9], 1.0), rollout("a", [5, 6], [10, 11], -0.5), rollout("b", [12], [13], 2.0)]
    masked = rollout("b", [12], [14, 15, 16, 17], -3.0, mask=[0, 0, 0, 0])
    results = {}
    for name, rolls, micro_batch_tokens in (("kept", kept, 64), ("with masked", kept + [masked], 64),
                                            ("with masked, split", [kept[0], masked, *kept[1:]], 8)):
        cfg = load_config(model="m", run_dir=str(tmp_path), **{
            "data.train": "d", "data.max_prompt_tokens": 4, "rollout.max_new_tokens": 4, "train.pack_length": 8,
            "train.micro_batch_tokens": micro_batch_tokens, "algorithm.aggregation": mode})
        torch.manual_seed(0)
        trainer = Trainer(tiny_model("llama", seed=5), cfg, device=torch.device("cpu"))
        results[name] = trainer.train_step(TrainBatch.from_rollouts([r for r, _ in rolls], [a for _, a in rolls]))
    # ratio 1 on the first update: every loss token holds -A
    by_hand = {"seq-mean-token-mean": -(1.0 - 0.5 + 2.0) / 3, "seq-mean-token-sum": -(3 * 1.0 - 2 * 0.5 + 2.0) / 3}
    assert results["with masked, split"]["actor/micro_batches"] > 1
    for name, metrics in results.items():
        assert metrics["actor/pg_loss"] == pytest.approx(by_hand[mode], rel=1e-6), name
        assert metrics["actor/grad_norm"] == pytest.approx(results["kept"]["actor/grad_norm"], rel=1e-5), name
