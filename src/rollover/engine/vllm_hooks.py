"""What vLLM calls back into, for VLLMEngine: the worker extension that reloads weights in
place (`worker_extension_cls`, reached through `collective_rpc`) and the stat logger that
fills `EngineStats` from vLLM's per-step stats."""

from __future__ import annotations

import threading

import torch
from vllm.v1.metrics.loggers import StatLoggerBase

from rollover.engine.core import EngineStats


class WeightLoader:
    """Mixed into vLLM's worker class (`worker_extension_cls`); called by `collective_rpc`."""

    def rollover_load_weights(self, paths: list[str]) -> None:
        """Every weight, from safetensors files read one at a time (VLLMEngine writes one per
        update, or one per staged bucket)."""
        from safetensors.torch import load_file

        def tensors():
            for path in paths:
                yield from load_file(path).items()

        # vLLM's in-place reload: restores the checkpoint-format parameters, loads, then re-runs
        # process_weights_after_loading (plain `model.load_weights` would write into tensors the
        # CPU backend has already repacked and emptied).
        self.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)
        # A layer whose weight is another layer's (a tied LM head) loads nothing itself, so the
        # reload does not redo its kernel preparation: on CPU the LM head would go on computing
        # logits from its packed copy of the old embedding. Redo it for every tied layer.
        owners: dict[int, list[torch.nn.Module]] = {}
        for module in self.model_runner.get_model().modules():
            for p in module.parameters(recurse=False):
                owners.setdefault(id(p), []).append(module)
        for modules in owners.values():
            for module in modules if len(modules) > 1 else ():
                method = getattr(module, "quant_method", None)
                if method is not None:
                    method.process_weights_after_loading(module)


class _Counters:
    """EngineStats shared by the loop thread (writer) and callers (readers)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.stats = EngineStats()


class _StepCounter(StatLoggerBase):
    """Fills EngineStats from vLLM's per-step stats (one record per engine step's outputs).

    decode_steps: steps that produced tokens; busy_row_steps: tokens those steps produced (one
    per running sequence); total_row_steps: steps x max_rows; prefill_tokens: prompt tokens
    computed (prefix-cache hits excluded). Tokens of aborted requests that never reached us are
    included here, unlike `generated_tokens`.
    """

    def __init__(self, counters: _Counters, max_rows: int):
        self.counters, self.max_rows = counters, max_rows

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if iteration_stats is None:
            return
        n = iteration_stats.num_generation_tokens
        with self.counters.lock:
            st = self.counters.stats
            st.prefill_tokens += iteration_stats.prompt_token_stats.computed
            if n:
                st.decode_steps += 1
                st.busy_row_steps += n
                st.total_row_steps += self.max_rows

    def log_engine_initialized(self) -> None:
        pass
