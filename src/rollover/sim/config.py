"""`rollover simulate`'s config: a training config plus the `simulate` section, the cluster to
simulate (pools of rollout workers, cost models, response lengths, simulated prompts and
environments). Training never reads that section, so it lives beside the simulator and a
training config has none (`rollover train` refuses one).

`load_sim_config` reads it as `load_config` reads a training config. The section's reference,
docs/simulator_config.md, is generated: `python -m rollover.sim.config docs/simulator_config.md`.
"""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from rollover.config import Config, load_config, markdown_reference
from rollover.config.base import NonEmptyStr, Section
from rollover.sim.costs import Contention, DecodeCost, RewardCost, SyncCost, TrainCost


# The keys a cost override may set: the fields of the cost model it overrides.
COST_FIELDS = {kind: tuple(f.name for f in fields(model)) for kind, model in
               (("decode", DecodeCost), ("train", TrainCost), ("sync", SyncCost), ("contention", Contention),
                ("reward", RewardCost))}


def _cost_fields(kind: str):
    """A validator that a dict names only fields of the cost model `kind` (`COST_FIELDS`)."""

    def check(d: dict[str, Any]) -> dict[str, Any]:
        names = COST_FIELDS[kind]
        bad = sorted(set(d) - set(names))
        if bad:
            raise ValueError(f"unknown {kind} cost keys {bad}; known: {', '.join(names)}")
        out = {}
        for k, v in d.items():
            if k in ("prefill_padded", "separate_admission"):
                if not isinstance(v, bool):
                    raise ValueError(f"{kind}.{k}={v!r}: must be true or false")
                out[k] = v
                continue
            if k == "rows_table":
                try:
                    out[k] = tuple((int(r), float(t)) for r, t in v)
                except (TypeError, ValueError):
                    raise ValueError(f"{kind}.rows_table={v!r}: must be a list of [rows, seconds] pairs") from None
                if any(t < 0 or r < 1 for r, t in out[k]) or [r for r, _ in out[k]] != sorted({r for r, _ in out[k]}):
                    raise ValueError(f"{kind}.rows_table: rows must increase from 1 up and seconds be >= 0")
                continue
            try:  # YAML reads 1e-7 (no dot) as a string
                x = float(v) if isinstance(v, str) else v
            except ValueError:
                x = None
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x < math.inf:
                raise ValueError(f"{kind}.{k}={v!r}: must be a finite number >= 0")
            out[k] = x
        return out

    return AfterValidator(check)


class SimPoolConfig(Section):
    name: NonEmptyStr = "rollout"
    """Name of this pool of identical rollout workers (in reports and the Gantt chart)."""
    workers: int = Field(1, ge=1)
    """Rollout workers (one engine each: a GPU, or a tensor-parallel group)."""
    max_rows: int = Field(64, ge=1)
    """Sequences each worker decodes together."""
    kv_tokens: int | None = Field(None, ge=1)
    """K/V-cache capacity of each worker, in tokens (prompt and response tokens of its running
    sequences, e.g. the memory left after the weights over K/V bytes per token). A request is
    admitted only with room for it; when the running sequences' growth would overrun the cache,
    the newest is preempted (its K/V dropped, recomputed when it is readmitted), as vLLM and
    SGLang do. None: the rows alone limit a worker. The schedulers' path only."""
    gpus_per_worker: int = Field(1, ge=1)
    """GPUs one worker uses (tensor parallel): counted in `rollover simulate plan`'s GPU totals."""
    admit_batch: int | None = Field(None, ge=1)
    """While rows decode, admit waiting requests once this many fit (or after 16 steps), as
    TorchEngine's `admit_batch`. None: its default, max_rows / 8 where the decode cost has
    `separate_admission` (CUDA graphs), else 1. The schedulers' path only."""
    decode: Annotated[dict[str, Any], _cost_fields("decode")] = {}
    """This pool's decode cost, over the profile's (keys of DecodeCost: step_s, per_row_s,
    per_context_token_s, prefill_s, prefill_per_token_s)."""


