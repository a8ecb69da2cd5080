"""The simulated engine's core: rollout workers doing continuous batching on a virtual clock.

It offers what `EngineCore` offers (`ThreadedEngine` drives either), but a step is an *event*,
not a forward pass. A worker's running sequences all gain one token per engine step, so
between two events (a sequence finishing, a request arriving, a command) a worker's state
moves by a whole number of steps whose total time has a closed form (the step time grows with
the context, linearly). The core jumps from event to event, over every worker in time order:
thousands of tokens cost one event.

Semantics, as close to `EngineCore` as an event model allows:
- Requests wait, are admitted into free rows at a step boundary (a prefill, shared by samples
  with identical tokens), and every running sequence gains one token per step; a sequence
  finishes when it reaches its drawn length ('stop') or its budget ('length').
- A request, abort or weight update arriving at time T reaches a worker at its first step
  boundary at or after T (the step in progress completes, as in the real engine). Sequences
  that finish in that step are delivered at its end, in time order with everything else.
- `pause` stops each worker at its last boundary before the pause (the step in progress does
  not happen), and `resume` continues from the resume time.
- A weight update stalls every worker for the dissemination time given with it; tokens after
  it carry the new version; 'continue' recomputes the running sequences' K/V (a prefill),
  'keep' does not, 'abort' aborts them.
- While rows decode, a worker admits waiting sequences once `admit_batch` of them fit, or after
  `admit_max_wait` steps, or at once where the prefill budget is what holds them back, as
  `EngineCore._admit` does (admit_batch defaults to max_rows / 8 where the cost model's
  `separate_admission` says a mixed step pays a whole prefill, 1 elsewhere).

Requests go to workers through the Ray runtime's `Router` (least outstanding tokens, with
prompt-prefix affinity), the policy a real multi-worker run uses.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque

from rollover.engine.core import EngineStats
from rollover.engine.validation import validate_request
from rollover.runtime.routing import Router
from rollover.sim.costs import ADMIT_MAX_WAIT, DecodeCost
from rollover.sim.workload import EOS, TOKEN, LengthModel, prompt_key
from rollover.types import Completion, Request

VOCAB = 1 << 30
LOGPROB = -1.0  # the simulated model reports this behaviour logprob for every token


class SimSeq:
    __slots__ = ("request", "n", "carried", "target", "finish", "runs", "prompt_len", "budget", "entering", "key")

    def __init__(self, request: Request, target: int, finish: str, key: int):
        self.request, self.key = request, key  # key: its prompt's (samples of one prompt prefill once)
        self.carried = self.n = len(request.response_ids)
        self.target, self.finish = target, finish
        self.runs: list[tuple[int, int]] = []  # (version, first response index) of the tokens made here
        self.prompt_len = len(request.prompt_ids)
        self.budget = request.sampling.max_new_tokens
        self.entering = False  # admitted at its worker's current boundary; prefilled in the next step

    @property
    def id(self) -> str:
        return self.request.id

    def completion(self, finish: str) -> Completion:
        r, new = self.request, self.n - self.carried
        ids = list(r.response_ids) + [TOKEN] * new
        if finish == "stop" and new:
            ids[-1] = EOS
        versions = list(r.response_versions)
        for i, (v, start) in enumerate(self.runs):
            end = self.runs[i + 1][1] if i + 1 < len(self.runs) else self.n
            versions += [v] * (end - start)
        return Completion(id=r.id, prompt_ids=list(r.prompt_ids), response_ids=ids,
                          logprobs=list(r.response_logprobs) + [LOGPROB] * new, versions=versions,
                          finish=finish, sampling=r.sampling)

    def mark(self, version: int) -> None:
        """Tokens from here on are made by `version`."""
        if self.runs and self.runs[-1][1] == self.n:
            self.runs[-1] = (version, self.n)
        else:
            self.runs.append((version, self.n))


class SimWorker:
    """One rollout worker: `max_rows` sequences decoded together, at `cost`."""

    def __init__(self, index: int, cost: DecodeCost, max_rows: int, pool: str = "rollout",
                 max_prefill_tokens: int = 8192, kv_tokens: int | None = None, admit_batch: int | None = None,
                 admit_max_wait: int = ADMIT_MAX_WAIT):
        self.index, self.cost, self.max_rows, self.pool = index, cost, max_rows, pool
        # TorchEngine's default (EngineCore.admit_batch): batch admissions where each costs a pass
        self.admit_batch = cost.admit_batch(max_rows, admit_batch)
        self.admit_max_wait = admit_max_wait
        self.steps = 0  # steps done (the clock of admission's waiting)
        self.deferred_from: int | None = None  # `steps` when admission began to wait for a batch
        self.admitting = False  # the planned segment's first step admits beside decoding rows
        self.kv_tokens = kv_tokens  # K/V capacity in tokens (None: the rows alone limit it)
        self.own_cost = cost  # `cost` is this, scaled while the device is shared with training
        self.max_prefill_tokens = max_prefill_tokens
        self.t = 0.0  # its last step boundary
        self.waiting: deque[SimSeq] = deque()
        self.running: list[SimSeq] = []
        self.context = 0  # context tokens of the running sequences
        self.load = 0  # tokens still owed (the router's measure)
        self.recompute = 0  # K/V tokens to recompute in the next step (a weight update's 'continue')
        # the planned segment from t: k steps to the next finish, `extra` seconds in the first
        # (prefill), per-step time `base` + slope * step index
        self.k, self.extra, self.base, self.slope = 0, 0.0, 0.0, 0.0
        self.extra_fresh = self.extra_recompute = 0  # tokens the first step prefills: entering rows, recompute
        self.prefill_part = 0.0  # seconds of prefill in the first step
        self.token = 0  # the heap entry of its planned segment (older ones are stale)
        self.busy_s = self.stall_s = 0.0
        self.timeline: list[list] = []  # [start, end, "generate" | "sync"], adjacent ones merged

    def end(self, j: int) -> float:
        """Time of the boundary after j steps of the planned segment."""
        return self.t + (self.extra if j else 0.0) + j * self.base + self.slope * j * (j - 1) / 2

    def first_at_or_after(self, T: float) -> int:
        """Steps of the segment until the first boundary at or after T (at most k)."""
        if T <= self.t:
            return 0
        a, b, c = self.slope / 2, self.base - self.slope / 2, self.t + self.extra - T
        if a > 0:
            j = math.ceil((-b + math.sqrt(max(b * b - 4 * a * c, 0.0))) / (2 * a))
        else:
            j = math.ceil(-c / b) if b > 0 else 1
        j = min(max(j, 1), self.k)
        while j > 1 and self.end(j - 1) >= T:
            j -= 1
        while j < self.k and self.end(j) < T:
            j += 1
        return j

    def record(self, start: float, end: float, kind: str) -> None:
        if end <= start:
            return
        if self.timeline and self.timeline[-1][2] == kind and abs(self.timeline[-1][1] - start) < 1e-9:
            self.timeline[-1][1] = end
        else:
            self.timeline.append([start, end, kind])
        if kind == "generate":
            self.busy_s += end - start
        else:
            self.stall_s += end - start


class SimCore:
    def __init__(self, workers: list[SimWorker], lengths: LengthModel, *, max_len: int, slack: int,
                 version: int = 0):
        self.workers = workers
        self.length_model = lengths
        self.max_len = max_len
        self.router = Router(slack)
        self.eos_token_ids = (EOS,)
        self.version = version
        self.stats = EngineStats()
        self.now = 0.0
        self.horizon = math.inf
        self.gate = None  # a predicate: while it is false, nothing happens and the clock stands
        self.paused = False
        self.where: dict[str, SimWorker] = {}  # live request id -> its worker
        self.heap: list = []  # (time, order, worker or None, token, or completions or a timer's function)
        self._order = itertools.count()

    # ------------------------------------------------------------ the EngineCore contract
    def validate(self, req: Request) -> None:
        validate_request(req, max_len=self.max_len, vocab_size=VOCAB, stop_strings=True)  # simulated: never found

    def add(self, req: Request) -> Completion | None:
        seq = self._seq(req)
        if seq.n >= seq.target:  # nothing left to generate (budget spent, or resumed at its end)
            self.stats.finished[seq.finish] += 1
            return seq.completion(seq.finish)
        w = self.router.pick(req, self.workers)
        self._sync(w)
        w.waiting.append(seq)
        w.load += seq.budget - seq.n
        self.where[req.id] = w
        self._plan(w)
        return None

    def has_work(self) -> bool:
        if self.gate is not None and not self.gate():
            return False
        while self.heap and self.heap[0][2] is not None and self.heap[0][3] != self.heap[0][2].token:
            heapq.heappop(self.heap)  # a segment re-planned since
        return bool(self.heap) and self.heap[0][0] < self.horizon

    def step(self) -> tuple[list[Completion], list]:
        """The next event: a worker's segment ends (its finished sequences are returned), or
        completions finished early (in a command's step) are delivered."""
        if not self.has_work():
            return [], []
        t, _, w, payload = heapq.heappop(self.heap)
        self.now = max(self.now, t)
        if w is None:
            if callable(payload):  # a timer (a simulated environment's answer)
                payload()
                return [], []
            return payload, []
        self._advance(w, w.k)
        done = self._finish_due(w)
        self._plan(w)
        return done, []

    def lengths(self) -> dict[str, int]:
        """Tokens each live request holds now (steps of a planned segment done by now count)."""
        out = {s.id: s.n for w in self.workers for s in w.waiting}
        for w in self.workers:
            done = 0
            if w.k:
                j = w.first_at_or_after(self.now)
                done = j if j and w.end(j) <= self.now else max(j - 1, 0)
            out.update({s.id: s.n + done for s in w.running})
        return out

    def abort(self, ids: set[str] | None) -> list[Completion]:
        out = []
        targets = list(self.where) if ids is None else [i for i in ids if i in self.where]
        by_worker: dict[int, list[str]] = {}
        for rid in targets:
            by_worker.setdefault(self.where[rid].index, []).append(rid)
        for index, rids in by_worker.items():
            w = self.workers[index]
            self._sync(w)  # sequences finishing in the step in progress finish, not abort
            gone = {r for r in rids if r in self.where}
            keep_w, keep_r = deque(), []
            for s in w.waiting:
                (out.append(self._drop(w, s, "abort")) if s.id in gone else keep_w.append(s))
            for s in w.running:
                if s.id in gone:
                    w.context -= s.prompt_len + s.n
                    out.append(self._drop(w, s, "abort"))
                else:
                    keep_r.append(s)
            w.waiting, w.running = keep_w, keep_r
            self._plan(w)
        return out

    def update_weights(self, named_tensors, version: int, inflight: str, stall_s: float = 0.0) -> list[Completion]:
        if inflight not in ("continue", "keep", "abort"):
            raise ValueError(f"inflight must be 'continue', 'keep' or 'abort', got {inflight!r}")
        self.version = version
        out = []
        for w in self.workers:
            self._sync(w)
            start = max(w.t, self.now)
            w.record(start, start + stall_s, "sync")
            w.t = start + stall_s
            if inflight == "abort":
                for s in w.running:
                    out.append(self._drop(w, s, "abort"))
                w.running, w.context = [], 0
                if w.kv_tokens is not None:  # preempted sequences are in flight too: they hold new tokens
                    out += [self._drop(w, s, "abort") for s in w.waiting if s.n > s.carried]
                    w.waiting = deque(s for s in w.waiting if s.n == s.carried)
            elif w.kv_tokens is not None:
                self._preempt(w)  # before counting what to recompute: a preempted row recomputes on readmission
            for s in w.running:
                s.mark(version)
            if inflight == "continue":
                w.recompute += sum(s.prompt_len + s.n for s in w.running)
            self._plan(w)
        return out

    # ------------------------------------------------------------ the simulation's own calls
    def timer(self, at: float, fn) -> None:
        """Call `fn()` on the engine thread at virtual time `at` (now, if that has passed), in
        time order with the workers' events."""
        heapq.heappush(self.heap, (max(at, self.now), next(self._order), None, fn))

    def slow_down(self, factor: float) -> None:
        """From the next step boundary on, every worker's steps take `factor` times their cost
        (1.0: back to normal); the step in progress finishes at the speed it started with."""
        for w in self.workers:
            self._sync(w)
            w.cost = w.own_cost.scaled(factor)
            self._plan(w)

    def busy(self) -> bool:
        """Whether any worker has rows running or waiting."""
        return any(w.running or w.waiting for w in self.workers)

    def pause(self) -> None:
        """Every worker stops at its last step boundary before now; nothing runs until resume."""
        for w in self.workers:
            if w.k:
                j = w.first_at_or_after(self.now)
                if j and w.end(j) > self.now:
                    j -= 1
                self._advance(w, j)  # j = 0: the first step did not happen; its rows still enter on resume
                w.k, w.token = 0, w.token + 1
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        for w in self.workers:
            self._sync(w)
            self._plan(w)

    # ------------------------------------------------------------ internals
    def _seq(self, req: Request) -> SimSeq:
        key = prompt_key(req)
        want = self.length_model.draw(key, req.sampling.seed if req.sampling.seed is not None else hash(req.id))
        budget = min(req.sampling.max_new_tokens, self.max_len - len(req.prompt_ids) - 1)
        if want < budget and not req.sampling.ignore_eos:
            return SimSeq(req, want, "stop", key)
        return SimSeq(req, budget, "length", key)

    def _sync(self, w: SimWorker) -> None:
        """Bring w to its first step boundary at or after now (an idle or paused worker: to now).
        Sequences that finish at that boundary are delivered at its time."""
        if not w.k:
            w.t = max(w.t, self.now)
            return
        j = w.first_at_or_after(self.now)
        if not j:
            return
        self._advance(w, j)
        done = self._finish_due(w)
        if done:
            heapq.heappush(self.heap, (w.t, next(self._order), None, done))
        w.token += 1  # its segment is re-planned by the caller

    def _advance(self, w: SimWorker, j: int) -> None:
        """Apply j steps of w's planned segment."""
        if j <= 0:
            return
        n, end = len(w.running), w.end(j)
        w.record(w.t, end, "generate")
        st = self.stats
        st.decode_steps += j
        st.admission_steps += w.admitting
        w.admitting = False
        w.steps += j
        st.busy_row_steps += n * j
        st.total_row_steps += w.max_rows * j
        st.generated_tokens += n * j
        st.prefill_s += w.prefill_part
        st.prefill_tokens += w.extra_fresh
        st.recomputed_tokens += w.extra_recompute
        st.decode_s += end - w.t - w.prefill_part
        w.extra_fresh = w.extra_recompute = 0
        w.prefill_part = 0.0
        for s in w.running:
            s.n += j
            s.entering = False
        w.context += n * j
        w.load -= n * j
        w.t, w.k, w.extra = end, w.k - j, 0.0
        w.base = w.cost.step(n, w.context)

    def _finish_due(self, w: SimWorker) -> list[Completion]:
        done, keep = [], []
        for s in w.running:
            if s.n >= s.target:
                w.context -= s.prompt_len + s.n
                done.append(self._drop(w, s, s.finish))
            else:
                keep.append(s)
        w.running = keep
        return done

    def _drop(self, w: SimWorker, s: SimSeq, finish: str) -> Completion:
        w.load -= s.budget - s.n
        del self.where[s.id]
        self.stats.finished[finish] += 1
        return s.completion(finish)

    def _preempt(self, w: SimWorker) -> None:
        """Free K/V for the next step's token of every row: the newest running sequences go back
        to the front of the queue with their tokens (recomputed when readmitted), as vLLM's and
        SGLang's schedulers preempt on a full cache."""
        while w.running and w.context + len(w.running) > w.kv_tokens:
            s = w.running.pop()
            w.context -= s.prompt_len + s.n
            s.entering = False
            w.waiting.appendleft(s)
            self.stats.preempted += 1

    @staticmethod
    def _admissible(w: SimWorker, keys: dict, budget: int) -> tuple[int, bool]:
        """How many of w's waiting sequences, in queue order, its boundary can admit (free rows,
        K/V room, the prefill budget; the samples of a prompt prefill once), and whether the
        prefill budget is what stops it. Unlike EngineCore, which charges every sample's tokens
        to the budget, a prompt its samples share is charged once (what it prefills); with
        kv_tokens, a request waiting for K/V room counts toward admission's wait for a batch
        (TorchEngine has no such cap to mirror)."""
        n, context, rows, seen = 0, w.context, len(w.running), set(keys)
        for s in w.waiting:
            if rows + n == w.max_rows:
                break
            need = s.prompt_len + s.n
            if w.kv_tokens is not None and context + need + rows + n + 1 > w.kv_tokens:
                break  # no room for it and one more token of every row: it waits for a finish
            if seen and need > budget:
                return n, True
            key = _key(s)
            if key not in seen:
                seen.add(key)
                budget -= need
            n, context = n + 1, context + need
        return n, False

    def _plan(self, w: SimWorker) -> None:
        """Admit waiting sequences into free rows and plan w's next segment from its boundary
        (none while paused or idle)."""
        w.token += 1
        w.k = 0
        w.admitting = False
        if self.paused:
            return
        if not w.running:  # whatever the first step was to prefill is gone (aborted)
            w.extra_recompute = 0
        # the first step's prefill: the rows entering at this boundary (an abort may have taken
        # some since they were admitted), the n samples of a fresh prompt once
        if w.kv_tokens is not None:
            self._preempt(w)
        entering = [s for s in w.running if s.entering]
        keys = {_key(s): s.prompt_len + s.n for s in entering}
        budget = w.max_prefill_tokens - sum(keys.values()) - w.extra_recompute
        take, held = self._admissible(w, keys, budget)
        wait_left = 0  # steps admission still waits for a batch (0: it does not wait)
        if take and not entering and len(w.running) and take < w.admit_batch and not held:
            if w.deferred_from is None:
                w.deferred_from = w.steps
            wait_left = max(0, w.admit_max_wait - (w.steps - w.deferred_from))
            take = 0 if wait_left else take
        if take or not w.waiting or len(w.running) == w.max_rows:
            w.deferred_from = None
        for _ in range(take):
            s = w.waiting.popleft()
            s.mark(self.version)
            s.entering = True
            w.running.append(s)
            w.context += s.prompt_len + s.n
            entering.append(s)
            keys.setdefault(_key(s), s.prompt_len + s.n)
        if not w.running:
            return
        w.extra_fresh = sum(keys.values())
        w.extra_recompute, w.recompute = w.extra_recompute + w.recompute, 0
        # the first step: a recompute after a weight update is a prefill of its own; the rows
        # entering now are prefilled in the decode step of the others (a mixed step: the
        # prefill's per-token cost on top), or alone (a pure prefill, which samples their first
        # token) when no row was decoding
        n, cost = len(w.running), w.cost
        fresh = w.extra_fresh
        if cost.prefill_padded and fresh:
            fresh = len(keys) * max(keys.values())
        decoding = n - len(entering)
        first = cost.prefill(w.extra_recompute)
        if decoding:
            decode = cost.step(decoding, w.context - sum(s.prompt_len + s.n for s in entering))
            w.prefill_part = first + (cost.prefill(fresh) - cost.mixed_saves_s if fresh else 0.0)
            w.admitting = bool(entering)
        else:
            decode, w.prefill_part = 0.0, first + cost.prefill(fresh)
        w.base = cost.step(n, w.context)
        w.extra = decode + w.prefill_part - w.base  # the first step's time less a plain step's
        w.slope = w.cost.per_context_token_s * n
        w.k = min(s.target - s.n for s in w.running)
        if w.kv_tokens is not None:  # the step after which the K/V would overflow: a preemption
            w.k = min(w.k, (w.kv_tokens - w.context) // n)
        if held:
            w.k = 1  # the prefill budget held some back: the next boundary admits more
        elif wait_left:
            w.k = min(w.k, wait_left)  # admission waits for a batch at most this long
        heapq.heappush(self.heap, (w.end(w.k), next(self._order), w, w.token))


def _key(s: SimSeq):
    """What a sequence's prefill is shared by: its prompt's key, or itself once it holds tokens."""
    return s.key if not s.n else ("resumed", id(s))
