"""Dropout off while training (`train.disable_dropout`): the sampler has none, so a trainer with
it would not compute the sampler's logprobs."""

from __future__ import annotations

import copy

import torch


def disable_dropout(model: torch.nn.Module) -> list[str]:
    """Every dropout rate in `model` set to 0: dropout layers, the rates modules keep as numbers
    (transformers' attention reads `self.attention_dropout` while training), and the rates some
    architectures read from their config in the forward (Persimmon; the flash-attention classes
    of GPT-Neo, GPT-J, Falcon): their inner modules get a copy of the config with the rates at 0,
    while the model's own config, the one `save_pretrained` writes, keeps them, so a checkpoint
    or an exported model has the rates it came with. Returns what was nonzero, as `name=rate`
    with repeated names counted once."""
    zeroed: dict[str, float] = {}
    top = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(top, "config", None)
    rates = {k: v for k, v in vars(config).items() if _is_rate(k, v) and v} if config is not None else {}
    if rates:
        quiet = copy.copy(config)
        for name in rates:
            setattr(quiet, name, 0.0)
        for module in model.modules():
            if module is not model and module is not top and getattr(module, "config", None) is config:
                module.config = quiet
        zeroed.update({f"config.{k}": v for k, v in rates.items()})
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            if module.p:
                zeroed.setdefault(type(module).__name__, module.p)
            module.p = 0.0
            continue
        for name, value in vars(module).items():
            if _is_rate(name, value):
                if value:
                    zeroed.setdefault(name, value)
                setattr(module, name, 0.0)
    return [f"{name}={rate:g}" for name, rate in zeroed.items()]


def _is_rate(name: str, value) -> bool:
    return ("dropout" in name or name.endswith("pdrop")) and isinstance(value, float)
