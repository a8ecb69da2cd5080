"""The critic of PPO with a learned value model (`algorithm.advantage: gae`, verl's default).

The critic is the policy's transformer trunk, copied at the start (verl's default critic is the
actor's checkpoint), with a linear head from the last hidden state to one number: its estimate,
before each response token, of the return still to come. The head starts at zero, so the first
values are 0 and the first advantages are the rewards.

A step (`Trainer.train_step`) asks the critic for its values over the batch (one no-grad pass),
turns them and the rewards into per-token advantages and returns (`rollover.algos.gae`), trains
the policy on those advantages, then trains the critic toward the returns with PPO's clipped
value loss, over the same `ppo_epochs x mini_batches` updates and micro-batches as the policy.
The critic has its own AdamW (`critic.lr`; the train section's betas, weight decay, schedule and
gradient clipping) and goes into every checkpoint with its optimizer.

One process only for now: the sharded trainer (`train.parallel=fsdp`) and LoRA are refused with
gae.
"""

from __future__ import annotations

import copy
import math
import warnings

import torch

from rollover.algos.aggregate import aggregate
from rollover.algos.gae import value_loss
from rollover.train.batch import TrainBatch


class Critic:
    """A value model over the trainer's packed micro-batches (`trainer`: the policy's Trainer,
    whose packing, attention masks, autocast and out-of-memory retry the critic shares)."""

    def __init__(self, trainer, model, schedule):
        """`model`: the policy as loaded (its trunk is copied); `schedule`: the learning-rate
        multiplier per update, the policy's."""
        self.trainer = trainer
        base = trainer._base(model)
        self.trunk = copy.deepcopy(base.base_model).to(trainer.device)
        config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
        self.head = torch.nn.Linear(config.hidden_size, 1, device=trainer.device, dtype=torch.float32)
        with torch.no_grad():
            self.head.weight.zero_()
            self.head.bias.zero_()
        t = trainer.cfg.train
        self.trunk.requires_grad_(True)
        params = list(self.trunk.parameters()) + list(self.head.parameters())
        fused = all(p.device.type in ("cpu", "cuda") for p in params) or None
        self.optimizer = torch.optim.AdamW(params, lr=trainer.cfg.critic.lr, betas=tuple(t.betas),
                                           weight_decay=t.weight_decay, fused=fused)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)

    def _values(self, mb):
        """The critic's values [N] before the micro-batch's response tokens."""
        t = self.trainer
        with t.autocast:
            hidden = self.trunk(**t._inputs(self.trunk, mb), position_ids=mb.position_ids,
                                attention_mask=t._attention_mask(mb, self.trunk), use_cache=False).last_hidden_state
        return self.head(hidden[mb.sel_row, mb.sel_col].float()).squeeze(-1)

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """The critic's values [B, T] over the batch's response tokens (0 on tokens out of the loss)."""
        t = self.trainer
        T = batch.mask_BT.shape[1]
        out = torch.zeros(len(batch), T, device=t.device)
        for mb in t._micro_batches(batch):
            rows = torch.tensor(mb.seq_index, dtype=torch.long, device=t.device)
            out[rows] = t._to_BT(self._values(mb), mb, T)
        return out.masked_fill(~batch.mask_BT.to(t.device), 0.0)

    def update(self, batch: TrainBatch, old_BT: torch.Tensor, returns_BT: torch.Tensor) -> dict:
        """One optimizer update of the critic toward `returns_BT` ([B, T], the batch's rows), its
        predictions clipped around `old_BT`; the update's metrics."""
        t = self.trainer
        T = batch.mask_BT.shape[1]
        mask_BT = batch.mask_BT.to(t.device)
        num_tokens = max(int(mask_BT.sum()), 1)
        clip = t.cfg.critic.value_clip

        def accumulate():
            self.optimizer.zero_grad(set_to_none=True)
            loss_sum, clipped, predicted, finite = 0.0, 0.0, 0.0, True
            for mb in t._micro_batches(batch):
                sel = torch.tensor(mb.seq_index, dtype=torch.long, device=t.device)
                v_BT = t._to_BT(self._values(mb), mb, T)
                m_BT = mask_BT[sel]
                loss_BT, metrics = value_loss(v_BT, old_BT[sel], returns_BT[sel], m_BT, clip)
                loss = aggregate(loss_BT, m_BT, "token-mean", num_tokens=num_tokens)
                if not torch.isfinite(loss):
                    finite = False
                    break
                loss.backward()
                n = float(m_BT.sum())
                loss_sum += float(loss.detach())
                clipped += n * float(metrics["vf_clipfrac"])
                predicted += n * float(metrics["vpred_mean"])
            return loss_sum, clipped, predicted, finite

        loss_sum, clipped, predicted, finite = t._fitting(accumulate)
        grad_norm = float("nan")
        if finite:
            params = [p for p in self.optimizer.param_groups[0]["params"] if p.grad is not None]
            clip_norm = t.cfg.train.grad_clip
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip_norm if clip_norm > 0 else math.inf))
            finite = math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            self.scheduler.step()
        else:
            warnings.warn("non-finite critic loss or gradient: this critic update is skipped", RuntimeWarning,
                          stacklevel=2)
        self.optimizer.zero_grad(set_to_none=True)
        return {"critic/vf_loss": loss_sum, "critic/vf_clipfrac": clipped / num_tokens,
                "critic/vpred_mean": predicted / num_tokens, "critic/grad_norm": grad_norm,
                "critic/lr": self.scheduler.get_last_lr()[0], "critic/skipped": float(not finite)}

    def state_dict(self) -> dict:
        return {"trunk": {k: v.detach().to("cpu", copy=True) for k, v in self.trunk.state_dict().items()},
                "head": {k: v.detach().to("cpu", copy=True) for k, v in self.head.state_dict().items()},
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.trunk.load_state_dict(state["trunk"])
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
