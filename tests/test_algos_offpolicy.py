import math
import threading
from fractions import Fraction

import pytest
import torch

from rollover.algos import importance_weights, m2po_mask, m2po_update_mask, policy_loss

F64 = torch.float64


def t(values):
    return torch.tensor(values, dtype=F64)


# old (trainer) log-probs 0; behaviour log-probs give ρ = π_old/π_behav = [0.5, 1.5, 4.0]
OLD = torch.zeros(1, 3, dtype=F64)
BEHAV = t([[math.log(2.0), -math.log(1.5), -math.log(4.0)]])
MASK = torch.ones(1, 3, dtype=torch.bool)


def test_token_truncate_caps_weights():
    w, mask, metrics = importance_weights(OLD, BEHAV, MASK, level="token", mode="truncate", cap=2.0)
    torch.testing.assert_close(w, t([[0.5, 1.5, 2.0]]))
    assert mask.all()
    torch.testing.assert_close(metrics["is_ratio_max"], t(4.0))
    torch.testing.assert_close(metrics["is_ratio_mean"], t(2.0))
    torch.testing.assert_close(metrics["is_clip_frac"], t(1 / 3))


def test_token_mask_drops_tokens_outside_bounds_and_keeps_rho_inside():
    w, mask, metrics = importance_weights(OLD, BEHAV, MASK, level="token", mode="mask", cap=2.0, floor=0.6)
    torch.testing.assert_close(w, t([[0.0, 1.5, 0.0]]))
    assert mask.tolist() == [[False, True, False]]
    torch.testing.assert_close(metrics["is_clip_frac"], t(2 / 3))


