"""A config's policy-loss options: what `policy_loss` is called with (`loss_options`), whether
they are ones the loss takes (`check_loss_options`, `loss_option_names`), whether the trainer
needs every token's old logprob before an update (`old_logprobs_first`), and what the plain
policy gradient or BAPO leaves uncorrected in a run (`loss_caveats`)."""

from __future__ import annotations

import inspect

import torch

from rollover.algos.offpolicy import off_policy_correction
from rollover.algos.policy import POLICY_LOSSES, policy_loss


def loss_options(algorithm) -> dict:
    """`policy_loss` keyword arguments from a config's algorithm section (its `loss_options`
    first, then the named keys: clip bounds, dual clip, TIS, M2PO)."""
    a = algorithm
    opts = dict(a.loss_options)
    if a.loss not in ("bapo", "sapo", "vespo", "reinforce"):  # BAPO finds its bounds; SAPO, VESPO, REINFORCE clip nothing
        opts.setdefault("eps_low", a.eps_low)
        opts.setdefault("eps_high", a.eps_high)
    if a.dual_clip is not None:
        opts.setdefault("dual_clip", a.dual_clip)
    if a.tis_cap is not None:
        opts.setdefault("is_level", "token")
        opts.setdefault("is_mode", "truncate")
        opts.setdefault("is_cap", a.tis_cap)
    if a.m2po_tau is not None:
        opts.setdefault("m2po_tau", a.m2po_tau)
    return opts


def old_logprobs_first(loss: str, opts: dict) -> bool:
    """Whether a trainer records every token's π_old before an update's passes even with one
    update per step: M2PO's mask is cut over the update's `(old - behav)²`, and BAPO's bounds are
    chosen over the update's loss tokens, which importance sampling in mask mode picks by
    `old - behav` (with one update and no mask, BAPO's ratios are 1 and need no pass)."""
    if opts.get("m2po_tau") is not None:
        return True
    return loss == "bapo" and opts.get("is_level") is not None and opts.get("is_mode", "truncate") == "mask"


def loss_caveats(cfg) -> list[str]:
    """What a run's policy loss leaves uncorrected in run `cfg`, for a warning. `reinforce` (no
    ratio): several updates a step (the later ones train on samples of an earlier policy, which
    no ratio corrects), and APRIL or async mode without importance weights (stale samples).
    `bapo`: its ratio is to the weights the update starts from, recomputed (as the authors' verl
    recipe does), so in APRIL or async mode without importance weights the samples of older
    weights are clipped and weighed as if their sampler were the current policy."""
    a, t = cfg.algorithm, cfg.train
    if a.loss == "sapo" and a.aggregation != "seq-mean-token-mean":
        return [f"algorithm.loss=sapo with aggregation={a.aggregation}: SAPO's paper, TRL and verl aggregate it "
                "seq-mean-token-mean; set algorithm.aggregation=seq-mean-token-mean to train as they do"]
    if a.loss not in ("reinforce", "bapo"):
        return []
    if a.loss == "reinforce" and cfg.distill.teacher is not None and cfg.distill.outcome_weight == 0:
        return []  # (the teacher alone: the policy term has no advantage to weigh)
    out = []
    updates = t.ppo_epochs * t.mini_batches
    if a.loss == "reinforce" and updates > 1:
        out.append(f"algorithm.loss=reinforce with {updates} updates a step (train.ppo_epochs x train.mini_batches): "
                   "the updates after the first follow the gradient of a policy already moved, with no ratio to "
                   "correct or clip it; use ppo for several updates")
    stale = _stale_samples(cfg)
    if stale and loss_options(a).get("is_level") is None:
        if a.loss == "reinforce":
            out.append(f"algorithm.loss=reinforce in {stale} trains samples of older policies without importance "
                       "weights: set algorithm.tis_cap (e.g. 2.0) to weight each token by its sampler's ratio")
        else:
            out.append(f"algorithm.loss=bapo in {stale}: BAPO's ratio is to the weights each update starts from "
                       "(recomputed), not to the older weights that sampled a stale token, so those tokens get no "
                       "correction of their own; set algorithm.tis_cap (e.g. 2.0) to weight each token by its "
                       "sampler's ratio")
    return out


def _stale_samples(cfg) -> str | None:
    """Where tokens of older policies reach the loss in run `cfg` ("async mode", "APRIL"), or None."""
    p = cfg.partial_rollout
    if cfg.mode == "async" and cfg.async_.max_staleness > 0:
        return "async mode"
    if p.enabled and not (p.max_carry_steps == 0 and p.on_stale == "mask"):
        return "APRIL"
    return None


def check_loss_options(algorithm) -> str | None:
    """None when the loss takes the section's options, else what is wrong with them: the loss
    runs once on a one-token batch, so an unknown key or a bad value is found before training."""
    if algorithm.loss == "bapo" and "bounds" in algorithm.loss_options:
        return ("bapo's bounds are chosen by the trainer, once per update over all its loss tokens; "
                "steer the search with low_start, low_max, high_start, high_max, step, target_pos_share")
    B = torch.zeros((1, 1))
    opts = loss_options(algorithm)
    known = loss_option_names(algorithm.loss)
    unknown = [k for k in opts if k not in known]
    if unknown:
        return f"unknown option {', '.join(map(repr, unknown))}; {algorithm.loss} takes {', '.join(known)}"
    try:
        policy_loss(algorithm.loss, B, B, torch.zeros(1), torch.ones((1, 1), dtype=torch.bool), B.clone(), **opts)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def loss_option_names(name: str) -> list[str]:
    """The options a policy loss takes: its own, and the off-policy corrections every loss takes
    through `**correction`."""
    params = list(inspect.signature(POLICY_LOSSES[name]).parameters.values())
    own = [p.name for p in params if p.kind == p.KEYWORD_ONLY]
    if any(p.kind == p.VAR_KEYWORD for p in params):
        own += [p.name for p in inspect.signature(off_policy_correction).parameters.values()
                if p.kind == p.KEYWORD_ONLY]
    return own
