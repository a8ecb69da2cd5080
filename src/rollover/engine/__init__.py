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
      generated token carries the version of the weights that produced it. Loops do not call
      it directly: weights cross the `WeightSync` seam (`rollover.train.weight_sync`).
    - `pause()` stops stepping at the next step boundary with running sequences keeping their
      rows (and K/V); `resume()` goes on; `paused` says which. `lengths()` maps each unfinished
      request to its response tokens so far. An engine without them (vLLM) keeps `paused`
      False and raises NotImplementedError naming the feature that needs them
      (`partial_rollout.carry=keep_kv`, which the config refuses for it).
    - `release_memory()` frees what the engine can rebuild on demand (TorchEngine: its packed
      weights); the synchronous loop calls it before training, while the engine is idle.
    - `oldest_version`: the oldest version a token sampled from now on may carry; `version`
      except where workers load updates on their own time (RayEngine, `ray.weight_sync=lazy`),
      which calls the `on_oldest_version(callback)` callbacks when it moves on; `settle()`
      waits until it equals `version` (before an evaluation, after a restore).
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
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    @property
    def paused(self) -> bool: ...
    def lengths(self) -> dict[str, int]: ...
    def release_memory(self) -> None: ...
    @property
    def oldest_version(self) -> int: ...
    def on_oldest_version(self, callback: Callable[[], None]) -> None: ...
    def settle(self) -> None: ...
    def shutdown(self) -> None: ...


def __getattr__(name):  # lazy: importing rollover.engine does not build anything
    if name == "TorchEngine":
        from rollover.engine.torch_engine import TorchEngine

        return TorchEngine
    raise AttributeError(name)


class PlainConfig:
    """A transformers config's attributes (and its class's `model_type`), read as attributes;
    built by `portable_architecture`. Unpickling it needs no transformers."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)

    def __repr__(self) -> str:
        return f"PlainConfig({getattr(self, 'model_type', '?')})"


def _plain(value) -> bool:
    if isinstance(value, (int, float, str, bool, type(None), torch.dtype)):
        return True
    if isinstance(value, (list, tuple)):
        return all(map(_plain, value))
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


def portable_architecture(architecture, cfg, max_len: int):
    """The (config, generation config) a rollout worker builds its engine from. Where
    TorchEngine's own forward serves the model (its default rotary embedding, no vision tower,
    `rollout.engine: torch`) it reads the config's attributes alone, and the worker is given
    them as a `PlainConfig` (and no generation config: workers are given the EOS ids): a
    transformers config would import transformers as it unpickles, about 4 of a worker's 6-8
    seconds of start-up on a 2-core CPU, paid again by every replacement. Elsewhere, the
    model's own."""
    from rollover.engine.hf_runner import fast_path
    from rollover.models import is_vision_language

    config, generation = architecture.config, getattr(architecture, "generation_config", None)
    rope = dict(getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if (cfg.rollout.engine != "torch" or cfg.rollout.engine_options.get("forward", "auto") == "transformers"
            or is_vision_language(config) or rope != "default" or not fast_path(config, max_len)):
        return config, generation
    attrs = {"model_type": getattr(config, "model_type", None), **vars(config)}
    if not all(map(_plain, attrs.values())):
        return config, generation
    return PlainConfig(**attrs), None


def make_engine(cfg, architecture, *, weights, device, max_len: int, eos_token_ids, version: int = 0,
                colocated: bool = False, tokenizer=None):
    """The engine a run's config asks for, holding `weights` (named tensors, LoRA merged) as
    `version` (0; a Ray worker's replacement starts at the current one). `architecture` is a
    Hugging Face model of the policy's architecture (its config and module names; TorchEngine
    copies it), not the trainer's, or what has its `config` (`portable_architecture`). `colocated`: the engine of a trainer rank on `device`
    (`train.colocate`). `tokenizer`: what finds `rollout.stop`'s strings (default: the model's,
    read here), sent by a driver to engines on other machines."""
    r = cfg.rollout
    dtype = r.dtype
    if dtype == "auto":  # float32 on every device: on a GPU the real model learned more in float32 (docs/gpu.md)
        dtype = "float32"
    stops = None
    if cfg.finds_stop_strings:
        from rollover.engine.stop import StopStrings, stop_strings_of

        stops = StopStrings.of(tokenizer) if tokenizer is not None else stop_strings_of(cfg.model)
    if "stop_strings" in r.engine_options:
        from rollover.config import ConfigError

        raise ConfigError("rollout.engine_options: stop_strings is set from rollout.stop")
    if r.engine == "vllm":
        from rollover.engine.vllm_engine import VLLMEngine

        # a rank's vLLM sleeps while the rank trains only if it is to free its weights
        options = {} if cfg.train.colocate_free_weights else {"enable_sleep_mode": False}
        return VLLMEngine.from_config(cfg, weights=weights, max_len=max_len, dtype=dtype, eos_token_ids=eos_token_ids,
                                      version=version, colocated=device if colocated else None, stop_strings=stops,
                                      **{**options, **r.engine_options})
    from rollover.engine.torch_engine import TorchEngine

    if r.quantize == "int8" and device.type == "cpu" and dtype == "float32":
        from rollover.config import ConfigError

        raise ConfigError("rollout.quantize=int8 on a CPU needs rollout.dtype=bfloat16: torch's int8 kernel has no "
                          "fast path for float32 activations there (5-35x slower than the float32 GEMM, measured)")
    options = {"adapt_threads": not cfg.train.deterministic, **r.engine_options}  # fixed threads: the same bits
    import inspect

    params = inspect.signature(TorchEngine).parameters
    taken = {"model", "state_dict", "device", "dtype", "max_rows", "max_len", "seed", "eos_token_ids", "version",
             "quantize", "stop_strings"}  # set from the config's own keys
    wrong = [k for k in r.engine_options if k not in params or k in taken]
    if wrong:
        from rollover.config import ConfigError

        raise ConfigError(f"rollout.engine_options: TorchEngine has no option {', '.join(map(repr, wrong))}; its "
                          f"options: {', '.join(k for k in params if k not in taken)}")
    return TorchEngine(architecture, state_dict=dict(weights), device=str(device), dtype=dtype,
                       max_rows=r.max_rows, max_len=max_len, seed=cfg.seed, eos_token_ids=eos_token_ids, version=version,
                       quantize=None if r.quantize == "none" else r.quantize, stop_strings=stops, **options)
