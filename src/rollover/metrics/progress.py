"""A progress display for training: step, live reward, throughput and ETA.

On a terminal it is a tqdm bar. When the stream is not a TTY (CI logs, `nohup`, a file) a bar
would write one carriage-return frame per refresh into the log, so instead it prints plain
lines of the form

    train step 12/200 (6%) | reward=0.412 | tok/s=1234 | 8.10 s/step | elapsed 01:38 | ETA 25:23

at most one every `min_interval_s` seconds (the first update and the last step always print;
`close()` prints the latest state if it was held back). RL steps usually take longer than the
interval, so a CI log gets one line per step; a fast toy run does not flood it.

ETA is the mean step time since this `Progress` was created times the steps left; steps
completed before a resume (`initial`) are not counted in the mean.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm


class Progress:
    """Shows `step/total_steps` with reward, throughput and ETA on `file` (default stderr)."""

    def __init__(
        self,
        total_steps: int,
        initial: int = 0,
        desc: str = "train",
        *,
        file: TextIO | None = None,
        min_interval_s: float = 10.0,
    ):
        self.total_steps = total_steps
        self.initial = initial
        self.desc = desc
        self.file = file if file is not None else sys.stderr
        self.min_interval_s = min_interval_s
        self.is_tty = self.file.isatty() and _columns(self.file) > 0  # (a terminal of no width shows no bar)
        self._start = time.monotonic()
        self._last_print = -float("inf")
        self._held: str | None = None  # latest line not printed because of the interval
        self._bar = None
        self._logs = None
        if self.is_tty:
            self._bar = tqdm(
                total=total_steps, initial=initial, desc=desc, unit="step", file=self.file, dynamic_ncols=True
            )
            self._logs = logging_redirect_tqdm()  # log lines go above the bar, not onto its line
            self._logs.__enter__()

    def update(
        self,
        step: int,
        reward: float | None = None,
        tokens_per_s: float | None = None,
        samples_per_s: float | None = None,
        **extra: Any,
    ) -> None:
        """Record that `step` steps are done (the loop's 1-based step number) and show the
        latest values. `extra` items are shown as `name=value`."""
        postfix = _postfix(reward=reward, tokens_per_s=tokens_per_s, samples_per_s=samples_per_s, **extra)
        if self._bar is not None:
            self._bar.set_postfix_str(" ".join(postfix), refresh=False)
            self._bar.update(step - self._bar.n)
            return
        line = self._line(step, postfix)
        now = time.monotonic()
        if now - self._last_print >= self.min_interval_s or step >= self.total_steps:
            self._print(line, now)
        else:
            self._held = line

    def close(self) -> None:
        if self._logs is not None:
            self._logs.__exit__(None, None, None)
            self._logs = None
        if self._bar is not None:
            self._bar.close()
        elif self._held is not None:
            self._print(self._held, time.monotonic())

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _line(self, step: int, postfix: list[str]) -> str:
        elapsed = time.monotonic() - self._start
        done = step - self.initial
        parts = [f"{self.desc} step {step}/{self.total_steps} ({100 * step / self.total_steps:.0f}%)", *postfix]
        if done > 0:
            per_step = elapsed / done
            eta = tqdm.format_interval(per_step * max(self.total_steps - step, 0))
            parts += [f"{per_step:.2f} s/step", f"elapsed {tqdm.format_interval(elapsed)}", f"ETA {eta}"]
        else:
            parts += [f"elapsed {tqdm.format_interval(elapsed)}", "ETA ?"]
        return " | ".join(parts)

    def _print(self, line: str, now: float) -> None:
        print(line, file=self.file, flush=True)
        self._last_print = now
        self._held = None


def _postfix(reward: float | None, tokens_per_s: float | None, samples_per_s: float | None, **extra: Any) -> list[str]:
    items = []
    if reward is not None:
        items.append(f"reward={reward:.3f}")
    if tokens_per_s is not None:
        items.append(f"tok/s={tokens_per_s:.0f}")
    if samples_per_s is not None:
        items.append(f"samples/s={samples_per_s:.2f}")
    for name, value in extra.items():
        items.append(f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}")
    return items


def reward_errors(metrics: dict) -> dict:
    """`{"reward_errors": n}` for a step whose reward calls failed n times (zero or skip kept the
    run going), else nothing: the progress line shows it only when there is something to see."""
    n = int(metrics.get("rollout/reward_errors", 0))
    return {"reward_errors": n} if n else {}


def _columns(file) -> int:
    """The width of the terminal `file` writes to (80 where it cannot be asked)."""
    import os

    try:
        return os.get_terminal_size(file.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 80
