"""LoRA adapters on the policy (`train.lora`), through peft."""

from __future__ import annotations


def apply_lora(model, lora: dict, task_type: str = "CAUSAL_LM"):
    """Wrap a model with peft LoRA adapters from the config mapping (`task_type`
    FEATURE_EXTRACTION for a trunk without its LM head: the critic's)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("train.lora needs peft: pip install 'rollover[lora]'") from e
    known = {"r", "alpha", "dropout", "target_modules"}
    unknown = set(lora) - known
    if unknown:
        raise ValueError(f"train.lora: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    _check_targets(model, lora.get("target_modules", "all-linear"))
    cfg = LoraConfig(
        r=int(lora.get("r", 16)),
        lora_alpha=int(lora.get("alpha", 32)),
        lora_dropout=float(lora.get("dropout", 0.0)),
        target_modules=lora.get("target_modules", "all-linear"),
        task_type=task_type,
    )
    tied = _tied_embeddings(model)
    wrapped = get_peft_model(model, cfg)
    # a regular expression names modules only as peft matches them: what it adapted is checked
    adapted = sorted(n for n, m in wrapped.named_modules() if any(getattr(m, "base_layer", None) is e for e in tied))
    if adapted:
        raise ValueError(f"train.lora.target_modules: {lora['target_modules']!r} adapts {', '.join(adapted)}, "
                         f"{_TIED_WHY}")
    return wrapped


_TIED_WHY = ("one of the input embedding and output head this model ties (tie_word_embeddings): a merged adapter "
             "would change both while training changes one; adapt the attention and MLP projections instead")


def _tied_embeddings(model) -> list:
    """The input embedding and output head of a model that ties them (none otherwise)."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return []
    return [m for m in (model.get_input_embeddings(), getattr(model, "get_output_embeddings", lambda: None)())
            if m is not None]


def _check_targets(model, targets) -> None:
    """Each named target adapts some module (peft drops a misspelt one beside a valid one without
    a word), and none is an embedding the model ties to its head: merging writes the delta into
    the one shared matrix, input and output both, while peft's forward, which trains, adds it to
    one of them; the sampler and the trainer would be two models."""
    if not isinstance(targets, (list, tuple)):  # "all-linear" or a regular expression: peft's to match
        return
    names = [n for n, _ in model.named_modules() if n]

    def matches(target: str) -> list[str]:
        return [n for n in names if n == target or n.endswith("." + target)]

    missing = [t for t in targets if not matches(t)]
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if n and not list(m.children())})
        raise ValueError(f"train.lora.target_modules: {', '.join(map(repr, missing))} names no module of this model; "
                         f"its modules' names end in: {', '.join(leaves)}")
    emb = _tied_embeddings(model)
    tied = [t for t in targets for n in matches(t) if any(model.get_submodule(n) is m for m in emb)]
    if tied:
        raise ValueError(f"train.lora.target_modules: {', '.join(map(repr, sorted(set(tied))))} is {_TIED_WHY}")
