"""The critic of PPO with a learned value model (`algorithm.advantage: gae`, verl's default).

The critic is the policy's transformer trunk, copied at the start (verl's default critic is the
actor's checkpoint; with `train.lora`, the base trunk under an adapter of its own, of the
policy's adapter's shape), with a linear head from the last hidden state to one number: its estimate,
before each response token, of the return still to come. The head starts at zero, so the first
values are 0 and the first advantages are the rewards. `critic.model` starts it from another
checkpoint with the policy's tokenizer instead (`value_model_from`): a causal LM's trunk under a
zero head, or a reward model's trunk under its own score head (verl's critic.model.path).

A step (`Trainer.train_step`) asks the critic for its values over the batch (one no-grad pass),
turns them and the rewards into per-token advantages and returns (`rollover.algos.gae`), trains
the policy on those advantages, then trains the critic toward the returns with PPO's clipped
value loss, over the same `ppo_epochs x mini_batches` updates and micro-batches as the policy.
The critic has its own AdamW (`critic.lr`; the train section's betas, weight decay, schedule and
gradient clipping) and goes into every checkpoint with its optimizer.

On the sharded trainer (`train.parallel: fsdp`) the critic is sharded as the policy is (each
decoder layer, then the rest), each rank runs it over its own sequences, and the step's sums
(token counts, the whitening's moments, the metrics) are taken over the ranks; its weights and
optimizer state go into the ranks' sharded checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch
from torch import nn

from rollover.algos.aggregate import aggregate
from rollover.algos.gae import explained_variance, gae, masked_whiten, value_loss
from rollover.train.batch import TrainBatch


class ValueModel(nn.Module):
    """The critic's network: a transformer trunk and a linear head to one number per position,
    which starts at zero. `no_split`: the decoder layers' class names (the policy's
    `_no_split_modules`), which the sharded trainer shards one by one."""

    def __init__(self, trunk: nn.Module, hidden_size: int, no_split):
        super().__init__()
        self.trunk = trunk
        self.head = nn.Linear(hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self._no_split_modules = list(no_split or ())

    # what the trainer's forward reads of a causal LM (`PolicyForward._trunk`), so the critic's pass is the policy's
    @property
    def base_model(self) -> nn.Module:
        return self.trunk

    @property
    def config(self):
        return self.trunk.config

    def get_input_embeddings(self) -> nn.Module:
        return self.trunk.get_input_embeddings()

    @property
    def dtype(self) -> torch.dtype:
        return self.get_input_embeddings().weight.dtype

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head on hidden states [N, H], in float32 whatever the trunk's precision: [N]."""
        w, b = self.head.weight, self.head.bias
        # a tensor of its own, not a view: FSDP's root unit hooks its backward on what it returns
        return torch.nn.functional.linear(hidden.float(), w.float(), b.float()).squeeze(-1).clone()


def value_model_of(model, lora: dict | None = None) -> ValueModel:
    """A fresh critic network from the policy as loaded: its causal LM's trunk copied, trained
    whole; with `lora` (train.lora; `model` then a peft model) the base trunk without the
    policy's adapter, under an adapter of its own that trains with the head (the base frozen)."""
    import copy

    if lora is not None:
        from rollover.train.lora import apply_lora

        causal = copy.deepcopy(model).unload()  # the policy's adapter left out: the base model, unmerged
        trunk = apply_lora(causal.base_model, lora, task_type="FEATURE_EXTRACTION")
    else:
        causal = model
        trunk = copy.deepcopy(model.base_model).requires_grad_(True)
    config = causal.config.get_text_config() if hasattr(causal.config, "get_text_config") else causal.config
    return ValueModel(trunk, config.hidden_size, getattr(causal, "_no_split_modules", None))


def _is_classifier(config) -> bool:
    return any(a.endswith("ForSequenceClassification") for a in (getattr(config, "architectures", None) or []))


