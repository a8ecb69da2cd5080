"""What the loops call on a trainer, whichever one the config builds: `Trainer` in this process,
`RemoteTrainer` (a Ray actor's proxy), `ShardedTrainer` (N FSDP rank processes) or
`RayShardedTrainer` (N FSDP rank actors). The loops and `build_run` rely on this and nothing
else: no probing for what a trainer happens to have."""

from __future__ import annotations

from typing import Iterable, Protocol, runtime_checkable

import torch


@runtime_checkable
class TrainerAPI(Protocol):
    sharded: bool  # N ranks each hold a shard (the engine cannot borrow the trainer's weights)
    is_peft: bool  # LoRA: the engine receives merged weights
    bad_steps: int  # non-finite steps in a row (train.max_bad_steps stops the run)
    model: object  # the policy, or what stands for it in the driver (its config; save_pretrained)
    architecture: object  # an HF model of the policy's architecture, for the engine to copy

    def train_step(self, batch) -> dict:
        """One step's updates on a `TrainBatch`; the step's metrics."""

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The policy's full tensors by HF name (LoRA merged), for the engine."""

    def state_dict(self) -> dict:
        """What a checkpoint needs besides the model's weights (optimizer, scheduler, counters)."""

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None:
        """Free what the trainer holds outside this process (actors, rank processes)."""
