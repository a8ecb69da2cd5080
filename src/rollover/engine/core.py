"""The synchronous engine core: sequence state, admission, one step at a time.

`EngineCore.step()` runs one decode step for every running sequence, then admits waiting
sequences into the free cache rows (one batched prefill, with sequences that share all their
tokens — the n samples of a prompt — prefilled once). Sequences leave the running batch at every
step and join it at every step, or in batches where admitting beside a CUDA-graph decode costs a
pass of its own (`admit_batch`, see `_admit`). It is single-threaded by design; `TorchEngine` drives it from a background
thread and is the public API.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from rollover.engine.model_runner import ModelRunner
from rollover.engine.sampler import Sampler
from rollover.engine.transfer import to_device, to_host
from rollover.engine.stop import StopStrings
from rollover.engine.validation import validate_request
from rollover.types import Completion, Request, SamplingParams


@dataclass
class Sequence:
    request: Request
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    row: int = -1
    cached: int = 0  # tokens whose K/V are in the cache row
    stop_ids: frozenset[int] = frozenset()

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.response_ids

    def completion(self, finish) -> Completion:
        return Completion(
            id=self.id,
            prompt_ids=list(self.request.prompt_ids),
            response_ids=list(self.response_ids),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            finish=finish,
            sampling=self.sampling,
        )


@dataclass
class EngineStats:
    """Counters since the engine started (or since `reset`)."""

    decode_steps: int = 0
    busy_row_steps: int = 0  # sum over decode steps of running sequences
    total_row_steps: int = 0  # sum over decode steps of max_rows
    generated_tokens: int = 0
    prefill_tokens: int = 0  # computed: sequences sharing all their tokens count once
    prefill_s: float = 0.0
    decode_s: float = 0.0
    recomputed_tokens: int = 0  # K/V recomputed after update_weights
    preempted: int = 0  # sequences whose K/V was dropped for lack of cache (the simulated engine's)
    admission_steps: int = 0  # decode steps that also admitted sequences (each an eager prefill with graphs)
    finished: dict = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})

    def add(self, other: "EngineStats") -> None:
        """Add another engine's counters to these (several workers as one engine)."""
        for k, v in other.__dict__.items():
            if k == "finished":
                for reason, n in v.items():
                    self.finished[reason] = self.finished.get(reason, 0) + n
            else:
                setattr(self, k, getattr(self, k) + v)

    @property
    def occupancy(self) -> float:
        return self.busy_row_steps / self.total_row_steps if self.total_row_steps else 0.0


