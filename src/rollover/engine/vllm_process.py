"""Where VLLMEngine's processes run, and that they end with the process that started them.

vLLM's asyncio engine runs its engine core as a subprocess. In a trainer rank
(`train.colocate`) that process must see only the rank's GPU (`visible_device`). And it does
not end when the process that started it is killed (SIGKILL: nothing runs to stop it), so it
would hold its memory, a GPU's included, until someone kills it: `reap_with_this_process`
starts a small watcher that kills it then.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Callable, Iterable

import torch

# The watcher: reads its stdin until this process says "done" (a clean shutdown) or dies (end of
# file without it), and in the second case kills the engine's processes.
_WATCHER = """# rollover: vLLM's watcher
import sys
import psutil
if sys.stdin.buffer.read(1) != b"x":
    for arg in sys.argv[1:]:
        pid, started = arg.split(":")
        try:
            proc = psutil.Process(int(pid))
            if proc.create_time() != float(started):  # that pid is another process's now
                continue
            for p in proc.children(recursive=True) + [proc]:
                p.kill()
        except psutil.Error:
            pass
"""


@contextlib.contextmanager
def visible_device(device: torch.device | None):
    """While vLLM starts: its engine-core process sees only `device` (a trainer rank's GPU), as
    its device 0. This process's CUDA is already set up and keeps its own view."""
    if device is None or device.type != "cuda":
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    index = torch.cuda.current_device() if device.index is None else device.index
    visible = before.split(",") if before else [str(i) for i in range(torch.cuda.device_count())]
    os.environ["CUDA_VISIBLE_DEVICES"] = visible[index]
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def reap_with_this_process(pids: Iterable[int]) -> Callable[[], None]:
    """Start a watcher that kills the processes `pids` and their children (SIGKILL) if this
    process ends without calling the returned `done()`, which a clean shutdown calls once they
    have stopped. A pid that another process has taken by then is left alone."""
    import psutil

    procs = []
    for pid in sorted(pids):
        try:
            procs.append(f"{pid}:{psutil.Process(pid).create_time()!r}")  # the pid, and which process has it
        except psutil.Error:
            pass
    if not procs:
        return lambda: None
    read, write = os.pipe()  # not inherited by any other child: only this process holds `write`
    watcher = subprocess.Popen([sys.executable, "-c", _WATCHER, *procs], stdin=read,
                               start_new_session=True)  # not in this process's group: a Ctrl-C does not end it
    os.close(read)

    def done() -> None:
        try:
            os.write(write, b"x")
            os.close(write)
        except OSError:
            pass
        try:
            watcher.wait(timeout=5)
        except subprocess.TimeoutExpired:
            watcher.kill()

    return done
