"""Small element-wise ops on the calling thread and on a second thread, as TorchEngine's engine
thread runs them beside the caller's: microseconds per call (2,000 calls after 200 warm-up).

    python benchmarks/openmp_threads.py                                   # the environment as is
    OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=100000 python benchmarks/openmp_threads.py

The variables must be set before torch loads (the `rollover` command sets these two itself).
"""

from __future__ import annotations

import threading
import time

import torch
import torch.nn.functional as F


def bench(where: str) -> None:
    x, y, w = torch.randn(64, 576), torch.randn(64, 576), torch.randn(576)
    for name, fn in (("rms_norm 64x576", lambda: F.rms_norm(x, (576,), w, 1e-5)), ("add 64x576", lambda: x + y)):
        for _ in range(200):
            fn()
        t0 = time.perf_counter()
        for _ in range(2000):
            fn()
        print(f"{where:14s} {name:16s} {(time.perf_counter() - t0) / 2000 * 1e6:7.1f} us", flush=True)


if __name__ == "__main__":
    bench("caller")  # the caller's OpenMP team exists first, as after loading a model
    t = threading.Thread(target=bench, args=("second thread",))
    t.start()
    t.join()
