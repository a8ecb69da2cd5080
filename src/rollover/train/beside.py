"""Models beside the policy that read its token ids: the critic's checkpoint (`critic.model`)
and on-policy distillation's teacher (`distill.teacher`).

Both are run by the trainer over the policy's packed micro-batches, so what they must be is the
same: a text model whose tokenizer gives every policy token the same id, whose embedding covers
the policy's tokenizer, whose context holds the run's sequences, of a family the policy's
packing suits, with heads that split over `train.sequence_parallel`.
"""

from __future__ import annotations


def load_whole(cls, path: str, where: str, whose: str, then: str, dtype=None):
    """`cls.from_pretrained(path)` in `dtype` (float32 by default), with transformers' load report quiet (a causal LM's
    head going unused is expected when its trunk is taken); a ValueError starting with `where`
    when the checkpoint lacks some of `whose` weights, which `then` ("would be random")."""
    import logging

    import torch

    report = logging.getLogger("transformers.modeling_utils")
    level = report.level
    report.setLevel(logging.ERROR)
    try:
        model, info = cls.from_pretrained(path, dtype=dtype or torch.float32, output_loading_info=True)
    except Exception as e:  # noqa: BLE001 - no weight file, a truncated one: said with the key that named it
        raise ValueError(f"{where}: its weights do not load ({type(e).__name__}: {e})") from e
    finally:
        report.setLevel(level)
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise ValueError(f"{where}: the checkpoint lacks {len(missing)} of {whose} weights (e.g. {missing[0]}), "
                         f"which {then}")
    return model


def check_reads_policy_tokens(name: str, where: str, role: str, tokenizer, policy_config, longest: int, *,
                              sequence_parallel: int = 1):
    """The config of checkpoint `name`, or a ValueError that starts with `where` (the config key
    and value) and says why `role` ("the critic", "the teacher") cannot read the policy's tokens
    from it. A hub id's files are fetched here, so that the ranks do not wait on rank 0's
    download."""
    from pathlib import Path

    from transformers import AutoConfig

    from rollover.engine.hf_runner import fast_path, unserved
    from rollover.models import is_vision_language, load_tokenizer, resolve_model, text_config

    if (Path(name) / "checkpoints").is_dir() and not (Path(name) / "config.json").is_file():
        raise ValueError(f"{where} is a rollover run directory, not a model: give one of its checkpoints' model/ "
                         f"directory, or export it first (rollover export {name} DIR; a LoRA run's adapter is merged)")
    try:
        path = resolve_model(name)
        config = AutoConfig.from_pretrained(path)
        theirs = load_tokenizer(name)
        if not Path(path).is_dir():
            from huggingface_hub import snapshot_download

            snapshot_download(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: not a model with a tokenizer ({type(e).__name__}: {e})") from None
    if is_vision_language(config) or is_vision_language(policy_config):
        raise ValueError(f"{where}: {role} from another checkpoint than the policy's is text-only: not with a "
                         "vision-language model")
    mine, other = tokenizer.get_vocab(), theirs.get_vocab()
    odd = sorted(((t, i) for t, i in mine.items() if other.get(t) != i), key=lambda kv: kv[1])
    if odd:
        token = odd[0][0]
        raise ValueError(f"{where} has another tokenizer than the policy's (token {token!r} is {mine[token]} in the "
                         f"policy's, {other.get(token)} in {role}'s): {role} reads the policy's tokens")
    vocab, sampled = text_config(config).vocab_size, text_config(policy_config).vocab_size
    if vocab < len(tokenizer):
        raise ValueError(f"{where} embeds {vocab} tokens, fewer than the policy's tokenizer's {len(tokenizer)}")
    if vocab < sampled:  # the engine samples from every row of the policy's head, named tokens or not
        raise ValueError(f"{where} embeds {vocab} tokens, fewer than the {sampled} the policy's head can sample "
                         f"(ids {vocab}-{sampled - 1} have no row in {role}'s embedding)")
    ctx = getattr(config, "max_position_embeddings", None)
    if ctx is not None and ctx < longest:
        raise ValueError(f"{where} has a context of {ctx} tokens; the run's sequences reach {longest}")
    if not fast_path(config, longest) and (fast_path(policy_config, longest)
                                           or config.model_type != policy_config.model_type):
        extra = unserved(config)
        raise ValueError(f"{where} is a {config.model_type} model{' with ' + ', '.join(extra) if extra else ''}: "
                         f"{role} must be of the Llama, Mistral or Qwen families (SiLU, no o_proj or MLP biases), "
                         f"or of the policy's own kind ({policy_config.model_type}); the policy's packing of "
                         "sequences into rows is made for those")
    if sequence_parallel > 1:
        from rollover.train.ulysses import check

        try:
            check(text_config(config), sequence_parallel)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return config
