"""The policy trainer: an HF causal LM, AdamW, micro-batched policy-gradient steps.

One `train_step(batch)` runs `ppo_epochs x mini_batches` optimizer updates. Each update packs
its sequences into micro-batches, accumulates gradients, and normalises by the update's
*global* token (or sequence) count, so the result does not depend on the micro-batch split.

Old (proximal) logprobs: with a single update per step, the current forward's detached
logprobs serve as the old policy (ratio = 1, no extra forward). With several updates, with
M2PO, or with BAPO over an IS mask, one no-grad pass over the batch records them first.
Behaviour logprobs always come from the engine; they enter only the off-policy options (TIS,
M2PO, decoupled PPO). M2PO's mask and BAPO's bounds are chosen once per update over all its
loss tokens (every micro-batch and rank) before its passes, so they do not depend on the split
either (BAPO's ratios are 1 at a step's first update; a later one measures them in one no-grad
pass).

The forward over micro-batches (logprobs and entropies from the selected positions' logits, in
chunks) is `rollover.train.forward`. Micro-batches are sized from
`train.activation_memory_gb` on a CPU and start at 65,536 tokens on CUDA, unless
`train.micro_batch_tokens` says otherwise (rollover.train.memory); an update that runs out of
device memory is redone at half the size. The heap the step freed is handed back to the OS after it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import warnings

import torch
import torch.utils.checkpoint

from rollover.algos import aggregate, kl_penalty, policy_loss, top_entropy_mask
from rollover.algos.offpolicy import MAX_LOG_RATIO, m2po_update_mask, opsm_mask
from rollover.algos.loss_options import old_logprobs_first
from rollover.algos.policy import bapo_update_bounds
from rollover.config import Config
from rollover.engine.hf_runner import fast_path
from rollover.models import restore_output_capture, stateful_layers
from rollover.train import memory
from rollover.train.batch import TrainBatch
from rollover.train.critic import Critic, value_model_from, value_model_of
from rollover.train.dropout import disable_dropout
from rollover.train.forward import PolicyForward
from rollover.train.heads import check_model
from rollover.train.metric_sums import add_metrics, mean_metrics
from rollover.train.teacher import Distillation
from rollover.train.token_baseline import TokenBaseline

log = logging.getLogger(__name__)


def _lr_lambda(schedule: str, warmup: int, total: int):
    def f(update: int) -> float:
        if warmup and update < warmup:
            return (update + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (update - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def follow_schedule(scheduler, base_lrs: list[float]) -> None:
    """After a checkpoint's optimizer and scheduler state are loaded: each group's rate is the one
    this run's schedule (`scheduler.lr_lambdas`, built from the config) gives the next update, at
    the config's base rates, so a finished run resumed with more steps, or one resumed under a
    changed lr, goes on along its own schedule (the saved rate came from the old one). Under the
    config the checkpoint was written with, this is the saved rate, computed as LambdaLR does."""
    scheduler.base_lrs = list(base_lrs)
    for group, base, rate in zip(scheduler.optimizer.param_groups, base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * rate(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


# what an update sums over its micro-batches (and ranks) for its metrics: the loss, entropy and the
# entropy bonus's tokens, the KL terms, the teacher's divergence; padding and row slots come after
TALLIES = ("loss", "pg_loss", "entropy", "bonus", "bonus_tokens", "kl", "rollout_kl", "taught")


class Trainer(PolicyForward, Distillation, TokenBaseline):
    sharded = False  # rollover.train.fsdp.FSDPTrainer: one rank of several, each holding a shard

    def __init__(self, model, cfg: Config, *, device: torch.device, pad_id: int = 0, reference=None):
        """reference: the KL reference policy (`algorithm.kl_coef`), where `model` no longer holds
        the starting weights (a resumed run); None: a copy of `model`."""
        self.cfg = cfg
        self.device = device
        self.pad_id = pad_id
        self._share = None
        if device.type == "cpu" and not self.sharded and not cfg.train.deterministic:
            from rollover.engine.cpu.share import shared

            self._share = shared()
        if device.type == "cpu" and not self.sharded:  # process-wide: no fresh mapping for every large block
            # (not in an FSDP rank: blocks its collectives' threads free stay in their arenas; a 0.5B model's rank
            # at 2 ranks ran out of memory at 11.5 GB with it, 7.5 GB without, benchmarks.md "Sharded trainer")
            memory.large_blocks_from_the_heap()
        restore_output_capture(model)  # a trainer actor or a rank gets the model pickled
        if reference is not None:
            restore_output_capture(reference)
        self.is_peft = hasattr(model, "get_base_model")
        if cfg.train.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        model.train()  # gradient checkpointing in transformers runs in training mode only
        if cfg.train.disable_dropout:
            zeroed = disable_dropout(model)
            if zeroed:
                log.info("train.disable_dropout: dropout set to 0 in %s", ", ".join(zeroed))
        # an architecture outside rollover's own forward: its logits checked to be the sampler's (on the
        # model as loaded: not on a torchrun rank that holds only its structure), its sequences one to a
        # row unless explicit masks keep them apart (some models' masks ignore packed position ids)
        self.generic = not fast_path(self._base(model).config, cfg.longest_sequence()[0])
        if self.generic and not any(p.is_meta for p in model.parameters()):
            check_model(self._base(model), training=cfg.train.disable_dropout)
        self.ref_model = None
        if cfg.algorithm.uses_reference and not self.is_peft:
            ref = reference if reference is not None else copy.deepcopy(model)
            self.ref_model = self._place(ref.eval().requires_grad_(False))
        # distill.teacher: on-policy distillation's frozen teacher, placed as the reference is
        self.teacher = None if cfg.distill.teacher is None else self._place(self._teacher_network())
        # algorithm.advantage=gae: the critic's network (critic.model's, or the policy's as loaded), placed below
        value = None
        if cfg.algorithm.advantage == "gae":
            value = self._critic_network(model)
            if cfg.train.disable_dropout:  # as the policy's (a LoRA critic's adapter is new)
                disable_dropout(value)
        # layers no mask keeps packed sequences apart in, in any network the step's rows go through
        self.stateful = sorted({k for net in (model, self.teacher, value) if net is not None
                                for k in stateful_layers(self._base(net).config)})
        self.model = self._place(model)
        self.critic = None
        params = [p for p in self.model.parameters() if p.requires_grad]
        t = cfg.train
        # fused: one vectorised pass over each tensor. torch's default on a CPU loops over tensors op by op:
        # 0.8-1.0 s an update for SmolLM2's 135M parameters on 2 cores, against 0.10-0.16 s fused
        # (FSDP's DTensor shards too; torch's foreach form would also hold several parameter-sized temporaries)
        fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params) or None
        self.optimizer = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay,
                                           fused=fused)
        updates_per_step = t.ppo_epochs * t.mini_batches
        schedule = _lr_lambda(t.schedule, t.warmup_steps * updates_per_step, cfg.steps * updates_per_step)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.base_lrs = list(self.scheduler.base_lrs)  # the config's (a checkpoint's scheduler state has its own)
        self.bad_steps = 0  # consecutive steps skipped for a non-finite loss
        self.steps_trained = 0  # train_step calls: algorithm.ref_sync_every counts them
        # the entropy bonus's coefficient, which adaptive control (algorithm.entropy_target) moves, the
        # entropy it last measured, and the coefficient the update in progress applies
        self.entropy_coef, self.last_entropy = cfg.algorithm.entropy_coef, math.inf
        self.entropy_coef_now = cfg.algorithm.entropy_coef
        shared_row = t.pack_length or self._fit_row(default_pack_length(cfg, shared_prefix=True))
        if self.stateful and t.shared_prefix:
            log.info("train.shared_prefix: %s layers (the policy's, teacher's or critic's) run along a row, which no "
                     "mask divides: each sequence is trained in a row of its own", ", ".join(self.stateful))
        self.shared_prefix = t.shared_prefix and not self.stateful and self._explicit_masks_work(shared_row)
        self.pack_length = shared_row if self.shared_prefix else t.pack_length or default_pack_length(cfg, False)
        self.one_per_row = (self.generic and not self.shared_prefix) or bool(self.stateful)
        if t.micro_batch_tokens is not None:
            self.micro_batch_tokens = t.micro_batch_tokens
        elif device.type == "cuda":  # the CPU's activation estimate is far above what a GPU needs
            # (bf16, flash attention): start large, halve on running out of memory (`_fitting`).
            # On an H100, 135M, 256 samples of ~290 tokens: 65,536 trained 3.4x faster than 4,096
            self.micro_batch_tokens = max(CUDA_MICRO_BATCH_TOKENS, self.pack_length)
        else:
            self.micro_batch_tokens = memory.micro_batch_tokens_for(
                self._base(self.model).config, t.activation_memory_gb, self.pack_length, t.gradient_checkpointing)
        self._micro_batch_start = self.micro_batch_tokens
        bf16 = t.dtype == "autocast_bf16"  # auto is float32 on every device (docs/gpu.md: it learned more)
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        if value is not None:
            self.critic = Critic(self, value, schedule)

    def _place(self, model):
        """The model on the trainer's device (FSDPTrainer: sharded over the ranks)."""
        return model.to(self.device)

    def _critic_network(self, model, config=None):
        """The critic's network: critic.model's checkpoint (with its `config`: only its structure,
        on the meta device), or a copy of the policy's trunk."""
        c, lora = self.cfg.critic, self.cfg.train.lora
        if c.model is not None:
            value = value_model_from(c.model, lora, config=config)
            if self.cfg.train.gradient_checkpointing:  # a copy of the policy's has it already
                (value.trunk.get_base_model() if lora is not None else value.trunk).gradient_checkpointing_enable()
            return value
        return value_model_of(model, lora) if self.is_peft else value_model_of(self._base(model))

    # ------------------------------------------------------------ training
    def train_step(self, batch: TrainBatch) -> dict:
        """All the updates of one step; returns metrics (means over updates)."""
        if self._share is not None:  # on a CPU: as many threads as other processes leave cores free
            self._share.apply()
        cfg, t = self.cfg, self.cfg.train
        if self.device.type == "cuda":  # the step's own high-water mark (perf/peak_device_gb)
            torch.cuda.reset_peak_memory_stats(self.device)
        multi = t.ppo_epochs * t.mini_batches > 1
        first = old_logprobs_first(cfg.algorithm.loss, self._loss_options())  # M2PO's mask, BAPO's over an IS mask
        old_BT = ent_BT = start_BT = None  # start_BT: the policy's logprobs before the step, where a pass made them
        top, otb = cfg.algorithm.top_entropy_quantile < 1.0, cfg.algorithm.advantage == "otb"
        if top or otb:  # one pass gives what they need and the old logprobs
            start_BT, ent_BT, others_sq_BT = self._fitting(self.token_stats, batch, None, top, otb)
            old_BT = start_BT if multi or first else None
        elif multi or first:
            old_BT = start_BT = self._fitting(self.logprobs, batch)
        ref_BT = None
        if cfg.algorithm.uses_reference:
            if self.is_peft:
                with self.model.disable_adapter():
                    ref_BT = self._fitting(self.logprobs, batch)
            else:
                ref_BT = self._fitting(self.logprobs, batch, self.ref_model)
        prepared = {}  # the metrics of what changes the batch's advantages
        if otb:  # the optimal token baseline: each token's advantage from the rewards in adv_B
            batch, prepared = self._token_baseline(batch, start_BT, others_sq_BT)
        if self.teacher is not None:  # on-policy distillation: advantages moved (sampled) or scaled (jsd)
            batch, prepared = self._teacher_batch(batch)
        critic = None
        if self.critic is not None:  # PPO with a critic: each token's advantage from its values
            if cfg.algorithm.kl_in_reward > 0 and start_BT is None:  # the KL in the reward is the policy's before the step
                start_BT = self._fitting(self.logprobs, batch)
            critic = self.critic.advantages(batch, start_BT if cfg.algorithm.kl_in_reward > 0 else None, ref_BT)
            batch = critic.batch
        groups = self._groups(batch)
        history: list[dict] = []
        skipped = False
        warming = self.critic is not None and self.steps_trained < cfg.critic.warmup_steps
        # a step may hold fewer groups than train.mini_batches (dynamic sampling out of rounds, failed
        # groups dropped, downsampling): one update per group then, none empty, and the learning-rate
        # schedule moved on by the updates not made, so it stays where the step count puts it
        chunks = min(t.mini_batches, len(groups))
        for epoch, k, idx in [] if warming else self._update_rows(batch, groups, chunks):
            metrics = self._update(batch.select(idx), None if old_BT is None else old_BT[idx],
                                   None if ref_BT is None else ref_BT[idx], fresh=epoch == k == 0,
                                   ent_BT=None if ent_BT is None else ent_BT[idx])
            history.append(metrics)
            skipped |= metrics.pop("skipped")
        for _ in range(t.ppo_epochs * (t.mini_batches - chunks) * (not warming)):  # warm-up: the policy's waits
            self.scheduler.step()
        if critic is not None:
            history += self.critic.train(critic, [idx for *_, idx in self._update_rows(batch, groups, chunks)],
                                         missing=t.ppo_epochs * (t.mini_batches - chunks))
        # each metric over the updates that report it (a max over no token is not reported)
        keys = dict.fromkeys(k for h in history for k in h)
        out = {k: sum(h[k] for h in history if k in h) / sum(k in h for h in history) for k in keys}
        if history and not warming:  # counts are the step's: its passes, and its loss tokens (once, not per epoch)
            out["actor/micro_batches"] = sum(h.get("actor/micro_batches", 0) for h in history)
            out["actor/loss_tokens"] = round(sum(h.get("actor/loss_tokens", 0) for h in history) / t.ppo_epochs)
        out["skipped_step"] = float(skipped)
        out.update(prepared)
        if critic is not None:
            out.update(critic.metrics)
            if warming:
                out["critic/warmup"] = 1.0
        if self.device.type == "cuda":
            out["perf/peak_device_gb"] = self._peak_device_gb()
        memory.release()
        if skipped:
            self.bad_steps += 1
        else:
            self.bad_steps = 0
        self.steps_trained += 1
        every = cfg.algorithm.ref_sync_every
        if every is not None and self.steps_trained % every == 0:
            self._sync_reference(cfg.algorithm.ref_mixup_alpha)
        return out

    def _update_rows(self, batch: TrainBatch, groups: list[int], chunks: int):
        """(epoch, mini-batch, its sequences) of each update: `ppo_epochs` passes over `chunks`
        mini-batches of whole groups."""
        t, index_B = self.cfg.train, batch.group_index_B.tolist()
        for epoch in range(t.ppo_epochs):
            for k in range(chunks):
                chosen = set(groups[k :: t.mini_batches])
                yield epoch, k, [i for i, g in enumerate(index_B) if g in chosen]

    @torch.no_grad()
    def _sync_reference(self, alpha: float) -> None:
        """TR-DPO's soft update of the KL reference: ref = alpha * policy + (1 - alpha) * ref."""
        ref = dict(self.ref_model.named_parameters())
        for name, p in self.model.named_parameters():
            ref[name].mul_(1.0 - alpha).add_(p.detach(), alpha=alpha)
        log.info("KL reference moved toward the policy (alpha %g) after step %d", alpha, self.steps_trained)

    def _peak_device_gb(self) -> float:
        """The most GPU memory this process's tensors held during the step (an engine sharing the
        device included), in GB."""
        return torch.cuda.max_memory_allocated(self.device) / 1e9

    def _groups(self, batch: TrainBatch) -> list[int]:
        """The step's groups, in the order mini-batches take them."""
        return batch.group_index_B.unique().tolist()

    def _fitting(self, fn, *args):
        """fn(*args), a pass over micro-batches that changes nothing but gradients (which it
        zeroes first); when the device runs out of memory, halve `micro_batch_tokens` (not below
        one row) and run it again. Logged; kept in the checkpoint."""
        while True:
            try:
                return fn(*args)
            except torch.OutOfMemoryError as e:
                if self.sharded:  # a rank cannot redo its passes alone: its peers wait in their collectives
                    raise RuntimeError(
                        f"out of device memory at train.micro_batch_tokens={self.micro_batch_tokens}: the sharded "
                        "trainer's ranks do not halve it as one trainer does; give a smaller "
                        "train.micro_batch_tokens, or train.gradient_checkpointing=true or train.fsdp_offload=true "
                        f"({' '.join(str(e).split())[:160]})") from None
                if self.micro_batch_tokens <= self.pack_length:
                    raise
            # outside the handler: the failed attempt's tensors are released with its traceback
            smaller = max(self.pack_length, self.micro_batch_tokens // 2)
            log.warning("out of device memory at train.micro_batch_tokens=%d; retrying at %d",
                        self.micro_batch_tokens, smaller)
            self.micro_batch_tokens = smaller
            self.optimizer.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _loss_options(self) -> dict:
        """`policy_loss` keyword arguments from the algorithm section (its `loss_options` first)."""
        from rollover.algos.loss_options import loss_options

        return loss_options(self.cfg.algorithm)

    def _update(self, batch: TrainBatch, old_BT, ref_BT, fresh: bool = False, ent_BT=None) -> dict:
        cfg, a = self.cfg, self.cfg.algorithm
        T = batch.mask_BT.shape[1]
        mask_BT = batch.mask_BT.to(self.device)
        # rows with no loss token (stale- or truncation-masked) are not counted (verl);
        # with ranks, both counts are the whole step's, summed over them
        num_tokens, num_seqs = self._counts(int(mask_BT.sum()), int(mask_BT.any(dim=1).sum()))
        num_seqs = max(num_seqs, 1)
        adv = (batch.adv_B if batch.adv_BT is None else batch.adv_BT).to(self.device)  # [B]; [B, T]: per-turn credit
        behav_BT, opts = batch.behav_logp_BT.to(self.device), self._loss_options()
        loss_mask_BT, top_BT, whole = self._per_update(batch, old_BT, behav_BT, adv, mask_BT, opts, fresh, ent_BT)
        need_entropy = True  # logged every step; cheap next to the forward
        adaptive = a.entropy_target is not None  # Skywork-OR1: on while the entropy is at or below the target
        self.entropy_coef_now = (self.entropy_coef if self.last_entropy <= a.entropy_target else 0.0) if adaptive \
            else a.entropy_coef

        def step_loss(values_BT, over_BT):  # a micro-batch's share of the update's loss (global normalisers)
            return aggregate(values_BT, over_BT, a.aggregation, num_tokens=max(num_tokens, 1), num_seqs=num_seqs,
                             max_len=cfg.rollout.max_new_tokens)

        def accumulate():
            """The micro-batches' forward and backward passes: gradients, and the sums for the metrics."""
            sums: dict[str, float] = {}
            tally = dict.fromkeys(TALLIES, 0.0)  # sums over the micro-batches' loss tokens, for the metrics
            finite = True
            self.optimizer.zero_grad(set_to_none=True)
            micro = self._micro_batches(batch)
            for mb in micro:
                sel = torch.tensor(mb.seq_index, dtype=torch.long, device=self.device)
                teacher = self._teacher_view(mb) if self.teacher_jsd else None
                logp, entropy, divergence, _ = self._forward(self.model, mb, need_entropy, teacher)
                m_BT = mask_BT[sel]
                # untrained tokens count nowhere; an image placeholder an environment inserted is
                # one, and the head's -inf for it (never sampled) would make the masked sums nan
                logp_BT = self._to_BT(logp, mb, T).masked_fill(~m_BT, 0.0)
                old = logp_BT.detach() if old_BT is None else old_BT[sel.cpu()].to(self.device)
                out = policy_loss(a.loss, logp_BT, old, adv[sel], loss_mask_BT[sel], behav_BT[sel], **opts)
                top = None if top_BT is None else top_BT[sel]
                keep = self._policy_term_kept(top, logp_BT, behav_BT[sel], adv[sel], m_BT, out.metrics)
                loss_BT = out.loss_BT if keep is None else out.loss_BT * keep
                pg_BT = loss_BT.detach()  # the policy term alone (actor/pg_loss): before KL, entropy and teacher
                if ref_BT is not None and a.kl_coef > 0:
                    kl_BT = kl_penalty(logp_BT, ref_BT[sel.cpu()].to(self.device), a.kl_estimator.rstrip("+"),
                                       k2_grad=a.kl_estimator.endswith("+"))
                    if a.kl_is_correction:  # pi / pi_old, with its gradient (0 outside the loss tokens: 1)
                        kl_BT = kl_BT * (logp_BT - old).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
                    loss_BT = loss_BT + a.kl_coef * kl_BT
                    tally["kl"] += float((kl_BT.detach() * m_BT).sum())
                taught_BT = None
                if divergence is not None:  # distill.loss=jsd: the teacher's divergence at each loss token
                    taught_BT = self._to_BT(divergence, mb, T).masked_fill(~m_BT, 0.0)
                    tally["taught"] += float(taught_BT.detach().sum())
                ent_BT = self._to_BT(entropy, mb, T)
                # the tokens the bonus acts on: the loss's (M2PO or an IS mask may have left some) that the
                # entropy quantile keeps (TRL's), where adaptive control also measures the entropy
                bonus_BT = out.mask_BT if top is None else out.mask_BT & top
                if self.entropy_coef_now:
                    loss_BT = loss_BT - self.entropy_coef_now * ent_BT * bonus_BT
                tally["entropy"] += float((ent_BT.detach() * m_BT).sum())
                tally["bonus"] += float((ent_BT.detach() * bonus_BT).sum())
                tally["bonus_tokens"] += float(bonus_BT.sum())
                # KL(sampler || trainer), k3 over the sampled tokens: the rollout-training mismatch
                # (engine precision, and for off-policy tokens their age)
                log_r = (logp_BT.detach() - behav_BT[sel]).clamp(max=20.0)
                tally["rollout_kl"] += float(((log_r.exp() - 1 - log_r) * m_BT).sum())
                loss = step_loss(loss_BT, out.mask_BT)
                if taught_BT is not None:  # over every loss token: the policy term's masks (M2PO, IS) are of ratios
                    loss = loss + cfg.distill.weight * step_loss(taught_BT, m_BT)
                if not torch.isfinite(loss):
                    finite = False
                    if not self.sharded:  # ranks go on: every rank runs the same passes (their collectives)
                        break
                loss.backward()
                if not mb.seq_index:  # a rank's stand-in pass (rollover.train.fsdp): nothing to count
                    continue
                tally["loss"] += float(loss.detach())
                tally["pg_loss"] += float(step_loss(pg_BT, out.mask_BT))
                given, kept = float(m_BT.sum()), float(out.mask_BT.sum())
                out.metrics["masked_frac"] = (given - kept) / max(given, 1)  # M2PO's drops too
                add_metrics(sums, out.metrics, {"masked_frac": given, "is": float(loss_mask_BT[sel].sum()), "": kept})
            tally["pad"] = float(sum(mb.pad_tokens for mb in micro))
            tally["slots"] = float(sum(mb.slots for mb in micro))
            return micro, sums, tally, finite

        # only the passes are redone on running out of memory: the optimizer step is not repeatable
        micro, sums, tally, finite = self._fitting(accumulate)
        sums, totals, finite = self._reduce(sums, tuple(tally.values()), finite)
        tally = dict(zip(tally, totals))
        grad_norm, finite = self._optimizer_step(finite)
        applied = self.entropy_coef_now
        if adaptive and finite and tally["bonus_tokens"] > 0:  # the next update's coefficient, from this one's entropy
            self.last_entropy = tally["bonus"] / tally["bonus_tokens"]
            step = a.entropy_coef_delta if self.last_entropy <= a.entropy_target else -a.entropy_coef_delta
            self.entropy_coef = min(max(self.entropy_coef + step, a.entropy_coef_min), a.entropy_coef_max)
        metrics = self._update_metrics(sums, whole, tally, num_tokens, kl=ref_BT is not None and a.kl_coef > 0)
        metrics.update({"actor/grad_norm": grad_norm, "actor/micro_batches": len(micro), "skipped": not finite})
        if adaptive:
            metrics["actor/entropy_coef"] = applied
        return metrics

    def _update_metrics(self, sums: dict, whole: dict, tally: dict, num_tokens: int, kl: bool) -> dict:
        """An update's metrics from its loss metrics' sums (`sums`), those chosen once over it
        (`whole`) and its tallies over the loss tokens (every rank's)."""
        metrics = {f"actor/{k}": v for k, v in mean_metrics(sums).items()}
        metrics.update({f"actor/{k}": float(v) for k, v in whole.items()})  # the same on every rank
        metrics.update({
            "actor/loss": tally["loss"],  # what the update minimised: the policy term, KL, entropy bonus, teacher
            "actor/pg_loss": tally["pg_loss"],
            "actor/lr": self.applied_lr,
            "actor/padding_fraction": tally["pad"] / max(tally["slots"], 1),
            "actor/loss_tokens": num_tokens,
        })
        if num_tokens:  # means over the update's loss tokens: an update with none has no value to report
            metrics["actor/entropy"] = tally["entropy"] / num_tokens
            metrics["actor/rollout_kl"] = tally["rollout_kl"] / num_tokens
            if kl:
                metrics["actor/kl"] = tally["kl"] / num_tokens
            if self.teacher_jsd:
                metrics["distill/divergence"] = tally["taught"] / num_tokens
        return metrics

    def _policy_term_kept(self, top_BT, logp_BT, behav_BT, adv, mask_BT, metrics: dict):
        """The tokens whose policy term counts in a pass (None: all): those the entropy quantile kept
        (`top_BT`) and OPSM keeps (its metric into `metrics`). They weigh the policy term only, as in
        TRL: the tokens they drop keep their KL term and count in every denominator."""
        keep = top_BT
        if self.cfg.algorithm.opsm_delta is not None:
            adv_BT = adv if adv.dim() == 2 else adv[:, None].expand_as(logp_BT)
            ok_BT, opsm = opsm_mask(logp_BT, behav_BT, adv_BT, mask_BT, delta=self.cfg.algorithm.opsm_delta)
            keep = ok_BT if keep is None else keep & ok_BT
            metrics.update(opsm)
        return keep

    def _per_update(self, batch: TrainBatch, old_BT, behav_BT, adv, mask_BT, opts: dict, fresh: bool, ent_BT=None):
        """What is chosen once over all the update's loss tokens, every micro-batch and rank, before any
        pass: the loss mask after M2PO (opts' m2po_tau, taken out), the tokens whose policy term the
        entropy quantile keeps (`ent_BT`: the tokens' entropies; None: every token) and BAPO's bounds
        (put in opts for every micro-batch's loss); and their metrics, the same on every rank.
        `fresh`: the weights are still those old_BT was recorded under (the step's first update)."""
        tau, whole, top_BT = opts.pop("m2po_tau", None), {}, None
        if ent_BT is not None:
            top_BT, whole = top_entropy_mask(ent_BT.to(self.device), mask_BT, self.cfg.algorithm.top_entropy_quantile,
                                             gather=self._gather)
        if tau is not None:
            mask_BT, m2po = m2po_update_mask(old_BT, behav_BT, mask_BT, batch.group_index_B, tau=tau,
                                             reduce=self._all_reduce, gather=self._gather)
            whole = {**whole, **m2po}
        if self.cfg.algorithm.loss == "bapo":  # r = pi / pi_old is 1 until the weights move: no pass then
            old = torch.zeros_like(behav_BT) if old_BT is None else old_BT.to(self.device)
            now = old if old_BT is None or fresh else self._fitting(self.logprobs, batch)
            bounds = bapo_update_bounds(now, old, adv, mask_BT, behav_BT, reduce=self._sum, **opts)
            opts["bounds"] = bounds[:2]
            whole = {**whole, **dict(zip(("bapo_c_low", "bapo_c_high", "bapo_pos_share"), bounds))}
        return mask_BT, top_BT, whole

    def _optimizer_step(self, finite: bool) -> tuple[float, bool]:
        """Clip and step when the loss and the gradient are finite (else skip this update, with a
        warning); the gradient's norm (NaN when skipped at the loss) and whether it stepped."""
        grad_norm = float("nan")
        self.applied_lr = self.scheduler.get_last_lr()[0]  # this update's rate (the scheduler then moves on)
        if finite:
            grad_norm = self._clip_grad_norm()
            finite = math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            self.scheduler.step()
        else:
            warnings.warn("non-finite loss or gradient: this update is skipped", RuntimeWarning, stacklevel=3)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, finite

    def _counts(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The update's loss tokens and sequences (FSDPTrainer: summed over the ranks)."""
        return num_tokens, num_seqs

    def _reduce(self, sums: dict, totals: tuple, finite: bool) -> tuple[dict, tuple, bool]:
        """An update's metric sums, totals and finiteness (FSDPTrainer: over the ranks)."""
        return sums, totals, finite

    def _gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Every rank's `rows` (a small CPU tensor) concatenated in rank order, and where this
        rank's begin (FSDPTrainer: over the ranks); M2PO's tie-break at its cut."""
        return rows, 0

    def _all_reduce(self, values: torch.Tensor, op: str) -> torch.Tensor:
        """A CPU tensor summed ("sum") or its maximum taken ("max") over the ranks (FSDPTrainer);
        M2PO's exact sums and its bisection."""
        return values

    def _sum(self, values: torch.Tensor) -> torch.Tensor:
        """A float64 CPU tensor summed over the ranks (FSDPTrainer); BAPO's tables."""
        return values

    def _whole(self, values_N: torch.Tensor, mb) -> torch.Tensor:
        """Values of the response tokens this process predicts as those of all the micro-batch's
        (a sequence-parallel rank's are its slice's: FSDPTrainer gathers its group's)."""
        return values_N

    def _pass(self, model, fn):
        """fn(model): a pass over `model` (FSDPTrainer: inside its root unit, its shards gathered)."""
        return fn(model)

    def _clip_grad_norm(self, params=None) -> float:
        """The gradient's norm (of `params`; default the policy's), clipped to train.grad_clip when
        that is set."""
        params = [p for p in (self.model.parameters() if params is None else params) if p.grad is not None]
        if self.cfg.train.grad_clip > 0:
            return float(torch.nn.utils.clip_grad_norm_(params, self.cfg.train.grad_clip))
        return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))

    # ------------------------------------------------------------ weights & state
    def named_weights(self):
        """(HF name, tensor) pairs of the full policy, LoRA merged in, for the engine."""
        if not self.is_peft:
            return [(n, p.detach()) for n, p in self.model.named_parameters()]
        # W + delta as new tensors: peft's merge_adapter then unmerge_adapter computes W + d - d
        # in place, which rounds, and the frozen base drifted away from the checkpoint's (a
        # resumed run then trained on another base)
        from peft.tuners.lora import LoraLayer

        merged = {}
        with torch.no_grad():
            for name, module in self.model.named_modules():
                if isinstance(module, LoraLayer) and not module.merged:
                    adapters = [a for a in module.active_adapters if a in module.lora_A or a in module.lora_embedding_A]
                    if adapters:
                        w = module.get_base_layer().weight
                        merged[f"{name}.base_layer.weight"] = w + sum(module.get_delta_weight(a) for a in adapters)
        out = []
        for n, p in self.model.named_parameters():
            if "lora_" in n:
                continue
            out.append((n.removeprefix("base_model.model.").replace(".base_layer", ""), merged.get(n, p).detach()))
        return out

    @property
    def architecture(self):
        """The policy's HF model (the base model under LoRA): what an engine copies."""
        return self.model.get_base_model() if self.is_peft else self.model

    def close(self) -> None:
        """Nothing lives outside this process."""

    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "bad_steps": self.bad_steps, "steps_trained": self.steps_trained,
                 "entropy_control": [self.entropy_coef, self.last_entropy],
                 "micro_batch_tokens": [self._micro_batch_start, self.micro_batch_tokens]}
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
        if self.cfg.algorithm.ref_sync_every is not None:  # moved off the starting model: kept
            state["reference"] = {n: p.detach().to("cpu", copy=True) for n, p in self.ref_model.named_parameters()}
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("sharded"):
            from rollover.config import ConfigError

            raise ConfigError("the checkpoint was written by sharded trainer ranks (train.parallel=fsdp): resume it "
                              "with train.parallel=fsdp (any train.ranks)")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.bad_steps = state["bad_steps"]
        self.steps_trained = state.get("steps_trained", 0)  # older checkpoints lack it
        self.entropy_coef, self.last_entropy = state.get("entropy_control", (self.entropy_coef, self.last_entropy))
        start, now = state.get("micro_batch_tokens", (None, None))  # older checkpoints lack it
        if start == self._micro_batch_start:  # halved after running out of memory: stays halved
            self.micro_batch_tokens = now
        if self.critic is not None:
            if "critic" not in state:
                raise self.critic.missing_error()
            self.critic.load_state_dict(state["critic"])
        if self.cfg.algorithm.ref_sync_every is not None:
            self._load_reference(state.get("reference"))
        self.follow_schedules()

    def follow_schedules(self) -> None:
        """The policy's and critic's rates from this run's schedules, after a checkpoint's optimizer
        and scheduler state are loaded (`follow_schedule`)."""
        follow_schedule(self.scheduler, self.base_lrs)
        if self.critic is not None:
            follow_schedule(self.critic.scheduler, self.critic.base_lrs)

    @torch.no_grad()
    def _load_reference(self, saved: dict | None) -> None:
        """The moved KL reference a checkpoint holds (none: it was written before the run synced its
        reference, which then starts from the starting model, with a warning)."""
        if saved is None:
            warnings.warn("algorithm.ref_sync_every: the checkpoint holds no moved KL reference; the reference "
                          "starts again from the starting model", RuntimeWarning, stacklevel=3)
            return
        for name, p in self.ref_model.named_parameters():
            p.copy_(saved[name])


CUDA_MICRO_BATCH_TOKENS = 65536


def default_pack_length(cfg: Config, shared_prefix: bool) -> int:
    """Row length when train.pack_length is unset: the longest sequence; with shared prefixes, room
    for a whole group (the prompt once, then every response) up to 4 x the longest sequence, so
    most groups share one prompt while the [L, L] attention of a row stays small. Never above a
    micro_batch_tokens the user set."""
    longest = cfg.longest_sequence()[0]
    if not shared_prefix:
        return longest
    if cfg.env.name is not None:
        group = cfg.env.max_total_tokens * cfg.rollout.samples_per_prompt  # turns are not a shared prompt
    else:
        group = cfg.data.max_prompt_tokens + cfg.rollout.samples_per_prompt * cfg.rollout.max_new_tokens
    length = max(longest, min(group, 4 * longest))
    return max(longest, min(length, cfg.train.micro_batch_tokens or length))
