"""The trainer's half of `algorithm.advantage: otb` (the optimal token baseline,
`rollover.algos.token_baseline`): the batch arrives with each sample's return in `adv_B`, and
leaves with each token's advantage in `adv_BT`, from the policy's distributions before the step."""

from __future__ import annotations

from dataclasses import replace

import torch

from rollover.algos import token_baseline as otb
from rollover.algos.offpolicy import off_policy_correction


class TokenBaseline:
    """Mixed into `rollover.train.trainer.Trainer` (which sets `device`, `_loss_options`, `_sum`;
    FSDPTrainer overrides `_whole_groups`)."""

    def _token_baseline(self, batch, logp_BT: torch.Tensor, others_sq_BT: torch.Tensor):
        """The batch with OTB's per-token advantages, and the step's `otb/*` metrics. `logp_BT`,
        `others_sq_BT`: the sampled tokens' logprobs and Σπ² over each position's other ids, under
        the policy now."""
        mask = batch.mask_BT.to(self.device)
        is_opts = {k: v for k, v in self._loss_options().items() if k.startswith("is_")}
        weight = None
        if is_opts.get("is_level") is not None:  # importance weights as the loss's, from the policy now
            weight, mask, _ = off_policy_correction(logp_BT, batch.behav_logp_BT.to(self.device), mask, **is_opts)
            # (in mask mode the tokens it drops leave the sums, as from the loss)
        energy = otb.path_energy(logp_BT, others_sq_BT.to(logp_BT), mask, weight)
        returns, groups = batch.adv_B.to(self.device).float(), batch.group_index_B.to(self.device)
        adv, info = otb.token_advantages(returns, groups, mask, self._whole_groups(otb.group_sums(returns, groups,
                                                                                                 energy, mask)))
        has = mask.any(dim=1)  # (a rank given no sequence has a [0, 0] batch)
        ends = energy[:, -1] if energy.shape[1] else energy.new_zeros(len(energy))
        total, count, base, base_n = self._sum(torch.tensor(
            [float(ends[has].sum()), float(has.sum()), info["baseline_sum"], info["baseline_tokens"]],
            dtype=torch.float64)).tolist()
        metrics = {"otb/path_energy": total / count} if count else {}
        if base_n:
            metrics["otb/baseline_mean"] = base / base_n
        return replace(batch, adv_BT=adv.cpu()), metrics

    def _whole_groups(self, sums: dict) -> dict:
        """Each group's OTB sums over all its samples (FSDPTrainer: over the ranks holding them)."""
        return sums
