"""`data`: where prompts come from and how they are read."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field

from rollover.config.base import NonEmptyStr, Section


def _template_kwargs(kwargs: dict) -> dict:
    """Template variables only: the arguments of `apply_chat_template` that are not (the
    template itself, how it tokenizes and what it returns) are rollover's to set."""
    reserved = sorted(set(kwargs) & {"conversation", "messages", "tokenize", "add_generation_prompt", "return_dict",
                                     "continue_final_message", "return_tensors", "chat_template", "padding",
                                     "truncation", "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs"})
    if reserved:
        raise ValueError(f"{reserved} are arguments of apply_chat_template that rollover sets itself, not template "
                         "variables (a chat template of your own goes in the model's tokenizer_config.json or "
                         "chat_template.jinja)")
    return kwargs


def _names(value):
    """A mapping's keys as strings where YAML read a year (2024) as a number."""
    if isinstance(value, dict):
        return {str(k) if isinstance(k, int) and not isinstance(k, bool) else k: v for k, v in value.items()}
    return value


def _sources(value):
    """`data.train` / `data.eval`: a source, or several by name (a YAML year such as 2024 read as
    one), each name non-blank and without '/' (metrics and prompt ids put one after it)."""
    if value is None or isinstance(value, str):
        if value == "":
            raise ValueError("must not be empty")
        return value
    if not isinstance(value, dict) or not value:
        raise ValueError("must be a source, or a mapping of names to sources")
    named = _names(value)
    bad = [k for k in named if not isinstance(k, str) or not k.strip() or "/" in k]
    if bad:
        raise ValueError(f"set names {bad}: each must be a non-blank string without '/'")
    empty = [k for k, v in named.items() if not isinstance(v, str) or not v]
    if empty:
        raise ValueError(f"sets {empty}: each needs a source (a non-empty string)")
    return named


Sources = Annotated[str | dict[str, str], BeforeValidator(_sources)]


class DataConfig(Section):
    train: Sources = "gen:arithmetic?digits=1&n=2000"
    """Training prompts: a .jsonl or .parquet file, a `save_to_disk` directory, `hf:owner/name`
    (where a hub is reachable) or a generator `gen:NAME?option=value&...` (see docs/data_and_rewards.md);
    or several by name ({math: math.jsonl, code: code.parquet}): all of them, each prompt once an
    epoch, or mixed at `train_weights`. With env.name: `env` (tasks from the environment's own
    prompts(n, seed)) or a dataset whose rows the environment's make_group(prompt, n) reads; it
    must then be set explicitly."""
    train_weights: Annotated[dict[str, Annotated[float, Field(gt=0, allow_inf_nan=False)]] | None,
                             BeforeValidator(_names)] = None
    """With several training sources: each prompt drawn comes from a source picked in proportion
    to its weight ({math: 3, code: 1}: three math prompts for each code one, whatever the sizes);
    each source goes through its own epochs. Unset: the sources together, each prompt once an epoch."""
    eval: Sources | None = None
    """Held-out prompts (same forms as `train`), or several held-out sets by name ({gsm8k:
    gsm8k_test.jsonl, math: math500.parquet}), each reported on its own as well
    (`eval/<name>/accuracy`, ...). When unset, `eval_size` prompts are carved from the training
    data (no overlap; from each named training source its share). One unnamed source whose rows
    have two or more `data_source` values (verl's column) is reported per value too."""
    eval_size: int = Field(48, ge=0)
    """How many held-out prompts to evaluate on (of each set when `eval` names several). Carved
    from `train` when `eval` is unset: that many distinct questions, each once, and every copy of
    them left out of training."""
    prompt_key: NonEmptyStr = "prompt"
    """Column holding the prompt: a string or a list of chat messages."""
    answer_key: NonEmptyStr | None = None
    """Column holding the ground truth; by default the first of answer, solution,
    reward_model.ground_truth."""
    require_answer: bool = True
    """Every row needs an answer (a missing one is a bad row). false keeps rows without one
    (answer None), for rewards that need none: format, reward_model, judge or your own functions."""
    system_prompt: str | None = None
    """A system message prepended to every prompt."""
    instruction: str | None = None
    """Text appended to the last user message (e.g. "Put the final answer in \\boxed{}.")."""
    chat_template: bool = True
    """Render prompts with the tokenizer's chat template."""
    chat_template_kwargs: Annotated[dict[str, Any], AfterValidator(_template_kwargs)] = {}
    """Extra arguments for the chat template, for prompts and every turn of an episode (e.g.
    {enable_thinking: false} for Qwen3; TRL's chat_template_kwargs, verl's apply_chat_template_kwargs).
    A key the template never reads (a misspelling) is warned about at start-up."""
    max_prompt_tokens: int = Field(256, ge=1)
    """Prompts longer than this are rejected at start-up (with the row named)."""
    on_bad_row: Literal["raise", "skip"] = "raise"
    """A malformed row stops the run with an error naming file and row, or is skipped and counted."""
    shuffle: bool = True
    """Shuffle the training prompts every epoch (deterministic from `seed`)."""
