"""A learned reward model as a reward function (`reward_model`, a built-in).

    reward:
      functions:
        - {fn: reward_model, kwargs: {path: my-reward-model/}}

The model is a transformers sequence classifier with one label (`AutoModelForSequenceClassification`,
e.g. a Skywork reward model); its logit is the score. What it reads (`template`):

- `auto` (the default): with a chat template in the reward model's tokenizer, the conversation:
  the prompt's messages (a text prompt as one user message) and the completion as the
  assistant's, in the reward model's own template (not the policy's); without one, `text`. A
  prompt ending in an assistant message (a prefill) and its completion are one assistant turn.
- `chat`: the conversation, and a tokenizer without a template is an error.
- `text`: the prompt's text (messages joined by newlines) followed by the completion, with the
  tokenizer's own special tokens.

TRL scores a conversational prompt the same way; a text prompt it joins as text (`template:
text` here), where `auto` makes it a conversation, as rollover's renderer does for the policy
when `data.chat_template` is on.

Batches are padded on the right and read where the classifier reads a sample alone: at its
last token, or, when the model's config names a padding id, at its last token that is not that
id (transformers' rule, which also skips an end token equal to it).

Departures: a sample longer than `max_length` tokens (default the model's and its tokenizer's
context) keeps its leading special tokens (a BOS or CLS the model reads) and its last tokens,
where the answer is, and is reported in the extras as `reward_model/truncated` rather than
failing (TRL does not truncate). dtype `auto` is float32 on a CPU and bfloat16 on a GPU.

Where it loads: once per process, when the reward is built where it runs (the driver's process
by default, at the run's start, so a wrong path fails there and no call's timeout pays for the
load; each worker process with `isolate: true`, each Ray reward worker with
`ray.reward_workers`, on the GPU `ray.gpus_per_reward_worker` gives it, else on its CPU). The
driver only checks the arguments when the model runs elsewhere. Calls from several threads take
turns on one model.
"""

from __future__ import annotations

import threading
from pathlib import Path

from rollover.types import prefilled

_LOCK = threading.Lock()
_SCORERS: dict[tuple, _Scorer] = {}
KWARGS = ("path", "batch_size", "max_length", "device", "dtype", "template")


def reward_model(prompts: list, completions: list[str], *, path: str, batch_size: int = 8,
                 max_length: int | None = None, device: str = "auto", dtype: str = "auto",
                 template: str = "auto") -> list[dict]:
    """Scores of `completions` (after `prompts`) by the sequence classifier at `path`, one dict
    per sample: `score` and `truncated` (1.0 where the sample was cut to `max_length`)."""
    return _scorer(path, device, dtype, template).score(prompts, completions, batch_size, max_length)


def _prepare(load: bool = True, **kwargs) -> dict:
    """The bound arguments checked, `path` made absolute where it is a local directory (so a
    worker elsewhere reads the same one), and the model loaded when `load`; returns the
    arguments to bind (`rollover.rewards.registry.prepare`)."""
    unknown = sorted(set(kwargs) - set(KWARGS))
    if unknown:
        raise ValueError(f"unknown kwargs {unknown} (known: {', '.join(KWARGS)})")
    if "path" not in kwargs:
        raise ValueError("kwargs.path is required: the reward model's directory (or hub id)")
    batch_size, max_length = kwargs.get("batch_size", 8), kwargs.get("max_length")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: must be an integer >= 1")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2):
        raise ValueError(f"max_length={max_length!r}: must be an integer >= 2")
    if kwargs.get("template", "auto") not in ("auto", "chat", "text"):
        raise ValueError(f"template={kwargs['template']!r}: expected auto, chat or text")
    if kwargs.get("dtype", "auto") not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={kwargs['dtype']!r}: expected auto, float32, bfloat16 or float16")
    local = Path(str(kwargs["path"])).expanduser()
    kwargs = {**kwargs, "path": str(local.resolve()) if local.exists() else str(kwargs["path"])}
    if load:
        _scorer(kwargs["path"], kwargs.get("device", "auto"), kwargs.get("dtype", "auto"), kwargs.get("template", "auto"))
    return kwargs


def _close() -> None:
    """Every loaded model let go (`RewardRunner.close`): its memory, on a GPU too, is freed once
    no call still runs on it."""
    with _LOCK:
        _SCORERS.clear()


reward_model._rollover_prepare = _prepare
reward_model._rollover_close = _close


