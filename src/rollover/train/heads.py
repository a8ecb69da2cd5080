"""The trainer's output head: the hidden states of the selected positions to logits, as the
model's own forward would compute them.

The trainer runs a model's trunk (`base_model`) over packed rows, then its LM head on the
response positions only, in chunks (the logits of every position would not fit). Most causal
LMs' forward is just that head; a few change the logits after it, and the trainer must too, or
its logprobs are not the sampler's: Gemma 2 (and any model with `final_logit_softcapping`) caps
them with `tanh`, Cohere multiplies them by `logit_scale`, Granite divides them by
`logits_scaling`. `check_model` compares the result with the model's forward on a few tokens, so
an architecture with another step is refused by name instead of training on the wrong logprobs.
"""

from __future__ import annotations

import torch

from rollover.data.media import placeholder_ids
from rollover.models import is_vision_language, text_config


class LogitHead:
    """`head(hidden) -> logits`: the model's output embedding and what its forward does after it."""

    def __init__(self, base):
        config = text_config(base.config)
        self.module = base.get_output_embeddings()
        if self.module is None:
            raise ValueError(f"{type(base).__name__} has no output embeddings: not a causal LM the trainer can train")
        scale = getattr(base, "logit_scale", None)  # Cohere keeps its config's on the module
        self.scale = scale if isinstance(scale, (int, float)) else None
        self.divide = getattr(config, "logits_scaling", None)
        self.cap = getattr(config, "final_logit_softcapping", None)
        # a vision-language model's image placeholders are never sampled (the engine's `placeholder_ids`)
        self.banned = placeholder_ids(base.config) if is_vision_language(base.config) else []
        self._banned_on: dict = {}  # device -> the banned ids as a tensor there

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """The model forward's `logits` with what this head leaves out of the distribution left out."""
        if not self.banned:
            return logits
        ids = self._banned_on.get(logits.device)
        if ids is None:  # made once per device: this runs on every chunk of every pass
            ids = self._banned_on[logits.device] = torch.tensor(self.banned, device=logits.device)
        return logits.index_fill(-1, ids, float("-inf"))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.module(hidden)
        if self.scale is not None:
            logits = logits * self.scale
        if self.divide is not None:
            logits = logits / self.divide
        if self.cap is not None:
            logits = torch.tanh(logits / self.cap) * self.cap
        return self.masked(logits)


@torch.no_grad()
def check_model(base, *, training: bool) -> None:
    """Raise ValueError when the trainer would not compute the model's own logprobs: trunk +
    `LogitHead` against the model's forward on a few tokens (an architecture whose forward does
    more after its head than `LogitHead` knows), and with `training` (dropout off) the forward
    in training mode against evaluation mode (PhiMoE routes its experts differently while
    training: the trainer's logprobs would not be the sampler's)."""
    import warnings

    config = text_config(base.config)
    device = next(base.parameters()).device
    ids = (torch.arange(1, 33, device=device)[None] * 7) % config.vocab_size  # enough tokens to route to every expert
    name, was_training = type(base).__name__, base.training

    def close(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
        kept = b.isfinite()  # what the head leaves out (-inf) it leaves out on both sides
        if not torch.equal(a.isfinite(), kept):
            return False, float("inf")
        a, b = a.float()[kept], b.float()[kept]
        gap = (a - b).abs().max().item()
        return gap <= 1e-3 * max(1.0, b.abs().max().item()), gap

    try:
        base.eval()
        head = LogitHead(base)
        ref = head.masked(base(input_ids=ids, use_cache=False).logits)
        ok, gap = close(head(base.base_model(input_ids=ids, use_cache=False).last_hidden_state), ref)
        if not ok:
            raise ValueError(f"{name}: the trainer's head (output embedding, logit scale, soft cap) gives logits "
                             f"{gap:.3g} away from the model's forward; this architecture does more after its head "
                             "than rollover's trainer knows")
        if training:
            base.train()
            with warnings.catch_warnings():  # gradient checkpointing, under no_grad here, warns
                warnings.simplefilter("ignore")
                ok, gap = close(head.masked(base(input_ids=ids, use_cache=False).logits), ref)
            if not ok:
                raise ValueError(f"{name} computes logits {gap:.3g} apart in training and in evaluation mode, "
                                 "dropout off (its routing or noise depends on the mode): the trainer's logprobs "
                                 "would not be the sampler's")
    finally:
        base.train(was_training)
