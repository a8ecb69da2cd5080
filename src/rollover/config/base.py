"""The base of every config section, the config error, and the field types several sections share."""

from __future__ import annotations

import difflib
import types
import typing
import math
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator


class ConfigError(ValueError):
    """A config that cannot run; the message names the key."""


def _numeric(annotation: Any) -> bool:
    """int or float (optionally | None): pydantic would quietly read true/false as 1/0."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else (annotation,)
    args = [typing.get_args(a)[0] if typing.get_origin(a) is Annotated else a for a in args if a is not type(None)]
    return bool(args) and all(a in (int, float) for a in args)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            problems = []  # every one of the section's, not only the first
            for key in data:
                if key not in cls.model_fields:
                    names = ["async" if n == "async_" else n for n in cls.model_fields]
                    close = difflib.get_close_matches(str(key), names, n=2, cutoff=0.5)
                    # a second guess only when nearly as close ('modle': mode or model; 'devce': not env)
                    close = close[:1] + [c for c in close[1:] if difflib.SequenceMatcher(None, str(key), c).ratio() >= 0.75]
                    hint = f"did you mean {' or '.join(map(repr, close))}?" if close else f"known keys: {', '.join(names)}"
                    if key in FOREIGN_KEYS:  # a nearly equal key of this section may be what was meant: both
                        system, ours = FOREIGN_KEYS[key]
                        foreign = f"{key} is {system}'s name for rollover's {ours}"
                        close = [c for c in close if difflib.SequenceMatcher(None, str(key), c).ratio() >= 0.75]
                        hint = f"did you mean {close[0]!r}? ({foreign})" if close else foreign
                    problems.append(f"unknown key {key!r}; {hint}")
                elif isinstance(data[key], bool) and _numeric(cls.model_fields[key].annotation):
                    problems.append(f"{key}={str(data[key]).lower()}: must be a number, not true/false")
            if problems:
                raise ValueError("; ".join(problems))
        return data


# Settings a TRL, verl or AReaL user writes first, with the rollover key that does the same (the whole
# table: docs/migrating.md).
FOREIGN_KEYS = {
    "learning_rate": ("TRL", "train.lr"), "num_generations": ("TRL", "rollout.samples_per_prompt"),
    "max_completion_length": ("TRL", "rollout.max_new_tokens"), "beta": ("TRL", "algorithm.kl_coef"),
    "epsilon": ("TRL", "algorithm.eps_low"), "epsilon_high": ("TRL", "algorithm.eps_high"),
    "loss_type": ("TRL", "algorithm.aggregation (or algorithm.loss)"), "max_steps": ("TRL", "steps"),
    "num_train_epochs": ("TRL", "epochs"), "output_dir": ("TRL", "run_dir"),
    "per_device_train_batch_size": ("TRL", "rollout.prompts_per_step"), "use_vllm": ("TRL", "rollout.engine: vllm"),
    "model_name_or_path": ("TRL", "model"), "save_steps": ("TRL", "checkpoint.every"),
    "total_training_steps": ("verl", "steps"), "total_epochs": ("verl", "epochs"),
    "adv_estimator": ("verl", "algorithm.advantage"), "kl_loss_coef": ("verl", "algorithm.kl_coef"),
    "clip_ratio_low": ("verl", "algorithm.eps_low"), "clip_ratio_high": ("verl", "algorithm.eps_high"),
    "loss_agg_mode": ("verl", "algorithm.aggregation"), "ppo_epochs": ("verl", "train.ppo_epochs"),
    "max_response_length": ("verl", "rollout.max_new_tokens"), "max_prompt_length": ("verl", "data.max_prompt_tokens"),
    "train_batch_size": ("verl", "rollout.prompts_per_step"),
    "max_grad_norm": ("TRL", "train.grad_clip"), "num_iterations": ("TRL", "train.ppo_epochs"),
    "scale_rewards": ("TRL", "algorithm.advantage (grpo, drgrpo or grpo_batch_std)"),
    "importance_sampling_level": ("TRL", "algorithm.loss: gspo"),
    "mask_truncated_completions": ("TRL", "algorithm.mask_truncated"), "warmup_ratio": ("TRL", "train.warmup_steps"),
    "use_kl_loss": ("verl", "algorithm.kl_coef (0 is off)"), "kl_loss_type": ("verl", "algorithm.kl_estimator"),
    "clip_ratio": ("verl", "algorithm.eps_low and algorithm.eps_high"), "clip_ratio_c": ("verl", "algorithm.dual_clip"),
    "filter_groups": ("verl", "algorithm.dynamic_sampling"),
    "norm_adv_by_std_in_grpo": ("verl", "algorithm.advantage (false: drgrpo)"),
    "lr_warmup_steps": ("verl", "train.warmup_steps"), "max_num_gen_batches": ("verl", "algorithm.max_resample_rounds"),
    "max_head_offpolicyness": ("AReaL", "async.max_staleness"), "eps_clip": ("AReaL", "algorithm.eps_low"),
    "eps_clip_higher": ("AReaL", "algorithm.eps_high"), "c_clip": ("AReaL", "algorithm.dual_clip"),
    "use_decoupled_loss": ("AReaL", "algorithm.loss: decoupled_ppo"),
    "behav_imp_weight_cap": ("AReaL", "algorithm.loss_options.is_cap (with decoupled_ppo)"),
    "kl_ctl": ("AReaL", "algorithm.kl_coef"), "mask_no_eos_with_zero": ("AReaL", "algorithm.mask_truncated"),
    "m2_threshold": ("AReaL", "algorithm.m2po_tau"),
}


def _reward_spec(spec: Any) -> Any:
    """A `reward.functions` entry: a non-empty name, or a mapping {fn, weight, kwargs, name,
    isolate, reasoning} whose weight is a finite number (returned as a float)."""
    if isinstance(spec, str):
        if not spec.strip():
            raise ValueError("a reward name must not be empty")
        return spec
    if callable(spec):
        name = getattr(spec, "__name__", "function")
        raise ValueError(f"a function object ({name}) cannot be written into a config: name it by reference, "
                         f"'module:{name}' or 'path/to/file.py:{name}' ('__main__:{name}' for one defined in the "
                         "running script)")
    if not isinstance(spec, dict):
        raise ValueError("must be a reward name or a mapping {fn, weight, kwargs, name, isolate, reasoning}")
    unknown = sorted(set(spec) - {"fn", "weight", "kwargs", "name", "isolate", "reasoning"})
    if unknown:
        raise ValueError(f"unknown keys {unknown} (known: fn, weight, kwargs, name, isolate, reasoning)")
    if spec.get("reasoning", "keep") not in ("keep", "drop"):
        raise ValueError(f"reasoning={spec['reasoning']!r}: must be keep (the whole completion) or drop (what follows "
                         "the model's </think>)")
    if spec.get("isolate") is not None and not isinstance(spec["isolate"], bool):
        raise ValueError(f"isolate={spec['isolate']!r}: must be true or false (run in a killable worker process)")
    if not isinstance(spec.get("fn"), str) or not spec["fn"].strip():
        raise ValueError(f"needs `fn`, a reward name, got {spec.get('fn')!r}")
    weight = spec.get("weight", 1.0)
    if isinstance(weight, str):
        try:
            weight = float(weight)
        except ValueError:
            raise ValueError(f"weight={spec['weight']!r}: must be a number") from None
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
        raise ValueError(f"weight={spec.get('weight')!r}: must be a finite number")
    if not isinstance(spec.get("kwargs", {}), dict):
        raise ValueError(f"kwargs={spec['kwargs']!r}: must be a mapping")
    if spec.get("name") is not None and not isinstance(spec["name"], str):
        raise ValueError(f"name={spec['name']!r}: must be a string")
    return {**spec, "weight": float(weight)}


def _lora(lora: dict[str, Any] | None) -> dict[str, Any] | None:
    """`train.lora`: known keys only, r and alpha >= 1, dropout in [0, 1)."""
    if lora is None:
        return None
    unknown = sorted(set(lora) - {"r", "alpha", "dropout", "target_modules"})
    if unknown:
        raise ValueError(f"unknown keys {unknown} (known: r, alpha, dropout, target_modules)")
    for key in ("r", "alpha"):
        if key in lora and (isinstance(lora[key], bool) or not isinstance(lora[key], int) or lora[key] < 1):
            raise ValueError(f"{key}={lora[key]!r}: must be an integer >= 1")
    dropout = lora.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise ValueError(f"dropout={dropout!r}: must be a number in [0, 1)")
    targets = lora.get("target_modules", "all-linear")
    if isinstance(targets, str):  # all-linear, or a regular expression peft matches against whole module paths
        if targets.isidentifier() and targets.lower() != "all-linear":
            raise ValueError(f"target_modules={targets!r}: text is a regular expression that peft matches against "
                             f"whole module paths (model.layers.0.self_attn.q_proj); for the modules of that name "
                             f"give a list: [{targets}]")
    elif not isinstance(targets, list | tuple) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"target_modules={targets!r}: must be all-linear, a list of module names ([q_proj, v_proj]) "
                         "or a regular expression")
    return lora


def lora_settings(lora: dict[str, Any]) -> dict[str, Any]:
    """`train.lora` with the defaults filled in and its targets in name order: the same for two
    configs that make the same adapter."""
    out = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear", **lora}
    targets = out["target_modules"]
    out["target_modules"] = sorted(targets) if isinstance(targets, list | tuple) else targets
    return out


NonEmptyStr = Annotated[str, Field(min_length=1)]


RewardSpecEntry = Annotated[Any, AfterValidator(_reward_spec)]


Beta = Annotated[float, Field(ge=0, lt=1)]
