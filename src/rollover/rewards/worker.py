"""A reward worker process: `python -m rollover.rewards.worker FD` (started by `pool.py`).

FD is this end of a pipe to the parent. The parent first sends the setup, a dict with
`sys_path`, `rewards` ({name: (reference, kwargs)}) and `watchdog_s`. The worker rebuilds the
rewards and answers ("ready", None), or ("failed", traceback) and exits. Then, for each
pickled request (name, method, args), it answers a pickled ("ok", value) or
("error", exception). It exits when the pipe closes.
"""

from __future__ import annotations

import asyncio
import faulthandler
import functools
import inspect
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection


def main() -> None:
    # Ctrl-C reaches the whole process group; stopping is the parent's call (it closes the pipe).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(sys.argv[1]))
    setup = conn.recv()
    sys.path[:] = setup["sys_path"]
    try:
        rewards = _rebuild(setup["rewards"])
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv_bytes()
        except EOFError:  # the pool closed, or the parent is gone
            return
        name, method, args = pickle.loads(request)
        # If the parent cannot kill this call (it died, or is frozen), the watchdog exits.
        faulthandler.dump_traceback_later(setup["watchdog_s"], exit=True)
        try:
            result = getattr(rewards[name], method)(*args)
            if inspect.iscoroutine(result):
                result = asyncio.run(result)
            if isinstance(result, list):  # a batched reward's failed samples: exceptions that must travel
                result = [_portable(x) if isinstance(x, Exception) else x for x in result]
            reply = ("ok", result)
        except BaseException as exc:  # reported to the parent, which counts the failure
            reply = ("error", _portable(exc))
        finally:
            faulthandler.cancel_dump_traceback_later()
        conn.send_bytes(_dumps(reply))


def _rebuild(references: dict[str, tuple[str, dict]]) -> dict:
    from rollover.rewards.registry import Reward, prepare, resolve_reward_fn

    rewards = {}
    for name, (ref, kwargs) in references.items():
        fn = resolve_reward_fn(ref)
        kwargs = prepare(fn, kwargs, f"reward {name!r} ({ref})")
        if kwargs:
            fn = functools.partial(fn, **kwargs)
        rewards[name] = Reward(name, fn, isolate=False)
    return rewards


def _portable(exc: BaseException, where: str = "the reward worker process") -> BaseException:
    """`exc` with this process's traceback as a note, or a RuntimeError naming it if it does
    not survive pickling."""
    note = f"in {where}:\n" + "".join(traceback.format_exception(exc)).rstrip()
    try:
        exc.add_note(note)
        return pickle.loads(pickle.dumps(exc))
    except Exception:
        stand_in = RuntimeError(f"{type(exc).__name__}: {exc}")
        stand_in.add_note(note)
        return stand_in


def _dumps(reply: tuple) -> bytes:
    try:
        return pickle.dumps(reply)
    except Exception as exc:
        value = reply[1]
        error = TypeError(
            f"returned {type(value).__name__}, which cannot be sent back from the worker "
            f"process: {exc}"
        )
        return pickle.dumps(("error", error))


if __name__ == "__main__":
    try:
        main()
    except (BrokenPipeError, EOFError, ConnectionResetError):
        pass  # the parent went away (closed, killed) mid-exchange: nobody is left to answer
