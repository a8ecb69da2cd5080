"""`ray`: the Ray runtime's workers, placement and weight transport."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollover.config.base import Section


class RayConfig(Section):
    address: str | None = None
    """Where the Ray cluster is: unset starts a local instance (or uses the one this process
    already started, or RAY_ADDRESS's); "auto" joins the cluster `ray start` runs on this machine; "HOST:PORT"
    joins that head node. Used with runtime=ray."""
    rollout_workers: int = Field(1, ge=1)
    """Rollout workers, each a Ray actor owning one engine (rollout.engine)."""
    cpus_per_worker: float = Field(1.0, gt=0)
    """CPUs each rollout worker reserves (and, on CPU, torch threads: the integer part, at least 1)."""
    gpus_per_worker: float = Field(0.0, ge=0)
    """GPUs each rollout worker reserves: 1 (disaggregated: a GPU per worker), a fraction to
    share a GPU (colocated with other workers or the trainer), 0 on CPU clusters."""
    affinity_slack_tokens: int | None = Field(None, ge=0)
    """The router keeps requests with a seen prompt prefix on the worker holding it while that
    worker's outstanding tokens exceed the least-loaded worker's by at most this much (default:
    one group's budget, rollout.max_new_tokens x rollout.samples_per_prompt)."""
    weight_delta: bool | None = None
    """Send only what changed in a weight update: unchanged tensors are skipped and tensors with
    few changed elements go as (indices, values), in the engine's dtype. Unset: on for a 16-bit
    engine (most bits survive an update) or a LoRA run (most tensors do), off otherwise (in
    float32 a full update changes every element, and comparing costs more than it saves)."""
    weight_transport: Literal["object_store", "gloo"] = "object_store"
    """How weight updates reach the rollout workers: "object_store" (the driver puts each tensor
    once, every worker pulls it; deltas possible) or "gloo" (a torch.distributed group of the
    driver and the workers: the driver sends one packed buffer to each worker over TCP; whole
    tensors only). Either way a worker's first weights come through the object store."""
    reward_workers: int = Field(0, ge=0)
    """Reward workers, Ray actors that score every reward call of the run (any node; a worker
    that dies or times out fails only the samples it was scoring, counted in the reward error
    metrics, and is replaced). 0: rewards run on the driver (isolated ones in its worker
    processes, reward.workers of them)."""
    cpus_per_reward_worker: float = Field(1.0, ge=0)
    """CPUs each reward worker reserves (0: none, for light rewards that share a node's CPUs)."""
    gpus_per_reward_worker: float = Field(0.0, ge=0)
    """GPUs (or a fraction) each reward worker reserves, for a reward that runs a model (the
    built-in reward_model on `device: auto` uses it). 0: the worker sees no GPU."""
    env_workers: int = Field(0, ge=0)
    """Environment workers, Ray actors that hold the environments of a multi-turn run (env.name)
    and answer their calls (any node; an actor that dies fails only the episodes it held, and
    is replaced). 0: environments run on the driver."""
    cpus_per_env_worker: float = Field(1.0, ge=0)
    """CPUs each environment worker reserves."""
    weight_sync: Literal["eager", "lazy"] = "eager"
    """When rollout workers load a weight update: "eager", every worker loads it before the push
    returns (the trainer waits); "lazy" (async mode), the push puts the weights in the object
    store and returns, and each worker loads the newest version on its own time while it goes on
    generating (ECHO-2's lazy pulls, DART's per-worker updates). Tokens keep their exact
    versions, and the staleness gate admits new groups by the oldest version a worker still
    holds, so async.max_staleness holds for every token."""
    sync_timeout_s: float = Field(300.0, gt=0)
    """Bound on every call to a worker that must answer (weight loads, aborts, stats): past it the
    run stops with an error naming the worker and the call."""
    max_restarts: int = Field(3, ge=0)
    """Restarts per rollout worker after its process died (its requests resume elsewhere from
    their tokens); one more death ends the run."""
    trainer: Literal["driver", "actor"] = "driver"
    """Where the trainer (policy, optimizer, reference model) runs: in the driver process (the
    `rollover train` process, which then needs the trainer's GPU), or as a Ray actor placed on
    `gpus_for_trainer` GPUs and `cpus_for_trainer` CPUs of any node (disaggregated: a head
    node without GPUs drives a trainer elsewhere). An actor that dies stops the run at its last
    checkpoint."""
    cpus_for_trainer: float = Field(1.0, ge=0)
    """CPUs the trainer actor reserves (and, on CPU, its torch threads: the integer part, at
    least 1). With ray.trainer=actor."""
    gpus_for_trainer: float = Field(0.0, ge=0)
    """GPUs the trainer actor reserves: 1 or more to train on its own GPU(s) (disaggregated), a
    fraction to share a GPU with rollout workers (colocated), 0 on CPU clusters. With
    ray.trainer=actor."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs of a local instance this run starts (default: all of the machine)."""
    dashboard: bool = False
    """Start the Ray dashboard with a local instance."""
