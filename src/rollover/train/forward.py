"""The trainer's forward passes over packed micro-batches: per-token logprobs and entropies.

Logits are computed only at the positions that predict response tokens (the LM head on the
selected hidden states), and divided by the rollout temperature so they match the engine's
sampling distribution. They are computed `train.logit_chunk_tokens` tokens at a time: each
chunk's full-vocabulary logits exist only while its logprobs (and entropies) are taken, and are
recomputed in the backward pass instead of kept, so the loss holds [chunk, vocab] floats at
most, not [tokens, vocab]. A micro-batch with one chunk or less keeps its logits (recomputing
them would save nothing: the backward starts there).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.utils.checkpoint

from rollover.engine.hf_runner import sliding_window
from rollover.train import memory
from rollover.train.batch import MicroBatch, TrainBatch, pack, with_media
from rollover.train.embedding import RowGradEmbedding, row_grad_applies
from rollover.train.heads import LogitHead
from rollover.train.ulysses import ATTENTION as ULYSSES


class PolicyForward:
    """The forward half of `rollover.train.trainer.Trainer` (which sets `cfg`, `device`, `model`,
    `autocast`, `pack_length`, `micro_batch_tokens`, `shared_prefix`, `one_per_row`, `pad_id`,
    `entropy_coef_now` and `sharded`); `rollover.train.fsdp.FSDPTrainer` overrides the inputs and micro-batches."""

    def _base(self, model):
        return model.get_base_model() if hasattr(model, "get_base_model") else model

    def _fit_row(self, row: int) -> int:
        """A default row length no longer than what one micro-batch of `train.activation_memory_gb`
        holds by the activation estimate (a micro-batch is at least one row), and never shorter
        than the longest sequence."""
        longest = self.cfg.longest_sequence()[0]
        t = self.cfg.train
        config = self._base(self.model).config
        while row > longest and memory.activation_bytes_per_token(config, row, t.gradient_checkpointing) * row \
                > t.activation_memory_gb * 1e9:
            row = max(longest, int(row * 0.9))
        return row

    def _explicit_masks_work(self, row: int) -> bool:
        """Whether the model takes the shared-prefix packing's [L, L] masks, over rows of `row`
        tokens, as they are: the sdpa and eager attention of transformers do; flash-attention
        kernels do not, nor does a sliding window shorter than a row (an explicit mask overrides
        the window). Those models keep the plain packing, with a warning."""
        config = self._base(self.model).config
        impl = getattr(config, "_attn_implementation", None)
        window = sliding_window(config)
        if impl in ("sdpa", "eager", ULYSSES) and (window is None or window >= row):
            return True
        why = f"{impl} attention" if impl not in ("sdpa", "eager") else f"a sliding window of {window} < rows of {row}"
        warnings.warn(f"train.shared_prefix: the model's {why} does not take an explicit mask; packing each sample "
                      "with its own prompt", RuntimeWarning, stacklevel=3)
        return False

    def _attention_mask(self, mb: MicroBatch, model):
        """The micro-batch's 4-D mask in the form the attention kernel reads, or None (plain packing:
        transformers builds the block-diagonal mask from the position ids)."""
        allow = mb.allow()
        if allow is None:
            return None
        allow = allow[:, None]  # [R, 1, L, L]
        if self._base(model).config._attn_implementation == "sdpa":
            return allow
        dtype = torch.bfloat16 if not isinstance(self.autocast, contextlib.nullcontext) else model.dtype
        return torch.zeros(allow.shape, dtype=dtype, device=allow.device).masked_fill(~allow, torch.finfo(dtype).min)

    def _trunk(self, model, base, mb: MicroBatch):
        """The hidden states [N, H] before the response tokens this process predicts, and those
        tokens [N] (all of the micro-batch's; a sequence-parallel rank overrides this)."""
        with self.autocast:
            hidden = base.base_model(**self._inputs(base, mb), position_ids=mb.position_ids,
                                     attention_mask=self._attention_mask(mb, model), use_cache=False).last_hidden_state
        return hidden[mb.sel_row, mb.sel_col], mb.targets

    def _forward(self, model, mb: MicroBatch, need_entropy: bool, teacher=None, others_sq: bool = False):
        """logp [N] of the response tokens, their entropy [N] when asked (else None), with
        `teacher` (`_teacher_view`'s head and hidden states) each position's divergence [N] from
        the teacher's next-token distribution (distill.loss=jsd; else None), and with `others_sq`
        each position's Σπ² over the ids other than the sampled one [N] (no gradient; else None)."""
        base = self._base(model)
        selected, targets = self._trunk(model, base, mb)  # [N, H], [N]
        head = LogitHead(base)  # the model's own: the policy's or the KL reference's
        # with no entropy bonus the entropy is only logged: keep it out of the graph
        entropy_grad = torch.is_grad_enabled() and self.entropy_coef_now != 0
        chunk = self.cfg.train.logit_chunk_tokens or max(len(selected), 1)
        # Recomputing chunks in the backward bounds the loss's memory only when there are several:
        # a lone chunk's logits would be alive at the backward's start either way (it is where
        # the recomputation runs), so it is kept instead of computed twice.
        recompute = torch.is_grad_enabled() and len(selected) > chunk
        parts = []
        for i in range(0, max(len(selected), 1), chunk):  # an empty selection still makes a graph
            taught = None if teacher is None else (teacher[0], teacher[1][i: i + chunk])
            args = (head, selected[i: i + chunk], targets[i: i + chunk], need_entropy, entropy_grad, taught, others_sq)
            if recompute:
                parts.append(torch.utils.checkpoint.checkpoint(self._token_logp, *args, use_reentrant=False))
            else:
                parts.append(self._token_logp(*args))
        logp = torch.cat([p[0] for p in parts])
        entropy = torch.cat([p[1] for p in parts]) if need_entropy else None
        divergence = torch.cat([p[2] for p in parts]) if teacher is not None else None
        return logp, entropy, divergence, torch.cat([p[3] for p in parts]) if others_sq else None

    def _inputs(self, base, mb: MicroBatch) -> dict:
        """What the trunk's forward takes besides positions and mask: the ids and the images."""
        embedding = base.get_input_embeddings()
        if torch.is_grad_enabled() and row_grad_applies(embedding) and not self.sharded and mb.media is None:
            return {"inputs_embeds": RowGradEmbedding.apply(mb.input_ids, embedding.weight, embedding.padding_idx)}
        return {"input_ids": mb.input_ids, **(mb.media or {})}

    def _token_logp(self, head, hidden_N, targets_N, need_entropy: bool, entropy_grad: bool, teacher=None,
                    others_sq: bool = False):
        """Logprobs of `targets_N`, the entropies (or an empty tensor), the divergences from
        `teacher`'s distributions (its head and its hidden states at the same positions; or an
        empty tensor) and Σπ² over the other ids than each target (`others_sq`; or an empty tensor),
        from the hidden states before them."""
        logp_all = self._all_logp(head, hidden_N)
        logp = logp_all.gather(1, targets_N[:, None]).squeeze(1)
        entropy = divergence = squares = logp.new_zeros(0)
        if others_sq:  # the optimal token baseline's: summed apart from the target's, whose (1 - π)² the caller
            with torch.no_grad():  # takes from its logprob, so that 1 - 2π + Σπ² does not cancel to 0 near π = 1
                squares = logp_all.exp().scatter_(1, targets_N[:, None], 0.0).square_().sum(-1)
        if need_entropy:
            with torch.set_grad_enabled(entropy_grad):  # tokens left out (-inf: image placeholders) add 0, not nan
                entropy = -(logp_all.exp() * logp_all.clamp(min=torch.finfo(logp_all.dtype).min)).sum(-1)
        if teacher is not None:
            from rollover.algos.distill import generalized_jsd

            with torch.no_grad():  # a teacher with more rows than the policy: its distribution over the policy's
                theirs = self._all_logp(*teacher, vocab=logp_all.shape[-1])
            divergence = generalized_jsd(logp_all, theirs, self.cfg.distill.beta)
        return logp, entropy, divergence, squares

    def _all_logp(self, head, hidden_N, vocab: int | None = None) -> torch.Tensor:
        """The next-token log-distribution [N, vocab] at the rollout temperature (over the first
        `vocab` ids only, when given)."""
        with self.autocast:
            logits = head(hidden_N).float()
        if vocab is not None and logits.shape[-1] > vocab:
            logits = logits[:, :vocab]
        t = self.cfg.rollout.temperature
        # dividing by 1 changes nothing but costs a pass over [N, vocab] and one in the backward
        return torch.log_softmax(logits if t == 1.0 else logits / t, dim=-1)

    @staticmethod
    def _to_BT(values_N: torch.Tensor, mb: MicroBatch, T: int) -> torch.Tensor:
        out = values_N.new_zeros((len(mb.seq_index), T))
        return out.index_put((mb.tok_seq, mb.tok_pos), values_N)

    def _micro_batches(self, batch: TrainBatch) -> list[MicroBatch]:
        images = batch.media is not None  # one sequence a row, with its images and the model's positions for them
        mbs = pack(batch, pack_length=self.pack_length, micro_batch_tokens=self.micro_batch_tokens, pad_id=self.pad_id,
                   shared_prefix=self.shared_prefix and not images, one_per_row=self.one_per_row or images)
        if images:
            mbs = [with_media(mb, batch, self._base(self.model)) for mb in mbs]
        return [mb.to(self.device) for mb in mbs]

    def logprobs(self, batch: TrainBatch, model=None, entropy: bool = False):
        """Per-token logprobs [B, T] of the batch's responses under `model` (default: policy); with
        `entropy`, (logprobs, entropies), both [B, T]."""
        logp, ent, _ = self.token_stats(batch, model, entropy)
        return (logp, ent) if entropy else logp

    @torch.no_grad()
    def token_stats(self, batch: TrainBatch, model=None, entropy: bool = False, others_sq: bool = False):
        """(logprobs, entropies or None, Σπ² over the ids other than the sampled one or None), each
        [B, T] (0 on untrained tokens), of the batch's responses under `model` (default: the policy)."""
        model = model or self.model
        T = batch.mask_BT.shape[1]
        out = [torch.zeros(len(batch), T, device=self.device) if want else None for want in (True, entropy, others_sq)]
        for mb in self._micro_batches(batch):
            logp, h, _, sq = self._forward(model, mb, need_entropy=entropy, others_sq=others_sq)
            rows = torch.tensor(mb.seq_index, dtype=torch.long, device=self.device)
            for into, values in zip(out, (logp, h, sq)):
                if into is not None:
                    into[rows] = self._to_BT(values, mb, T)
        untrained = ~batch.mask_BT.to(self.device)  # untrained tokens: 0, as `_update` has them
        return tuple(None if x is None else x.masked_fill(untrained, 0.0) for x in out)
