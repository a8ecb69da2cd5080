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
  buckets of `train.weight_bucket_mb` as they fill, so no rank holds a second full copy (the
  driver's engine takes the whole set: TorchEngine checks every name and shape before loading);
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

import atexit
import logging
import os
import re
import signal
import socket
import threading
import time
import weakref
from multiprocessing.connection import wait
from pathlib import Path

import torch

from rollover.train.rank_server import _rank_main

log = logging.getLogger("rollover")


class RankLost(RuntimeError):
    """A trainer rank died or failed; the run stops at its last checkpoint. `traceback`: the
    rank's own, where it reported one (its last line is in the message)."""

    def __init__(self, message: str, traceback: str | None = None):
        super().__init__(message)
        self.traceback = traceback


def _last_line(tb: str) -> str:
    """The exception a traceback ends in, as Python prints its first line (`Type: message`): a
    message of several lines (CUDA's and NCCL's end in advice) is named by its first."""
    lines = [line for line in tb.strip().splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"[A-Za-z_][\w.]*(: |$)", line)]
    return raised[-1].strip() if raised else (lines[-1].strip() if lines else "(no traceback)")


def _rank_context(mp, architecture, cuda: bool):
    """Where rank processes come from. On CPUs: a fork server (one per driver process) that
    imported torch, the rank's own modules and the model class's transformers module once, before
    any thread exists; each rank is a fork of it and starts with them, where a spawned rank
    imported them again (about 4 s a rank on 2 cores, each time ranks start). The server and its
    ranks keep the environment the driver had when the server started. On GPUs ranks are spawned:
    a module that asked CUDA anything at import (`torch.cuda.is_available()` initialises the
    driver) would leave every fork of the server unable to use CUDA."""
    if cuda:
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    modules = ["torch", "rollover.train.rank_server", "rollover.train.fsdp", type(architecture).__module__]
    ctx.set_forkserver_preload([m for m in modules if m != "__main__"])  # read when the server starts
    # A stop signal sent to the whole process group (torchrun, a scheduler, `kill -TERM -PGID`) is
    # the driver's to act on, as the ranks ignore it: were the server to die of it, each rank's exit
    # status (which the server reports) would be lost. An ignored signal stays ignored in the
    # process the server starts as (the server ignores SIGINT itself).
    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN) if main else None
    try:
        forkserver.ensure_running()
    finally:
        if main:
            signal.signal(signal.SIGTERM, before)
    return ctx


def call_name(call: str, args: tuple) -> str:
    """A call to a rank as errors name it: a colocated engine's by its method ("engine_call stats")."""
    return f"{call} {args[0]}" if call == "engine_call" and args else call


# what a rank's traceback says when a collective failed because a peer stopped (not its own fault)
_PEER_FAILURE = ("DistBackendError", "DistNetworkError", "DistStoreError", "gloo", "Gloo", "NCCL",
                 "Connection closed by peer", "Connection reset by peer")


def _collective_error(traceback_text: str) -> bool:
    """Whether a traceback's exception (its last line) is a collective's or a connection's."""
    last = next((line for line in reversed(traceback_text.strip().splitlines()) if line.strip()), "")
    return any(mark in last for mark in _PEER_FAILURE)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ShardedModel:
    """What the driver holds in place of the policy: its config (and the driver's own copy as
    the engine's architecture), and `save_pretrained` done by the ranks."""

    def __init__(self, owner: "RankGroup", model):
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
        if files == 1:  # one file: model.safetensors, no index (as transformers writes it)
            (path / "model-00001.safetensors").rename(path / "model.safetensors")
        else:  # name the files "-of-" once their count is known, as transformers does
            for old in range(files):
                src = path / f"model-{old + 1:05d}.safetensors"
                src.rename(path / f"model-{old + 1:05d}-of-{files:05d}.safetensors")
            index = {n: f.replace(".safetensors", f"-of-{files:05d}.safetensors") for n, f in index.items()}
            (path / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1))
        self.config.save_pretrained(path)
        if self.generation_config is not None:
            self.generation_config.save_pretrained(path)
        self._owner._all("save_sharded", str(path.parent / "sharded"))


