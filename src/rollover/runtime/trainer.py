"""The trainer as a Ray actor (`ray.trainer: actor`): the policy, its optimizer and the
reference model live in one actor placed on `ray.gpus_for_trainer` GPUs and
`ray.cpus_for_trainer` CPUs of any node, instead of in the driver.

`RemoteTrainer` is what the loops see: the calls of `rollover.train.trainer.Trainer` they make
(`train_step`, `named_weights`, `state_dict`, `load_state_dict`, `bad_steps`, `is_peft`, and
`model` for checkpoints), each answered by the actor. The model is built once, by the driver
(data, tokenizer and context checks need its config), and sent to the actor before any
gradient-checkpointing hook makes it unpicklable; the driver keeps only its config.

What crosses the seam: a `TrainBatch` (tensors) in, metrics out; for every push the actor puts
its weights into the object store itself, cast to the engine's dtype, and the driver hands the
references to the rollout workers, which load them from the actor's node: one hop (with
`ray.weight_delta` or the gloo transport the driver needs the tensors to diff or send, and
fetches them: two hops, as before); optimizer state (on the CPU) and the
actor's RNG state out and in at checkpoints; the model's files out at checkpoints, one file a
call (the actor writes them into a directory on its node and sends the bytes, so the
checkpoint lands in the driver's run dir whatever node the trainer is on).

Device: the actor trains on CUDA only on the GPUs Ray gave it (`ray.gpus_for_trainer`), else on
its CPUs; `device: cuda` with no GPU for the trainer is refused when the config is read.

Faults: the actor is never restarted. If it dies, the call that finds it raises `TrainerLost`,
the run stops (no checkpoint can be written without the trainer), and the last checkpoint
stands: `rollover train` with the same command resumes from it, as after a driver's death.
The start and weight calls wait at most `ray.sync_timeout_s`, checkpoint transfers (the
model's files, the optimizer state) 10 times that, and a training step has no bound, as in the
driver (its length is the workload's); a dead actor ends any of them at once, and a call past
its bound raises `TrainerLost` naming it.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

from rollover.runtime.live import first_line, kill_actor

log = logging.getLogger("rollover")

BULK, BULK_FACTOR = "bulk", 10  # checkpoint transfers (the model's files, optimizer state) wait 10 x ray.sync_timeout_s


def _to_cpu(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


class TrainerLost(RuntimeError):
    """The trainer actor died or stopped answering; the run stops at its last checkpoint."""


class TrainerActor:
    """The actor's side (wrapped by `ray.remote` in `RemoteTrainer`)."""

    def __init__(self, model, cfg, pad_id: int, sys_path: list[str], reference=None):
        for path in reversed(sys_path):
            if path not in sys.path:
                sys.path.insert(0, path)
        import ray
        import torch

        from rollover.train.seeding import seed_everything, use_deterministic_kernels
        from rollover.train.trainer import Trainer

        if cfg.train.deterministic:  # process-wide: this process trains, not the driver
            use_deterministic_kernels()
        seed_everything(cfg.seed)
        # CUDA only on the GPUs Ray reserved for this actor (an actor asking for none still sees them all)
        device = torch.device("cuda" if cfg.device != "cpu" and ray.get_gpu_ids() else "cpu")
        if device.type == "cpu":
            torch.set_num_threads(max(1, int(cfg.ray.cpus_for_trainer)))
        self.trainer = Trainer(model, cfg, device=device, pad_id=pad_id, reference=reference)

    def ready(self) -> dict:
        import ray

        return {"node": ray.util.get_node_ip_address(), "pid": os.getpid(), "device": str(self.trainer.device),
                "is_peft": self.trainer.is_peft}

    def train_step(self, batch) -> tuple[dict, int]:
        metrics = self.trainer.train_step(batch)
        return metrics, self.trainer.bad_steps

    def named_weights(self) -> list:
        return [(n, t.cpu()) for n, t in self.trainer.named_weights()]

    def put_weights(self, dtype) -> list[tuple[str, object, int]]:
        """Every named weight put into the object store by this actor (floating ones in `dtype`):
        (name, reference, bytes). The workers load them from this node: one hop."""
        import ray

        out = []
        for name, t in self.trainer.named_weights():
            t = t.detach().to(device="cpu", dtype=dtype if t.is_floating_point() else t.dtype).contiguous()
            out.append((name, ray.put(t), t.numel() * t.element_size()))
        return out

    def state_dict(self) -> dict:
        from rollover.train.checkpoint import rng_state

        return _to_cpu({**self.trainer.state_dict(), "actor_rng": rng_state()})  # a driver may have no GPU

    def load_state_dict(self, state: dict) -> int:
        from rollover.train.checkpoint import set_rng_state

        state = dict(state)
        rng = state.pop("actor_rng", None)
        self.trainer.load_state_dict(state)
        if rng is not None:
            set_rng_state(rng)
        return self.trainer.bad_steps

    def save_model(self) -> list[str]:
        """Write the model's `save_pretrained` files into a directory of this actor's; their
        paths relative to it (`model_file` sends each)."""
        import shutil

        if getattr(self, "_saved", None):
            shutil.rmtree(self._saved, ignore_errors=True)
        self._saved = tempfile.mkdtemp(prefix="rollover-trainer-save-")
        self.trainer.model.save_pretrained(self._saved, safe_serialization=True)
        root = Path(self._saved)
        return [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]

    def model_file(self, name: str, last: bool) -> bytes:
        import shutil

        data = (Path(self._saved) / name).read_bytes()
        if last:
            shutil.rmtree(self._saved, ignore_errors=True)
            self._saved = None
        return data


