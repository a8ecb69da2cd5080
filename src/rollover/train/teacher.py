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
