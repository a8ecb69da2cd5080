"""VLLMEngine's pause, resume and weight-version bookkeeping (vLLM 0.32's "keep" mode).

Pauses, resumes and weight loads run one after another on the engine's loop, in the order they
were asked for (`_after_control`); a segment starts only once none is on its way. `pause()` and
`resume()` never wait on the loop, so a scheduler may call them under the lock its callbacks
take. After a pause, `_drain` waits until every output vLLM made before it has reached its
sequence, and `_token_versions` reads each token's weight version from the labels vLLM's engine
core put on the step that made it.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future
from typing import Callable

log = logging.getLogger("rollover")

CONTROL_TIMEOUT_S = 900.0  # a pause, load or resume that vLLM has not finished by then is stuck


def wait_control(done: Future, what: str):
    """The result of a control operation, waited for from outside the loop, at most
    CONTROL_TIMEOUT_S."""
    try:
        return done.result(timeout=CONTROL_TIMEOUT_S)
    except TimeoutError:
        raise TimeoutError(f"VLLMEngine: {what} waited {CONTROL_TIMEOUT_S:g} s for vLLM to finish a pause, "
                           "resume or weight load") from None


class PauseControl:
    """Mixed into `VLLMEngine`: needs its `_loop`, `_llm`, `_seqs`, `_on_loop`, `_in_loop`,
    `_fail`, and the state `_control`, `_paused`, `_vllm_paused`, `_asleep` (`WeightControl`)."""

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        """Stop generating; running requests keep their K/V in vLLM (`pause_generation` in
        mode "keep"). Returns at once; later `lengths`, `update_weights` and `resume` act after
        it, with every token made before it delivered. Requests, aborts and weight updates are
        still accepted while paused; new requests start at `resume`. (An `abort` acts at once:
        it returns the tokens received so far.)"""
        self._paused = True
        self._on_loop(lambda: self._set_paused(True), wait=False)

    def resume(self) -> None:
        """Go on generating (the kept requests first). Returns at once, as `pause` does (a
        scheduler calls it under the lock its callbacks take); it acts after every earlier
        pause or load."""
        self._paused = False
        self._on_loop(lambda: self._set_paused(False), wait=False)

    def lengths(self) -> dict[str, int]:
        """Response tokens so far of every unfinished request. After a pause it waits until what
        vLLM made before the pause has arrived (from a callback it answers at once)."""
        if self._in_loop():
            return self._lengths_now()
        done = self._on_loop(lambda: self._after_control(self._drained_lengths), wait=True)
        return wait_control(done, "lengths() after a pause")

    async def _controls_done(self) -> None:
        """Wait until no pause, resume or load is on its way (re-checked: another may begin
        while this waits), so a request asked for after `pause()` starts after `resume()`."""
        while self._control is not None and not self._control.done():
            await asyncio.wait([self._control])

    def _after_control(self, make: Callable) -> Future:
        """Run the coroutine `make()` on the loop once every earlier control operation is done;
        a Future of its result (call on the loop thread)."""
        prev, done = self._control, Future()

        async def run():
            try:
                if prev is not None:
                    await asyncio.wait([prev])  # its own caller got its error
                done.set_result(await make())
            except asyncio.CancelledError:  # shut down
                done.cancel()
            except Exception as e:  # vLLM refused a pause, a resume or a load: it is not usable
                self._fail(e)
                done.set_exception(e)

        self._control = self._loop.create_task(run())
        return done

    def _set_paused(self, paused: bool) -> Future:
        return self._after_control(self._pause_vllm if paused else self._resume_vllm)

    async def _pause_vllm(self) -> None:
        if not self._vllm_paused:
            if not self._asleep:  # asleep nothing runs; the load that wakes it pauses it again
                await self._llm.pause_generation(mode="keep", clear_cache=False)
            self._vllm_paused = True
            if not self._asleep:
                await self._drain()

    async def _resume_vllm(self) -> None:
        if self._vllm_paused:
            if not self._asleep:  # asleep, vLLM resumes itself when the load wakes it
                await self._llm.resume_generation()
            self._vllm_paused = False

    async def _drained_lengths(self) -> dict[str, int]:
        if self._vllm_paused:
            await self._drain()
        return self._lengths_now()

    def _lengths_now(self) -> dict[str, int]:
        return {rid: len(s.response_ids) for rid, s in self._seqs.items()}

    async def _drain(self, timeout_s: float = 10.0) -> None:
        """With vLLM paused: wait until every output its engine sent before the pause has reached
        its sequence (vLLM's pause returns once the engine has sent them, not once they arrived)."""
        queue = self._llm.engine_core.outputs_queue  # vLLM 0.32's internals (pinned)
        states = self._llm.output_processor.request_states
        deadline = self._loop.time() + timeout_s
        spins = 0
        while self._loop.time() < deadline:
            await asyncio.sleep(0 if spins < 100 else 0.001)
            spins += 1
            # the output handler is parked in get() (not between two chunks of a batch), and
            # every request's outputs were taken by its generator
            if queue.empty() and queue._getters and all(
                    getattr(st.queue, "output", None) is None for st in list(states.values())):
                await asyncio.sleep(0)  # a generator that just took its output appends it
                return
        # token versions stay exact (vLLM labels them); only lengths() may miss late tokens
        log.warning(
            "vLLM's outputs from before a pause had not all arrived after %g s", timeout_s)

    def _token_versions(self, sub_id: str, c, start: int, version: int) -> list[int]:
        """The weight version of each of `c`'s new tokens (positions start.. of the vLLM request),
        from the version spans vLLM tracks per request; `version` (the segment's) where vLLM
        has no label for them."""
        if c.weight_versions is not None:  # a finished request: its spans
            starts = [(span.version, span.start) for span in c.weight_versions]
        else:
            processor = self._llm.output_processor  # keyed by vLLM's internal ids
            internal = processor.external_req_ids.get(sub_id) or [None]
            state = processor.request_states.get(internal[-1])
            starts = list(state.weight_version_starts) if state is not None else []
        out, k = [], -1
        for i in range(start, start + len(c.token_ids)):
            while k + 1 < len(starts) and starts[k + 1][1] <= i:
                k += 1
            label = starts[k][0] if k >= 0 else None
            out.append(int(label) if label is not None and label.lstrip("-").isdigit() else version)
        return out
