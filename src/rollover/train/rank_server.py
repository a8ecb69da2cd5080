"""One trainer rank's side (`RankServer`): its FSDPTrainer in a process group, the driver's calls
answered one by one (`_serve`), and its colocated engine (`train.colocate`). The same code runs
in a rank process this machine spawns (`_rank_main`, `rollover.train.ranks`), in one torchrun
starts (`rollover.train.torchrun`) and in a Ray rank actor (`rollover.runtime.trainer_group`)."""

from __future__ import annotations

import os
import threading
import traceback

import torch


class RankServer:
    """One rank's side, the same under a pipe (`_rank_main`) and as a Ray actor
    (`rollover.runtime.trainer_group`): its FSDPTrainer in a process group, and the calls the
    driver makes."""

    def __init__(self, rank: int, world: int, init_method: str, cfg, model, pad_id: int, threads: int | None,
                 events=None, *, from_rank0: bool = False, local_rank: int | None = None, reference=None):
        from types import SimpleNamespace

        from rollover.train.seeding import seed_everything, use_deterministic_kernels
        from rollover.train.fsdp import FSDPTrainer, process_group

        if threads:
            torch.set_num_threads(threads)
        if cfg.train.deterministic:
            use_deterministic_kernels()
        seed_everything(cfg.seed)
        cuda = cfg.device != "cpu" and torch.cuda.is_available()
        index = rank if local_rank is None else local_rank  # torchrun: this machine's rank
        device = torch.device(f"cuda:{index % torch.cuda.device_count()}" if cuda else "cpu")
        if cuda:
            torch.cuda.set_device(device)
        self.rank = rank
        self._group = process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank, world, init_method,
                                    cfg.train.collective_timeout_s)
        self._group.__enter__()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self._architecture = SimpleNamespace(config=base.config, generation_config=getattr(base, "generation_config", None))
        self.cfg, self.device = cfg, device
        self.trainer = FSDPTrainer(model, cfg, device=device, pad_id=pad_id, from_rank0=from_rank0,
                                   reference=reference)
        self.info = {"pid": os.getpid(), "device": str(device), "is_peft": self.trainer.is_peft}
        self._buckets = None
        self.engine = None  # train.colocate: this rank's rollout engine, on its device
        self._events = events  # where the engine's completions go (a sender thread drains `_outbox`)
        self._outbox = None
        self._engine_bytes_in_step = None

    def train_step(self, batch, groups, profile: bool = False):
        t = self.trainer
        if self.engine is not None:  # what this rank's engine holds while the rank trains
            self._engine_bytes_in_step = self.engine.weight_bytes()
        if profile:
            metrics, seconds, comm = t.profiled_step(batch, groups)
            t.last_profile = {"step_s": seconds, "collective_s": comm}
        else:
            metrics = t.train_step(batch, groups)
        return metrics, t.bad_steps

    def begin_weights(self, bucket_bytes: int, dtype) -> None:
        self._buckets = self.trainer.gather_buckets(bucket_bytes, dtype)

    def next_bucket(self):
        """The next bucket (rank 0's tensors; the other ranks' are empty), None after the last."""
        bucket = next(self._buckets, None)
        if bucket is None:
            self._buckets = None
        return bucket

    def save_sharded(self, path: str) -> None:
        self.trainer.save_sharded(path)

    def load(self, state: dict, sharded: str | None) -> int:
        self.trainer.load_state_dict(state)
        if sharded is not None:
            self.trainer.load_sharded(sharded)
        return self.trainer.bad_steps

    def state_dict(self) -> dict:
        return self.trainer.state_dict()  # the scheduler and counters: no tensors

    def stats(self) -> dict:
        engine = {} if self.engine is None else {"engine_weight_bytes_in_step": self._engine_bytes_in_step}
        return {"rank": self.rank, "pid": os.getpid(), **self.trainer.state_bytes(), "peak_rss_gb": _peak_rss_gb(),
                **engine, **getattr(self.trainer, "last_profile", {})}

    # ------------------------------------------------------------ a colocated engine (train.colocate)
    def engine_start(self, max_len: int, eos_token_ids, bucket_bytes: int, tokenizer=None) -> None:
        """Build this rank's engine on its device from the gathered weights (every rank gathers and
        keeps each tensor). Its completions leave through `events`, sent by a thread of their own so
        the engine never waits on the pipe."""
        import queue

        from rollover.engine import make_engine

        weights = [nt for bucket in self.trainer.gather_buckets(bucket_bytes, everyone=True) for nt in bucket]
        self.engine = make_engine(self.cfg, self._architecture, weights=weights, device=self.device, max_len=max_len,
                                  eos_token_ids=eos_token_ids, colocated=True, tokenizer=tokenizer)
        del weights
        self._outbox = queue.SimpleQueue()
        threading.Thread(target=self._send_events, name="rollover-rank-events", daemon=True).start()

    def _send_events(self) -> None:
        while (c := self._outbox.get()) is not None:
            try:
                self._events.send(c)
            except (OSError, BrokenPipeError):  # the driver went away
                return

    def engine_submit(self, requests) -> None:
        self.engine.submit_many(requests, on_done=self._outbox.put)

    def engine_load(self, bucket_bytes: int, version: int, inflight: str):
        """The trainer's weights into this rank's engine, a bucket at a time, the engine paused
        meanwhile; returns what `inflight='abort'` aborted. TorchEngine loads each bucket as it
        comes (no second full copy); vLLM takes each as a file (in /dev/shm where it has room: a
        full copy of the weights per rank in host memory) and loads them all at the end."""
        paused = self.engine.paused
        self.engine.pause()
        stage = getattr(self.engine, "stage_weights", None)  # VLLMEngine: every weight in one load
        try:
            for bucket in self.trainer.gather_buckets(bucket_bytes, everyone=True):
                if stage is not None:
                    stage(bucket)
                else:
                    self.engine.update_weights(bucket, version=version, inflight="keep")
                del bucket
            return self.engine.update_weights([], version=version, inflight=inflight)
        except BaseException:
            if stage is not None:  # what this push staged must not reach a later one
                self.engine.discard_staged()
            raise
        finally:
            if not paused:
                self.engine.resume()

    def engine_call(self, method: str, *args):
        """The rest of the engine contract: abort, pause, resume, stats, reset_stats, lengths,
        release_memory, and release_weights (`train.colocate_free_weights`)."""
        return getattr(self.engine, method)(*args)

    def close(self) -> None:
        self.stop_engine()
        self._group.__exit__(None, None, None)

    def stop_engine(self) -> None:
        """Stop this rank's engine, if it has one (at `close`, and however else the rank ends: a
        vLLM engine's process would otherwise keep the rank's process from exiting)."""
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.shutdown()
            self._outbox.put(None)


