"""What keeps a run from losing work: graceful interrupts (the stall watchdog every wait polls
is `rollover.rollout.stops`).

Interrupts. `Interrupts` turns the first SIGINT or SIGTERM into a request that the loop honours
at its next consistent point (the end of the current step): it saves a checkpoint and returns
with `interrupted` set, and the CLI prints one line. A second signal exits at once (exit code
128 + signal number) without saving; the checkpoint on disk is the last complete one, because a
checkpoint is written to a temporary directory and renamed into place.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


class Interrupts:
    """Context manager: the first SIGINT/SIGTERM sets `requested`; a second one exits now.

    A repeat within `REPEAT_S` (a quarter second) of the first is the same request, not a second one: GNU `timeout`,
    a job scheduler or a terminal that signals the process and its group delivers one signal
    twice at once.

    Installs handlers only in the main thread (Python delivers signals there); elsewhere it is
    inert. The previous handlers come back on exit.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    REPEAT_S = 0.25  # a duplicate arrives within microseconds; a person pressing Ctrl-C again takes longer

    def __init__(self, stream=None):
        self.requested: str | None = None  # "SIGINT" / "SIGTERM" once one arrived
        self._first_at = 0.0
        self.stream = stream
        self._previous: dict = {}

    def __enter__(self) -> "Interrupts":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        out = self.stream or sys.stderr
        import time

        if self.requested is not None and time.monotonic() - self._first_at < self.REPEAT_S:
            return  # the same signal delivered twice (to the process and to its group)
        if self.requested is None:
            self.requested = name
            self._first_at = time.monotonic()
            print(f"\nrollover: {name} received: finishing this step, then saving a checkpoint and exiting "
                  f"(send it again to exit at once without saving)", file=out, flush=True)
            return
        print(f"\nrollover: second {name}: exiting now without saving (the last complete checkpoint stands)",
              file=out, flush=True)
        os._exit(128 + signum)


def interrupted_result(step: int, signal_name: str, checkpoint_path) -> dict:
    """What a loop returns when it stopped on a signal (the CLI turns it into one line)."""
    return {"step": step, "interrupted": signal_name, "checkpoint": str(checkpoint_path)}


def resume_point(error: Exception, run_dir, step: int, saved: bool = False) -> Exception:
    """`error` (a run-stopping `RewardFailed`) with where a resume of the run starts added to its
    message: the step just saved (`saved`), or the latest checkpoint and the steps trained since
    it, which a resume trains again."""
    from rollover.train import checkpoint

    if saved:
        where = f"a checkpoint of step {step} was saved: a resume continues from it"
    elif step == 0:
        where = "the run stopped in its first step: nothing was trained"
    else:
        latest = checkpoint.latest(run_dir)
        done = int(latest.name[5:]) if latest is not None else 0
        saved = f"its latest checkpoint is step {done}" if latest is not None else "it has no checkpoint"
        where = (f"the run stopped after step {step}; {saved}"
                 + (f", so a resume trains {_steps(done + 1, step)} again (checkpoint.every sets how often one is "
                    "saved)" if done < step else ": a resume continues from it"))
    error.args = (f"{error.args[0]} ({where})", *error.args[1:])
    return error


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"
