"""Weights from rank 0 to ranks that built only a model's structure (torchrun's ranks, a critic
read from its checkpoint by rank 0 alone): each whole tensor broadcast in turn, each rank keeping
its shard of it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def check_same_model(model: nn.Module) -> list[tuple]:
    """Every rank built rank 0's model (names, shapes, dtypes of its parameters and buffers), or
    all of them raise: one broadcast too many or too few would hang them. Returns them."""
    mine = [(n, tuple(t.shape), str(t.dtype)) for n, t in [*model.named_parameters(), *model.named_buffers()]]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for r, theirs in enumerate(every):
        if theirs != every[0]:
            diff = next((a, b) for a, b in zip(every[0] + [None], theirs + [None]) if a != b)
            raise ValueError(f"rank {r} built another model than rank 0: {diff[1]} where rank 0 has {diff[0]}")
    return mine


def broadcast_whole(model: nn.Module, device: torch.device) -> None:
    """Rank 0: each parameter and buffer, whole, a tensor at a time (through the GPU on GPUs, so
    NCCL carries it)."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.detach().to(device), src=0)


def receive_shards(model: nn.Module, shapes: list[tuple], device: torch.device, rank: int, world: int) -> None:
    """Another rank, its model sharded: each of rank 0's tensors in turn into a buffer of one
    tensor's size, this rank's part of it (FSDP2's dim-0 chunk) kept; buffers (not sharded) whole."""
    from torch.distributed.tensor import DTensor

    dtypes = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}
    with torch.no_grad():
        for t, (name, shape, dtype) in zip([*model.parameters(), *model.buffers()], shapes):
            whole = torch.empty(shape, dtype=dtypes.get(dtype, t.dtype), device=device)
            dist.broadcast(whole, src=0)
            if isinstance(t, DTensor):
                local = t.to_local()
                chunks = torch.chunk(whole, world, dim=0)
                part = chunks[rank] if rank < len(chunks) else whole[:0]
                if tuple(local.shape) != tuple(part.shape):
                    raise RuntimeError(f"{name}: this rank's shard is {tuple(local.shape)}, its chunk of rank 0's "
                                       f"{tuple(part.shape)}")
                local.copy_(part)
            else:
                t.copy_(whole)
