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

    def _token_baseline(self, batch, logp_BT: torch.Tensor, sum_sq_BT: torch.Tensor):
        """The batch with OTB's per-token advantages, and the step's `otb/*` metrics. `logp_BT`,
        `sum_sq_BT`: the sampled tokens' logprobs and each position's Σπ² under the policy now."""
        mask = batch.mask_BT.to(self.device)
        is_opts = {k: v for k, v in self._loss_options().items() if k.startswith("is_")}
        weight = None
        if is_opts.get("is_level") is not None:  # the loss's importance weights (0 where its mask drops a token)
            weight, kept, _ = off_policy_correction(logp_BT, batch.behav_logp_BT.to(self.device), mask, **is_opts)
            weight = (torch.ones_like(logp_BT) if weight is None else weight) * kept
        energy = otb.path_energy(logp_BT, sum_sq_BT.to(logp_BT), mask, weight)
        returns, groups = batch.adv_B.to(self.device).float(), batch.group_index_B.to(self.device)
        adv, info = otb.token_advantages(returns, groups, mask, self._whole_groups(otb.group_sums(returns, groups,
                                                                                                 energy, mask)))
        has = mask.any(dim=1)
        total, count, base, base_n = self._sum(torch.tensor(
            [float(energy[has, -1].sum()), float(has.sum()), info["baseline_sum"], info["baseline_tokens"]],
            dtype=torch.float64)).tolist()
        metrics = {"otb/path_energy": total / count} if count else {}
        if base_n:
            metrics["otb/baseline_mean"] = base / base_n
        return replace(batch, adv_BT=adv.cpu()), metrics

    def _whole_groups(self, sums: dict) -> dict:
        """Each group's OTB sums over all its samples (FSDPTrainer: over the ranks holding them)."""
        return sums