def value_model_from(name: str, lora: dict | None = None, config=None) -> ValueModel:
    """A fresh critic network from the checkpoint `name` (critic.model): its trunk, under the score
    head of a one-label sequence classifier (a reward model) or else a head at zero; with `lora`
    an adapter of its own on the trunk, trained with the head. `config`: the checkpoint's config,
    to build only its structure on the meta device (a sharded rank that takes rank 0's tensors)."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    from rollover.models import resolve_model
    from rollover.train.beside import load_whole

    score = None
    if config is not None:
        with torch.device("meta"):
            trunk = AutoModel.from_config(config, dtype=torch.float32)
    else:
        path = resolve_model(name)
        where = f"critic.model={name!r}"
        if _is_classifier(AutoConfig.from_pretrained(path)):
            scorer = load_whole(AutoModelForSequenceClassification, path, where, "the critic's", "would start at random")
            trunk, score = scorer.base_model, getattr(scorer, "score", None)
            if not isinstance(score, nn.Linear) or score.out_features != 1:
                raise ValueError(f"{where}: its classifier's head is not one linear layer to one label (`score`, as "
                                 "Llama's, Qwen's and Mistral's reward models have)")
        else:
            trunk = load_whole(AutoModel, path, where, "the critic's", "would start at random")
    no_split = getattr(trunk, "_no_split_modules", None)
    if lora is not None:
        from rollover.train.lora import apply_lora

        trunk = apply_lora(trunk, lora, task_type="FEATURE_EXTRACTION")
    else:
        trunk.requires_grad_(True)
    value = ValueModel(trunk, trunk.config.hidden_size, no_split)
    if score is not None:
        with torch.no_grad():
            value.head.weight.copy_(score.weight.reshape(value.head.weight.shape))
            if getattr(score, "bias", None) is not None:
                value.head.bias.copy_(score.bias.reshape(value.head.bias.shape))
    return value.train()


def check_critic_model(name: str, tokenizer, policy_config, longest: int, *, sequence_parallel: int = 1,
                       lora: dict | None = None) -> None:
    """ValueError unless the checkpoint `name` can be the critic of this policy: a model that
    reads the policy's tokens (`rollover.train.beside.check_reads_policy_tokens`: its tokenizer,
    context, family and heads), one label if it is a sequence classifier, and modules `lora`
    names."""
    from transformers import AutoModel

    from rollover.train.beside import check_reads_policy_tokens

    where = f"critic.model={name!r}"
    config = check_reads_policy_tokens(name, where, "the critic", tokenizer, policy_config, longest,
                                       sequence_parallel=sequence_parallel)
    if _is_classifier(config) and getattr(config, "num_labels", 1) != 1:
        raise ValueError(f"{where} is a sequence classifier with {config.num_labels} labels: a critic's head gives "
                         "one number (a reward model has one label)")
    if lora is not None:
        from rollover.train.lora import apply_lora

        try:
            with torch.device("meta"):
                apply_lora(AutoModel.from_config(config), lora, task_type="FEATURE_EXTRACTION")
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


@dataclasses.dataclass
class CriticStep:
    """What a step's critic pass gives: the batch with each token's advantage (`adv_BT`), the
    critic's values before the step's updates, the returns it trains toward, and the step's
    critic/ metrics."""

    batch: TrainBatch
    values_BT: torch.Tensor
    returns_BT: torch.Tensor
    metrics: dict


class Critic:
    """A value model over the trainer's packed micro-batches (`trainer`: the policy's Trainer or a
    sharded rank, whose packing, attention masks, autocast, reductions and out-of-memory retry the
    critic shares)."""

    def __init__(self, trainer, value: ValueModel, schedule):
        """`value`: the critic network, placed on the trainer's device (or sharded) here;
        `schedule`: the learning-rate multiplier per update, the policy's."""
        self.trainer = trainer
        self.value = trainer._place(value)
        t = trainer.cfg.train
        params = [p for p in self.value.parameters() if p.requires_grad]  # with LoRA: its adapter and the head
        fused = all(p.device.type in ("cpu", "cuda") for p in params) or None
        self.optimizer = torch.optim.AdamW(params, lr=trainer.cfg.critic.lr, betas=tuple(t.betas),
                                           weight_decay=t.weight_decay, fused=fused)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.base_lrs = list(self.scheduler.base_lrs)  # critic.lr (a checkpoint's scheduler state has its own)
        self.kl_coef = trainer.cfg.algorithm.kl_in_reward  # the KL penalty's weight in the reward (adaptive: moves)

    def _values(self, mb):
        """The critic's values [N] before the micro-batch's response tokens."""
        t = self.trainer
        return t._whole(t._pass(self.value, lambda value: value.values(t._trunk(value, value, mb)[0])), mb)

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

    def advantages(self, batch: TrainBatch, old_BT=None, ref_BT=None) -> CriticStep:
        """Each token's advantage from the critic's values (GAE, whitened over the step's loss
        tokens on every rank; `batch.adv_B` holds the rewards at each sequence's end, `batch.adv_BT`
        where given the rewards on its tokens: env.credit=reward_to_go). `old_BT`, `ref_BT`: the policy's
        and the reference's logprobs, for the KL penalty in the reward (algorithm.kl_in_reward)."""
        t, a = self.trainer, self.trainer.cfg.algorithm
        values_BT = t._fitting(self.values, batch)
        mask_BT = batch.mask_BT.to(t.device)
        kl_metrics = {}
        token_rewards_BT = None if batch.adv_BT is None else batch.adv_BT.to(t.device)  # each turn's, where earned
        if old_BT is not None:
            penalty_BT, kl_metrics = self._kl_penalty(old_BT.to(t.device), ref_BT.to(t.device), mask_BT)
            token_rewards_BT = penalty_BT if token_rewards_BT is None else token_rewards_BT + penalty_BT
        adv_BT, returns_BT = gae(batch.adv_B.to(t.device), values_BT, mask_BT, gamma=a.gamma, lam=a.lam,
                                 token_rewards_BT=token_rewards_BT)
        whitened_BT = masked_whiten(adv_BT, mask_BT, reduce=t._sum)
        sums = torch.stack([mask_BT.sum(), values_BT.sum(), returns_BT.sum(), adv_BT.sum()]).double().cpu()
        n, v, r, adv = t._sum(sums).tolist()
        n = max(n, 1.0)
        metrics = {"critic/values/mean": v / n, "critic/returns/mean": r / n, "critic/advantages/mean": adv / n,
                   "critic/vf_explained_var": explained_variance(values_BT, returns_BT, mask_BT, reduce=t._sum),
                   **kl_metrics}
        return CriticStep(dataclasses.replace(batch, adv_BT=whitened_BT.cpu()), values_BT, returns_BT, metrics)

    def _kl_penalty(self, old_BT, ref_BT, mask_BT):
        """Each token's KL penalty in the reward, -coef * (log pi_old - log pi_ref) on the loss
        tokens, and its metrics; then, under adaptive control, the next step's coefficient from
        this step's mean KL (each sequence's mean over its tokens, averaged over every rank's
        sequences; verl's AdaptiveKLController)."""
        a, t = self.trainer.cfg.algorithm, self.trainer
        kl_BT = (old_BT - ref_BT) * mask_BT
        per_seq = kl_BT.sum(1) / mask_BT.sum(1).clamp(min=1)
        seqs = mask_BT.any(1)
        total, count = t._sum(torch.tensor([float(per_seq[seqs].sum()), float(seqs.sum())])).tolist()
        kl = total / max(count, 1.0)
        applied = self.kl_coef
        if a.kl_in_reward_target is not None:
            error = min(max(kl / a.kl_in_reward_target - 1.0, -0.2), 0.2)
            self.kl_coef *= 1.0 + error * count / a.kl_in_reward_horizon
        return -applied * kl_BT, {"critic/kl_in_reward": kl, "critic/kl_in_reward_coef": applied}

    def train(self, step: CriticStep, updates: list[list[int]], missing: int = 0) -> list[dict]:
        """The critic's updates over the step's batch, one per list of its sequences (the policy's
        epochs and mini-batches), and the schedule moved on by `missing` updates not made (a step
        with fewer groups than mini-batches); their metrics."""
        out = []
        for idx in updates:
            rows = torch.tensor(idx, dtype=torch.long, device=self.trainer.device)
            out.append(self.update(step.batch.select(idx), step.values_BT[rows], step.returns_BT[rows]))
        for _ in range(missing):
            self.scheduler.step()
        return out

    def update(self, batch: TrainBatch, old_BT: torch.Tensor, returns_BT: torch.Tensor) -> dict:
        """One optimizer update of the critic toward `returns_BT` ([B, T], the batch's rows), its
        predictions clipped around `old_BT`; the update's metrics (over every rank's tokens)."""
        t = self.trainer
        T = batch.mask_BT.shape[1]
        mask_BT = batch.mask_BT.to(t.device)
        num_tokens = max(t._counts(int(mask_BT.sum()), 0)[0], 1)
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
                    if not t.sharded:  # ranks go on: every rank runs the same passes (their collectives)
                        break
                loss.backward()
                if not mb.seq_index:  # a rank's stand-in pass: nothing to count
                    continue
                n = float(m_BT.sum())
                loss_sum += float(loss.detach())
                clipped += n * float(metrics["vf_clipfrac"])
                predicted += n * float(metrics["vpred_mean"])
            return loss_sum, clipped, predicted, finite

        loss_sum, clipped, predicted, finite = t._fitting(accumulate)
        loss_sum, clipped, predicted, bad = t._sum(torch.tensor([loss_sum, clipped, predicted, float(not finite)])).tolist()
        finite, grad_norm = bad == 0, float("nan")
        lr = self.scheduler.get_last_lr()[0]  # the rate this update steps with (the scheduler then moves on)
        if finite:
            grad_norm = t._clip_grad_norm(self.optimizer.param_groups[0]["params"])
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
                "critic/lr": lr, "critic/skipped": float(not finite)}

    def _trained(self) -> set[str]:
        return {n for n, p in self.value.named_parameters() if p.requires_grad}

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the critic: its trained weights (under LoRA the adapter and
        the head: the frozen base comes from the model again), optimizer, schedule, KL weight."""
        trained = self._trained()
        return {"value": {k: v.detach().to("cpu", copy=True) for k, v in self.value.state_dict().items() if k in trained},
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "kl_coef": self.kl_coef, "source": self.trainer.cfg.critic.model}

    def load_state_dict(self, state: dict) -> None:
        self.check_source(state.get("source"))
        missing = self._trained() - set(state["value"])
        if missing:
            raise ValueError(f"the checkpoint's critic lacks {len(missing)} trained weights, e.g. {sorted(missing)[0]} "
                             "(written with another train.lora?)")
        self.value.load_state_dict(state["value"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.kl_coef = self.resumed_kl_coef(state.get("kl_coef"))

    def check_source(self, saved: str | None) -> None:
        """A ConfigError unless the checkpoint's critic started from the network critic.model names
        now (`saved`: its critic.model; None: the policy's copy), whose weights the checkpoint's
        go into."""
        now = self.trainer.cfg.critic.model
        if saved != now:
            from rollover.config import ConfigError

            was = "a copy of the policy" if saved is None else f"critic.model={saved!r}"
            raise ConfigError(f"the checkpoint's critic started from {was}, this run's from "
                              f"{'a copy of the policy' if now is None else f'critic.model={now!r}'}: a critic cannot "
                              "change its network when a run resumes")

    @staticmethod
    def missing_error():
        """The error of a resume into gae from a checkpoint written without a critic."""
        from rollover.config import ConfigError

        return ConfigError("the checkpoint holds no critic (it was written with another algorithm.advantage than "
                           "gae): a run cannot switch to PPO with a critic when it resumes")

    def resumed_kl_coef(self, saved: float | None) -> float:
        """The KL-in-reward weight a resumed run goes on with: the adaptive one it had moved to, or
        the config's (a fixed weight, or a run that had none: a config change applies)."""
        a = self.trainer.cfg.algorithm
        if a.kl_in_reward_target is None or not saved:
            return a.kl_in_reward
        return saved
