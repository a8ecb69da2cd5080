"""One rank of a sharded trainer on PyTorch's FSDP2 (`train.parallel: fsdp`).

`FSDPTrainer` is `rollover.train.trainer.Trainer` with its model sharded over the ranks of the
default process group: `fully_shard` on every decoder layer and on a root module that holds the
rest (embeddings, final norm, LM head), so a rank keeps 1/N of the weights, gradients and AdamW
moments and gathers one layer's weights at a time for its forward and backward. Each rank trains
its share of the step's sequences (`split_batch`); what makes N ranks train as one:

- **Global normalisers.** An update's loss is normalised by the whole step's loss tokens and
  sequences, summed over the ranks before any forward (`_counts`), so every aggregation (token
  mean, sequence mean, Dr.GRPO's constant) is the one-rank loss, split. FSDP's reduce-scatter
  then *sums* the ranks' gradients (its averaging is turned off): the one-rank gradient.
- **The same passes on every rank.** A forward gathers weights collectively, so a rank with
  fewer micro-batches than another runs stand-in passes over one padding token, which select no
  token and add nothing (`_micro_batches`). With images, every pass of an update in which any
  rank has one runs the vision tower once: a pass with no image of its own runs it on a stand-in
  image (`rollover.data.media.stand_in_image`) whose features join the embeddings at zero weight. A non-finite loss does not stop a rank early; the
  ranks agree afterwards whether the update is skipped (`_reduce`).
- **One M2PO mask.** The ranks find M2PO's cut over all the update's loss tokens together, by a
  bisection whose every step sums exactly over the ranks (`_all_reduce`; 35 KB a step, never the
  tokens), and break ties at the cut in one order (`_gather`), so M2PO drops what one trainer
  would.
- **One pair of BAPO bounds.** Every rank sums its update tokens' candidate tables and the ranks
  add them up (`_sum`) before the search, so every rank clips where one trainer would.
- **Metrics** are summed over the ranks, so rank 0 reports the step's (M2PO's and BAPO's, the
  same on every rank, are not summed).

Mixed precision (`train.dtype: autocast_bf16`): bf16 weights in the forward and backward, fp32
master weights, gradients reduced in fp32 (`MixedPrecisionPolicy`). `train.fsdp_offload`: the
sharded weights, gradients and optimizer state live on the CPU (`CPUOffloadPolicy`) and each
layer is copied to the GPU for its passes. Gradient checkpointing, LoRA, shared-prefix packing
and chunked logprobs work as in one process.

With `train.sequence_parallel` N, each N consecutive ranks train one share together, each on
1/N of every row (`rollover.train.ulysses`); the sums above are taken over one rank of each such
group (`_peers`), since its ranks hold the same sequences.

Weights leave the ranks in buckets (`gather_buckets`): every rank takes part in gathering each
full tensor, rank 0 keeps a bucket of at most `train.weight_bucket_mb` and hands it on before
gathering the next, so no rank holds a second full copy. Checkpoints are
`torch.distributed.checkpoint` directories (each rank writes its shards of the weights and the
optimizer state; `save_sharded` / `load_sharded`), loadable at another world size.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from rollover.train.batch import MicroBatch, TrainBatch
from rollover.train.fsdp_checkpoint import ShardedCheckpoints
from rollover.train.fsdp_rank0 import broadcast_whole, check_same_model, receive_shards
from rollover.train.metric_sums import reduce_sums
from rollover.train.trainer import Trainer

log = logging.getLogger("rollover")


def decoder_layers(model) -> list[nn.Module]:
    """The decoder layers FSDP shards one by one: the modules of the classes the model names as
    not to be split (`_no_split_modules`: `LlamaDecoderLayer`, `GPT2Block`, ...), outermost
    ones only, else its trunk's `layers`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers, inside = [], set()
    for name, module in base.named_modules():
        if type(module).__name__ in names and not any(name.startswith(p + ".") for p in inside):
            layers.append(module)
            inside.add(name)
    if not layers:
        layers = list(getattr(base.base_model, "layers", None) or ())
    if not layers:
        raise ValueError(f"train.parallel=fsdp: {type(base).__name__} names no decoder layers to shard one by one")
    return layers


