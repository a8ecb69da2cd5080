"""TorchEngine: the built-in engine, a background thread (`ThreadedEngine`) stepping an
`EngineCore`.

Every public method is thread-safe. Commands (submit, abort, update_weights) are applied
between steps in the order they were issued; a step in progress is never interrupted, so
`abort` returns within one decode step. Completions resolve `concurrent.futures.Future`s from
the engine thread, so a done-callback that calls `abort` or `submit` runs before the next
step; `agenerate` and `stream` wrap the same futures for asyncio.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch

from rollover.engine.core import EngineCore
from rollover.engine.hf_runner import HFRunner, fast_path, sliding_window, unserved
from rollover.engine.model_runner import SUPPORTED, ModelRunner
from rollover.engine.stop import StopStrings
from rollover.engine.threaded import ThreadedEngine
from rollover.models import eos_ids


log = logging.getLogger("rollover")


def _generic(config, forward: str, max_len: int, **fast_options) -> bool:
    """Whether the model's own forward runs (`HFRunner`) rather than `ModelRunner`'s; refuses the
    fast path's options where it does not run, and an architecture the fast path lacks when it
    is asked for."""
    if forward not in ("auto", "rollover", "transformers"):
        raise ValueError(f"forward must be 'auto', 'rollover' or 'transformers', got {forward!r}")
    fast = fast_path(config, max_len)
    window = sliding_window(config)
    if forward == "rollover" and (missing := unserved(config)):
        raise ValueError(f"forward='rollover' computes SiLU MLPs without biases and no o_proj bias: "
                         f"{', '.join(missing)} needs forward='transformers' (or 'auto')")
    if forward == "rollover" and fast_path(config, None if window is None else window) and not fast:
        raise ValueError(f"forward='rollover' has no sliding window: {config.model_type!r} attends over "
                         f"{window} tokens and max_len is {max_len} (forward='transformers', or max_len <= {window})")
    if forward == "rollover" or (forward == "auto" and fast):
        return False  # ModelRunner names the supported architectures if this one is not
    asked = {k: v for k, v in fast_options.items()
             if v not in (None, False, "torch")}  # the defaults: no int8, no compile, native kernels where they build
    if asked:
        raise ValueError(f"{', '.join(f'{k}={v!r}' for k, v in asked.items())}: options of rollover's own forward, which "
                         f"serves {', '.join(sorted(SUPPORTED))}; {getattr(config, 'model_type', '?')!r} runs through "
                         "transformers' forward (forward='transformers')")
    if forward == "auto":
        log.info("TorchEngine: %s runs through transformers' forward (rollover's own serves %s%s)",
                 getattr(config, "model_type", "this model"), ", ".join(sorted(SUPPORTED)),
                 f", without a sliding window shorter than max_len ({window} < {max_len})" if window else "")
    return True


class TorchEngine(ThreadedEngine):
    """Continuous-batching generation on CPU or CUDA.

    model: an HF causal LM module, or a name for `rollover.models.resolve_model`.
    state_dict: weights to use instead of the module's own (e.g. a trainer's LoRA-merged ones).
    max_rows: sequences decoded together (the slot limit).
    max_len: cache length per sequence (prompt + response).
    quantize: "int8" to multiply by int8 copies of the weight matrices (see `ModelRunner`).
    pack_weights: MKL-packed weights for decode batches on a CPU (see `ModelRunner`); whether
        they pay depends on the CPU (`rollout.engine_options: {pack_weights: false}` turns them off).
    cuda_graphs: record decode steps as CUDA graphs and replay them, on CUDA (see `rollover.engine.cuda_graphs`;
        `rollout.engine_options: {cuda_graphs: false}` runs every step eagerly).
    compile_decode: compile the decode step with `torch.compile` (`rollout.engine_options:
        {compile_decode: true}`; off by default: the first step compiles for a minute or more on a
        CPU; what it gains is in docs/benchmarks.md). Outputs equal the eager step's up to float
        rounding (tests/test_engine.py). With CUDA graphs the graphs record the compiled step.
    native_kernels: on a CPU in fp32, the decode attention, RMSNorm and SiLU-and-multiply as C
        loops compiled at first use (`rollover.engine.cpu.native`): None (default) where they build,
        saying once why not; True requires them; False (`rollout.engine_options:
        {native_kernels: false}`, or `ROLLOVER_NATIVE=0`) keeps torch's ops.
    attention: the decode step's attention on CUDA: "torch" (default: batched matrix products over
        the step's attended length, masked per row) or "triton" (`rollout.engine_options:
        {attention: triton}`: one kernel reading each row's own keys only,
        `rollover.engine.triton_attention`; not yet measured on a GPU).
    forward: whose decoder forward runs: "rollover" (the hand-written Llama / Mistral / Qwen2 /
        Qwen3 forward of `ModelRunner`, which the options above tune), "transformers" (the model's
        own forward over the same cache, `rollover.engine.hf_runner`: any decoder-only model
        transformers loads, none of the options above), or "auto" (default: "rollover" where
        the architecture is one of those, else "transformers").
    admit_batch, admit_max_wait: while sequences decode, admit waiting ones once `admit_batch`
        fit or after `admit_max_wait` steps (`EngineCore._admit`); None: max_rows / 8 with CUDA
        graphs, else 1 (every step).
    adapt_threads: on a CPU, decode with as many threads as other processes leave cores free
        (`rollover.engine.cpu.share`; `rollout.engine_options: {adapt_threads: false}` keeps
        torch's count).
    stop_strings: what finds requests' stop strings (`rollover.engine.stop`; a run's engines get
        one when `rollout.stop` or `env.name` is set); None: a request with stop strings is refused.
    """

    def __init__(
        self,
        model,
        *,
        state_dict: dict[str, torch.Tensor] | None = None,
        device: str | None = None,
        dtype: torch.dtype | str = torch.float32,
        max_rows: int = 64,
        max_len: int | None = None,
        seed: int = 0,
        version: int = 0,
        eos_token_ids: Iterable[int] | None = None,
        max_prefill_tokens: int = 8192,
        quantize: str | None = None,
        pack_weights: bool = True,
        cuda_graphs: bool = True,
        compile_decode: bool = False,
        native_kernels: bool | None = None,
        attention: str = "torch",
        admit_batch: int | None = None,
        admit_max_wait: int = 16,
        adapt_threads: bool = True,
        forward: str = "auto",
        stop_strings: StopStrings | None = None,
    ):
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows must be a positive int (sequences decoded together), got {max_rows!r}")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if isinstance(model, str):
            from rollover.models import load_hf_model

            model = load_hf_model(model)
        config = model.config
        gen_config = getattr(model, "generation_config", None)
        max_len = max_len or min(getattr(config, "max_position_embeddings", 2048), 2048)
        if _generic(config, forward, max_len, quantize=quantize, compile_decode=compile_decode, native_kernels=native_kernels,
                    attention=attention):
            runner = HFRunner(config, state_dict if state_dict is not None else model.state_dict(), max_rows=max_rows,
                              max_len=max_len, device=device, dtype=dtype)
        else:
            runner = ModelRunner(
                config, state_dict if state_dict is not None else model.state_dict(), max_rows=max_rows, max_len=max_len,
                device=device, dtype=dtype, quantize=quantize, pack_weights=pack_weights, cuda_graphs=cuda_graphs,
                compile_decode=compile_decode, native_kernels=native_kernels, attention=attention,
            )
        eos = tuple(eos_token_ids) if eos_token_ids is not None else eos_ids(gen_config, config)
        core = EngineCore(
            runner, eos_token_ids=eos, seed=seed, version=version, max_prefill_tokens=max_prefill_tokens,
            admit_batch=admit_batch, admit_max_wait=admit_max_wait, stop_strings=stop_strings,
        )
        self.max_rows, self.max_len, self.device = max_rows, max_len, runner.device
        self._start(core)
        if adapt_threads and str(runner.device).startswith("cpu"):
            from rollover.engine.cpu.share import shared

            self._share = shared()  # fewer threads while other processes hold cores

    def lend_weights(self, model) -> int:
        """Hold `model`'s weights once (`ModelRunner.lend_weights`): its parameters become views of
        the engine's. For a trainer that never steps while this engine generates. The engine's
        packed copies of the weights are not views: after each in-place change of the
        parameters (an optimizer step), call `update_weights` (which skips the tensors already
        in place) before generating, or the packs hold the old values (the synchronous loop
        drops them from an optimizer hook, `rollover.train.weight_sync`). Returns the bytes
        saved."""
        return self._run_or_queue(lambda: self.core.runner.lend_weights(model), wait=True)

    def release_memory(self) -> None:
        """Free what the engine can rebuild when it next needs it: its packed weights, and its
        KV cache when no sequence holds a row (paused ones keep theirs); hand the freed heap
        back to the OS. Requests keep running (a decode step repacks). With CUDA graphs the cache
        stays: the graphs address it, and recording them again after every training step would
        cost more than the memory is worth (`cuda_graphs=False` frees it)."""
        from rollover.train.memory import release

        def drop():
            runner = self.core.runner
            runner.drop_packs()
            if not self.core.running and not runner.cuda_graphs:
                runner.drop_cache()

        self._run_or_queue(drop, wait=True)
        release()

    def release_weights(self) -> int:
        """Free the weights too, until `update_weights` has loaded every one of them again
        (`ModelRunner.release_weights`): for an engine whose weights always come back after the
        trainer's step (`train.colocate`), and the K/V cache unless paused sequences hold rows
        (with CUDA graphs too: the graphs go with the weights). Only while nothing decodes (idle,
        or paused with its sequences keeping their K/V); a request before the weights are back is
        refused, naming a missing weight. Returns the bytes of weights freed."""
        from rollover.train.memory import release

        def drop() -> int:
            if self.core.running and not self._paused:
                raise RuntimeError(f"release_weights: {len(self.core.running)} sequences are decoding; "
                                   "pause the engine first")
            freed = self.core.runner.release_weights()
            if not self.core.running:  # the decode graphs went with the weights: nothing keeps the cache now
                self.core.runner.drop_cache()
            return freed

        freed = self._run_or_queue(drop, wait=True)
        release()
        return freed

    def weight_bytes(self) -> int:
        """Bytes the engine's weights hold now (0 while released)."""
        return self._run_or_queue(self.core.runner.weight_bytes, wait=True)