def test_sequence_level_product_and_geometric_mean():
    old = torch.zeros(2, 3, dtype=F64)
    behav = t([[-0.1, -0.2, 5.0], [0.3, 0.0, -0.9]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    w, _, _ = importance_weights(old, behav, mask, level="sequence", cap=10.0)
    prod = [math.exp(0.3), math.exp(0.6)]
    torch.testing.assert_close(w, t([[prod[0], prod[0], 0.0], [prod[1]] * 3]))
    w, _, _ = importance_weights(old, behav, mask, level="sequence", cap=10.0, seq_ratio="geo_mean")
    geo = [math.exp(0.15), math.exp(0.2)]
    torch.testing.assert_close(w, t([[geo[0], geo[0], 0.0], [geo[1]] * 3]))
    # sequence mask drops the whole response
    w, new_mask, _ = importance_weights(old, behav, mask, level="sequence", mode="mask", cap=1.5)
    assert new_mask.tolist() == [[True, True, False], [False, False, False]]


def test_tis_multiplies_the_clipped_policy_loss():
    logp = torch.full((1, 3), 0.1, dtype=F64, requires_grad=True)
    out = policy_loss("ppo", logp, OLD, t([1.0]), MASK, BEHAV, is_level="token", is_cap=2.0)
    out.loss_BT.sum().backward()
    r = math.exp(0.1)
    torch.testing.assert_close(out.loss_BT, -r * t([[0.5, 1.5, 2.0]]))
    torch.testing.assert_close(logp.grad, -r * t([[0.5, 1.5, 2.0]]))
    # the same options on GSPO: weights multiply the sequence loss written to each token
    out = policy_loss("gspo", logp.detach(), OLD, t([1.0]), MASK, BEHAV, is_level="token", eps_low=0.2, eps_high=0.2)
    torch.testing.assert_close(out.loss_BT, -r * t([[0.5, 1.5, 2.0]]))


def test_invalid_options_raise():
    with pytest.raises(ValueError, match="is_level"):
        importance_weights(OLD, BEHAV, MASK, level="tok")
    with pytest.raises(ValueError, match="is_mode"):
        importance_weights(OLD, BEHAV, MASK, mode="clip")
    with pytest.raises(ValueError, match="is_floor < is_cap"):
        importance_weights(OLD, BEHAV, MASK, cap=1.0, floor=2.0)
    with pytest.raises(ValueError, match="m2po_tau"):
        m2po_mask(OLD, BEHAV, MASK, tau=-1.0)


# ---- M2PO ------------------------------------------------------------------------------------


def m2po(deltas, tau, mask=None):
    old = t([deltas])
    mask = torch.ones_like(old, dtype=torch.bool) if mask is None else mask
    return m2po_mask(old, torch.zeros_like(old), mask, tau=tau)


def test_m2po_masks_nothing_when_second_moment_is_below_tau():
    mask, metrics = m2po([0.1, -0.2, 0.15, 0.0], tau=0.04)  # mean Δ² = .0725 / 4 = .018125
    assert mask.all()
    torch.testing.assert_close(metrics["m2po_m2_before"], t(0.018125))
    torch.testing.assert_close(metrics["m2po_m2_after"], t(0.018125))
    assert metrics["m2po_masked_frac"] == 0


def test_m2po_masks_the_fewest_largest_tokens():
    # Δ² = [.01, .25, .01, 0]: mean .0675 > .04; without .25: .02/3 <= .04
    mask, metrics = m2po([0.1, 0.5, -0.1, 0.0], tau=0.04)
    assert mask.tolist() == [[True, False, True, True]]
    torch.testing.assert_close(metrics["m2po_m2_after"], t(0.02 / 3))
    # Δ² = [.09, .09, .01, .01]: mean .05; dropping one tie (the first) leaves .11/3 = .0367
    mask, _ = m2po([0.3, -0.3, 0.1, 0.1], tau=0.04)
    assert mask.tolist() == [[False, True, True, True]]


def test_m2po_drop_takes_any_float_and_an_infinite_tau():
    from rollover.algos import m2po_drop

    drop, _ = m2po_drop(torch.tensor([0.01, 0.25, 0.01, 0.0]), 0.04)  # float32, as a caller may hand it
    assert drop.tolist() == [False, True, False, False]
    drop, metrics = m2po_drop(torch.tensor([0.01, 9.0, float("inf")], dtype=F64), float("inf"))
    assert drop.tolist() == [False, False, True] and float(metrics["m2po_masked_frac"]) == pytest.approx(1 / 3)


def test_m2po_masks_everything_when_every_token_exceeds_tau():
    mask, metrics = m2po([0.5, -0.5], tau=0.04)
    assert not mask.any()
    assert metrics["m2po_masked_frac"] == 1


def test_m2po_ignores_tokens_outside_the_mask():
    mask, _ = m2po([0.1, 5.0, -0.1], tau=0.04, mask=torch.tensor([[True, False, True]]))
    assert mask.tolist() == [[True, False, True]]


def test_m2po_is_minimal_on_random_batches():
    g = torch.Generator().manual_seed(0)
    batches_with_drops = 0
    for _ in range(50):
        old = 0.3 * torch.randn(4, 9, generator=g, dtype=F64)
        given = torch.rand(4, 9, generator=g) < 0.8
        tau = float(torch.rand((), generator=g, dtype=F64)) * 0.1
        mask, _ = m2po_mask(old, torch.zeros_like(old), given, tau=tau)
        m2 = old.square()
        assert not (mask & ~given).any()
        kept, dropped = m2[mask], m2[given & ~mask]
        assert kept.numel() == 0 or kept.mean() <= tau
        if dropped.numel():
            batches_with_drops += 1
            if kept.numel():
                assert dropped.min() >= kept.max()  # the largest ones went
            # putting back the smallest dropped token breaks the bound: the mask is minimal
            assert torch.cat([kept, dropped.min()[None]]).mean() > tau
    assert batches_with_drops > 25


class Ranks:
    """The ranks' collectives among threads of one process: every rank calls the same ones in
    the same order, as torch.distributed's ranks do."""

    def __init__(self, world):
        self.world, self.barrier, self.slots = world, threading.Barrier(world), [None] * world

    def _exchange(self, rank, x):
        self.slots[rank] = x
        self.barrier.wait()
        every = list(self.slots)
        self.barrier.wait()
        return every

    def reduce(self, rank):
        ops = {"sum": lambda xs: torch.stack(xs).sum(0), "max": lambda xs: torch.stack(xs).max(0).values}
        return lambda x, op: ops[op](self._exchange(rank, x))

    def gather(self, rank):
        def gather(x):
            every = self._exchange(rank, x)
            return torch.cat(every), sum(len(e) for e in every[:rank])
        return gather


def ranks_of(old, given, group, shares, tau):
    """m2po_update_mask on each rank's rows (`shares`), the ranks running side by side: the mask
    reassembled [B, T], and each rank's metrics."""
    ranks, out = Ranks(len(shares)), {}

    def rank(r, rows):
        out[r] = m2po_update_mask(old[rows], torch.zeros_like(old[rows]), given[rows], group[rows], tau=tau,
                                  reduce=ranks.reduce(r), gather=ranks.gather(r))

    threads = [threading.Thread(target=rank, args=(r, rows)) for r, rows in enumerate(shares)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    mask, metrics = torch.zeros_like(given), []
    for r, rows in enumerate(shares):
        mask[rows] = out[r][0]
        metrics.append(out[r][1])
    return mask, metrics


def smallest_cut(m2, tau):
    """The definition, by brute force in exact arithmetic: how many of the largest values go."""
    values = sorted((Fraction(float(v)) for v in m2), reverse=True)
    for k in range(len(values) + 1):
        rest = values[k:]
        if not rest or sum(rest) / len(rest) <= Fraction(tau):
            return k


def test_m2po_update_mask_is_one_mask_whatever_the_ranks():
    g = torch.Generator().manual_seed(1)
    old = 0.3 * torch.randn(8, 6, generator=g, dtype=F64)
    given = torch.rand(8, 6, generator=g) < 0.8
    group = torch.tensor([2, 0, 0, 1, 3, 2, 1, 3])
    whole, whole_metrics = m2po_update_mask(old, torch.zeros_like(old), given, group, tau=0.04)
    assert 0 < whole_metrics["m2po_masked_frac"] < 1 and torch.equal(whole & given, whole)
    torch.testing.assert_close(whole, m2po_mask(old, torch.zeros_like(old), given, tau=0.04)[0])  # no ties here
    for shares in ([[0, 3, 5, 6], [1, 2, 4, 7]], [[1, 2], [], [0, 3, 4, 5, 6, 7]]):  # whole groups, a rank empty
        mask, metrics = ranks_of(old, given, group, [torch.tensor(s, dtype=torch.long) for s in shares], 0.04)
        assert torch.equal(mask, whole)
        assert all(torch.equal(m[k], v) for m in metrics for k, v in whole_metrics.items())  # on every rank


def test_m2po_update_mask_on_ties_across_ranks_and_non_finite_values():
    """Values on a coarse grid (many ties at the cut), split over three ranks with groups
    interleaved: the one-process mask, the definition's count, the largest values gone."""
    g = torch.Generator().manual_seed(2)
    for trial in range(20):
        old = torch.randint(0, 6, (9, 5), generator=g).to(F64) / 10
        given = torch.rand(9, 5, generator=g) < 0.9
        if trial % 4 == 0:  # a token sampled at logprob -inf, or a NaN from the engine: always dropped
            old[trial % 9, 0] = float("inf") if trial % 8 else float("nan")
            given[trial % 9, 0] = True
        group = torch.tensor([4, 1, 3, 0, 2, 4, 1, 3, 0])
        tau = float(torch.rand((), generator=g, dtype=F64)) * 0.08
        whole, whole_metrics = m2po_update_mask(old, torch.zeros_like(old), given, group, tau=tau)
        m2 = old.square()[given]
        finite = torch.isfinite(m2)
        k = smallest_cut(m2[finite], tau) + int((~finite).sum())
        assert int((given & ~whole).sum()) == k and not (whole & ~given).any()
        kept, dropped = old.square()[whole], old.square()[given & ~whole]
        dropped = dropped[torch.isfinite(dropped)]
        assert kept.numel() == 0 or ((dropped.numel() == 0 or dropped.min() >= kept.max()) and kept.mean() <= tau)
        assert whole_metrics["m2po_masked_frac"] == pytest.approx(k / m2.numel(), abs=1e-15)
        shares = [torch.tensor(s) for s in ([0, 3, 6], [1, 4, 8], [2, 5, 7])]  # whole groups per rank
        mask, metrics = ranks_of(old, given, group, shares, tau)
        assert torch.equal(mask, whole), trial
        for m in metrics:
            for key, v in whole_metrics.items():
                assert torch.equal(m[key], v) or (v.isnan() and m[key].isnan()), key


def test_m2po_update_mask_breaks_ties_by_group_then_row_then_position():
    # Δ² = [.09, .01], [.01, .09], [.09, .01]: mean .05, without one .09 .042, without two .03
    old = t([[0.3, 0.1], [0.1, -0.3], [0.3, 0.1]])
    given = torch.ones_like(old, dtype=torch.bool)
    mask, _ = m2po_update_mask(old, torch.zeros_like(old), given, torch.tensor([1, 0, 1]), tau=0.04)
    assert mask.tolist() == [[False, True], [True, False], [True, True]]
    mask, _ = m2po_update_mask(old, torch.zeros_like(old), given, torch.tensor([0, 1, 0]), tau=0.04)
    assert mask.tolist() == [[False, True], [True, True], [False, True]]


def test_m2po_through_a_policy_loss():
    logp = torch.zeros(1, 4, dtype=F64, requires_grad=True)
    behav = -t([[0.1, 0.5, -0.1, 0.0]])  # old - behav = Δ of the test above
    out = policy_loss("ppo", logp, torch.zeros(1, 4, dtype=F64), t([1.0]), torch.ones(1, 4, dtype=torch.bool), behav,
                      m2po_tau=0.04)
    out.loss_BT.sum().backward()
    assert out.mask_BT.tolist() == [[True, False, True, True]]
    torch.testing.assert_close(out.loss_BT, t([[-1.0, 0.0, -1.0, -1.0]]))
    torch.testing.assert_close(logp.grad, t([[-1.0, 0.0, -1.0, -1.0]]))
    torch.testing.assert_close(out.metrics["masked_frac"], t(0.25))


def test_m2po_paper_objective_is_unclipped_ppo_with_the_mask():
    # documented recipe: J = Σ M·r·A, i.e. ppo without clipping plus m2po_tau
    logp = t([[0.5, 0.1, -0.7, 0.0]]).requires_grad_()
    behav = -t([[0.1, 0.5, -0.1, 0.0]])
    adv = t([[1.0, 1.0, -1.0, 2.0]])
    out = policy_loss("ppo", logp, torch.zeros(1, 4, dtype=F64), adv, torch.ones(1, 4, dtype=torch.bool), behav,
                      m2po_tau=0.04, eps_low=1.0, eps_high=float("inf"))
    out.loss_BT.sum().backward()
    r = logp.detach().exp()
    keep = t([[1.0, 0.0, 1.0, 1.0]])
    torch.testing.assert_close(out.loss_BT, -adv * r * keep)
    torch.testing.assert_close(logp.grad, -adv * r * keep)
    assert out.metrics["clip_frac_low"] == 0 and out.metrics["clip_frac_high"] == 0


def test_opsm_drops_the_negative_tokens_of_sequences_far_off_policy():
    """DeepSeek-V3.2's mask by hand: sequence 0 is far off (mean log(behav / pi) 0.6 > 0.5), sequence
    1 is near (0.1); only sequence 0's negative-advantage tokens go."""
    from rollover.algos.offpolicy import opsm_mask

    logp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    behav = torch.tensor([[-0.2, -0.6, -0.4], [-0.9, -0.9, -0.9]], dtype=torch.float64)  # gaps 0.8 0.4 0.6 | 0.1
    adv = torch.tensor([[1.0, -1.0, -2.0], [-1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    keep, m = opsm_mask(logp, behav, adv, mask, delta=0.5)
    assert keep.tolist() == [[True, False, False], [True, True, True]]
    assert float(m["opsm_masked_frac"]) == pytest.approx(2 / 6)
    # a masked token does not count in its sequence's mean: without the 0.8 gap, sequence 0 is at 0.5
    keep, _ = opsm_mask(logp, behav, adv, torch.tensor([[False, True, True], [True, True, True]]), delta=0.5)
    assert keep[0].tolist() == [False, True, True]
    with pytest.raises(ValueError, match="opsm_delta must be >= 0"):
        opsm_mask(logp, behav, adv, mask, delta=-1.0)