class RankGroup:
    """What the loops call on a sharded trainer, whatever carries the calls to its ranks:
    subclasses give `_step(shares, groups, profile)` (rank 0's answer), `_buckets(dtype)` (rank
    0's buckets as they fill) and `_all(call, *args)` (every rank's answer)."""

    sharded = True
    world: int
    checkpoint = None
    architecture = None  # the driver's copy of the policy (set by the subclass): the engine's architecture
    bad_steps = 0

    def train_step(self, batch, profile: bool = False) -> dict:
        """One step, each rank training its share (whole groups, balanced by tokens); `profile`:
        the ranks time their collectives (`stats` reports them)."""
        from rollover.train.fsdp import split_batch

        groups = batch.group_index_B.unique().tolist()
        sp = self.cfg.train.sequence_parallel  # the ranks of a sequence-parallel group train one share together
        shares = [batch.select(share) for share in split_batch(batch, self.world // sp) for _ in range(sp)]
        metrics, self.bad_steps = self._step(shares, groups, profile)
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
                              "not sharded; resume it with train.parallel=none, or start a new run on the sharded "
                              "trainer from its weights (rollover export RUN_DIR OUT, then model=OUT and a new "
                              "run_dir; AdamW's moments start again)")
        sharded = self.checkpoint / "sharded" if self.checkpoint is not None else None
        state = {k: v for k, v in state.items() if k != "sharded"}
        self.bad_steps = self._all("load", state, None if sharded is None else str(sharded))[0]

    def stats(self) -> list[dict]:
        """Per rank: bytes of weights, gradients and optimizer state held, peak resident memory,
        and the last profiled step's seconds and seconds in collectives."""
        return self._all("stats")


class ShardedTrainer(RankGroup):
    """`Trainer`'s calls, answered by N rank processes (see the module docstring)."""

    def __init__(self, model, cfg, *, pad_id: int, checkpoint: Path | None = None, reference=None):
        import torch.multiprocessing as mp

        from rollover.train.torchrun import RemoteRanks, torchrun_env

        self.cfg, self.world = cfg, cfg.train.ranks
        self.checkpoint = checkpoint
        self.bad_steps, self.procs, self.conns = 0, [], []
        self.events = []  # train.colocate: each rank's engine completions
        self.remote: RemoteRanks | None = None  # torchrun: ranks 1..N-1 are the job's other processes
        self.failure: RankLost | None = None  # why the ranks stopped, once they have
        self._lock = threading.RLock()  # one call at a time on the pipes (async mode's trainer thread, checkpoints)
        self.architecture = model.get_base_model() if hasattr(model, "get_base_model") else model
        env = torchrun_env()
        local = 1 if env is not None else self.world  # rank processes started here
        cuda = cfg.device != "cpu" and torch.cuda.is_available()
        ctx = _rank_context(mp, self.architecture, cuda)
        host = env["addr"] if env is not None else "127.0.0.1"
        init = f"tcp://{host}:{_free_port()}"
        per_machine = env["local_world"] if env is not None else self.world
        threads = max(1, (os.cpu_count() or 1) // per_machine)  # the ranks split the cores
        if cuda:
            threads = min(8, threads)  # on a GPU a rank's host threads only feed it
        # a rank whose engine is vLLM starts vLLM's engine-core process, which a daemonic process
        # may not; such ranks are closed before interpreter exit joins them (they would wait on the pipe)
        daemon = not (cfg.train.colocate and cfg.rollout.engine == "vllm")
        if not daemon:
            atexit.register(_close_at_exit, weakref.ref(self))
        try:
            if env is not None:
                if env["world"] != self.world:
                    raise ValueError(f"torchrun started {env['world']} processes but train.ranks={self.world}")
                self.remote = RemoteRanks(env, cfg.train.colocate, cfg.train.collective_timeout_s)
            for rank in range(local):
                parent, child = ctx.Pipe()
                events_in, events_out = ctx.Pipe(duplex=False) if cfg.train.colocate else (None, None)
                p = ctx.Process(target=_rank_main, args=(rank, self.world, init, cfg, model, pad_id, threads, child,
                                                         events_out, env is not None, reference),
                                name=f"rollover-rank-{rank}", daemon=daemon)
                p.start()
                child.close()
                if events_out is not None:
                    events_out.close()
                    self.events.append(events_in)
                self.procs.append(p)
                self.conns.append(parent)
            if self.remote is not None:
                base = self.architecture
                start = {"init": init, "cfg": cfg, "pad_id": pad_id, "config": base.config,
                         "dtype": next(model.parameters()).dtype, "reference": reference is not None}
                for rank in range(1, self.world):
                    self.conns.append(self.remote.calls[rank])
                    if cfg.train.colocate:
                        self.events.append(self.remote.events[rank])
                    self._send(rank, start, "start")
            infos = [self._recv(r, "start") for r in range(self.world)]
        except BaseException:
            self.close()
            raise
        self.is_peft = infos[0]["is_peft"]
        self.model = ShardedModel(self, model)
        log.info("trainer: %d FSDP ranks (%s)", self.world, ", ".join(f"{i['device']} pid {i['pid']}" for i in infos))

    def _watched(self) -> dict:
        """What becomes ready when a rank's process ends, by rank: a local process's sentinel, a
        torchrun rank's lifeline."""
        out = {p.sentinel: r for r, p in enumerate(self.procs)}
        if self.remote is not None:
            out.update({conn: r for r, conn in self.remote.lifelines.items()})
        return out

    def _ended(self, rank: int) -> bool:
        if rank < len(self.procs):
            return self.procs[rank].exitcode is not None and self.procs[rank].exitcode != 0
        return self.remote.lifelines[rank].poll()

    # ------------------------------------------------------------ internals
    def _step(self, shares, groups, profile):
        with self._lock:
            for r, share in enumerate(shares):
                self._send(r, ("train_step", share, groups, profile), "train_step")
            return [self._recv(r, "train_step") for r in range(self.world)][0]

    def close(self) -> None:
        for r, c in enumerate(self.conns):
            if r >= len(self.procs) or self.procs[r].is_alive():
                try:
                    c.send(("close",))
                except (OSError, BrokenPipeError):
                    pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for c in self.conns[: len(self.procs)] + self.events[: len(self.procs)]:
            c.close()
        if self.remote is not None:  # a torchrun rank's process ends itself after `close`
            self.remote.close()
            self.remote = None
        self.procs, self.conns, self.events = [], [], []

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

    def _all(self, call: str, *args, timeout: float | None = None):
        """Every rank's answer; with `timeout` (seconds from when the calls go out), a rank that has
        not answered by then is taken for hung (`_hung`)."""
        with self._lock:
            deadline = None if timeout is None else time.monotonic() + timeout
            for r in range(self.world):
                self._send(r, (call, *args), call, deadline, timeout)
            return [self._recv(r, call, deadline=deadline, timeout=timeout) for r in range(self.world)]

    def call(self, rank: int, call: str, *args, timeout: float | None = None):
        """One rank's answer to one call (its colocated engine's calls), within `timeout` if given."""
        what = call_name(call, args)
        with self._lock:
            deadline = None if timeout is None else time.monotonic() + timeout
            self._send(rank, (call, *args), what, deadline, timeout)
            return self._recv(rank, what, deadline=deadline, timeout=timeout)

    def _send(self, rank: int, message, what: str, deadline: float | None = None, timeout: float | None = None) -> None:
        """Send `message` to a rank. With a deadline the send itself is bounded too: a hung rank
        stops reading its pipe, and a message larger than the pipe's buffer would block for ever."""
        if self.failure is not None:  # the ranks are gone: say why, whoever calls next
            raise RankLost(str(self.failure), traceback=self.failure.traceback)
        if deadline is None:
            try:
                self.conns[rank].send(message)
            except (OSError, BrokenPipeError):
                self._stopped(rank, what)
            return
        failed: list[BaseException] = []

        def send() -> None:
            try:
                self.conns[rank].send(message)
            except (OSError, BrokenPipeError) as e:  # the rank is gone (or killed as hung meanwhile)
                failed.append(e)

        sender = threading.Thread(target=send, name=f"rollover-send-{rank}", daemon=True)
        sender.start()
        sender.join(max(0.0, deadline - time.monotonic()))
        if sender.is_alive():
            self._hung(rank, what, timeout)
        if failed:
            self._stopped(rank, what)

    def _recv(self, rank: int, what: str, raw: bool = False, deadline: float | None = None,
              timeout: float | None = None):
        """Rank `rank`'s answer to `what`. A rank still silent at `deadline` (time.monotonic) is
        taken for hung (`_hung`)."""
        if self.failure is not None:
            raise RankLost(str(self.failure), traceback=self.failure.traceback)
        conn, watched = self.conns[rank], self._watched()
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([conn, *watched], timeout=left)
            if not ready:
                self._hung(rank, what, timeout)
            dead = next((r for x, r in watched.items() if x in ready), None)
            if dead is not None:  # a death first: the errors of its peers' collectives follow from it
                self._stopped(dead, what)
            try:
                kind, value = conn.recv()
            except (EOFError, OSError):
                self._stopped(rank, what)
            if kind == "error":
                self._stopped(rank, what, value)
            return (kind, value) if raw else value

    def _hung(self, rank: int, what: str, timeout: float | None = None) -> None:
        """A rank gave no answer in time (an engine stuck in a call, a stopped process; `timeout`
        None: its peers' collectives gave up waiting for it): recorded first (its death is this),
        the rank killed (it may never read a close), the ranks stopped."""
        why = (f"to {what} within {timeout:g} s (from train.collective_timeout_s)" if timeout is not None else
               f"during {what} while the collectives of its peers gave up waiting for it (train.collective_timeout_s)")
        self.failure = RankLost(f"trainer rank {rank} of {self.world} gave no answer {why}: taken for hung, the ranks "
                                "are stopped; the run stops at its last checkpoint (run the same command to resume "
                                "from it)")
        if rank < len(self.procs):
            self.procs[rank].kill()
        self._fail(self.failure)

    def _pending_errors(self) -> dict[int, str]:
        """The tracebacks ranks sent before they stopped, by rank (read only once the ranks are
        failing: any other answer waiting on a pipe is dropped)."""
        out = {}
        for r, conn in enumerate(self.conns):
            try:
                while conn.poll():
                    kind, value = conn.recv()
                    if kind == "error":
                        out.setdefault(r, value)
            except (EOFError, OSError):
                continue
        return out

    def _stopped(self, rank: int, what: str, error: str | None = None):
        """A rank failed (`error`: its traceback) or its process ended while `what` ran: find the
        cause among all ranks and raise `RankLost` naming it. A rank killed without a word comes
        first (its peers' collectives fail because of it), then a rank's own error over the
        collective errors of its peers, which follow from it."""
        watched = self._watched()
        wait(list(watched), timeout=2.0)  # a peer's death reaches the others' collectives first
        errors = self._pending_errors()
        if error is not None:
            errors.setdefault(rank, error)
        killed = [r for r in range(self.world) if r not in errors and self._ended(r)]
        if killed or not errors:
            victim = killed[0] if killed else rank
            how = self.how_ended(victim)
            self._fail(RankLost(f"trainer rank {victim} of {self.world} died ({how}) during {what}; the run stops "
                                f"at its last checkpoint (run the same command to resume from it)"))
        own = [r for r, tb in sorted(errors.items()) if not _collective_error(tb)]
        silent = [r for r in range(self.world) if r not in errors]
        if not own and silent:  # its peers' collectives gave up waiting for a rank that says nothing: hung
            self._hung(silent[0], what)
        victim = own[0] if own else min(errors)
        self._fail(RankLost(f"trainer rank {victim} failed during {what}: {_last_line(errors[victim])}",
                            traceback=errors[victim]))

    def _fail(self, error: RankLost):
        self.failure = error
        self.close()
        raise error

    def how_ended(self, rank: int) -> str:
        """How a rank's process ended, in words (a torchrun rank elsewhere: only that it did)."""
        if rank < len(self.procs):
            proc = self.procs[rank]
            proc.join(timeout=1)
            code = proc.exitcode
            return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return "its torchrun process ended or its machine went away"


def _close_at_exit(ref) -> None:
    trainer = ref()
    if trainer is not None:
        trainer.close()
