"""The sharded trainer's ranks started by `torchrun` (`torchrun --nproc-per-node N -m rollover.cli
train CONFIG`, one node or several).

torchrun starts N copies of the command. The one with RANK 0 is the driver, as with
`train.ranks`: it builds the run (data, engine, partial rollouts, async state) and starts trainer
rank 0 as its own child process; every other copy is trainer rank RANK and serves the driver's
calls, exactly as a rank process that `train.ranks` spawns (`rollover.train.rank_server._serve`).

How they meet: the driver listens on a free port and writes its address (and a key) into
torchrun's store (MASTER_ADDR:MASTER_PORT); each rank reads it and opens three connections:
`calls` (the driver's calls and their answers), `lifeline` (nothing is ever sent on it: it
becomes readable only when the rank's process ends, which is how the driver tells a death from
an answer) and, with `train.colocate`, `events` (its engine's completions). Messages are
pickled whole (`PlainConnection`), not through shared memory, so a rank may be on another
machine.

A rank builds only the model's structure (from the driver's model config, on the meta device,
LoRA included), shards it, makes room for its shards only and keeps its part of each of rank
0's tensors as they are broadcast one at a time (`FSDPTrainer(from_rank0=True)`): nothing is read
from disk there, no rank but 0 holds the whole model, and every rank starts from the driver's
weights. A checkpoint's shards are read by every rank from `run_dir`, which must then
be on a filesystem every node sees.
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import signal
import socket
import traceback
from datetime import timedelta
from multiprocessing.connection import Client, Connection, Listener

log = logging.getLogger("rollover")

def _address_key() -> str:
    """Where the driver's address goes: one key per attempt (torchrun --max-restarts keeps its
    store across attempts, and a dead driver's address would send the new ranks to nobody)."""
    return f"rollover/driver/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def torchrun_env() -> dict | None:
    """This process's place in a torchrun job (world, rank, local rank, local world, store
    address), or None outside one."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or "LOCAL_RANK" not in os.environ:
        return None
    return {"world": world, "rank": int(os.environ["RANK"]), "local_rank": int(os.environ["LOCAL_RANK"]),
            "local_world": int(os.environ.get("LOCAL_WORLD_SIZE", world)),
            "addr": os.environ.get("MASTER_ADDR", "127.0.0.1"), "port": int(os.environ.get("MASTER_PORT", "29500"))}


class PlainConnection:
    """A connection whose messages are pickled whole (tensors as bytes, not shared-memory
    handles, which do not cross machines)."""

    def __init__(self, conn: Connection):
        self.conn = conn
        _keepalive(conn.fileno())

    def send(self, obj) -> None:
        self.conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self):
        return pickle.loads(self.conn.recv_bytes())

    def fileno(self) -> int:
        return self.conn.fileno()

    def poll(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)

    def close(self) -> None:
        self.conn.close()


def _keepalive(fd: int, idle_s: int = 30, every_s: int = 10, probes: int = 3) -> None:
    """TCP keepalive on a connection: a machine that vanishes without closing it (power, network)
    ends it within about idle + every * probes seconds, as a process's death would at once."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", idle_s), ("TCP_KEEPINTVL", every_s), ("TCP_KEEPCNT", probes)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    finally:
        sock.close()  # the duplicate only: the options stay with the connection's socket


def _store(env: dict, timeout_s: float):
    """torchrun's key-value store (its agent's, or rank 0's where the launcher runs none)."""
    from torch.distributed import TCPStore

    master = env["rank"] == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    return TCPStore(env["addr"], env["port"], is_master=master, timeout=timedelta(seconds=timeout_s))