class SimEnvConfig(Section):
    turns: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Mean sampled turns of a simulated episode (geometric, at least 1; env.max_turns caps it).
    0 (and no turn_values): no environment (single-turn samples, scored by the simulated
    reward); 1: one turn, then one environment call that scores it (a sandboxed check)."""
    turn_values: list[Annotated[int, Field(ge=1)]] = []
    """Turns of episodes measured in a real run (e.g. its trajectories' turn counts): each
    simulated episode draws one of them (instead of the geometric draw of `turns`)."""
    step_s: float = Field(1.0, ge=0, allow_inf_nan=False)
    """Median seconds of one environment step (log-normal around it)."""
    sigma: float = Field(0.5, ge=0, allow_inf_nan=False)
    """Spread of a step's log-seconds (0: every step takes step_s)."""
    min_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    """A step takes at least this long (its draw clipped from below)."""
    max_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    """A step takes at most this long (clipped from above; unset: no limit but env.step_timeout_s)."""
    open_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Seconds of an episode's opening (initial_observation: a sandbox or VM starting)."""
    obs_tokens: int = Field(64, ge=5)
    """Tokens an environment answer inserts between turns (its message and the template's 5)."""

    @property
    def enabled(self) -> bool:
        """Whether samples are simulated episodes."""
        return self.turns > 0 or bool(self.turn_values)


class SimConfig(Section):
    profile: NonEmptyStr | None = None
    """A profile JSON (`rollover simulate calibrate` writes one): the decode, train and sync costs."""
    pools: list[SimPoolConfig] = Field([SimPoolConfig()], min_length=1)
    """Rollout worker pools (several: a heterogeneous cluster)."""
    decode: Annotated[dict[str, Any], _cost_fields("decode")] = {}
    """Decode cost over the profile's, for every pool."""
    train: Annotated[dict[str, Any], _cost_fields("train")] = {}
    """Training step cost over the profile's (step_s, per_token_s)."""
    sync: Annotated[dict[str, Any], _cost_fields("sync")] = {}
    """Weight dissemination cost over the profile's (latency_s, bytes, bandwidth_bytes_per_s, per_worker_s)."""
    reward: Annotated[dict[str, Any], _cost_fields("reward")] = {}
    """Scoring time (per_sample_s, per_group_s, workers): each group is scored on one of
    `workers` reward workers in arrival order; unset, scoring takes no time. Sync mode scores a
    round's groups once it is generated (the workers wait); async mode scores each group as it
    lands while generation runs on. Not modelled with APRIL yet."""
    shared_device: bool = False
    """Rollout and training share one device (a one-box run, as on a CPU): while both run, each
    is slowed by the profile's `contention` factors."""
    contention: Annotated[dict[str, Any], _cost_fields("contention")] = {}
    """Contention factors over the profile's (decode, train: slowdowns >= 1 when both run)."""
    lengths: dict[str, Any] = {}
    """Response lengths (rollover/sim/workload.py LengthModel): kind lognormal (median, sigma,
    prompt_sigma) or empirical (values)."""
    trainer_gpus: int = Field(1, ge=1)
    """GPUs of the trainer whose step the train cost describes (`rollover simulate plan` counts
    them and scales them with the batch)."""
    prompts: int = Field(512, ge=1)
    """Distinct simulated prompts."""
    prompt_tokens: int = Field(128, ge=1)
    """Tokens of every simulated prompt."""
    solve_alpha: float = Field(1.0, gt=0)
    """Each prompt is solved with probability p ~ Beta(solve_alpha, solve_beta) per sample."""
    solve_beta: float = Field(1.0, gt=0)
    """See solve_alpha (Beta(1, 1): solve rates uniform over prompts)."""
    env: SimEnvConfig = SimEnvConfig()
    """Simulated multi-turn environments (rollover/sim/envs.py): each call takes virtual time,
    at most env.max_concurrent at once; env.max_turns, env.max_total_tokens and
    env.step_timeout_s apply as in a real run."""
    fast: bool = False
    """The fast path (rollover/sim/fast.py): the same cluster and policies on arrays, vectorised
    over workers (1,024 workers x 1,000 steps in a minute or two); sync, async and APRIL; not
    yet adaptive alpha, dynamic sampling, prompt selection, scoring time or a shared device.
    False: run rollover's own schedulers on the simulated workers."""
    router: Literal["auto", "numba", "python"] = "auto"
    """The fast path's per-event loops: the router (the Ray router's rule over every worker's
    load, rollover/sim/route.py) and admission at a step boundary (rollover/sim/admission.py).
    `numba` compiles them (needs numba: `pip install rollover[sim]`; vLLM brings it too),
    `python` runs the router in plain Python and admission on numpy arrays (slower: at 1,024
    workers APRIL with `carry: resubmit` routes about 16,000 resumed requests one by one every
    step), `auto` compiles when numba is installed. The decisions are the same either way; the
    report names the router that ran."""


class SimRunConfig(Config):
    """A training config and the cluster it is simulated on (`rollover simulate` reads it)."""

    simulate: SimConfig = SimConfig()
    """The simulated cluster (docs/simulator_config.md)."""

    @property
    def simulated_episodes(self) -> bool:  # Config's checks for episodes hold for simulated ones
        return self.simulate.env.enabled


def load_sim_config(path: str | Path | None = None, overrides: list[str] = (), **data: Any) -> SimRunConfig:
    """`load_config` for `rollover simulate`: the same keys, errors and overrides, plus `simulate`."""
    return load_config(path, overrides, schema=SimRunConfig, **data)


def reference() -> str:
    """docs/simulator_config.md: every key of the `simulate` section with its default, range and
    meaning (tests/test_docs.py keeps it current)."""
    return markdown_reference(
        SimConfig, "simulate.", title="Simulator configuration reference",
        command="python -m rollover.sim.config docs/simulator_config.md",
        lead="The `simulate` section of a `rollover simulate` config: the cluster it simulates "
             "([simulator.md](simulator.md)). The rest of the config is a training config and means what it means "
             "in a run ([config.md](config.md)); `rollover simulate --help-config` lists both.")


if __name__ == "__main__":  # python -m rollover.sim.config docs/simulator_config.md
    import sys

    Path(sys.argv[1]).write_text(reference() + "\n")