def _rank_main(rank: int, world: int, init_method: str, cfg, model, pad_id: int, threads: int, conn,
               events=None, from_rank0: bool = False, reference=None) -> None:
    """One rank as a process of this machine: answer the driver's calls on `conn` until `close`.
    A stop signal (Ctrl-C reaches the whole process group; torchrun passes SIGTERM on) is the
    driver's to act on: it finishes the step, saves it with every rank, then closes them; if the
    driver dies, the pipe's end ends this process."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    closing = threading.Event()
    _watch_driver(conn, closing)
    server = None
    try:
        server = RankServer(rank, world, init_method, cfg, model, pad_id, threads, events, from_rank0=from_rank0,
                            reference=reference)
        del model, reference
        conn.send(("ok", server.info))
        _serve(server, conn, closing)
    except (EOFError, KeyboardInterrupt):  # the driver went away
        pass
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
    finally:
        closing.set()  # ending by itself: the watch has nothing left to end (a colocated vLLM may take a while to stop)
        if server is not None:
            server.stop_engine()


def _watch_driver(conn, closing: threading.Event, grace_s: float = 5.0) -> None:
    """End this rank process when the driver that started it is gone (its end of `conn` closed)
    and it was not closing the rank: a rank blocked where the pipe's end cannot reach it (the
    start's rendezvous with a peer the dead driver never started, a collective) would otherwise
    wait out train.collective_timeout_s, holding its memory and the model's shared tensors. A
    rank waiting on the pipe ends by itself first (`grace_s`). The watch only polls for the hang-up:
    it reads nothing from the pipe."""
    import select

    def watch() -> None:
        poller = select.poll()
        poller.register(conn.fileno(), 0)  # (a hang-up is always reported)
        while not any(event & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, event in poller.poll()):
            pass
        if not closing.wait(grace_s):
            os._exit(1)

    threading.Thread(target=watch, name="rollover-driver-watch", daemon=True).start()


def _serve(server: RankServer, conn, closing: threading.Event | None = None) -> bool:
    """Answer the driver's calls until `close` (True) or a failure its peers may share (False)."""
    while True:
        call, *args = conn.recv()
        try:
            if call == "close":
                if closing is not None:
                    closing.set()
                conn.send(("ok", None))
                server.close()
                return True
            if call == "weights":  # every bucket in turn, rank 0 sending each as it fills
                server.begin_weights(*args)
                n = 0
                while (bucket := server.next_bucket()) is not None:
                    if server.rank == 0:
                        conn.send(("bucket", bucket))
                        n += len(bucket)
                conn.send(("ok", n))
            elif call in ("train_step", "save_sharded", "load", "state_dict", "stats", "engine_start", "engine_submit",
                          "engine_load", "engine_call"):
                conn.send(("ok", getattr(server, call)(*args)))
            else:
                raise ValueError(f"unknown call {call!r}")
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            if call in ("train_step", "weights", "save_sharded", "load", "engine_start", "engine_load"):  # its peers
                # may be mid-collective
                return False


def _peak_rss_gb() -> float | None:
    """This process's resident high-water mark (Linux)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        return None
    return None