def _scorer(path: str, device: str, dtype: str, template: str) -> _Scorer:
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    key = (path, str(torch.device(device)), dtype, template)
    with _LOCK:
        if key not in _SCORERS:
            _SCORERS[key] = _Scorer(path, device, dtype, template)
        return _SCORERS[key]


class _Scorer:
    def __init__(self, path: str, device: str, dtype: str, template: str):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.device = torch.device(device)
        dtypes = {"auto": torch.bfloat16 if self.device.type == "cuda" else torch.float32,
                  "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtypes[dtype])
        except (OSError, ValueError) as e:
            raise ValueError(f"path={path!r}: not a reward model transformers can load "
                             f"(AutoModelForSequenceClassification): {e}") from None
        if model.config.num_labels != 1:
            raise ValueError(f"path={path!r}: the classifier has {model.config.num_labels} labels; a reward model "
                             "has one (a scalar score)")
        if template == "chat" and not self.tokenizer.chat_template:
            raise ValueError(f"path={path!r}: template=chat, but the reward model's tokenizer has no chat template")
        self.chat = bool(self.tokenizer.chat_template) and template != "text"
        self.pad_id = model.config.pad_token_id  # None: each batch pads with an id it does not hold
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.context = _context(model.config, self.tokenizer)
        self.special = set(self.tokenizer.all_special_ids)
        self.lock = threading.Lock()

    def text(self, prompt, completion: str) -> str:
        """One sample as the reward model reads it."""
        if self.chat:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            if prefilled(messages):
                # a prefilled answer (the prompt's last message): the completion continues it, in one turn
                messages, completion = messages[:-1], messages[-1]["content"] + completion
            return self.tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": completion}],
                                                      tokenize=False)
        if isinstance(prompt, list):
            prompt = "\n".join(m["content"] for m in prompt)
        return prompt + completion

    def ids(self, prompt, completion: str) -> list[int]:
        # a chat template writes its own begin token; plain text gets the tokenizer's
        return self.tokenizer(self.text(prompt, completion), add_special_tokens=not self.chat)["input_ids"]

    def cut(self, ids: list[int], limit: int) -> list[int]:
        """`ids` within `limit` tokens: its leading special tokens (BOS, CLS) and its end."""
        head = 0
        while head < min(4, limit - 1) and ids[head] in self.special:
            head += 1
        return ids[:head] + ids[len(ids) - (limit - head):]

    def score(self, prompts: list, completions: list[str], batch_size: int, max_length: int | None) -> list[dict]:
        import torch

        limit = min(x for x in (max_length, self.context) if x is not None) if (max_length or self.context) else None
        rows = [self.ids(p, c) for p, c in zip(prompts, completions)]
        cut = [limit is not None and len(r) > limit for r in rows]
        rows = [self.cut(r, limit) if c else r for r, c in zip(rows, cut)]
        scores = [0.0] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # batches of like lengths pad little
        batches = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
        with self.lock, torch.inference_mode():
            while batches:
                part = batches.pop()
                pad = self.pad_id
                if pad is None:  # read at each row's last token, as the classifier does for one sample alone:
                    present = {t for i in part for t in rows[i]}  # pad with an id no row holds
                    pad = next((t for t in range(self.model.config.vocab_size) if t not in present), None)
                    if pad is None and len(part) > 1:  # every id is in the batch: one row at a time
                        batches += [[i] for i in part]
                        continue
                width = max(len(rows[i]) for i in part)
                ids = torch.full((len(part), width), 0 if pad is None else pad, dtype=torch.long)
                mask = torch.zeros((len(part), width), dtype=torch.long)
                for j, i in enumerate(part):
                    ids[j, :len(rows[i])] = torch.tensor(rows[i])
                    mask[j, :len(rows[i])] = 1
                self.model.config.pad_token_id = pad
                try:
                    logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
                finally:
                    self.model.config.pad_token_id = self.pad_id
                for j, i in enumerate(part):
                    scores[i] = float(logits[j, 0])
        return [{"score": s, "truncated": float(c)} for s, c in zip(scores, cut)]


def _context(config, tokenizer) -> int | None:
    """The most tokens the classifier reads: its position table (RoBERTa's begins after the
    padding id) and its tokenizer's stated limit, whichever is smaller."""
    limits = []
    positions = getattr(config, "max_position_embeddings", None)
    if positions:
        if "roberta" in config.model_type or config.model_type == "camembert":
            positions -= (config.pad_token_id or 0) + 1
        limits.append(positions)
    if tokenizer.model_max_length and tokenizer.model_max_length < 1e8:  # unset: a huge sentinel
        limits.append(int(tokenizer.model_max_length))
    return min(limits) if limits else None
