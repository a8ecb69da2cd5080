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
    cfg = LoraConfig(
        r=int(lora.get("r", 16)),
        lora_alpha=int(lora.get("alpha", 32)),
        lora_dropout=float(lora.get("dropout", 0.0)),
        target_modules=lora.get("target_modules", "all-linear"),
        task_type=task_type,
    )
    return get_peft_model(model, cfg)
