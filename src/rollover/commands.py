"""What every command (`rollover ...` and its tools) does with its config and its errors:
a config error is one line (exit 2), any other error one line and a hint (exit 1), with the
traceback behind `--debug`. Below the commands, so the tools (bench, simulate) share it without
importing the command line."""

from __future__ import annotations

import signal
import sys


def _split_config(path: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """The first positional is a config path unless it is an override (key=value)."""
    if path is not None and "=" in path and not path.endswith((".yaml", ".yml")):
        return None, [path, *overrides]
    return path, list(overrides)


def _load_config(prog: str, path, overrides: list[str], schema=None, recorded: bool = False):
    """The config (a training config, or a `schema` of the tool's own: rollover.sim.config), or
    None after printing the one-line error. `recorded`: `path` is a run's own config.yaml."""
    from rollover.config import Config, ConfigError, load_config

    try:
        return load_config(path, overrides, schema=schema or Config, recorded=recorded)
    except ConfigError as e:
        print(f"{prog}: config error: {e}", file=sys.stderr)
        return None


def _guarded(prog: str, debug: bool, body) -> int:
    """Run `body`; an exception becomes a short message (a traceback too with --debug) and a
    nonzero exit. KeyboardInterrupt and SystemExit pass through."""
    from rollover.config import ConfigError

    try:
        return body()
    except BrokenPipeError:  # stdout's reader went away (`| head`): rollover.cli.main ends it quietly
        raise
    except KeyboardInterrupt:  # (training: before the loop took over SIGINT: loading data, the model, ...)
        said = "interrupted before the first step; nothing was saved" if prog == "rollover train" else "interrupted"
        print(f"\n{prog}: {said}", file=sys.stderr)
        return 128 + signal.SIGINT
    except Exception as e:
        if debug:
            import traceback

            traceback.print_exc()
            if getattr(e, "traceback", None):  # a trainer rank's own (RankLost)
                print(f"the rank's traceback:\n{e.traceback}", file=sys.stderr)
        if isinstance(e, ConfigError):
            print(f"{prog}: config error: {e}", file=sys.stderr)
            return 2
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        if not debug:
            print("hint: rerun with --debug for the traceback", file=sys.stderr)
        return 1


def _one_line(e: Exception) -> str:
    """An exception as one line; a type from outside rollover is named, since its message
    was not written to be read alone."""
    text = " ".join(str(e).split()) or "(no message)"
    ours = type(e).__module__.startswith("rollover")
    return text if ours else f"{type(e).__name__}: {text}"
