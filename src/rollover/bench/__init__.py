"""Benchmarks behind `rollover bench`; helpers they share."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path


@contextlib.contextmanager
def scratch_run_dir(prefix: str):
    """A run directory for one measured run, deleted afterwards: a run's final checkpoint of the
    135M model is 1.6 GB, and a benchmark that left it behind filled the disk after a few dozen runs."""
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def drop_checkpoints(run_dir: str | Path) -> None:
    """Delete a finished run's checkpoints, keeping its metrics (for runs whose directory a
    benchmark's JSON still names)."""
    shutil.rmtree(Path(run_dir) / "checkpoints", ignore_errors=True)
def at_least(low: int):
    """An argparse type: an integer >= low, else a clear usage error naming the bound."""
    import argparse

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse
