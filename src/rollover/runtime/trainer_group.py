"""The sharded trainer's ranks as a group of Ray actors (`runtime: ray`, `train.parallel: fsdp`,
`train.ranks: N`, `ray.trainer: actor`): the same ranks as `rollover.train.ranks` (each a
`RankServer` holding an FSDPTrainer), placed by Ray on any nodes with `ray.cpus_for_trainer`
CPUs and `ray.gpus_for_trainer` GPUs each, counted by the placement check before anything
starts. Rank 0's node and a free port there join them into one process group (gloo on CPUs,
NCCL on GPUs).

`RayShardedTrainer` answers the loops' calls as `rollover.train.ranks.ShardedTrainer` does:
each rank trains its share of a step; weights come from rank 0 in buckets, one gather per call
on every rank; checkpoints write the Hugging Face model from those buckets (in the driver's run
dir) and each rank's shards under the checkpoint's `sharded/` (each rank writes on its own node:
on several machines the run dir must be on a shared filesystem for a resume to find them).

Faults: a rank actor that dies ends the call waiting on it at once with `RankLost` naming the
rank; the other ranks are killed, and the run stops at its last checkpoint.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

from rollover.runtime.live import first_line, kill_actor
from rollover.train.rank_server import RankServer
from rollover.train.ranks import RankGroup, RankLost, ShardedModel, call_name

log = logging.getLogger("rollover")


class TrainerRank:
    """One rank's actor: a `RankServer` built once the group's address is known."""

    def __init__(self, sys_path: list[str]):
        for path in reversed(sys_path):
            if path not in sys.path:
                sys.path.insert(0, path)
        self.server = None

    def address(self) -> str:
        """tcp://IP:PORT on this actor's node (rank 0's is the group's rendezvous)."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def start(self, rank: int, world: int, init_method: str, cfg, model, pad_id: int, reference=None,
              events_at=None) -> dict:
        """Build this rank's `RankServer`; `events_at` (train.colocate): the driver's (host, port,
        key), where this rank's engine sends its completions."""
        import ray
        import torch

        threads = None if ray.get_gpu_ids() else max(1, int(cfg.ray.cpus_for_trainer))
        if not ray.get_gpu_ids() and cfg.device != "cpu":
            cfg = cfg.model_copy(update={"device": "cpu"})  # no GPU reserved for this rank: its CPUs
        events = None
        if events_at is not None:
            from multiprocessing.connection import Client

            from rollover.train.torchrun import PlainConnection

            host, port, key = events_at
            events = PlainConnection(Client((host, port), authkey=key))
            events.send(rank)
        self.server = RankServer(rank, world, init_method, cfg, model, pad_id, threads, events, reference=reference)
        return {**self.server.info, "node": ray.util.get_node_ip_address(), "torch_threads": torch.get_num_threads()}

    def call(self, name: str, *args):
        return getattr(self.server, name)(*args)


