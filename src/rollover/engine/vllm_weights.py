"""VLLMEngine's weights: loads in place (`update_weights`), a trainer rank's staged buckets
(`stage_weights`), and sleeping while a trainer that shares the device steps (`release_weights`).

Weights reach vLLM's workers as safetensors files (in /dev/shm where it exists), which every
worker reloads in place with vLLM's layer-wise reload (`rollover.engine.vllm_hooks.WeightLoader`).
A load runs on the engine's loop after every earlier pause, resume or load (`_after_control`).
After `release_weights` (vLLM sleep level 2: weights and K/V cache freed) the next load wakes
the weights, loads them, then wakes the K/V cache, as vLLM's RL recipe does.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import shutil
import tempfile
from concurrent.futures import Future
from typing import Iterable

import torch
from vllm.platforms import current_platform

from rollover.engine.vllm_control import wait_control
from rollover.types import Completion

log = logging.getLogger("rollover")


class WeightControl:
    """Mixed into `VLLMEngine`: needs its `_llm`, `_lock`, `_pending`, `_seqs`, `_shapes`,
    `_required`, `dtype`, `_on_loop`, `_in_loop`, `_after_control`, `_check_alive`, the pause
    state of `PauseControl`, and the state `_staged`, `_asleep`, `_sleeps`, `_generation`."""

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, inflight: str = "continue"
    ) -> list[Completion]:
        """Load new weights in place, without a restart; later tokens carry `version`.

        inflight='continue': running sequences are resubmitted from their tokens once the new
        weights are in (their K/V recomputed). inflight='keep': they stay in vLLM, paused while
        the weights load, and go on over the K/V the old weights computed (a sequence that has
        not produced a token yet is resubmitted, so no prompt is prefilled under old weights and
        decoded under new ones). inflight='abort': they are aborted and returned. Every weight
        of the model must be given, here or by `stage_weights` since the last load (names and
        shapes are checked before anything changes). The tensors are copied before this returns.
        After `release_weights` this wakes vLLM first.
        """
        if inflight not in ("continue", "keep", "abort"):
            raise ValueError(f"inflight must be 'continue', 'keep' or 'abort', got {inflight!r}")
        items = [(k, v.detach()) for k, v in named_tensors]
        self._check_weights(items, complete=True)
        paths = [path for path, _ in self._staged] + ([self._write_weights(items)] if items else [])
        self._staged = []
        loaded: Future = Future()
        try:
            aborted = self._on_loop(lambda: self._begin_update(paths, version, inflight, loaded), wait=True)
        except BaseException:
            for path in paths:
                _unlink(path)
            raise
        if not self._in_loop():
            wait_control(loaded, "update_weights")
        return aborted

    def stage_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hand over part of the next update's weights now (a trainer's bucket: it may free them
        at once); the next `update_weights` loads them with what it is given. Names and shapes
        are checked here; nothing changes in vLLM until then."""
        items = [(k, v.detach()) for k, v in named_tensors]
        self._check_weights(items, complete=False)
        if items:
            self._staged.append((self._write_weights(items), {k for k, _ in items}))

    def discard_staged(self) -> None:
        """Drop the weights staged since the last load (their files too): a push that failed
        part-way, or a shutdown."""
        staged, self._staged = self._staged, []
        for path, _ in staged:
            _unlink(path)

    def release_weights(self) -> int:
        """Free the weights and the K/V cache while a trainer that shares the device steps
        (`train.colocate`): vLLM sleeps (level 2: nothing is kept, the next `update_weights` loads
        every weight again). Only with no unfinished request, whose K/V would go. vLLM's CPU build
        has no sleep mode: there nothing is freed (a warning says so). Returns the weight bytes freed."""
        with self._lock:
            self._check_alive()
            unfinished = len(self._pending)
        if unfinished:
            raise RuntimeError(f"release_weights: {unfinished} requests are unfinished and vLLM's sleep "
                               "frees their K/V cache; finish or abort them first")
        if not self._sleeps:
            if not getattr(self, "_warned_no_sleep", False):
                self._warned_no_sleep = True
                log.warning("vLLM has no sleep mode here (%s): its weights stay in memory while the ranks train",
                            "its CPU build" if current_platform.is_cpu() else "not enabled")
            return 0
        if self._asleep:
            return 0
        freed = self.weight_bytes()
        done = self._on_loop(lambda: self._after_control(self._sleep), wait=True)
        wait_control(done, "release_weights")
        return freed

    def weight_bytes(self) -> int:
        """Bytes of the model's weights in vLLM's dtype, as held now: 0 while asleep (computed from
        the shapes; the device's own count is in the step's `perf/peak_device_gb`)."""
        if self._asleep:
            return 0
        return sum(math.prod(self._shapes[name]) for name in self._required) * self.dtype.itemsize

    def _check_weights(self, items: list[tuple[str, torch.Tensor]], complete: bool) -> None:
        for name, t in items:
            if name not in self._shapes:
                raise ValueError(f"unknown weight {name!r}")
            if tuple(t.shape) != self._shapes[name]:
                raise ValueError(f"weight {name!r}: shape {tuple(t.shape)}, expected {self._shapes[name]}")
        if not complete:
            return
        missing = self._required - {name for name, _ in items}.union(*(names for _, names in self._staged))
        if missing:
            raise ValueError(f"update_weights needs every weight of the model (vLLM reloads whole layers); "
                             f"missing {sorted(missing)[:5]}{' ...' if len(missing) > 5 else ''}")

    def _write_weights(self, items: list[tuple[str, torch.Tensor]]) -> str:
        from safetensors.torch import save_file

        need = sum(v.numel() for _, v in items) * self.dtype.itemsize
        # shared memory where it has room (a container's /dev/shm is often 64 MB), else the temp dir
        tmp = "/dev/shm" if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 2 * need else None
        fd, path = tempfile.mkstemp(prefix="rollover-weights-", suffix=".safetensors", dir=tmp)
        os.close(fd)
        try:
            # a copy per tensor: safetensors refuses tensors that share storage (tied weights)
            save_file({k: v.to("cpu", self.dtype, copy=True).contiguous() for k, v in items}, path)
        except BaseException:
            os.unlink(path)
            raise
        return path

    def _begin_update(self, paths: list[str], version: int, inflight: str, loaded: Future) -> list[Completion]:
        running = [s for s in self._seqs.values() if s.running]
        if inflight == "keep":  # a segment with no token yet restarts: its prefill uses the new weights
            running = [s for s in running if s.segment_tokens == 0]
        sub_ids = [s.sub_id for s in running]
        for s in running:
            self._stop_segment(s)
        self._version = version
        done = self._after_control(lambda: self._load(paths, version, sub_ids, keep=inflight == "keep"))
        done.add_done_callback(lambda _: [_unlink(path) for path in paths])  # also when a shutdown cancels the load
        done.add_done_callback(functools.partial(_pass_on, loaded))
        if inflight == "abort":
            return [self._finish(s, "abort") for s in running if s.id in self._seqs]
        with self._counters.lock:
            self._counters.stats.recomputed_tokens += sum(len(s.request.prompt_ids) + len(s.response_ids) for s in running)
        for s in running:  # they wait for the new weights
            s.task = self._loop.create_task(self._run_segment(s))
        return []

    async def _load(self, paths: list[str], version: int, sub_ids: list[str], keep: bool) -> None:
        if sub_ids:
            await self._llm.abort(sub_ids)
        hold = keep and not self._vllm_paused
        if hold:  # nothing runs while the weights change: every step's tokens have one version
            await self._pause_vllm()
        if self._asleep:  # room for the weights first; the K/V cache after they are in (vLLM's RL recipe)
            await self._llm.wake_up(tags=["weights"])
        await self._llm.collective_rpc("rollover_load_weights", args=(paths,))
        if self._asleep:
            await self._llm.wake_up(tags=["kv_cache"])  # fully awake: vLLM resumes its scheduler
            self._asleep = False
            if self._vllm_paused:  # ... which rollover had paused: it stays so until `resume`
                await self._llm.pause_generation(mode="keep", clear_cache=False)
        await self._llm.update_weight_version(str(version))
        self._generation += 1  # a new prefix-cache salt: no block computed before this load is reused
        if hold:
            await self._resume_vllm()

    async def _sleep(self) -> None:
        await self._llm.sleep(level=2)
        self._asleep = True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _pass_on(to: Future, done: Future) -> None:
    if done.cancelled():
        to.set_exception(RuntimeError("engine shut down during a weight update"))
    elif done.exception() is not None:
        to.set_exception(done.exception())
    else:
        to.set_result(None)
