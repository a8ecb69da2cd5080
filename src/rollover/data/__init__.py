"""Prompts for RL: loaders (jsonl, parquet, HF datasets, generators), held-out splits,
chat-template rendering and a resumable batch iterator. See docs/data_and_rewards.md."""

from rollover.data.generators import GENERATORS, arithmetic, countdown, generate
from rollover.data.iterator import MixedIterator, PromptIterator
from rollover.data.loaders import BadRow, DataError, PromptSet, load_prompts, row_to_prompt
from rollover.data.render import BOXED_INSTRUCTION, render_media_prompt, render_messages, render_prompt
from rollover.data.split import content_key, distinct_questions, split_holdout

__all__ = [
    "BOXED_INSTRUCTION",
    "GENERATORS",
    "BadRow",
    "DataError",
    "MixedIterator",
    "PromptIterator",
    "PromptSet",
    "arithmetic",
    "countdown",
    "generate",
    "load_prompts",
    "render_media_prompt",
    "render_messages",
    "render_prompt",
    "row_to_prompt",
    "content_key",
    "distinct_questions",
    "split_holdout",
]
