"""Rollout engines behind one contract (see `Engine`)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import AsyncIterator, Callable, Iterable, Protocol

import torch

from rollover.engine.core import EngineStats
from rollover.types import Completion, Request


class Engine(Protocol):
    """What schedulers and loops may call. Token ids in, token ids out.

    - `submit`/`submit_many` validate in the caller's thread (ValueError naming the request)
      and return futures of `Completion`s; `on_done` is called as each one finishes (from the
      engine's thread); `generate` blocks, `agenerate`/`stream` are asyncio.
    - `abort(ids | None)` returns promptly with partial completions (finish 'abort').
    - a `Request` carrying response tokens resumes from them; `max_new_tokens` bounds the
      whole response.
    - `update_weights(named tensors, version, inflight)` swaps weights between steps; every
      generated token carries the version of the weights that produced it.
    """

    version: int
    eos_token_ids: tuple[int, ...]

    def submit(self, request: Request, on_done: Callable[[Completion], None] | None = None) -> Future: ...
    def submit_many(
        self, requests: Iterable[Request], on_done: Callable[[Completion], None] | None = None
    ) -> list[Future]: ...
    def generate(self, requests: Iterable[Request]) -> list[Completion]: ...
    async def agenerate(self, request: Request) -> Completion: ...
    def stream(self, request: Request) -> AsyncIterator: ...
    def abort(self, ids: Iterable[str] | None = None) -> list[Completion]: ...
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, inflight: str = "continue"
    ) -> list[Completion]: ...
    def stats(self) -> EngineStats: ...
    def reset_stats(self) -> None: ...
    def shutdown(self) -> None: ...


def __getattr__(name):  # lazy: importing rollover.engine does not build anything
    if name == "TorchEngine":
        from rollover.engine.torch_engine import TorchEngine

        return TorchEngine
    raise AttributeError(name)


def make_engine(cfg, trainer, *, device, max_len: int, eos_token_ids):
    """The engine a run's config asks for, holding the trainer's current weights (version 0)."""
    r = cfg.rollout
    dtype = r.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    base = trainer.model.get_base_model() if trainer.is_peft else trainer.model
    if r.engine == "vllm":
        from rollover.engine.vllm_engine import VLLMEngine

        return VLLMEngine.from_trainer(cfg, trainer, max_len=max_len, dtype=dtype, eos_token_ids=eos_token_ids,
                                       **r.engine_options)
    from rollover.engine.torch_engine import TorchEngine

    return TorchEngine(base, state_dict=dict(trainer.named_weights()), device=str(device), dtype=dtype,
                       max_rows=r.max_rows, max_len=max_len, seed=cfg.seed, eos_token_ids=eos_token_ids,
                       **r.engine_options)
