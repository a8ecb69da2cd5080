"""Policy-optimisation algorithms as small pure functions over tensors.

No engine, trainer or config object in here: tensors in, tensors (and a metrics dict) out.
Shapes are in the names: `_B` per sequence, `_BT` per response token, `_BTV` per vocabulary
entry. Every loss is to be *minimised*.

    adv_B, info = compute_advantages("grpo", rewards_B, group_ids_B)
    out = policy_loss("ppo", logp_BT, old_logp_BT, adv_B, mask_BT, behav_logp_BT, eps_high=0.28)
    loss = aggregate(out.loss_BT, out.mask_BT, "token-mean", num_tokens=step_tokens)

- `advantages`: grpo, grpo_batch_std, drgrpo, rloo, reinforce_pp, reinforce_pp_baseline, gapo, opo,
  gpg, grpo_passk, remax, gdpo (`ADVANTAGES`, gdpo apart: it takes each reward function's scores),
  gae (the rewards, for the critic).
- `distill`: on-policy distillation's per-token term, the teacher's logprob less the sampler's.
- `gae`: PPO with a critic: generalised advantage estimation over the trained tokens, whitening,
  the clipped value loss, explained variance.
- `policy`: ppo, gspo, gspo_token, cispo, sapo, vespo, decoupled_ppo, bapo, reinforce (`POLICY_LOSSES`);
  `bapo_update_bounds` picks BAPO's bounds once over an update split into micro-batches and ranks.
- `loss_options`: a config's options for the policy loss, checked against what the loss takes.
- `bapo_bounds`: BAPO's candidate bounds, the tables a batch contributes, the search.
- `offpolicy`: truncated / masked importance sampling and the M2PO mask, as options of every
  policy loss (`is_level`, `is_mode`, `is_cap`, `is_floor`, `is_seq_ratio`, `m2po_tau`);
  `m2po_update_mask` cuts one M2PO mask over an update split into micro-batches and ranks.
- `regularizers`: KL estimators k1/k2/k3, chunked entropy from logits, entropy bonus.
- `aggregate`: token-mean, seq-mean-token-mean, seq-mean-token-sum, drgrpo, exact under
  micro-batching when given the step's global counts.
- `shaping`: DAPO soft overlong penalty, masking of truncated responses.

docs/algorithms.md lists papers, defaults and differences from verl and TRL.
"""

from rollover.algos.advantages import (
    ADVANTAGES,
    compute_advantages,
    drgrpo,
    gapo,
    grpo,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
)
from rollover.algos.aggregate import AGGREGATIONS, aggregate, masked_max, masked_mean
from rollover.algos.offpolicy import (
    importance_weights,
    m2po_drop,
    m2po_mask,
    m2po_update_mask,
    off_policy_correction,
)
from rollover.algos.bapo_bounds import bapo_bounds, bapo_search, bapo_tables
from rollover.algos.policy import (
    POLICY_LOSSES,
    PolicyLossOutput,
    bapo,
    bapo_update_bounds,
    cispo,
    decoupled_ppo,
    gspo,
    gspo_token,
    policy_loss,
    ppo,
    sapo,
    vespo,
)
from rollover.algos.regularizers import KL_ESTIMATORS, entropy_bonus, entropy_from_logits, kl_penalty, top_entropy_mask
from rollover.algos.shaping import overlong_penalty, truncated_mask

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "PolicyLossOutput",
    "aggregate",
    "bapo",
    "bapo_bounds",
    "bapo_search",
    "bapo_tables",
    "bapo_update_bounds",
    "cispo",
    "compute_advantages",
    "decoupled_ppo",
    "drgrpo",
    "entropy_bonus",
    "entropy_from_logits",
    "gapo",
    "grpo",
    "gspo",
    "gspo_token",
    "importance_weights",
    "kl_penalty",
    "m2po_drop",
    "m2po_mask",
    "m2po_update_mask",
    "masked_max",
    "masked_mean",
    "off_policy_correction",
    "overlong_penalty",
    "policy_loss",
    "ppo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "rloo",
    "sapo",
    "vespo",
    "top_entropy_mask",
    "truncated_mask",
]
