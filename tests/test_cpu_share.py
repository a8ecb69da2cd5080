"""The engine's thread count follows the cores other processes leave free (rollover.engine.cpu.share)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rollover.engine.cpu import share as cpu_share
from rollover.engine.cpu.share import CpuShare


@pytest.fixture(autouse=True)
def adapting(monkeypatch):
    """On here (tests/conftest.py turns it off for the rest of the session)."""
    monkeypatch.delenv("ROLLOVER_CPU_SHARE", raising=False)
    monkeypatch.setattr(cpu_share, "_shared", None)  # a share made under the session's setting is not this one


def share_on(cores: int, threads: int) -> CpuShare:
    s = CpuShare(threads)
    s.cpus, s.enabled = set(range(cores)), True
    return s


def test_threads_for_the_cores_others_leave():
    s = share_on(cores=2, threads=2)
    assert [s.wanted(x) for x in (0.0, 0.4, 0.6, 1.0, 1.7, 2.0)] == [2, 2, 1, 1, 1, 1]
    s = share_on(cores=8, threads=4)  # never above the configured count
    assert [s.wanted(x) for x in (0.0, 3.0, 4.6, 7.9)] == [4, 4, 3, 1]


def test_lowers_at_once_and_raises_after_two_readings(monkeypatch):
    """Readings every EVERY_S: others' busy ticks grow by 1 core, then 0, from a fake /proc."""
    clock, busy, own = [0.0], [0], [0]
    monkeypatch.setattr(cpu_share.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(cpu_share, "_busy_ticks", lambda cpus: busy[0])
    monkeypatch.setattr(cpu_share, "_own_ticks", lambda: own[0])
    s = share_on(cores=2, threads=2)

    def reading(others_cores: float, own_cores: float = 1.0):
        clock[0] += 1.0
        own[0] += int(own_cores * cpu_share._TICKS)
        busy[0] += int((others_cores + own_cores) * cpu_share._TICKS)
        return s.check()

    assert s.check() is None  # the first reading is the baseline
    assert reading(0.0) is None and s.threads == 2
    assert reading(1.0) == 1 and s.others == pytest.approx(1.0)  # one busy process: one thread, at once
    assert reading(1.0) is None and s.threads == 1
    assert reading(0.0) is None and s.threads == 1  # one quiet reading is not enough
    assert reading(0.0) == 2 and s.changes == 2  # two are
    clock[0] += 0.1
    assert s.check() is None  # not read again before EVERY_S


def test_off_by_environment_and_with_one_thread(monkeypatch):
    assert not CpuShare(1).enabled
    monkeypatch.setenv("ROLLOVER_CPU_SHARE", "0")
    assert not CpuShare(4).enabled


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="reads /proc; needs two cores")
def test_a_busy_process_takes_a_thread_away_on_this_machine():
    cores = len(os.sched_getaffinity(0))
    s = CpuShare(cores)
    assert s.enabled
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(1, cores - 1))]
    try:
        time.sleep(0.5)
        deadline = time.monotonic() + 10
        while s.threads == cores and time.monotonic() < deadline:
            s.check()
            time.sleep(0.1)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert s.threads < cores and s.others > 0.5


def test_one_share_per_process_and_restore_gives_torch_its_count_back():
    import torch

    s = cpu_share.shared()
    assert cpu_share.shared() is s and s.max_threads >= 1
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as an adapting step would
    s.threads = 1
    cpu_share.restore()
    assert torch.get_num_threads() == s.max_threads == s.threads
    torch.set_num_threads(before)
