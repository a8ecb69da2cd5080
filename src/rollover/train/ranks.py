"""The sharded trainer's ranks as processes of this machine (`train.parallel: fsdp`, `train.ranks: N`).

`ShardedTrainer` is what the loops see: the calls of `rollover.train.trainer.Trainer` they make
(`train_step`, `named_weights`, `state_dict`, `load_state_dict`, `bad_steps`, `is_peft`, and
`model` for checkpoints), answered by N rank processes that each run a
`rollover.train.fsdp.FSDPTrainer` over one process group (gloo on CPUs; NCCL, with gloo beside
it for small objects, on GPUs: rank r on `cuda:r`). The driver keeps the data, the engine, the
partial rollouts and the async state, as with one trainer.

What crosses the seam (one pipe per rank; tensors through shared memory):
- a step: each rank its share of the `TrainBatch` (whole groups, balanced by tokens) and the
  step's group order; rank 0 answers with the step's metrics, summed over the ranks;
- weights: every rank takes part in gathering each full tensor, and rank 0 sends them on in
  buckets of `train.weight_bucket_mb` as they fill, so the engine loads them while the next
  bucket is gathered and no rank holds a second full copy;
- checkpoints: rank 0 writes the Hugging Face model from the gathered buckets (`model/`, what
  `rollover export` and `rollover eval` read) and every rank its shards of the weights and the
  optimizer state (`sharded/`, `torch.distributed.checkpoint`), read back at any world size.

The model reaches the ranks once, at start, through shared memory (the driver built it: data,
tokenizer and context checks need it, and it is the engine's architecture).

Faults: a rank that dies (a signal, out of memory) ends the call waiting on it at once with one
error naming the rank (`RankLost`), the other ranks are stopped, and the run stops at its last
checkpoint (run the same command to resume from it). A rank whose peer died inside a collective
gives up after `train.collective_timeout_s`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import traceback
from multiprocessing.connection import wait
from pathlib import Path

import torch

log = logging.getLogger("rollover")


class RankLost(RuntimeError):
    """A trainer rank died or failed; the run stops at its last checkpoint."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, init_method: str, cfg, model, pad_id: int, threads: int, conn) -> None:
    """One rank: build its FSDPTrainer, then answer the driver's calls until `close`."""
    try:
        from rollover.loops.common import seed_everything, use_deterministic_kernels
        from rollover.train.fsdp import FSDPTrainer, process_group

        torch.set_num_threads(threads)
        if cfg.train.deterministic:
            use_deterministic_kernels()
        seed_everything(cfg.seed)
        cuda = cfg.device != "cpu" and torch.cuda.is_available()
        device = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu")
        if cuda:
            torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        with process_group(backend, rank, world, init_method, cfg.train.collective_timeout_s):
            trainer = FSDPTrainer(model, cfg, device=device, pad_id=pad_id)
            del model
            conn.send(("ok", {"pid": os.getpid(), "device": str(device), "is_peft": trainer.is_peft}))
            _serve(trainer, rank, conn)
    except (EOFError, KeyboardInterrupt):  # the driver went away
        pass
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass


def _serve(trainer, rank: int, conn) -> None:
    while True:
        call, *args = conn.recv()
        try:
            if call == "close":
                conn.send(("ok", None))
                return
            if call == "train_step":
                batch, groups, profile = args
                if profile:
                    metrics, seconds, comm = trainer.profiled_step(batch, groups)
                    trainer.last_profile = {"step_s": seconds, "collective_s": comm}
                else:
                    metrics = trainer.train_step(batch, groups)
                conn.send(("ok", (metrics, trainer.bad_steps)))
            elif call == "stats":
                conn.send(("ok", {"rank": rank, "pid": os.getpid(), **trainer.state_bytes(), "peak_rss_gb": _peak_rss_gb(),
                                  **getattr(trainer, "last_profile", {})}))
            elif call == "weights":
                bucket_bytes, dtype = args
                n = 0
                for bucket in trainer.gather_buckets(bucket_bytes, dtype):
                    if rank == 0:
                        conn.send(("bucket", bucket))
                        n += len(bucket)
                conn.send(("ok", n))
            elif call == "save_sharded":
                trainer.save_sharded(args[0])
                conn.send(("ok", None))
            elif call == "load":
                state, sharded = args
                trainer.load_state_dict(state)
                if sharded is not None:
                    trainer.load_sharded(sharded)
                conn.send(("ok", trainer.bad_steps))
            elif call == "state_dict":
                conn.send(("ok", trainer.state_dict()))
            else:
                raise ValueError(f"unknown call {call!r}")
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            if call in ("train_step", "weights", "save_sharded", "load"):  # its peers may be mid-collective
                return


def _peak_rss_gb() -> float | None:
    """This process's resident high-water mark (Linux)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        return None
    return None


class ShardedModel:
    """What the driver holds in place of the policy: its config (and the driver's own copy as
    the engine's architecture), and `save_pretrained` done by the ranks."""

    def __init__(self, owner: "ShardedTrainer", model):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self._owner, self.config, self.generation_config = owner, base.config, getattr(base, "generation_config", None)

    def save_pretrained(self, path, safe_serialization: bool = True) -> None:
        """The Hugging Face model from the gathered weights (rank 0's buckets, one safetensors
        file each, and the index), and every rank's shards under `path/../sharded`."""
        import json

        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        index, files, total = {}, 0, 0
        for bucket in self._owner._buckets(None):
            files += 1
            name = f"model-{files:05d}.safetensors"
            save_file({n: t.contiguous() for n, t in bucket}, str(path / name), metadata={"format": "pt"})
            for n, t in bucket:
                index[n] = name
                total += t.numel() * t.element_size()
        for old in range(files):  # name the files "-of-" once their count is known, as transformers does
            src = path / f"model-{old + 1:05d}.safetensors"
            src.rename(path / f"model-{old + 1:05d}-of-{files:05d}.safetensors")
        index = {n: f.replace(".safetensors", f"-of-{files:05d}.safetensors") for n, f in index.items()}
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1))
        self.config.save_pretrained(path)
        if self.generation_config is not None:
            self.generation_config.save_pretrained(path)
        self._owner._all("save_sharded", str(path.parent / "sharded"))