class _Root(nn.Module):
    """The root FSDP unit: the model's parameters outside its decoder layers (embeddings, final
    norm, LM head) are gathered when this module's forward runs. The trainer's forward (trunk,
    then the LM head on the selected positions, in chunks) runs inside it as `fn(model)`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.lm = model

    def forward(self, fn):
        return fn(self.lm)


def split_batch(batch: TrainBatch, world: int) -> list[list[int]]:
    """Sequence indices for each rank: groups whole (their shared prompt packs once), balanced
    by tokens (largest group first onto the rank with the fewest tokens so far); a step with
    fewer groups than ranks is split by sequences. A rank may get none (it runs stand-in passes)."""
    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(batch.group_index_B.tolist()):
        groups.setdefault(g, []).append(i)
    units = list(groups.values()) if len(groups) >= world else [[i] for i in range(len(batch))]
    units.sort(key=lambda u: (-sum(lengths[i] for i in u), u[0]))
    shares: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for u in units:
        r = min(range(world), key=lambda k: (load[k], k))
        shares[r].extend(u)
        load[r] += sum(lengths[i] for i in u)
    return [sorted(s) for s in shares]


def _sequence_parallel_groups(rank: int, world: int, size: int):
    """(this rank's sequence-parallel group: `size` consecutive ranks, its data-parallel peers:
    the ranks at its place in every such group, on gloo), or (None, None) for size 1. Every
    rank makes every group, in one order, as torch.distributed requires."""
    if size == 1:
        return None, None
    mine = None, None
    for start in range(0, world, size):
        g = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = g, mine[1]
    for index in range(size):
        g = dist.new_group(list(range(index, world, size)), backend="gloo")
        if rank % size == index:
            mine = mine[0], g
    return mine


def _stand_in(pad_id: int, shared_prefix: bool) -> MicroBatch:
    """A pass over one padding token that selects no token: it gathers and reduces like any
    micro-batch and contributes nothing."""
    empty = torch.zeros(0, dtype=torch.long)
    one = torch.zeros((1, 1), dtype=torch.long)
    return MicroBatch([], torch.full((1, 1), pad_id, dtype=torch.long), one.clone(), empty, empty.clone(),
                      empty.clone(), empty.clone(), empty.clone(), pad_tokens=1, slots=1,
                      segment=torch.full((1, 1), -1, dtype=torch.long) if shared_prefix else None,
                      response=one.clone() if shared_prefix else None)


class FSDPTrainer(ShardedCheckpoints, Trainer):
    """A `Trainer` whose model is sharded over the ranks of the default process group."""

    sharded = True

    def __init__(self, model, cfg, *, device: torch.device, pad_id: int = 0, from_rank0: bool = False,
                 reference=None):
        """from_rank0: the ranks other than 0 built only the model's structure, on the meta device
        (started by torchrun, `rollover.train.torchrun`): they shard it and take their parts of
        rank 0's tensors."""
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.sp = cfg.train.sequence_parallel
        self._sp_group, self._dp_group = _sequence_parallel_groups(self.rank, self.world, self.sp)
        self._from_rank0 = from_rank0
        self._global_groups: list[int] | None = None
        self._roots: dict[int, _Root] = {}
        self._reference_saved = False  # the checkpoint being resumed holds a moved KL reference
        self._rank0_built: set[int] = set()  # models only rank 0 read from disk (critic.model, distill.teacher): the others take its tensors
        self._teacher_head = None  # distill.loss=jsd: the teacher's output layer, whole (`_teacher_view`)
        super().__init__(model, cfg, device=device, pad_id=pad_id, reference=reference)

    # ------------------------------------------------------------ sharding
    def _place(self, model):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        t = self.cfg.train
        mesh = init_device_mesh(self.device.type, (self.world,))
        from_rank0 = self._from_rank0 or id(model) in self._rank0_built
        if from_rank0:
            shapes = check_same_model(model)
            if self.rank == 0:  # its whole tensors to the others, then it shards them as usual
                broadcast_whole(model, self.device)
        kw = {"mesh": mesh}
        if t.dtype == "autocast_bf16":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if t.fsdp_offload:
            kw["offload_policy"] = CPUOffloadPolicy()
        if self.sp > 1:
            from rollover.train import ulysses

            ulysses.use(model, self.sp)
        for layer in decoder_layers(model):
            fully_shard(layer, **kw)
        root = _Root(model)
        fully_shard(root, **kw)
        if from_rank0 and self.rank != 0:  # built on the meta device: room for its shards only, then rank 0's values
            model.to_empty(device="cpu" if t.fsdp_offload else self.device)
            for b in model.buffers():  # buffers are not sharded or offloaded: they stay where the passes run
                b.data = b.data.to(self.device)
            receive_shards(model, shapes, self.device, self.rank, self.world)
        # the ranks' losses are parts of one sum (global normalisers): add their gradients, do not average
        for m in root.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
        self._roots[id(model)] = root
        return model

    def _critic_network(self, model):
        """critic.model: read by rank 0 (`_read_on_rank0`)."""
        if self.cfg.critic.model is None:
            return super()._critic_network(model)
        return self._read_on_rank0(lambda config: Trainer._critic_network(self, model, config=config),
                                   "the critic from critic.model")

    def _teacher_network(self, config=None):
        """distill.teacher: read by rank 0 (`_read_on_rank0`)."""
        return self._read_on_rank0(lambda config: Trainer._teacher_network(self, config=config),
                                   "the teacher from distill.teacher")

    @torch.no_grad()
    def _teacher_view(self, mb):
        """distill.loss=jsd: the teacher's hidden states through its own root (the rank's trunk
        over the micro-batch, its slice of it with sequence parallelism), and its output layer
        whole, copied out of the root's gathered parameters at the first call and kept: the
        forward's chunks (and their recomputation in the backward) apply it after the root has
        let its parameters go."""
        from rollover.train.heads import LogitHead

        root = self._roots[id(self.teacher)]

        def view(teacher):
            base = self._base(teacher)
            if self._teacher_head is None:
                head, layer = LogitHead(base), base.get_output_embeddings()
                weight = layer.weight.detach().clone()
                bias = None if getattr(layer, "bias", None) is None else layer.bias.detach().clone()
                head.module = lambda hidden: torch.nn.functional.linear(hidden, weight, bias)
                self._teacher_head = head
            return self._trunk(teacher, base, mb)[0]

        hidden = root(view)
        root.reshard()
        return self._teacher_head, hidden

    def _read_on_rank0(self, build, what: str):
        """`build(config)` on every rank: rank 0's reads the checkpoint (config None), the others
        build its structure on the meta device from rank 0's config and take their parts of rank
        0's tensors when it is placed (as torchrun's ranks do the policy's). A failure on rank 0
        reaches every rank, as its text."""
        built, config, failed = None, [None], None
        if self.rank == 0:
            try:
                built = build(None)
                config[0] = built.config
            except Exception as e:  # noqa: BLE001 - every rank raises, none waits for tensors
                failed, config[0] = e, f"{type(e).__name__}: {e}"
        dist.broadcast_object_list(config, src=0, group=self._cpu_group)
        if failed is not None:
            raise failed
        if isinstance(config[0], str):
            raise RuntimeError(f"trainer rank 0 could not build {what}: {config[0]}")
        if built is None:
            built = build(config[0])
        self._rank0_built.add(id(built))
        return built

    # ------------------------------------------------------------ passes
    def _forward(self, model, mb: MicroBatch, need_entropy: bool, teacher=None, others_sq: bool = False):
        root = self._roots[id(model)]
        out = root(lambda lm: Trainer._forward(self, lm, mb, need_entropy, teacher, others_sq))
        return tuple(None if x is None else self._whole(x, mb) for x in out)

    def _whole(self, values_N: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        if self.sp == 1:
            return values_N
        from rollover.train.ulysses import gather_tokens

        return gather_tokens(values_N, mb.sel_col // self._sp_slice, self._sp_pass)

    def _trunk(self, model, base, mb: MicroBatch):
        """With train.sequence_parallel: the trunk over this rank's slice of every row (the rows
        padded to a multiple of the group's size), and the response tokens predicted there."""
        if self.sp == 1:
            return super()._trunk(model, base, mb)
        from rollover.train import ulysses

        if mb.media is not None or mb.stand_in_image is not None:
            raise ValueError("train.sequence_parallel: prompts with images are not supported yet")
        L = mb.input_ids.shape[1]
        width = -(-L // self.sp)  # each rank's slice of a row
        extra = width * self.sp - L
        ids = torch.nn.functional.pad(mb.input_ids, (0, extra), value=self.pad_id)
        positions = torch.cat([mb.position_ids, torch.arange(extra, device=ids.device).expand(len(ids), extra)], 1)
        allow = mb.allow()
        if allow is not None and extra:  # the padding attends to itself (it is never selected)
            allow = torch.nn.functional.pad(allow, (0, extra, 0, extra)) | torch.eye(L + extra, dtype=torch.bool,
                                                                                    device=allow.device)
        self._sp_slice = width
        self._sp_pass = ulysses.Pass(self._sp_group, self.sp, self.rank % self.sp, ulysses.row_mask(positions, allow))
        ulysses.set_pass(self._sp_pass)
        lo = self._sp_pass.index * width
        with self.autocast:
            hidden = base.base_model(input_ids=ids[:, lo: lo + width], position_ids=positions[:, lo: lo + width],
                                     use_cache=False).last_hidden_state
        mine = (mb.sel_col // width) == self._sp_pass.index
        return hidden[mb.sel_row[mine], mb.sel_col[mine] - lo], mb.targets[mine]

    def _inputs(self, base, mb: MicroBatch) -> dict:
        if mb.stand_in_image is None:
            return super()._inputs(base, mb)
        # the tower runs on the stand-in image before the trunk, as it does on a real one, and the
        # features the model's forward takes of it (`pooler_output`: not the other layers' states,
        # which a real pass leaves unused) join the embeddings at zero weight: the same gathers and
        # reductions as the peers' passes, and nothing added to any gradient
        features = base.base_model.get_image_features(**mb.stand_in_image)
        zero = sum(t.float().sum() for t in _tensors(features.pooler_output)) * 0.0
        embeds = base.get_input_embeddings()(mb.input_ids)
        return {"inputs_embeds": embeds + zero.to(embeds.dtype)}

    def _micro_batches(self, batch: TrainBatch) -> list[MicroBatch]:
        micro = super()._micro_batches(batch) if len(batch) else []
        count = torch.tensor([len(micro)], dtype=torch.long)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self._cpu_group)
        while len(micro) < int(count):
            micro.append(_stand_in(self.pad_id, self.shared_prefix).to(self.device))
        if batch.media is not None and self._images_anywhere(batch):
            for mb in micro:  # every rank's every pass runs the vision tower once
                if mb.media is None:
                    mb.stand_in_image = self._stand_in_image()
        return micro

    def _images_anywhere(self, batch: TrainBatch) -> bool:
        """Whether any rank's share of these sequences has an image. `batch.media` is a list on
        every rank when the step has images (None on every rank when not), so all ranks ask.
        Asked per pass set (an update's mini-batch may hold none): an update whose sequences have
        no image runs no tower anywhere, so its weights get no gradient, as with one trainer."""
        mine = torch.tensor([int(any(m is not None for m in batch.media))], dtype=torch.long)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self._cpu_group)
        return bool(mine)

    def _stand_in_image(self) -> dict:
        if not hasattr(self, "_stand_in_inputs"):
            from rollover.data.media import stand_in_image

            self._stand_in_inputs = {k: v.to(self.device) for k, v in stand_in_image(self._base(self.model).config).items()}
        return self._stand_in_inputs

    def train_step(self, batch: TrainBatch, groups: list[int] | None = None) -> dict:
        """`groups`: the whole step's group indices (mini-batches take them in this order on
        every rank); default: this rank's."""
        self._global_groups = groups
        try:
            return super().train_step(batch)
        finally:
            self._global_groups = None

    def _groups(self, batch: TrainBatch) -> list[int]:
        return self._global_groups if self._global_groups is not None else super()._groups(batch)

    @property
    def _cpu_group(self):
        """The group for small CPU tensors and objects (gloo; with NCCL a gloo group beside it)."""
        if not hasattr(self, "_gloo"):
            self._gloo = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return self._gloo

    @property
    def _peers(self):
        """The group over which the step's sums are taken: every rank, or with
        train.sequence_parallel one rank of each sequence-parallel group (its ranks hold the
        same sequences)."""
        return self._dp_group if self.sp > 1 else self._cpu_group

    def _counts(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        both = torch.tensor([num_tokens, num_seqs], dtype=torch.long)
        dist.all_reduce(both, group=self._peers)
        return int(both[0]), int(both[1])

    def _peak_device_gb(self) -> float:
        """The largest of the ranks' step peaks (each rank's own GPU)."""
        peak = torch.tensor([super()._peak_device_gb()])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self._cpu_group)
        return float(peak[0])

    def _reduce(self, sums: dict, totals: tuple, finite: bool) -> tuple[dict, tuple, bool]:
        parts: list = [None] * (self.world // self.sp)
        dist.all_gather_object(parts, (sums, totals, finite), group=self._peers)
        out = reduce_sums([s for s, _, _ in parts])
        return out, tuple(sum(t[i] for _, t, _ in parts) for i in range(len(totals))), all(f for _, _, f in parts)

    def _gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
        parts: list = [None] * (self.world // self.sp)
        dist.all_gather_object(parts, rows, group=self._peers)
        return torch.cat(parts), sum(len(p) for p in parts[: self.rank // self.sp])

    def _whole_groups(self, sums: dict) -> dict:
        from rollover.algos.token_baseline import merge

        if self._global_groups is not None and len(self._global_groups) >= self.world // self.sp:
            return sums  # as many groups as data-parallel ranks: `split_batch` kept each whole on one

        parts: list = [None] * (self.world // self.sp)  # tensors on the CPU: objects travel on gloo
        dist.all_gather_object(parts, {g: s._replace(weighted_T=s.weighted_T.cpu(), energy_T=s.energy_T.cpu())
                                       for g, s in sums.items()}, group=self._peers)
        return merge(parts)

    def _all_reduce(self, values: torch.Tensor, op: str) -> torch.Tensor:
        values = values.clone()
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        dist.all_reduce(values, op=ops[op], group=self._peers)
        return values

    def _sum(self, values: torch.Tensor) -> torch.Tensor:
        values = values.to(torch.float64, copy=True)
        dist.all_reduce(values, group=self._peers)
        return values

    def _pass(self, model, fn):
        return self._roots[id(model)](fn)

    def _clip_grad_norm(self, params=None) -> float:
        params = [p for p in (self.model.parameters() if params is None else params) if p.grad is not None]
        clip = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    # ------------------------------------------------------------ measuring
    def profiled_step(self, batch: TrainBatch, groups: list[int] | None = None) -> tuple[dict, float, float]:
        """`train_step` with its collectives timed: (metrics, seconds, seconds inside them).
        FSDP's all-gathers and reduce-scatters and the all-reduces run synchronously during this
        step, each timed (torch's profiler would hold GBs of events for a long CPU step)."""
        import time

        timed = {"s": 0.0}

        def clocked(fn):
            def call(*args, **kwargs):
                kwargs["async_op"] = False  # the wait is inside the call, and counted
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    timed["s"] += time.perf_counter() - t0
            return call

        names = ("all_gather_single", "reduce_scatter_single", "all_reduce")
        real = {n: getattr(dist, n) for n in names}
        for n in names:
            setattr(dist, n, clocked(real[n]))
        try:
            t0 = time.perf_counter()
            metrics = self.train_step(batch, groups)
            seconds = time.perf_counter() - t0
        finally:
            for n in names:
                setattr(dist, n, real[n])
        return metrics, seconds, timed["s"]

    def state_bytes(self) -> dict:
        """Bytes this rank holds of the weights, their gradients (one per trainable shard during a
        step) and the optimizer's state."""
        def local(t):
            t = t.to_local() if hasattr(t, "to_local") else t
            return t.numel() * t.element_size()

        params = list(self.model.parameters())
        return {"params": sum(local(p) for p in params), "grads": sum(local(p) for p in params if p.requires_grad),
                "optimizer": sum(local(v) for s in self.optimizer.state.values() for v in s.values()
                                 if torch.is_tensor(v) and v.dim() > 0)}

    # ------------------------------------------------------------ weights
    def gather_buckets(self, bucket_bytes: int, dtype: torch.dtype | None = None,
                       everyone: bool = False) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full tensors, in buckets of about `bucket_bytes`, every rank taking part in each gather;
        rank 0's buckets hold the tensors (on the CPU, LoRA merged, floating ones in `dtype` if
        given), the other ranks' are empty. With `everyone`, every rank's buckets hold them, on
        its own device (for its colocated engine). Names are the HF model's (as `named_weights`)."""
        bucket, size = [], 0
        keep = everyone or self.rank == 0
        for name, tensor in self._full_tensors():
            cast = dtype is not None and tensor.is_floating_point()
            # every rank counts the full tensor's bytes, so every rank closes its buckets (each
            # its own call, for Ray's rank actors) after the same tensors
            size += tensor.numel() * (torch.empty((), dtype=dtype).element_size() if cast else tensor.element_size())
            if keep:
                t = tensor.detach() if everyone else tensor.detach().to("cpu")
                bucket.append((name, t.to(dtype) if cast else t))
            del tensor
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if size:
            yield bucket

    def _full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of the policy, one gather at a time (all ranks call it)."""
        def full(p):
            return p.full_tensor() if hasattr(p, "full_tensor") else p

        if not self.is_peft:
            for n, p in self.model.named_parameters():
                yield n, full(p)
            return
        # LoRA: W + scale * B @ A for every adapted weight, merged from gathered tensors
        lora = {}
        for n, p in self.model.named_parameters():
            if "lora_" in n:
                lora[n] = full(p).detach()
        scaling = {}
        for n, m in self.model.named_modules():
            if hasattr(m, "scaling") and isinstance(getattr(m, "scaling"), dict) and "default" in m.scaling:
                scaling[n] = m.scaling["default"]
        known = (".lora_A.default.weight", ".lora_B.default.weight", ".lora_embedding_A.default",
                 ".lora_embedding_B.default")
        other = sorted(n for n in lora if not n.endswith(known))
        if other:  # DoRA's magnitudes and the like: merged by rules this does not know
            raise ValueError(f"train.parallel=fsdp merges plain LoRA adapters only; {other[0]} is another kind")
        for n, p in self.model.named_parameters():
            if "lora_" in n:
                continue
            t = full(p).detach()
            mod = n.rsplit(".base_layer.", 1)[0] if ".base_layer." in n else None
            if mod is not None and n.endswith("weight") and f"{mod}.lora_A.default.weight" in lora:
                a, b = lora[f"{mod}.lora_A.default.weight"], lora[f"{mod}.lora_B.default.weight"]
                t = t + (b.float() @ a.float()).to(t.dtype) * scaling[mod]
            elif mod is not None and n.endswith("weight") and f"{mod}.lora_embedding_A.default" in lora:
                # an embedding's adapter: A [r, vocab], B [dim, r]; the delta is (B @ A)^T
                a, b = lora[f"{mod}.lora_embedding_A.default"], lora[f"{mod}.lora_embedding_B.default"]
                t = t + (b.float() @ a.float()).T.to(t.dtype) * scaling[mod]
            yield n.removeprefix("base_model.model.").replace(".base_layer", ""), t

    # ------------------------------------------------------------ reference
    def logprobs(self, batch, model=None, entropy: bool = False):
        out = super().logprobs(batch, model, entropy)
        if model is not None and model is not self.model:  # a frozen model (the KL reference, the teacher) has no
            self._roots[id(model)].reshard()  # backward to free its root's gathered embeddings and head: free them now
        return out

    def _sync_reference(self, alpha: float) -> None:
        for model in (self.model, self.ref_model):  # each its own shards: a root kept whole after its
            self._roots[id(model)].reshard()        # forward would take the update in a passing copy
        super()._sync_reference(alpha)


def _tensors(out) -> list[torch.Tensor]:
    """The floating tensors in a model output (a tensor, a tuple or list, or a `ModelOutput`)."""
    if torch.is_tensor(out):
        return [out] if out.is_floating_point() else []
    values = out.values() if hasattr(out, "values") and callable(out.values) else out if isinstance(out, (list, tuple)) else []
    return [t for v in values for t in _tensors(v)]


@contextlib.contextmanager
def process_group(backend: str, rank: int, world: int, init_method: str, timeout_s: float):
    """The default process group for one rank, destroyed on the way out."""
    import os
    from datetime import timedelta

    # under torchrun this would make rank 0 a client of torchrun's store instead of the host of
    # the group's own (`init_method` names a port of the driver's machine)
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    dist.init_process_group(backend, rank=rank, world_size=world, init_method=init_method,
                            timeout=timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
