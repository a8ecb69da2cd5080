import io
import logging
import re
import sys

from rollover.metrics import Progress
from rollover.metrics import progress as progress_module


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_non_tty_prints_one_line_per_step_with_reward_and_eta(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", clock)
    out = io.StringIO()
    with Progress(10, desc="grpo", file=out, min_interval_s=0.0) as progress:
        for step in (1, 2):
            clock.now += 4.0
            progress.update(step, reward=0.5 * step, tokens_per_s=1234.4, stale=2)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines == [
        "grpo step 1/10 (10%) | reward=0.500 | tok/s=1234 | stale=2 | 4.00 s/step | elapsed 00:04 | ETA 00:36",
        "grpo step 2/10 (20%) | reward=1.000 | tok/s=1234 | stale=2 | 4.00 s/step | elapsed 00:08 | ETA 00:32",
    ]


def test_non_tty_lines_are_throttled_but_the_last_state_is_printed(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", clock)
    out = io.StringIO()
    # Resumed at step 20 of 100; steps take 1 s; at most one line per 10 s.
    progress = Progress(100, initial=20, file=out, min_interval_s=10.0)
    for step in range(21, 46):
        clock.now += 1.0
        progress.update(step, reward=float(step))
    progress.close()
    steps = [line.split()[2] for line in out.getvalue().splitlines()]
    assert steps == ["21/100", "31/100", "41/100", "45/100"]
    assert out.getvalue().splitlines()[-1].endswith("1.00 s/step | elapsed 00:25 | ETA 00:55")


def test_tty_uses_a_tqdm_bar_with_the_reward():
    out = _Terminal()
    progress = Progress(4, file=out)
    progress.update(1, reward=0.25, samples_per_s=3.5)
    progress.update(2, reward=0.75, samples_per_s=3.5)
    progress.close()
    text = out.getvalue()
    assert "\r" in text and "2/4" in text and "reward=0.750" in text and "samples/s=3.50" in text


def test_a_step_whose_rewards_failed_says_so_on_the_progress_line():
    out = io.StringIO()
    with Progress(4, desc="train", file=out, min_interval_s=0.0) as progress:
        for step, failed in ((1, 0), (2, 36)):
            progress.update(step, reward=0.0, **progress_module.reward_errors({"rollout/reward_errors": failed}))
    first, second = out.getvalue().splitlines()
    assert "reward_errors" not in first and "| reward_errors=36 |" in second


def test_a_log_line_on_a_terminal_goes_above_the_bar_not_onto_its_line(monkeypatch):
    out = _Terminal()
    monkeypatch.setattr(sys, "stderr", out)
    handler = logging.StreamHandler(out)  # as logging.basicConfig sets one up, on stderr
    logging.getLogger().addHandler(handler)
    try:
        progress = Progress(4, file=out)
        progress.update(1, reward=0.25)
        logging.getLogger("rollover").warning("reward 'flaky' failed")
        progress.update(2, reward=0.5)
        progress.close()
    finally:
        logging.getLogger().removeHandler(handler)
    assert "reward 'flaky' failed" in re.split(r"[\r\n]", out.getvalue())  # a line of its own


def test_a_terminal_of_no_width_gets_the_plain_lines(monkeypatch):
    """A pseudo-terminal that reports 0 columns (docker -t without a size): a bar there prints
    nothing, so the plain lines are printed instead."""
    assert progress_module._columns(io.StringIO()) == 80  # no terminal to ask: a bar's usual width
    monkeypatch.setattr(progress_module, "_columns", lambda file: 0)
    out = _Terminal()
    progress = Progress(2, file=out, min_interval_s=0)
    progress.update(1, reward=0.5, samples_per_s=1.0)
    progress.close()
    assert "\r" not in out.getvalue() and "reward=0.500" in out.getvalue()
