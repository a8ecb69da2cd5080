"""Cost models of the simulated cluster: engine steps, training steps, weight dissemination.

Each is a small linear model whose coefficients come from a profile (`rollover simulate
calibrate` fits them from measured runs; published GPU figures can be typed in). Departures
from a real engine, on purpose: a step's time depends only on its rows and their context
tokens (no kernel launch jitter, no memory-bandwidth cliffs), and the tokens a prefilled
sequence samples in its admission step cost what a decode row costs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path


# steps a worker's admission waits at most for a batch (EngineCore's admit_max_wait default)
ADMIT_MAX_WAIT = 16

@dataclass(frozen=True)
class DecodeCost:
    """Seconds of one engine step over `rows` running sequences holding `context` tokens in all:
    step_s + per_row_s * rows + per_context_token_s * context. Prefilling T tokens costs
    prefill_s + prefill_per_token_s * T + prefill_quadratic_s * T^2 alone (a pure prefill step,
    which also samples the new rows' first token), or all but prefill_s inside the decode step of
    the rows already running (a mixed step). A prompt its samples share counts once; with
    `prefill_padded`, T is the prefilled rows times the longest of them, as in an engine that
    pads a step's prompts to one length. With `separate_admission` a mixed step pays the whole
    prefill, prefill_s included, on top of the decode step: TorchEngine with CUDA graphs replays
    the graphed decode and then prefills the entering rows in an eager pass of their own (and so
    batches admissions, `admit_batch`)."""

    step_s: float = 0.02
    per_row_s: float = 0.0
    per_context_token_s: float = 0.0
    prefill_s: float = 0.0
    prefill_per_token_s: float = 0.0
    prefill_quadratic_s: float = 0.0
    prefill_padded: bool = False  # T counts every prefilled row at the step's longest (TorchEngine pads)
    separate_admission: bool = False  # a mixed step = the decode step + a whole prefill (CUDA graphs)
    # measured [rows, seconds of a step at no context] points: between them the step time is
    # interpolated (a CPU's or GPU's step time is not linear in rows); beyond them it follows
    # per_row_s from the last point. Empty: step_s + per_row_s * rows.
    rows_table: tuple = ()

    def step(self, rows: int, context: int) -> float:
        return self._rows(rows) + self.per_context_token_s * context

    def _rows(self, rows: int) -> float:
        t = self.rows_table
        if not t:
            return self.step_s + self.per_row_s * rows
        if rows <= t[0][0]:
            return t[0][1] + self.per_row_s * (rows - t[0][0])
        for (r0, s0), (r1, s1) in zip(t, t[1:]):
            if rows <= r1:
                return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
        return t[-1][1] + self.per_row_s * (rows - t[-1][0])

    def admit_batch(self, max_rows: int, setting: int | None = None) -> int:
        """Waiting requests a worker of `max_rows` admits at once beside decoding rows: `setting`,
        or TorchEngine's default (EngineCore.admit_batch): max_rows / 8 where each admission is a
        pass of its own, else 1."""
        return setting or (max(1, max_rows // 8) if self.separate_admission else 1)

    def prefill(self, tokens: int) -> float:
        if not tokens:
            return 0.0
        return self.prefill_s + self.prefill_per_token_s * tokens + self.prefill_quadratic_s * tokens * tokens

    @property
    def mixed_saves_s(self) -> float:
        """What a prefill inside a mixed step costs less than alone: its fixed part, unless
        admission is a pass of its own (`separate_admission`)."""
        return 0.0 if self.separate_admission else self.prefill_s

    def scaled(self, factor: float) -> "DecodeCost":
        """Every time `factor` times longer (the device shared with a training step)."""
        if factor == 1.0:
            return self
        times = ("step_s", "per_row_s", "per_context_token_s", "prefill_s", "prefill_per_token_s", "prefill_quadratic_s")
        return replace(self, **{k: getattr(self, k) * factor for k in times},
                       rows_table=tuple((r, t * factor) for r, t in self.rows_table))


@dataclass(frozen=True)
class TrainCost:
    """Seconds of one optimizer step: step_s + per_token_s * tokens (prompt and response tokens
    of every sample in the batch, forward, backward and the logprob passes included)."""

    step_s: float = 1.0
    per_token_s: float = 0.0

    def seconds(self, tokens: int) -> float:
        return self.step_s + self.per_token_s * tokens


@dataclass(frozen=True)
class SyncCost:
    """Seconds from the end of a training step until every rollout worker holds the new weights:
    latency_s + bytes / bandwidth_bytes_per_s + per_worker_s * (workers - 1) (the last term: a
    pipelined broadcast's chain of hops; 0 for an object store every worker pulls from at
    once). Rollout workers generate nothing meanwhile (their weights are being replaced), and
    the trainer waits for the transfer."""

    latency_s: float = 0.0
    bytes: float = 0.0
    bandwidth_bytes_per_s: float = 1e9
    per_worker_s: float = 0.0

    def seconds(self, workers: int) -> float:
        return self.latency_s + self.bytes / self.bandwidth_bytes_per_s + self.per_worker_s * max(workers - 1, 0)


@dataclass(frozen=True)
class RewardCost:
    """Scoring: a group takes per_group_s + per_sample_s * its samples on one of `workers`
    reward workers (a verifier pool, a code sandbox), first come first served. 0: scoring takes
    no simulated time."""

    per_sample_s: float = 0.0
    per_group_s: float = 0.0
    workers: float = 1.0

    def group(self, samples: int) -> float:
        return self.per_group_s + self.per_sample_s * samples

    @property
    def free(self) -> bool:
        return self.per_group_s == 0 and self.per_sample_s == 0

    def pool(self) -> "RewardPool":
        return RewardPool(self)


class RewardPool:
    """The reward workers' queue: `score(at, samples)` is when a group that arrives at `at` has
    its reward (it waits for the first worker free, in arrival order)."""

    def __init__(self, cost: RewardCost):
        self.cost = cost
        self.free_at = [0.0] * max(1, int(cost.workers))
        self.busy_s = 0.0

    def score(self, at: float, samples: int) -> float:
        i = min(range(len(self.free_at)), key=self.free_at.__getitem__)
        seconds = self.cost.group(samples)
        done = max(at, self.free_at[i]) + seconds
        self.free_at[i] = done
        self.busy_s += seconds
        return done


@dataclass(frozen=True)
class Contention:
    """Slowdowns when rollout and training share one device (`simulate.shared_device`: a
    one-box run, as on this CPU) and run at the same time: decode steps take `decode` times
    longer while a training step runs, and a training step progresses `train` times slower
    while the workers generate. 1.0: no sharing."""

    decode: float = 1.0
    train: float = 1.0


@dataclass(frozen=True)
class Profile:
    """The cost models of one hardware and model combination, saved as JSON."""

    name: str = "unnamed"
    decode: DecodeCost = DecodeCost()
    train: TrainCost = TrainCost()
    sync: SyncCost = SyncCost()
    contention: Contention = Contention()
    source: str = ""  # how the numbers were obtained (a command and host, or a paper)
    fit: dict = field(default_factory=dict)  # calibration residuals and sample counts

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"profile: unknown keys {unknown} (known: {sorted(known)})")
        parts = {"decode": DecodeCost, "train": TrainCost, "sync": SyncCost, "contention": Contention}
        out = {}
        for k, v in d.items():
            if k in parts:
                names = {f.name for f in fields(parts[k])}
                bad = sorted(set(v) - names)
                if bad:
                    raise ValueError(f"profile.{k}: unknown keys {bad} (known: {sorted(names)})")
                if k == "decode" and "rows_table" in v:
                    v = {**v, "rows_table": tuple(tuple(p) for p in v["rows_table"])}
                out[k] = parts[k](**v)
            else:
                out[k] = v
        return cls(**out)

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"profile {path}: {e}") from None
        return cls.from_dict(data)
