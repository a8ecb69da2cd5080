"""D3S-style dynamic dual-level down-sampling (arXiv 2509.22115): generate many samples per
prompt, train on the few that teach the most.

- Sample level (`max_variance_subset`): from each group keep the `keep` samples whose
  advantages have the largest variance. The best k-subset of numbers by variance is always some
  i smallest and k - i largest (PODS, arXiv 2504.13818), so scanning i over 0..k on the sorted
  values finds it exactly in O(n log n).
- Token level (`top_tokens`): of the step's trained response tokens keep the fraction with the
  largest |A| x H, A the sample's advantage and H the token's entropy, estimated by the sampled
  token's negative log-probability (the engine reports no entropy; a one-sample estimate, as
  `rollover.rollout.curation.top_entropy_mask` uses).
- Curriculum (`token_fraction_at`): from aggressive to relaxed, the token fraction moves
  linearly from `token_fraction_start` to `token_fraction` over `anneal_steps` steps.

Where this departs from the papers: advantages are computed over the whole group before the
subset is taken (PODS normalises within the subset; the whole group is the better baseline and
keeps the estimator the run configured), and the token entropy is the one-sample estimate
above, not the trainer's full-distribution entropy (which would need a forward pass before the
choice). D3S's own ratios are not published in the sources this project read; the defaults keep
everything, and `rollover bench learn` measures one setting.
"""

from __future__ import annotations

from dataclasses import replace

from rollover.types import Group, Rollout


def max_variance_subset(values: list[float], k: int) -> list[int]:
    """Indices (ascending) of the k values with the largest population variance. Ties go to
    the subset with fewer smallest values, and among equal values to the earlier index for the
    low end and the later for the high end (a stable sort), so the choice is deterministic."""
    n = len(values)
    if k >= n:
        return list(range(n))
    if k <= 0:
        return []
    order = sorted(range(n), key=lambda i: values[i])
    xs = [values[i] for i in order]
    pre, pre2 = [0.0], [0.0]
    for x in xs:
        pre.append(pre[-1] + x)
        pre2.append(pre2[-1] + x * x)
    best_i, best_var = 0, -1.0
    for i in range(k + 1):  # i lowest, k - i highest
        s = pre[i] + pre[n] - pre[n - (k - i)]
        s2 = pre2[i] + pre2[n] - pre2[n - (k - i)]
        var = s2 / k - (s / k) ** 2
        if var > best_var + 1e-12:
            best_i, best_var = i, var
    return sorted(order[:best_i] + order[n - (k - best_i):])


def token_fraction_at(cfg, step: int) -> float:
    """The token fraction the curriculum gives the `step`-th training step (1-based)."""
    if cfg.token_fraction_start is None or cfg.anneal_steps == 0:
        return cfg.token_fraction
    t = min(1.0, max(0, step - 1) / cfg.anneal_steps)
    return cfg.token_fraction_start + t * (cfg.token_fraction - cfg.token_fraction_start)


def top_tokens(rollouts: list[Rollout], advantages: list[float], fraction: float) -> tuple[list[Rollout], int]:
    """The rollouts with the loss mask kept on the top `fraction` of trained tokens by
    |A| x (-logprob) and zeroed elsewhere (new rollouts; the inputs are unchanged), and how many
    tokens were dropped. Ties keep the earlier token (batch order, then position)."""
    scored = []  # (score, order, rollout index, position)
    for i, (r, a) in enumerate(zip(rollouts, advantages)):
        for t, m in enumerate(r.loss_mask):
            if m:
                scored.append((abs(a) * -r.logprobs[t], len(scored), i, t))
    if fraction >= 1.0 or not scored:
        return list(rollouts), 0
    keep = max(1, round(fraction * len(scored)))
    dropped = sorted(scored, key=lambda x: (-x[0], x[1]))[keep:]
    masks = {}
    for _, _, i, t in dropped:
        masks.setdefault(i, list(rollouts[i].loss_mask))[t] = 0
    out = [replace(r, loss_mask=masks[i]) if i in masks else r for i, r in enumerate(rollouts)]
    return out, len(dropped)


def downsample(groups: list[Group], advantages: list[float], cfg, step: int) -> tuple[list[Rollout], list[float], dict]:
    """The rollouts and advantages to train on after both levels, and the step's metrics (with
    `kept_samples`: each group's kept samples, by index). `advantages` are the flattened
    per-rollout advantages of `groups` (group order)."""
    rollouts, advs, kept, at = [], [], [], 0
    for g in groups:
        own = advantages[at:at + len(g.rollouts)]
        at += len(g.rollouts)
        idx = max_variance_subset(own, cfg.keep) if cfg.keep else list(range(len(g.rollouts)))
        rollouts += [g.rollouts[i] for i in idx]
        advs += [own[i] for i in idx]
        kept.append(idx)
    if at != len(advantages):
        raise ValueError(f"{len(advantages)} advantages for {at} rollouts")
    fraction = token_fraction_at(cfg, step)
    trained = sum(sum(r.loss_mask) for r in rollouts)
    rollouts, dropped = top_tokens(rollouts, advs, fraction)
    return rollouts, advs, {
        "downsample/samples_kept": len(rollouts), "downsample/samples_generated": at,
        "downsample/token_fraction": fraction, "downsample/tokens_kept": trained - dropped,
        "kept_samples": kept,  # each group's kept samples (not a metric: the ledger's record of what trained)
    }
