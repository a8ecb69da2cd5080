"""Pieces every schedule of the fast path (`rollover.sim.fast`) shares: a step's report row, the
training step and weight push on the trainer's timeline, the group accounting of completions."""

from __future__ import annotations

from collections import Counter

import numpy as np

from rollover.sim.fleet import Fleet


def _train_tokens(fleet: Fleet, sids: np.ndarray) -> tuple[int, int]:
    resp = int(fleet.s_target[sids].sum())
    return resp + len(sids) * fleet.prompt_tokens, resp


def _row(step, t_start, t_train, t_end, sids, fleet, version, train_s, sync_s, groups, engine_tokens=None) -> dict:
    ages = Counter((version - fleet.s_v0[sids]).tolist())
    return {"step": step + 1, "t_start": t_start, "t_train": t_train, "t_end": t_end, "wait_s": t_train - t_start,
            "train_s": train_s, "sync_s": sync_s, "samples": len(sids), "groups": groups,
            "response_tokens": int(fleet.s_target[sids].sum()), "ages": {int(k): v for k, v in ages.items()},
            "filtered_groups": 0, "discarded_tokens": 0, "engine_tokens": engine_tokens}


def _train_and_push(profile, fleet: Fleet, step: int, t0: float, t1: float, sids: np.ndarray, made: int,
                    inflight: str, rows: list, trainer_tl: list, progress) -> float:
    """Sync and APRIL: train on `sids` from t1, push the weights (workers stall), record the
    step; when the next step starts."""
    train_s = profile.train.seconds(_train_tokens(fleet, sids)[0])
    sync_s = profile.sync.seconds(fleet.W)
    version = fleet.version
    fleet.stall(t1 + train_s, sync_s, step + 1, inflight)
    now = t1 + train_s + sync_s
    trainer_tl += [[t1, t1 + train_s, "train"], [t1 + train_s, now, "sync"]]
    rows.append(_row(step, t0, t1, now, sids, fleet, version, train_s, sync_s, len(np.unique(fleet.s_group[sids])),
                     int(fleet.row_steps.sum()) - made))
    if progress:
        progress(rows[-1])
    return now


def _completions(left: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """For finish events in time order (their groups), 1 where the event is its group's last
    sample (`left`: each group's samples not finished before these events)."""
    order = np.argsort(groups, kind="stable")
    g = groups[order]
    starts = np.concatenate([[True], g[1:] != g[:-1]])
    first = np.maximum.accumulate(np.where(starts, np.arange(len(g)), 0))
    seen = np.empty(len(g), dtype=np.int64)
    seen[order] = np.arange(len(g)) - first + 1  # events of its group up to this one
    return (seen == left[groups]).astype(np.int64)


class _Groups:
    """Per group (by serial): samples not finished, and when it completed."""

    def __init__(self):
        self.left = np.zeros(1024, dtype=np.int64)
        self.done = np.full(1024, np.nan)

    def add(self, serials: list[int], n: int) -> None:
        need = serials[-1] + 1
        if need > len(self.left):
            size = max(need, 2 * len(self.left))
            self.left = np.concatenate([self.left, np.zeros(size - len(self.left), dtype=np.int64)])
            self.done = np.concatenate([self.done, np.full(size - len(self.done), np.nan)])
        self.left[serials] = n
        self.done[serials] = np.nan

    def finish(self, groups: np.ndarray, times: np.ndarray) -> np.ndarray:
        """Count finished samples (events in time order); per event, 1 where it completed its group."""
        complete = _completions(self.left, groups)
        np.subtract.at(self.left, groups, 1)
        np.fmax.at(self.done, groups, times)
        return complete
