"""The rollout service and data manager of the asynchronous loop, and the staleness gate.

Staleness rule (AReaL's admission control, made exact by FIFO batching). Let B be the groups
per training batch, eta the staleness bound and v the current policy version (= batches
trained so far). The rollout service starts a new group only while

    started - dropped < (v + eta + 1) * B

where `started - dropped` counts every group ever started that was not dropped (dynamic
sampling filter, too few samples left after failures). The data manager forms batches
strictly in start order among non-dropped groups, so the j-th such group (0-based) trains in
batch floor(j / B) at version floor(j / B). At admission j <= started - dropped <
(v + eta + 1) * B, hence floor(j / B) <= v + eta: no group is trained more than eta versions
after the version that started it. Drops only move later groups earlier, so the bound survives them. eta = 0 admits
exactly one batch per version: the synchronous loop.

Resume: the counter `started - dropped`, the groups still in flight (with their partial
tokens), the finished-but-untrained groups and their start versions are all saved in the
checkpoint, so the bound holds across a kill and resume (AReaL once lost it there).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter

from rollover.rollout.stops import TooManyEmptyCollections, Watchdog
from rollover.rollout.curation import ExperiencePool, dynamic_samples, top_entropy_mask
from rollover.rollout.core import SampleDriver
from rollover.rollout.groups import PendingGroup, keep_group, observe_groups, sampling_from, scored_groups
from rollover.types import Completion, Group
from rollover.rollout.inputs import RolloutInputs


class StalenessGate:
    def __init__(self, batch_groups: int, max_staleness: int, max_groups: int):
        self.B = batch_groups
        self.eta = max_staleness
        self.max_groups = max_groups  # the run needs no more than steps x B accepted groups
        self.live = 0  # started - dropped

    def capacity(self, version: int) -> int:
        return max(0, min((version + self.eta + 1) * self.B, self.max_groups) - self.live)

    def state_dict(self) -> dict:
        return {"live": self.live}

    def load_state_dict(self, state: dict) -> None:
        self.live = state["live"]


class ComponentError(RuntimeError):
    """A component of the async loop failed; the message names it."""


class RolloutService:
    """Keeps the engine supplied with groups the gate admits; hands finished groups on.

    Runs on engine done-callbacks (the engine thread) and environment answers; `admit()` is
    also called by the trainer after each weight update and by the data manager after a drop.
    Samples move through the rollout core's `SampleDriver`.
    """

    def __init__(self, inputs: RolloutInputs, gate: StalenessGate, out: "queue.Queue[PendingGroup]", on_error):
        self.inputs, self.cfg, self.gate, self.out = inputs, inputs.cfg, gate, out
        self.on_error = on_error
        self.sampling = sampling_from(inputs.cfg)
        self.inflight: dict[str, PendingGroup] = {}
        self.running = 0  # samples of the groups in flight not finished yet (rows they need)
        self.paused = True  # until `resume()`: nothing is admitted before the restored groups are resubmitted
        self.stopping = False
        self.success_rate: dict[str, float] = {}  # prompt id -> last success rate (dynamic samples)
        self.lock = threading.RLock()
        self.busy_s = 0.0
        self.driver = SampleDriver(inputs, self.lock, on_finished=self._finished, on_aborted=self._aborted,
                                   on_error=lambda e: on_error("rollout service", e), on_done_callback=self._on_done)
        self.driver.hold = True
        inputs.engine.on_oldest_version(self._caught_up)

    def _caught_up(self) -> None:
        """A lagging worker loaded a newer version (lazy pulls): the gate may open."""
        try:
            self.admit()
        except BaseException as e:
            self.on_error("rollout service", e)

    def admit(self) -> None:
        with self.lock:
            if self.paused or self.stopping:
                return
            # the oldest version a worker still generates with (the trained one, unless workers
            # load updates lazily): tokens of a group started now carry it or a newer one
            oldest = self.inputs.engine.oldest_version
            k = min(self.gate.capacity(oldest), self.room())
            if k <= 0:
                return
            groups = self.inputs.next_groups(k, version=oldest)
            if self.cfg.async_.dynamic_samples:
                for g in groups:
                    greedy = g.greedy_first  # ReMax's greedy answer is not one of the samples it sizes
                    g.n = greedy + dynamic_samples(self.success_rate.get(g.prompt.id), g.n - greedy,
                                                   self.cfg.async_.min_samples)
            self.gate.live += len(groups)
            self._submit(groups)

    def room(self) -> int:
        """Groups to admit now: enough for a batch (prompts_per_step in flight), and enough to
        fill the engine's rows. Rows count the samples still running, not whole groups: a group
        whose short samples finished leaves their rows to new groups while its long one runs."""
        r = self.cfg.rollout
        return max(r.prompts_per_step - len(self.inflight), -(-(r.max_rows - self.running) // self.cfg.requests_per_group))

    def _submit(self, groups: list[PendingGroup]) -> None:
        for g in groups:
            self.inflight[g.id] = g
            self.running += g.n - len(g.done)
        self.driver.start(groups, self.sampling, self.cfg.seed)

    def _on_done(self, c: Completion) -> None:
        try:
            with self.lock:
                self.driver.completed(c)
        except BaseException as e:
            self.on_error("rollout service", e)

    def _aborted(self, g: PendingGroup, j: int) -> None:
        if not (self.paused or self.stopping):  # weight update with inflight=abort: resume at once
            self.driver.advance(g, j, self.sampling, self.cfg.seed)

    def _finished(self, g: PendingGroup, j: int) -> None:
        self.running -= 1
        if g.complete:
            del self.inflight[g.id]
            self.out.put(g)
        self.admit()  # its row is free

    def pause(self) -> list[PendingGroup]:
        """Abort everything in flight (tokens kept in their samples), let environment calls in
        flight land, and hold admissions; the groups in flight, oldest first."""
        with self.lock:
            self.paused = self.driver.hold = True
        self.driver.abort_all()
        dog = Watchdog("rollout service", "the engine and environments to settle",
                       lambda: (len(self.driver.routes), self.driver.env_calls), self.cfg.rollout.stall_timeout_s,
                       describe=lambda: f"{len(self.driver.routes)} requests not returned, "
                                        f"{self.driver.env_calls} environment calls in flight")
        while True:
            with self.lock:
                if self.driver.idle or self.stopping:
                    return sorted(self.inflight.values(), key=lambda g: g.serial)
            time.sleep(0.005)
            dog.check()

    def resume(self) -> None:
        with self.lock:
            self.paused = self.driver.hold = False
            groups = sorted(self.inflight.values(), key=lambda g: g.serial)
            self.inflight, self.running = {}, 0
            self._submit(groups)
        self.admit()

    def stop(self) -> None:
        with self.lock:
            self.stopping = self.driver.hold = True
        try:
            self.driver.abort_all()
        except RuntimeError:
            pass  # the engine itself is what failed


class DataManager:
    """Scores finished groups, filters and curates them, and forms batches in start order."""

    def __init__(self, inputs: RolloutInputs, gate: StalenessGate, service: RolloutService, inbox: "queue.Queue",
                 batches: "queue.Queue", on_error):
        self.inputs, self.cfg, self.gate, self.service = inputs, inputs.cfg, gate, service
        self.inbox, self.batches, self.on_error = inbox, batches, on_error
        self.training = 0  # batches the trainer has taken and not yet pushed the weights of (0 or 1)
        self.version_lock = threading.Lock()  # taking a batch and counting it, against the estimate below
        self.B = inputs.cfg.rollout.prompts_per_step
        self.next_serial = 0  # oldest serial not yet resolved
        self.resolved: dict[int, Group | None] = {}  # serial -> scored group, or None if dropped
        self.forming: list[Group] = []
        self.pool = ExperiencePool(inputs.cfg.reward.correct_threshold, inputs.primary_reward) if inputs.cfg.async_.experience_pool else None
        self.metrics = Counter()
        self.trajectories: list = []  # episodes resolved since the last metrics row (multi-turn)
        self.lock = threading.RLock()  # held while processing; checkpoints take it to quiesce
        self.busy_s = 0.0
        self.resolved_count = 0  # groups taken off the inbox and resolved (progress signal)
        self.dropped_in_row = 0  # groups dropped in a row, in start order
        # what a sync collection draws at most: `collection` groups dropped in a row are an empty one
        a = inputs.cfg.algorithm
        self.collection = self.B * (a.max_resample_rounds if a.dynamic_sampling else 1)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="rollover-data-manager", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _loop(self) -> None:
        # A group is taken off the inbox and resolved under one hold of the lock that
        # checkpoints take, so a snapshot never sees a group in the manager's hands: it is in
        # the inbox, or resolved (scored, dropped, in the forming batch or in a batch).
        try:
            while not self.stop.is_set():
                with self.lock:
                    try:
                        g = self.inbox.get_nowait()
                    except queue.Empty:
                        g = None
                    if g is not None:
                        t0 = time.perf_counter()
                        try:
                            self._process(g)
                        except BaseException:
                            self.inbox.put(g)  # keep it: the checkpoint saves the inbox, a resume retries it
                            raise
                        self.busy_s += time.perf_counter() - t0
                        self.resolved_count += 1
                if g is None:
                    time.sleep(0.01)  # wait outside the lock, so a checkpoint can take it
        except BaseException as e:
            self.on_error("data manager", e)

    def describe(self) -> str:
        """Where the data manager stands (for stall errors)."""
        return (f"the data manager waits for group g{self.next_serial}; {len(self.forming)}/{self.B} groups "
                f"in the forming batch, {len(self.resolved)} resolved out of order, {self.inbox.qsize()} "
                f"finished groups queued, {len(self.service.inflight)} groups in flight")

    def _process(self, pg: PendingGroup) -> None:
        cfg = self.cfg
        group = scored_groups([pg], self.inputs, self.metrics)[0]
        observe_groups(self.inputs, [pg], [group])
        if pg.episodes is not None:
            self.trajectories += [pg.done[j] for j in range(pg.n)]

        def curate(group: Group) -> None:  # DART: success rates for dynamic samples, the experience pool
            rewards = [r.scores.get(self.inputs.primary_reward) or 0.0 for r in group.rollouts]
            rate = sum(x >= cfg.reward.correct_threshold for x in rewards) / len(rewards)
            with self.service.lock:
                self.service.success_rate[pg.prompt.id] = rate
            if self.pool is not None:
                train_version = self._train_version_bound(pg.serial)
                if self.pool.observe_and_fill(group, train_version, cfg.async_.max_staleness):
                    self.metrics["experience_pool_substitutions"] += 1

        keep = keep_group(group, cfg, self.metrics, curate, self.inputs.primary_reward)
        if not keep:
            with self.service.lock:
                self.gate.live -= 1
            self.service.admit()
        self.resolved[pg.serial] = group if keep else None
        stop_at = cfg.train.max_bad_steps * self.collection  # dropped in a row: no batch forms, the trainer stops
        while self.next_serial in self.resolved and self.dropped_in_row < stop_at:
            g = self.resolved.pop(self.next_serial)
            self.next_serial += 1
            self.dropped_in_row = 0 if g is not None else self.dropped_in_row + 1
            if g is None and self.dropped_in_row % self.collection == 0:
                self.metrics["empty_collections"] += 1
            if g is not None:
                self.forming.append(g)
                if len(self.forming) == self.B:
                    batch, self.forming = self.forming, []
                    batch, masked = top_entropy_mask(batch, cfg.async_.top_entropy_fraction)
                    self.metrics["entropy_masked_samples"] += masked
                    self.batches.put(batch)

    def empty_collections_error(self, step: int):
        """The error that stops the run once `train.max_bad_steps` collections' worth of groups
        in a row (in start order) were all dropped, as the sync loop stops after that many
        empty collections; None until then. A collection is a batch of groups, or with dynamic
        sampling `algorithm.max_resample_rounds` of them, as in the sync loop."""
        limit = self.cfg.train.max_bad_steps
        if self.dropped_in_row < limit * self.collection:
            return None  # at the limit the count stays there: no group after it resolves
        return TooManyEmptyCollections(
            f"the last {self.dropped_in_row} groups ({limit} collections' worth, train.max_bad_steps={limit}) were "
            f"all dropped (skipped for failed samples or, with dynamic sampling, filtered for equal rewards); "
            f"stopped at step {step} with a checkpoint in {self.cfg.run_dir}/checkpoints")

    def _train_version_bound(self, serial: int) -> int:
        """The latest version at which the group started as `serial` can train: batches form in
        start order, so ahead of it are the forming batch's groups and every earlier serial not
        yet taken in (each counted as kept; a dropped one only brings it forward). The forming
        batch trains at the trained version, plus one for a batch the trainer is training now,
        plus the batches queued."""
        with self.version_lock:
            ahead = len(self.forming) + serial - self.next_serial
            return self.inputs.engine.version + self.training + self.batches.qsize() + ahead // self.B

    def state_dict(self) -> dict:
        return {"next_serial": self.next_serial, "dropped_in_row": self.dropped_in_row,
                "resolved": dict(self.resolved), "forming": list(self.forming),
                "inbox": list(self.inbox.queue), "batches": list(self.batches.queue),
                "pool": self.pool.state_dict() if self.pool else None}

    def load_state_dict(self, state: dict) -> None:
        self.next_serial = state["next_serial"]
        self.dropped_in_row = state.get("dropped_in_row", 0)  # absent from checkpoints written before it
        if self.dropped_in_row >= self.cfg.train.max_bad_steps * self.collection:  # the stop's checkpoint: try again
            self.dropped_in_row = 0
        self.resolved = dict(state["resolved"])
        self.forming = list(state["forming"])
        for g in state["inbox"]:
            self.inbox.put(g)
        for b in state["batches"]:
            self.batches.put(b)
        if self.pool is not None and state["pool"] is not None:
            self.pool.load_state_dict(state["pool"])