class EngineCore:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        eos_token_ids: tuple[int, ...],
        seed: int = 0,
        version: int = 0,
        max_prefill_tokens: int = 8192,
        admit_batch: int | None = None,
        admit_max_wait: int = 16,
        stop_strings: StopStrings | None = None,
    ):
        self.runner = runner
        self.stop_strings = stop_strings  # finds requests' stop strings (None: such requests are refused)
        self.sampler = Sampler(runner.device, seed, getattr(runner, "kernels", None))
        self.eos_token_ids = tuple(eos_token_ids)
        self.version = version
        self.max_prefill_tokens = max_prefill_tokens
        if (admit_batch is not None and admit_batch < 1) or admit_max_wait < 0:
            raise ValueError(f"admit_batch must be >= 1 and admit_max_wait >= 0 (got {admit_batch}, {admit_max_wait})")
        self._admit_batch, self.admit_max_wait = admit_batch, admit_max_wait
        self._deferred = 0  # steps admission has waited while sequences decode (see `_admit`)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # running[i].row == i
        self.stats = EngineStats()

    @property
    def admit_batch(self) -> int:
        """See `_admit`: as set, or by default max_rows / 8 while the runner admits in a separate
        pass (CUDA graphs; a failed capture turns that off), else 1."""
        if self._admit_batch is not None:
            return self._admit_batch
        return max(1, self.runner.max_rows // 8) if self.runner.separate_admission else 1

    # ------------------------------------------------------------ requests
    def validate(self, req: Request) -> None:
        """Raise ValueError naming the request and the problem (RuntimeError while the weights
        are released: the request is refused, the engine and its other requests go on)."""
        validate_request(req, max_len=self.runner.max_len, vocab_size=self.runner.vocab_size,
                         media=getattr(self.runner, "takes_media", False), stop_strings=self.stop_strings is not None)
        self.runner._check_weights()

    def add(self, req: Request) -> Completion | None:
        """Queue a validated request. A resumed request with no budget left finishes at once."""
        seq = Sequence(
            request=req,
            response_ids=list(req.response_ids),
            logprobs=list(req.response_logprobs),
            versions=list(req.response_versions),
            stop_ids=frozenset(req.sampling.stop_token_ids)
            | (frozenset() if req.sampling.ignore_eos else frozenset(self.eos_token_ids)),
        )
        ended = bool(req.response_ids) and req.response_ids[-1] in seq.stop_ids  # (an EOS or a stop token)
        if ended or (req.sampling.stop and self.stop_strings.ends(req.sampling.stop, req.response_ids)):
            self.stats.finished["stop"] += 1  # a resume whose carried tokens already end where it stops
            return seq.completion("stop")
        if req.remaining_tokens <= 0:
            self.stats.finished["length"] += 1
            return seq.completion("length")
        self.waiting.append(seq)
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def lengths(self) -> dict[str, int]:
        """Response tokens so far of every unfinished sequence."""
        return {s.id: len(s.response_ids) for s in (*self.waiting, *self.running)}

    def abort(self, ids: set[str] | None) -> list[Completion]:
        """Abort waiting and running sequences (all when ids is None); their partial output."""
        out = []
        keep = deque()
        for seq in self.waiting:
            if ids is None or seq.id in ids:
                out.append(seq.completion("abort"))
            else:
                keep.append(seq)
        self.waiting = keep
        for seq in [s for s in self.running if ids is None or s.id in ids]:
            self._free(seq)
            out.append(seq.completion("abort"))
        self.stats.finished["abort"] += len(out)
        return out

    def update_weights(self, named_tensors, version: int, inflight: str) -> list[Completion]:
        """Load new weights between steps. inflight: 'continue' recomputes the running
        sequences' K/V under the new weights (their later tokens carry the new version);
        'keep' keeps the K/V computed by the older weights (PipelineRL's in-flight update: later
        tokens are sampled, and their logprobs reported, from new weights over old K/V);
        'abort' aborts them and returns their partial output."""
        if inflight not in ("continue", "keep", "abort"):
            raise ValueError(f"inflight must be 'continue', 'keep' or 'abort', got {inflight!r}")
        self.runner.load_weights(named_tensors)
        self.version = version
        if inflight == "abort":
            return self.abort({s.id for s in self.running})
        if self.running and inflight == "continue":
            t0 = time.perf_counter()
            toks = [s.tokens()[: s.cached] for s in self.running]
            uniq, src = self._unique(toks, self.running)
            self._prefill([self.running[i] for i in uniq], [toks[i] for i in uniq])
            self._copy_shared(self.running, uniq, src, toks)
            self.stats.recomputed_tokens += sum(len(toks[i]) for i in uniq)
            self.stats.prefill_s += time.perf_counter() - t0
        return []

    # ------------------------------------------------------------ stepping
    def step(self) -> tuple[list[Completion], list[Sequence]]:
        """Decode one token for every running sequence and admit waiting ones into the free rows
        (their prefill samples their first token) — in one forward pass when both happen. Every
        sequence gains exactly one token per step. Returns (finished completions, sequences that
        got a token)."""
        finished: list[Completion] = []
        touched: list[Sequence] = []
        decoding = list(self.running)
        admitted = self._admit()
        if not decoding and not admitted:
            return finished, touched
        t0 = time.perf_counter()
        if decoding:
            dev = self.runner.device
            tokens = to_device([s.response_ids[-1] for s in decoding], torch.long, dev)
            positions_l = [s.cached for s in decoding]
            positions, max_position = to_device(positions_l, torch.long, dev), max(positions_l)
        if admitted:
            all_toks = [s.tokens() for s in admitted]
            uniq, src = self._unique(all_toks, admitted)
            rows = [admitted[i].row for i in uniq]
            toks = [all_toks[i] for i in uniq]
            media = self._media([admitted[i] for i in uniq])
            if decoding and self.runner.separate_admission:
                # decode first: a CUDA graph pads its batch with the rows past the running ones,
                # where the admitted sequences go, and their prefill then overwrites that padding
                logits = self.runner.decode(tokens, positions, max_position)
                logits = torch.cat([logits, self._prefill([admitted[i] for i in uniq], toks)])
            elif decoding:
                logits = self.runner.mixed(tokens, positions, rows, toks, **media)
            else:
                logits = self._prefill([admitted[i] for i in uniq], toks)
            logits_p = logits[len(decoding):] if decoding else logits
            self._copy_shared(admitted, uniq, src, all_toks)
            self.stats.prefill_tokens += sum(map(len, toks))
            if src != list(range(len(src))):  # samples of one prompt share its row's logits
                logits_p = logits_p[to_device(src, torch.long, logits.device)]
            logits = torch.cat([logits[: len(decoding)], logits_p]) if decoding else logits_p
        else:
            logits = self.runner.decode(tokens, positions, max_position)
        for s in decoding:
            s.cached += 1
        if decoding:
            self.stats.decode_steps += 1
            self.stats.admission_steps += bool(admitted)
            self.stats.busy_row_steps += len(decoding)
            self.stats.total_row_steps += self.runner.max_rows
        self._append(decoding + admitted, logits, finished, touched)
        dt = time.perf_counter() - t0
        if decoding:
            self.stats.decode_s += dt  # a mixed step counts as decode time
        else:
            self.stats.prefill_s += dt
        return finished, touched

    @staticmethod
    def _media(seqs: list[Sequence]) -> dict:
        """The runner's `media` argument for prefilling `seqs`: none where none has images (the
        fast path's runner takes none)."""
        media = [s.request.media for s in seqs]
        return {"media": media} if any(m is not None for m in media) else {}

    def _prefill(self, seqs: list[Sequence], toks: list[list[int]]) -> torch.Tensor:
        return self.runner.prefill([s.row for s in seqs], toks, **self._media(seqs))

    @staticmethod
    def _unique(token_lists: list[list[int]], seqs: list[Sequence]) -> tuple[list[int], list[int]]:
        """Indices of the first occurrence of each distinct sequence (its tokens and images), and
        for every one the position of its representative among them (the n samples of a prompt
        prefill once)."""
        first: dict[tuple, int] = {}
        uniq, src = [], []
        for i, toks in enumerate(token_lists):
            media = seqs[i].request.media
            key = (tuple(toks), media.key if media is not None else None)
            if key not in first:
                first[key] = len(uniq)
                uniq.append(i)
            src.append(first[key])
        return uniq, src

    def _copy_shared(self, seqs: list[Sequence], uniq: list[int], src: list[int],
                     token_lists: list[list[int]]) -> None:
        """After prefilling the representatives `uniq` with `token_lists`, give every sequence
        its cache (a copy of its representative's row) and mark those tokens cached."""
        for i, s in enumerate(seqs):
            rep = seqs[uniq[src[i]]]
            if rep is not s:
                self.runner.copy_prefix(rep.row, s.row, len(token_lists[i]))
            s.cached = len(token_lists[i])

    def _admit(self) -> list[Sequence]:
        """Move waiting sequences into free rows, within the prefill token budget.

        While others decode, admission may wait for a batch: a step that admits beside a
        graphed decode runs an eager prefill pass, whose cost on a GPU is kernel launches, about
        the same for one sequence as for dozens (docs/benchmarks.md, "On a GPU"). So with
        `admit_batch` > 1, waiting sequences are admitted once `admit_batch` of them fit, or
        after `admit_max_wait` steps in which fewer fit, or at once where the prefill budget,
        not the rows or the queue, is what holds them back (waiting would not batch more); with
        nothing decoding they are admitted at once. The default is max_rows / 8 where the runner
        separates admission (CUDA graphs) and 1 (every step) elsewhere."""
        free, batch = self.runner.max_rows - len(self.running), self.admit_batch
        if not free or not self.waiting:  # nothing can join: no need to size the queue's head
            self._deferred = 0
            return []
        fit, budget, budget_binds = 0, self.max_prefill_tokens, False
        for seq in self.waiting:  # how many the prefill budget takes (looking no further than needed)
            if fit == max(free, batch):
                break
            n = len(seq.tokens())
            if fit and n > budget:
                budget_binds = True
                break
            fit, budget = fit + 1, budget - n
        take = min(fit, free)
        if (self.running and 0 < take < batch and not (budget_binds and take == fit)
                and self._deferred < self.admit_max_wait):
            self._deferred += 1
            return []
        self._deferred = 0
        admitted = []
        for _ in range(take):
            seq = self.waiting.popleft()
            seq.row = len(self.running)
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def _append(self, seqs, logits, finished, touched) -> None:
        params = [s.request.sampling for s in seqs]
        positions = [len(s.response_ids) for s in seqs]
        tokens, logprobs = self.sampler.sample(logits, params, positions, lambda b: seqs[b].tokens())
        tokens, logprobs = to_host(tokens, logprobs)
        done = []
        version, max_len = self.version, self.runner.max_len  # per row, every step: kept local
        for s, p, n, tok, lp in zip(seqs, params, positions, tokens, logprobs):
            s.response_ids.append(tok)
            s.logprobs.append(lp)
            s.versions.append(version)
            if tok in s.stop_ids or (p.stop and self.stop_strings.ends(p.stop, s.response_ids)):
                done.append((s, "stop"))
            elif n + 1 >= p.max_new_tokens:
                done.append((s, "length"))
            elif s.cached >= max_len:  # the cache has no room to feed this token
                done.append((s, "length"))
        touched.extend(seqs)
        self.stats.generated_tokens += len(seqs)
        for s, reason in done:
            self._free(s)
            self.stats.finished[reason] += 1
            finished.append(s.completion(reason))

    def _free(self, seq: Sequence) -> None:
        """Release a sequence's row, moving the last running row into it."""
        row = seq.row
        last = self.running[-1]
        if last is not seq:
            self.runner.move_row(last.row, row, last.cached)
            last.row = row
            self.running[row] = last
        self.running.pop()
        seq.row = -1