class RemoteModel:
    """What the driver holds in place of the model: its config, and `save_pretrained` done by
    the actor (for `rollover.train.checkpoint.save`)."""

    def __init__(self, owner: "RemoteTrainer", config, generation_config):
        self._owner, self.config, self.generation_config = owner, config, generation_config

    def save_pretrained(self, path, safe_serialization: bool = True) -> None:
        path = Path(path)
        names = self._owner._call("save_model", timeout=BULK)
        for i, name in enumerate(names):
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            (path / name).write_bytes(self._owner._call("model_file", name, i == len(names) - 1, timeout=BULK))


class RemotePeftModel(RemoteModel):
    """A LoRA policy: checkpoints hold its adapter (`checkpoint.save` asks `get_base_model`)."""

    def get_base_model(self) -> RemoteModel:
        return RemoteModel(self._owner, self.config, self.generation_config)


class RemoteWeights:
    """A trainer actor's current weights, not fetched yet: the object-store transport takes
    `refs(dtype)` (put by the actor); anything else iterates them as (name, tensor) pairs,
    fetched through the driver."""

    def __init__(self, owner: "RemoteTrainer"):
        self.owner = owner

    def __iter__(self):
        self.owner.weight_fetches += 1
        return iter(self.owner._call("named_weights"))

    def refs(self, dtype) -> list[tuple[str, object, int]]:
        return self.owner._call("put_weights", dtype)


class RemoteTrainer:
    """`Trainer`'s calls, answered by a `TrainerActor` (see the module docstring)."""

    sharded = False

    def __init__(self, model, cfg, *, pad_id: int, reference=None):
        import ray

        from rollover.runtime import check_resources, start_ray

        self.cfg, self.rc = cfg, cfg.ray
        self.owns_ray = start_ray(cfg)
        self.handle, self.bad_steps, self.where = None, 0, "trainer actor"
        self.weight_fetches = 0  # the times the weights came to the driver (not those that went one hop)
        try:
            check_resources(cfg)
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            config, generation = base.config, getattr(base, "generation_config", None)
            actor = ray.remote(TrainerActor).options(num_cpus=self.rc.cpus_for_trainer,
                                                     num_gpus=self.rc.gpus_for_trainer, name=None)
            self.handle = actor.remote(model, cfg, pad_id, list(sys.path), reference)
            info = self._call("ready", what="start")
        except BaseException:
            self.close()
            raise
        self.is_peft, self.pid, self.node = info["is_peft"], info["pid"], info["node"]
        self.where = f"trainer actor (node {info['node']}, pid {info['pid']}, {info['device']})"
        log.info("ray: the %s holds the policy", self.where)
        self.model = (RemotePeftModel if self.is_peft else RemoteModel)(self, config, generation)

    # ------------------------------------------------------------ Trainer's calls
    @property
    def architecture(self):
        """The policy's config in the driver (the actor holds the weights): what an engine copies."""
        return self.model.get_base_model() if self.is_peft else self.model

    def train_step(self, batch) -> dict:
        metrics, self.bad_steps = self._call("train_step", batch, timeout=None)
        return metrics

    def named_weights(self) -> RemoteWeights:
        return RemoteWeights(self)

    def state_dict(self) -> dict:
        return self._call("state_dict", timeout=BULK)

    def load_state_dict(self, state: dict) -> None:
        self.bad_steps = self._call("load_state_dict", state, timeout=BULK)

    def close(self) -> None:
        """End the actor, and the local Ray instance if this trainer started it (close it after
        everything else on Ray)."""
        import ray

        if self.handle is not None:
            kill_actor(self.handle)
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()

    # ------------------------------------------------------------ internals
    def _call(self, method: str, *args, timeout: float | None | str = -1, what: str | None = None):
        import ray

        timeout = {-1: self.rc.sync_timeout_s, BULK: BULK_FACTOR * self.rc.sync_timeout_s}.get(timeout, timeout)
        try:
            return ray.get(getattr(self.handle, method).remote(*args), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            bound = "ray.sync_timeout_s" if timeout == self.rc.sync_timeout_s else f"{BULK_FACTOR} x ray.sync_timeout_s"
            hint = " (are its resources free? `ray status` shows them)" if what == "start" else ""
            raise TrainerLost(f"{self.where}: {what or method} did not answer within {timeout:g} s ({bound}){hint}") from None
        except ray.exceptions.RayActorError as e:
            if getattr(e, "actor_init_failed", False) or what == "start":  # its setup failed: the whole reason
                raise TrainerLost(f"{self.where} failed to start: {e}") from None
            raise TrainerLost(f"{self.where} died during {what or method}: {first_line(e)}; the run stops at its last "
                              f"checkpoint (run the same command to resume from it)") from None
        except ray.exceptions.RayTaskError as e:  # the trainer's own error (a bug, CUDA out of memory): as raised
            raise e.as_instanceof_cause() from None