class RayShardedTrainer(RankGroup):
    """`Trainer`'s calls, answered by N `TrainerRank` actors (see the module docstring)."""

    def __init__(self, model, cfg, *, pad_id: int, checkpoint=None, reference=None):
        import ray

        from rollover.runtime import check_resources, start_ray

        self.cfg, self.rc, self.world = cfg, cfg.ray, cfg.train.ranks
        self.checkpoint, self.bad_steps, self.actors = checkpoint, 0, []
        self.architecture = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.events: list = []  # train.colocate: each rank's engine completions, over TCP from its node
        self.failure: RankLost | None = None  # why the ranks stopped, once they have
        self._lock = threading.RLock()
        self.owns_ray = start_ray(cfg)
        try:
            check_resources(cfg, 0 if cfg.train.colocate else None)  # colocated: the ranks generate
            actor = ray.remote(TrainerRank).options(num_cpus=self.rc.cpus_for_trainer, num_gpus=self.rc.gpus_for_trainer)
            self.actors = [actor.remote(list(sys.path)) for _ in range(self.world)]
            init = self._get([self.actors[0].address.remote()], "start")[0]
            shared = ray.put(model)
            ref = ray.put(reference) if reference is not None else None
            listener = _EventsListener() if cfg.train.colocate else None
            refs = [a.start.remote(r, self.world, init, cfg, shared, pad_id, ref,
                                   None if listener is None else listener.address)
                    for r, a in enumerate(self.actors)]
            if listener is not None:  # each rank's start reaches back here first
                def failed():  # a start that ended before its rank connected: its error
                    done = ray.wait(refs, num_returns=len(refs), timeout=0)[0]
                    self._get(done, "start", ranks=[refs.index(ref) for ref in done])

                self.events = listener.accept(self.world, self.rc.sync_timeout_s, failed)
            infos = self._get(refs, "start", timeout=self.rc.sync_timeout_s)
        except BaseException:
            self.close()
            raise
        self.is_peft, self.pids = infos[0]["is_peft"], [i["pid"] for i in infos]
        self.model = ShardedModel(self, model)
        log.info("trainer: %d FSDP ranks as Ray actors (%s)", self.world,
                 ", ".join(f"node {i['node']} {i['device']}" for i in infos))

    # ------------------------------------------------------------ internals
    def _step(self, shares, groups, profile):
        with self._lock:
            refs = [a.call.remote("train_step", share, groups, profile) for a, share in zip(self.actors, shares)]
            return self._get(refs, "train_step")[0]

    def close(self) -> None:
        import ray

        self._stop_ranks()
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()

    def _stop_ranks(self) -> None:
        for a in self.actors:
            kill_actor(a)
        self.actors = []
        for conn in self.events:
            conn.close()

    # ------------------------------------------------------------ the ranks' engines (train.colocate)
    def call(self, rank: int, name: str, *args, timeout: float | None = None):
        """One rank's answer to one call (its colocated engine's calls), within `timeout` if given."""
        what = call_name(name, args)
        with self._lock:
            return self._get([self.actors[rank].call.remote(name, *args)], what, timeout=timeout, ranks=[rank],
                             knob="from train.collective_timeout_s")[0]

    def _watched(self) -> dict:
        """What becomes ready when a rank ends: nothing besides its events connection, whose end
        (a dead actor's socket closes; a vanished node's, by TCP keepalive) says so."""
        return {}

    def how_ended(self, rank: int) -> str:
        return "its Ray actor or node went away"

    def _buckets(self, dtype):
        bucket_bytes = int(self.cfg.train.weight_bucket_mb * 2**20)
        with self._lock:
            self._all("begin_weights", bucket_bytes, dtype)
            while True:
                bucket = self._get([a.call.remote("next_bucket") for a in self.actors], "weights")[0]
                if bucket is None:
                    return
                yield bucket

    def _all(self, name: str, *args, timeout: float | None = None) -> list:
        with self._lock:
            return self._get([a.call.remote(name, *args) for a in self.actors], name, timeout=timeout,
                             knob="from train.collective_timeout_s")

    def _dead(self, pending: list, index: dict) -> int | None:
        """The rank whose actor died, among the calls still out (waiting up to 3 s for them)."""
        import ray

        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=3.0) if pending else ([], [])
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                return index.get(ref)
            except Exception:  # noqa: BLE001 - another failure, not a death
                continue
        return None

    def _get(self, refs: list, what: str, timeout: float | None = None, ranks: list[int] | None = None,
             knob: str = "ray.sync_timeout_s") -> list:
        """Every rank's answer (`refs` from the ranks `ranks`, default all in order); the first rank
        to die or fail ends the wait, as does `timeout` (the setting `knob`) passing with answers
        still out: `failure` is set, the ranks stopped, RankLost raised."""
        import ray

        if self.failure is not None:  # the ranks are gone: say why, whoever calls next
            raise RankLost(str(self.failure))
        ranks = list(range(len(refs))) if ranks is None else ranks
        index = dict(zip(refs, ranks))
        pending, out = list(refs), {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                silent = sorted(index[ref] for ref in pending)
                then = "" if what == "start" else ("; the run stops at its last checkpoint (run the same command "
                                                   "to resume from it)")
                self._fail(RankLost(f"trainer rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} of "
                                    f"{self.world} gave no answer to {what} within {timeout:g} s ({knob}): taken for "
                                    f"hung, the ranks are stopped{then}"))
            ref = ready[0]
            try:
                out[index[ref]] = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                self._fail(RankLost(f"trainer rank {index[ref]} of {self.world} (a Ray actor) died during {what}: "
                                    f"{first_line(e)}; the run stops at its last checkpoint (run the same command to "
                                    "resume from it)"))
            except ray.exceptions.RayTaskError as e:
                # a peer that died mid-collective fails this rank's collective at once: name the dead one
                dead = self._dead(pending, index)
                if dead is not None:
                    self._fail(RankLost(f"trainer rank {dead} of {self.world} (a Ray actor) died during {what}; the "
                                        "run stops at its last checkpoint (run the same command to resume from it)"))
                self._fail(RankLost(f"trainer rank {index[ref]} of {self.world} failed during {what}: {first_line(e)}"))
        return [out[r] for r in ranks]

    def _fail(self, error: RankLost):
        """The ranks stop for `error`: recorded first (a colocated reader that sees the connections
        close asks why), then the actors stopped, then raised. Ray itself stays up until the run
        closes, after its rollout workers (which would otherwise see it go and start another)."""
        self.failure = error
        self._stop_ranks()
        error.__suppress_context__ = True  # the Ray error it replaces says less
        raise error


class _EventsListener:
    """Where the ranks' engines connect to send their completions (train.colocate under Ray): a
    socket on the driver's node that every node reaches, with a key of its own."""

    def __init__(self):
        import secrets
        from multiprocessing.connection import Listener

        import ray

        key = secrets.token_bytes(16)
        self._listener = Listener(("0.0.0.0", 0), authkey=key)
        self.address = (ray.util.get_node_ip_address(), self._listener.address[1], key)

    def accept(self, world: int, timeout_s: float, failed) -> list:
        """Each rank's connection, in rank order. Between tries `failed()` raises the error of a
        rank whose start already ended (a rank that died or failed before it connected); a rank
        that has not connected within `timeout_s` is an error naming it."""
        import socket
        import time
        from multiprocessing import AuthenticationError

        from rollover.train.torchrun import PlainConnection

        self._listener._listener._socket.settimeout(1.0)
        conns: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(conns) < world:
                try:
                    conn = PlainConnection(self._listener.accept())
                except (socket.timeout, TimeoutError):
                    failed()
                    if time.monotonic() > deadline:
                        missing = sorted(set(range(world)) - set(conns))
                        raise RankLost(f"trainer ranks {missing} (Ray actors) did not connect their engines to the "
                                       f"driver within ray.sync_timeout_s={timeout_s:g} s") from None
                    continue
                except AuthenticationError:  # not one of the ranks
                    continue
                conns[conn.recv()] = conn
        except BaseException:
            for conn in conns.values():
                conn.close()
            raise
        finally:
            self._listener.close()
        return [conns[r] for r in range(world)]
