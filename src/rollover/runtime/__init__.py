"""Runtimes: where a run's services live.

- local (default): one process; the engine is a thread (TorchEngine) or an in-process vLLM.
- ray: the rollout engine becomes `RayEngine`, a router over `ray.rollout_workers` Ray actors
  (`RolloutWorker`), each owning one engine; weights reach them through the Ray object store.
  The loops, collectors and the staleness gate are the same objects as in the local runtime:
  they see one engine and one `WeightSync`.

What runs where with runtime=ray: the driver (the `rollover train` process) runs the loop and,
by default, the trainer and environments; rollout workers run on any node of the cluster, and
so do the trainer (`ray.trainer: actor`, `rollover.runtime.trainer`), reward workers
(`ray.reward_workers`, `rollover.runtime.rewards`) and environment workers (`ray.env_workers`,
`rollover.runtime.envs`) when asked for; without them the driver trains, scores the rewards and
holds the environments.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("rollover")


def start_ray(cfg) -> bool:
    """Connect to Ray as `ray.address` says; True when this call started a local instance
    (which the run then shuts down at its end)."""
    import ray

    if ray.is_initialized():
        return False
    rc = cfg.ray
    quiet = {"log_to_driver": True, "logging_level": logging.WARNING}
    if rc.address is not None:
        try:
            ray.init(address=rc.address, **quiet)
        except ConnectionError as e:
            raise ConnectionError(f"ray.address={rc.address!r}: no Ray cluster answered ({e}); start one with "
                                  "`ray start --head` or leave ray.address unset for a local instance") from None
        return False
    if os.environ.get("RAY_ADDRESS"):  # `ray job submit` sets it: the job's cluster, whose resources are its own
        ray.init(**quiet)
        return False
    # a new local instance: ray.init() without an address would join the cluster /tmp/ray/ray_current_cluster
    # last recorded, and wait forever where that cluster has died
    ray.init(address="local", num_cpus=rc.num_cpus, include_dashboard=rc.dashboard, **quiet)
    return True


def check_resources(cfg, rollout_workers: int | None = None) -> None:
    """Refuse, before any worker starts, a placement the cluster cannot hold, naming the role
    and the numbers: the total asked against the cluster's resources, and one worker's share
    against the largest node, then the workers node by node. A trainer in the driver is not
    Ray's to account for (on one machine give Ray the other GPUs, `ray start --num-gpus`, or
    share with fractional ray.gpus_per_worker); a trainer actor (`ray.trainer: actor`) is
    counted like the workers. (Resources other jobs hold are not refused here: workers wait for
    them, up to ray.sync_timeout_s.) `rollout_workers`: how many start, when not ray.rollout_workers."""
    import ray

    from rollover.config import ConfigError

    rc = cfg.ray
    if rollout_workers is not None:  # 0: the trainer ranks' own engines generate (train.colocate)
        rc = rc.model_copy(update={"rollout_workers": rollout_workers})
    total, free = ray.cluster_resources(), ray.available_resources()
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    problems = []
    helpers = [(n, c, role) for n, c, role in ((rc.reward_workers, rc.cpus_per_reward_worker, "reward"),
                                               (rc.env_workers, rc.cpus_per_env_worker, "environment")) if n and c]
    helper_cpus = sum(n * c for n, c, _ in helpers)
    reward_gpus = rc.reward_workers * rc.gpus_per_reward_worker
    ranks = cfg.train.ranks if cfg.train.parallel == "fsdp" else 1  # FSDP ranks: one trainer actor each
    trainer = (rc.cpus_for_trainer, rc.gpus_for_trainer) if rc.trainer == "actor" else (0.0, 0.0)  # one actor's
    actors = f"{ranks} trainer rank actors x " if ranks > 1 else "the trainer actor: "
    for k, (key, per) in enumerate((("CPU", rc.cpus_per_worker), ("GPU", rc.gpus_per_worker))):
        asked, have = per * rc.rollout_workers, total.get(key, 0.0)
        extra = (helper_cpus if key == "CPU" else reward_gpus) + trainer[k] * ranks
        if asked + extra > have + 1e-9:
            also = "".join(f" + {role} workers: {n} x {c:g} CPU" for n, c, role in helpers) if key == "CPU" else \
                (f" + reward workers: {rc.reward_workers} x {rc.gpus_per_reward_worker:g} GPU" if reward_gpus else "")
            also += f" + {actors}{trainer[k]:g} {key}" if trainer[k] else ""
            problems.append(f"rollout workers: {rc.rollout_workers} x {per:g} {key}{also} = {asked + extra:g} {key} "
                            f"asked, the cluster has {have:g} {key} ({free.get(key, 0.0):g} free now)")
        biggest = max((n.get(key, 0.0) for n in nodes), default=0.0)
        if rc.rollout_workers and per > biggest + 1e-9:
            problems.append(f"rollout worker: {per:g} {key} each, the largest node has {biggest:g} {key}")
        if trainer[k] > biggest + 1e-9:
            problems.append(f"trainer actor: {trainer[k]:g} {key}{' each' if ranks > 1 else ''}, the largest node has "
                            f"{biggest:g} {key}")
    biggest_cpu = max((n.get("CPU", 0.0) for n in nodes), default=0.0)
    for _, c, role in helpers:
        if c > biggest_cpu + 1e-9:
            problems.append(f"{role} worker: {c:g} CPU each, the largest node has {biggest_cpu:g} CPU")
    biggest_gpu = max((n.get("GPU", 0.0) for n in nodes), default=0.0)
    if reward_gpus and rc.gpus_per_reward_worker > biggest_gpu + 1e-9:
        problems.append(f"reward worker: {rc.gpus_per_reward_worker:g} GPU each, the largest node has {biggest_gpu:g} GPU")
    if any(trainer) and not problems and not any(n.get("CPU", 0.0) + 1e-9 >= trainer[0] and
                                                 n.get("GPU", 0.0) + 1e-9 >= trainer[1] for n in nodes):
        problems.append(f"trainer actor: {trainer[0]:g} CPU and {trainer[1]:g} GPU on one node, no node has both")
    if not problems:  # the totals fit: do the workers fit node by node?
        def fits(node: dict) -> float:
            return min([node.get(key, 0.0) // per for key, per in (("CPU", rc.cpus_per_worker),
                                                                  ("GPU", rc.gpus_per_worker)) if per > 0] or [0])
        room = int(sum(fits(n) for n in nodes))
        shapes = ", ".join(f"{n.get('CPU', 0):g} CPU/{n.get('GPU', 0):g} GPU" for n in nodes)
        if room < rc.rollout_workers:
            problems.append(f"rollout workers: {rc.rollout_workers} asked, each {rc.cpus_per_worker:g} CPU and "
                            f"{rc.gpus_per_worker:g} GPU on one node; the nodes ({shapes}) hold {room}")
        elif (helpers or any(trainer)) and not _packs(
                nodes, [(rc.cpus_per_worker, rc.gpus_per_worker)] * rc.rollout_workers +
                [(c, rc.gpus_per_reward_worker if role == "reward" else 0.0) for n, c, role in helpers for _ in range(n)]
                + ([trainer] * ranks if any(trainer) else [])):
            # first fit can miss a packing that exists, so this warns rather than refuses
            asked = ", ".join([f"{rc.rollout_workers} rollout x {rc.cpus_per_worker:g} CPU/{rc.gpus_per_worker:g} GPU"] +
                              [f"{n} {role} x {c:g} CPU" for n, c, role in helpers] +
                              ([f"{ranks} trainer x {trainer[0]:g} CPU/{trainer[1]:g} GPU"] if any(trainer) else []))
            log.warning("ray placement: the workers (%s) may not fit node by node into the nodes (%s): placing the "
                        "largest first found no room for all of them; a worker that finds none waits up to its "
                        "start timeout", asked, shapes)
    if problems:
        raise ConfigError("ray placement does not fit: " + "; ".join(problems) +
                          " (ray.rollout_workers, ray.cpus_per_worker, ray.gpus_per_worker, ray.reward_workers, "
                          "ray.cpus_per_reward_worker, ray.gpus_per_reward_worker, ray.env_workers, ray.cpus_per_env_worker, ray.trainer, "
                          "ray.cpus_for_trainer, ray.gpus_for_trainer)")


def _packs(nodes: list[dict], items: list[tuple[float, float]]) -> bool:
    """Whether `items` ((CPU, GPU) each) fit into `nodes`, placed largest first, each on the
    first node with room for it."""
    room = [[n.get("CPU", 0.0), n.get("GPU", 0.0)] for n in nodes]
    for cpu, gpu in sorted(items, key=lambda x: (x[1], x[0]), reverse=True):
        for r in room:
            if r[0] + 1e-9 >= cpu and r[1] + 1e-9 >= gpu:
                r[0] -= cpu
                r[1] -= gpu
                break
        else:
            return False
    return True
