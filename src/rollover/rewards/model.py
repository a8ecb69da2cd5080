"""A learned reward model as a reward function (`reward_model`, a built-in).

    reward:
      functions:
        - {fn: reward_model, kwargs: {path: my-reward-model/}}

The model is a transformers sequence classifier with one label (`AutoModelForSequenceClassification`,
e.g. a Skywork or an ArmoRM-style scalar head); its logit is the score. It scores what TRL's
GRPOTrainer scores for a reward model id:

- each sample as a conversation, the prompt's messages (a text prompt is one user message)
  followed by the completion as the assistant's, rendered with the reward model's own chat
  template (not the policy's); a tokenizer without a template gets the prompt's text followed by
  the completion;
- right padding in batches, the score read at the last token that is not padding (the
  classifier's own rule, so a batch scores as each sample alone does).

Departures: a sample longer than `max_length` tokens (default the model's context) keeps its
last `max_length` tokens, where the answer is, and is reported in the extras as
`reward_model/truncated` rather than failing (TRL does not truncate). dtype `auto` is float32 on
a CPU and bfloat16 on a GPU.

The model is loaded once per process, when the reward is built (a run's start: a wrong path fails
there, not at the first step, and loading is not charged to a call's timeout), and shared by
every call; calls from several threads take turns. It runs where the reward runs: in the
driver's process, or in each Ray reward worker with `ray.reward_workers`.
"""

from __future__ import annotations

import threading
from pathlib import Path

_LOCK = threading.Lock()
_SCORERS: dict[tuple, _Scorer] = {}


def reward_model(prompts: list, completions: list[str], *, path: str, batch_size: int = 8,
                 max_length: int | None = None, device: str = "auto", dtype: str = "auto") -> list[dict]:
    """Scores of `completions` (after `prompts`) by the sequence classifier at `path`, one dict
    per sample: `score` and `truncated` (1.0 where the sample was cut to `max_length`)."""
    return _scorer(path, device, dtype).score(prompts, completions, batch_size, max_length)


def _prepare(**kwargs) -> None:
    """Checks the bound arguments and loads the model when the reward is built (`RewardSpec.build`)."""
    known = ("path", "batch_size", "max_length", "device", "dtype")
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise ValueError(f"unknown kwargs {unknown} (known: {', '.join(known)})")
    if "path" not in kwargs:
        raise ValueError("kwargs.path is required: the reward model's directory (or hub id)")
    batch_size, max_length = kwargs.get("batch_size", 8), kwargs.get("max_length")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: must be an integer >= 1")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2):
        raise ValueError(f"max_length={max_length!r}: must be an integer >= 2")
    _scorer(kwargs["path"], kwargs.get("device", "auto"), kwargs.get("dtype", "auto"))


reward_model.prepare = _prepare


def _scorer(path: str, device: str, dtype: str) -> _Scorer:
    key = (str(Path(path).expanduser().resolve()) if Path(path).expanduser().exists() else path, device, dtype)
    with _LOCK:
        if key not in _SCORERS:
            _SCORERS[key] = _Scorer(path, device, dtype)
        return _SCORERS[key]


class _Scorer:
    def __init__(self, path: str, device: str, dtype: str):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        dtypes = {"auto": torch.bfloat16 if self.device.type == "cuda" else torch.float32,
                  "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if dtype not in dtypes:
            raise ValueError(f"dtype={dtype!r}: expected one of {sorted(dtypes)}")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtypes[dtype])
        except (OSError, ValueError) as e:
            raise ValueError(f"path={path!r}: not a reward model transformers can load "
                             f"(AutoModelForSequenceClassification): {e}") from None
        if model.config.num_labels != 1:
            raise ValueError(f"path={path!r}: the classifier has {model.config.num_labels} labels; a reward model "
                             "has one (a scalar score)")
        pad = model.config.pad_token_id
        if pad is None:  # the classifier finds each row's last token by its padding id
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
            if pad is None:
                raise ValueError(f"path={path!r}: neither the model nor its tokenizer names a padding or end token")
            model.config.pad_token_id = pad
        self.pad_id = pad
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.context = getattr(model.config, "max_position_embeddings", None)
        self.lock = threading.Lock()

    def text(self, prompt, completion: str) -> str:
        """One sample as the reward model reads it."""
        if self.tokenizer.chat_template:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            return self.tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": completion}],
                                                      tokenize=False)
        if isinstance(prompt, list):
            prompt = "\n".join(m["content"] for m in prompt)
        return prompt + completion

    def ids(self, prompt, completion: str) -> list[int]:
        # a chat template writes its own begin token; plain text gets the tokenizer's
        return self.tokenizer(self.text(prompt, completion), add_special_tokens=not self.tokenizer.chat_template
                              )["input_ids"]

    def score(self, prompts: list, completions: list[str], batch_size: int, max_length: int | None) -> list[dict]:
        import torch

        limit = max_length or self.context
        rows = [self.ids(p, c) for p, c in zip(prompts, completions)]
        cut = [limit is not None and len(r) > limit for r in rows]
        rows = [r[-limit:] if c else r for r, c in zip(rows, cut)]
        scores = [0.0] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # batches of like lengths pad little
        with self.lock, torch.inference_mode():
            for start in range(0, len(order), batch_size):
                part = order[start:start + batch_size]
                width = max(len(rows[i]) for i in part)
                ids = torch.full((len(part), width), self.pad_id, dtype=torch.long)
                mask = torch.zeros((len(part), width), dtype=torch.long)
                for j, i in enumerate(part):
                    ids[j, :len(rows[i])] = torch.tensor(rows[i])
                    mask[j, :len(rows[i])] = 1
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
                for j, i in enumerate(part):
                    scores[i] = float(logits[j, 0])
        return [{"score": s, "truncated": float(c)} for s, c in zip(scores, cut)]
