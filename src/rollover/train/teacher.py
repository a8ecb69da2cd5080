"""`distill.teacher`: the frozen model on-policy distillation asks, for every token the policy
sampled, how likely it would have written it (`rollover.algos.distill` turns the answers into
each token's advantage)."""

from __future__ import annotations


import torch


def teacher_model(name: str, config=None, dtype: str = "float32"):
    """The teacher (a causal LM) in `dtype`, frozen and in evaluation mode. `config`: the checkpoint's
    config, to build only its structure on the meta device (a sharded rank that takes rank 0's
    tensors). A checkpoint that lacks some of the model's weights is refused: they would be
    random."""
    from transformers import AutoModelForCausalLM

    from rollover.models import resolve_model

    if config is not None:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    else:
        from rollover.train.beside import load_whole

        model = load_whole(AutoModelForCausalLM, resolve_model(name), f"distill.teacher={name!r}", "the model's",
                           "would be random", dtype=getattr(torch, dtype))
    return model.eval().requires_grad_(False)


def check_teacher_model(name: str, tokenizer, policy_config, longest: int, *, sequence_parallel: int = 1) -> None:
    """ValueError unless `name` can teach this policy: a causal LM that reads the policy's tokens
    (`rollover.train.beside.check_reads_policy_tokens`)."""
    from rollover.train.beside import check_reads_policy_tokens

    where = f"distill.teacher={name!r}"
    config = check_reads_policy_tokens(name, where, "the teacher", tokenizer, policy_config, longest,
                                       sequence_parallel=sequence_parallel)
    if not any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in (config.architectures or ["ForCausalLM"])):
        raise ValueError(f"{where} is a {', '.join(config.architectures)}: the teacher gives each token a "
                         "probability, so it must be a causal LM")


class Distillation:
    """The trainer's teacher half (`rollover.train.trainer.Trainer` sets `cfg`, `teacher` and the
    forward's `_base`, `_trunk`, `_fitting`, `logprobs`, `_sum`). `distill.loss: sampled` scores
    the step's tokens in one no-grad pass and moves their advantages; `jsd` hands each update's
    micro-batches the teacher's view of them (`_teacher_view`), and the forward adds the
    divergence of whole next-token distributions to the loss."""

    def _teacher_network(self, config=None):
        """distill.teacher's model (with its `config`: only its structure, on the meta device)."""
        return teacher_model(self.cfg.distill.teacher, config=config, dtype=self.cfg.distill.dtype)

    @property
    def teacher_jsd(self) -> bool:
        return self.teacher is not None and self.cfg.distill.loss == "jsd"

    def _teacher_batch(self, batch):
        """The step's batch as the update trains it, and the step's distillation metrics: the
        advantages moved by the sampled term (distill.loss=sampled), or scaled by
        `outcome_weight` (jsd: the teacher's divergence joins the loss in each update)."""
        from dataclasses import replace

        d = self.cfg.distill
        if d.loss == "sampled":
            return self._with_teacher(batch, self._fitting(self.logprobs, batch, self.teacher))
        if d.outcome_weight == 1.0:
            return batch, {}
        adv_BT = None if batch.adv_BT is None else batch.adv_BT * d.outcome_weight
        return replace(batch, adv_B=batch.adv_B * d.outcome_weight, adv_BT=adv_BT), {}

    def _with_teacher(self, batch, teacher_BT: torch.Tensor):
        """The batch with each loss token's advantage moved by the teacher's term
        (`rollover.algos.distill.teacher_advantages`), and the step's mean reverse KL to the
        teacher over its loss tokens (summed over the ranks)."""
        from dataclasses import replace

        from rollover.algos.distill import teacher_advantages

        d, mask = self.cfg.distill, batch.mask_BT
        adv_BT = batch.adv_B[:, None].expand(mask.shape) if batch.adv_BT is None else batch.adv_BT
        adv_BT, kl_BT = teacher_advantages(adv_BT.float(), mask, batch.behav_logp_BT, teacher_BT.cpu().float(),
                                           weight=d.weight, outcome_weight=d.outcome_weight)
        total, count = self._sum(torch.tensor([float(kl_BT.sum()), float(mask.sum())], dtype=torch.float64)).tolist()
        # a step with no loss token (all truncated or stale, masked) has no KL to report, not 0
        return replace(batch, adv_BT=adv_BT), {"distill/reverse_kl": total / count} if count else {}

    @torch.no_grad()
    def _teacher_view(self, mb):
        """distill.loss=jsd: the teacher's output head and its hidden states [N, H] before the
        micro-batch's response tokens (the policy's selection), for the forward's chunks."""
        from rollover.train.heads import LogitHead

        base = self._base(self.teacher)
        hidden, _ = self._trunk(self.teacher, base, mb)
        return LogitHead(base), hidden
