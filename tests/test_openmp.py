"""rollover.engine.cpu.openmp: a thread that is about to wait hands its OpenMP workers back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

PROBE = r"""
import os, sys
try:  # a package that bundles a libgomp of its own, loaded first: torch's must still be released
    import sentencepiece
except ImportError:
    pass
import torch
from rollover.engine.cpu import openmp

def threads():
    return len(os.listdir("/proc/self/task"))

a = torch.randn(512, 512)
(a + a).sum()  # a parallel region: this thread's pool of workers
before = threads()
released = openmp.release()
after = threads()
(a + a).sum()  # the pool comes back at the next parallel region
print(released, before, after, threads(), torch.get_num_threads())
"""


def probe(**env) -> tuple[bool, int, int, int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0] == "True", *map(int, out[1:])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2,
                    reason="needs Linux and at least two OpenMP threads")
def test_release_frees_the_callers_openmp_workers_until_its_next_parallel_region():
    released, before, after, again, n = probe()
    assert released
    assert after == before - (n - 1)  # the calling thread's n - 1 workers are gone
    assert again == before  # and back once it computes again
    released, before, after, again, n = probe(ROLLOVER_OPENMP_RELEASE="0")
    assert not released and after == before == again