class RemoteRanks:
    """The driver's side: the connections of ranks 1..N-1, accepted once each has started."""

    def __init__(self, env: dict, colocate: bool, timeout_s: float):
        self.world = env["world"]
        key = secrets.token_bytes(16)
        self._listener = Listener(("0.0.0.0", 0), authkey=key)
        port = self._listener.address[1]
        self._store = _store(env, timeout_s)
        # MASTER_ADDR: rank 0's machine, which every rank reaches (torchrun's own rendezvous uses it)
        self._store.set(_address_key(), pickle.dumps((env["addr"], port, key, colocate)))
        roles = ("calls", "lifeline", "events") if colocate else ("calls", "lifeline")
        self.calls: dict[int, PlainConnection] = {}
        self.lifelines: dict[int, PlainConnection] = {}
        self.events: dict[int, PlainConnection] = {}
        self._listener._listener._socket.settimeout(timeout_s)  # an absent rank: an error, not a hang
        expected = (self.world - 1) * len(roles)
        try:
            for _ in range(expected):
                conn = PlainConnection(self._listener.accept())
                rank, role = conn.recv()
                getattr(self, {"calls": "calls", "lifeline": "lifelines", "events": "events"}[role])[rank] = conn
        except (socket.timeout, TimeoutError):
            missing = sorted(set(range(1, self.world)) - set(self.calls))
            self.close()
            raise TimeoutError(f"torchrun: trainer ranks {missing} did not reach the driver within "
                               f"train.collective_timeout_s={timeout_s:g} s") from None
        self._listener.close()

    def close(self) -> None:
        for conn in [*self.calls.values(), *self.lifelines.values(), *self.events.values()]:
            conn.close()
        self._listener.close()


def _skeleton(config, dtype, lora: dict | None):
    """The model's structure on the meta device: FSDPTrainer(from_rank0=True) shards it, makes
    room for this rank's shards only and fills them from rank 0's tensors."""
    import torch

    from rollover.models import auto_model_class
    from rollover.train.lora import apply_lora

    with torch.device("meta"):
        model = auto_model_class(config).from_config(config, dtype=dtype)
        if lora is not None:
            model = apply_lora(model, lora)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.tie_weights()
    return model


def serve_rank(env: dict, wait_s: float = 3600.0) -> int:
    """Trainer rank RANK of a torchrun job: reach the driver (which first builds its run: data,
    model, engine; up to `wait_s`), build the model's structure, then answer its calls until it
    closes (or goes away). Returns the process's exit code."""
    from rollover.train.rank_server import RankServer, _serve

    store = _store(env, wait_s)
    try:
        host, port, key, colocate = pickle.loads(store.get(_address_key()))
    except Exception as e:  # the store's own timeout error says nothing of what was awaited
        raise TimeoutError(f"torchrun rank {env['rank']}: the driver (RANK 0) published no address in "
                           f"{wait_s:g} s ({type(e).__name__}: {e})") from None
    conns = {}
    for role in ("calls", "lifeline", "events") if colocate else ("calls", "lifeline"):
        conns[role] = PlainConnection(Client((host, port), authkey=key))
        conns[role].send((env["rank"], role))
    # from now on the driver decides when this rank ends (its `close`, or its connection's end):
    # a stop signal torchrun passes on lets the driver finish the step and checkpoint with every rank
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    calls = conns["calls"]
    server = None
    try:
        start = calls.recv()
        try:
            model = _skeleton(start["config"], start["dtype"], start["cfg"].train.lora)
            reference = _skeleton(start["config"], start["dtype"], None) if start["reference"] else None
            server = RankServer(env["rank"], env["world"], start["init"], start["cfg"], model, start["pad_id"],
                                max(1, (os.cpu_count() or 1) // env["local_world"]), conns.get("events"),
                                from_rank0=True, local_rank=env["local_rank"], reference=reference)
        except Exception:
            calls.send(("error", traceback.format_exc()))  # the driver reports it, naming this rank
            return 1
        del model, reference
        calls.send(("ok", server.info))
        return 0 if _serve(server, calls) else 1
    except (EOFError, ConnectionError):  # the driver went away
        return 1
    finally:
        if server is not None:
            server.stop_engine()

