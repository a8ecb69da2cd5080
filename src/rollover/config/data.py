"""`data`: where prompts come from and how they are read."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from rollover.config.base import NonEmptyStr, Section


def _set_names(sets):
    """`data.eval`'s set names: strings (a YAML year such as 2024 read as one), without '/'
    (metrics and prompt ids put one after the name) and not blank."""
    if not isinstance(sets, dict):
        return sets
    names = {str(k) if isinstance(k, int) and not isinstance(k, bool) else k: v for k, v in sets.items()}
    bad = [k for k in names if not isinstance(k, str) or not k.strip() or "/" in k]
    if bad:
        raise ValueError(f"held-out set names {bad}: each must be a non-blank string without '/'")
    return names


class DataConfig(Section):
    train: NonEmptyStr = "gen:arithmetic?digits=1&n=2000"
    """Training prompts: a .jsonl or .parquet file, a `save_to_disk` directory, `hf:owner/name`
    (where a hub is reachable) or a generator `gen:NAME?option=value&...` (see docs/data_and_rewards.md).
    With env.name: `env` (tasks from the environment's own prompts(n, seed)) or a dataset whose
    rows the environment's make_group(prompt, n) reads; it must then be set explicitly."""
    eval: NonEmptyStr | Annotated[dict[str, NonEmptyStr], BeforeValidator(_set_names), Field(min_length=1)] | None = None
    """Held-out prompts (same forms as `train`), or several held-out sets by name ({gsm8k:
    gsm8k_test.jsonl, math: math500.parquet}), each reported on its own as well
    (`eval/<name>/accuracy`, ...). When unset, `eval_size` prompts are carved from the training
    data (no overlap). Rows with a `data_source` column (verl's) are reported per source too."""
    eval_size: int = Field(48, ge=0)
    """How many held-out prompts to evaluate on (carved from `train` when `eval` is unset; of
    each set when `eval` names several)."""
    prompt_key: NonEmptyStr = "prompt"
    """Column holding the prompt: a string or a list of chat messages."""
    answer_key: NonEmptyStr | None = None
    """Column holding the ground truth; by default the first of answer, solution,
    reward_model.ground_truth."""
    system_prompt: str | None = None
    """A system message prepended to every prompt."""
    instruction: str | None = None
    """Text appended to the last user message (e.g. "Put the final answer in \\boxed{}.")."""
    chat_template: bool = True
    """Render prompts with the tokenizer's chat template."""
    chat_template_kwargs: dict[str, Any] = {}
    """Extra arguments for the chat template, for prompts and every turn of an episode (e.g.
    {enable_thinking: false} for Qwen3; TRL's chat_template_kwargs, verl's apply_chat_template_kwargs)."""
    max_prompt_tokens: int = Field(256, ge=1)
    """Prompts longer than this are rejected at start-up (with the row named)."""
    on_bad_row: Literal["raise", "skip"] = "raise"
    """A malformed row stops the run with an error naming file and row, or is skipped and counted."""
    shuffle: bool = True
    """Shuffle the training prompts every epoch (deterministic from `seed`)."""