class ShardedTrainer:
    """`Trainer`'s calls, answered by N rank processes (see the module docstring)."""

    sharded = True

    def __init__(self, model, cfg, *, pad_id: int, checkpoint: Path | None = None):
        import torch.multiprocessing as mp

        self.cfg, self.world = cfg, cfg.train.ranks
        self.checkpoint = checkpoint
        self.bad_steps, self.procs, self.conns = 0, [], []
        self._lock = threading.RLock()  # one call at a time on the pipes (async mode's trainer thread, checkpoints)
        self.architecture = model.get_base_model() if hasattr(model, "get_base_model") else model
        ctx = mp.get_context("spawn")
        init = f"tcp://127.0.0.1:{_free_port()}"
        threads = max(1, (os.cpu_count() or 1) // self.world) if cfg.device == "cpu" or not torch.cuda.is_available() \
            else max(1, min(8, (os.cpu_count() or 1) // self.world))
        try:
            for rank in range(self.world):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_rank_main, args=(rank, self.world, init, cfg, model, pad_id, threads, child),
                                name=f"rollover-rank-{rank}", daemon=True)
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            infos = [self._recv(r, "start") for r in range(self.world)]
        except BaseException:
            self.close()
            raise
        self.is_peft = infos[0]["is_peft"]
        self.model = ShardedModel(self, model)
        log.info("trainer: %d FSDP ranks (%s)", self.world, ", ".join(f"{i['device']} pid {i['pid']}" for i in infos))

    # ------------------------------------------------------------ Trainer's calls
    def train_step(self, batch, profile: bool = False) -> dict:
        """One step, each rank training its share; `profile`: the ranks time their collectives
        (`stats` reports them)."""
        from rollover.train.fsdp import split_batch

        groups = batch.group_index_B.unique().tolist()
        with self._lock:
            for r, share in enumerate(split_batch(batch, self.world)):
                self._send(r, ("train_step", batch.select(share), groups, profile), "train_step")
            replies = [self._recv(r, "train_step") for r in range(self.world)]
        metrics, self.bad_steps = replies[0]
        return metrics

    def named_weights(self):
        """The policy's full tensors (LoRA merged), streamed from rank 0 bucket by bucket."""
        for bucket in self._buckets(None):
            yield from bucket

    def state_dict(self) -> dict:
        return {"sharded": True, **self._all("state_dict")[0]}

    def load_state_dict(self, state: dict) -> None:
        from rollover.config import ConfigError

        if not state.get("sharded"):
            raise ConfigError("the checkpoint was written by one trainer (train.parallel=none): its optimizer state is "
                              "not sharded; resume it with train.parallel=none")
        sharded = self.checkpoint / "sharded" if self.checkpoint is not None else None
        state = {k: v for k, v in state.items() if k != "sharded"}
        self.bad_steps = self._all("load", state, None if sharded is None else str(sharded))[0]

    def stats(self) -> list[dict]:
        """Per rank: bytes of weights, gradients and optimizer state held, peak resident memory,
        and the last profiled step's seconds and seconds in collectives."""
        return self._all("stats")

    def close(self) -> None:
        for r, (p, c) in enumerate(zip(self.procs, self.conns)):
            if p.is_alive():
                try:
                    c.send(("close",))
                except (OSError, BrokenPipeError):
                    pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []

    # ------------------------------------------------------------ internals
    def _buckets(self, dtype):
        bucket_bytes = int(self.cfg.train.weight_bucket_mb * 2**20)
        with self._lock:
            for r in range(self.world):
                self._send(r, ("weights", bucket_bytes, dtype), "weights")
            while True:
                kind, value = self._recv(0, "weights", raw=True)
                if kind == "bucket":
                    yield value
                    continue
                for r in range(1, self.world):
                    self._recv(r, "weights")
                return

    def _all(self, call: str, *args):
        with self._lock:
            for r in range(self.world):
                self._send(r, (call, *args), call)
            return [self._recv(r, call) for r in range(self.world)]

    def _send(self, rank: int, message, what: str) -> None:
        try:
            self.conns[rank].send(message)
        except (OSError, BrokenPipeError):
            self._lost(rank, what)

    def _recv(self, rank: int, what: str, raw: bool = False):
        conn, proc = self.conns[rank], self.procs[rank]
        while True:
            ready = wait([conn, proc.sentinel] + [p.sentinel for p in self.procs if p is not proc])
            if conn in ready:
                try:
                    kind, value = conn.recv()
                except EOFError:
                    self._lost(rank, what)
                if kind == "error":
                    self.close()
                    raise RankLost(f"trainer rank {rank} failed during {what}:\n{value}")
                return (kind, value) if raw else value
            dead = next(r for r, p in enumerate(self.procs) if p.sentinel in ready)
            self._lost(dead, what)

    def _lost(self, rank: int, what: str):
        proc = self.procs[rank]
        proc.join(timeout=1)
        code = proc.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        self.close()
        raise RankLost(f"trainer rank {rank} of {self.world} died ({how}) during {what}; the run stops at its last "
                       f"checkpoint (run the same command to resume from it)")
