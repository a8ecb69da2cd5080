"""Reward functions the runner tests name by reference, so worker processes can import them."""

import os
import signal


class NeedsTwoArgs(Exception):
    """An exception that does not survive pickling (its __init__ needs two arguments)."""

    def __init__(self, what, why):
        super().__init__(f"{what}: {why}")


def misbehaves(completion, answer, **fields):
    """Scores 1.0 with the worker's pid as an extra, unless the completion asks otherwise."""
    if completion == "spin":
        while True:
            pass
    if completion == "exit":
        os._exit(3)
    if completion == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if completion.startswith("spawn "):  # starts a child that outlives nothing, then hangs
        import subprocess
        import time

        subprocess.Popen(["sleep", completion.split()[1]])
        time.sleep(1000)
    if completion == "raise":
        raise ValueError(f"asked to raise (answer {answer})")
    if completion == "unpicklable":
        raise NeedsTwoArgs("odd", "error")
    return {"score": 1.0, "pid": os.getpid()}


def scaled_length(completion, answer, level, scale=1.0):
    """A field (`level`) and a bound kwarg (`scale`); None when there is no answer."""
    if answer is None:
        return None
    return scale * len(completion) + level


def prefix_match(prompts, completions, answer, **kwargs):
    """TRL signature: one call per batch."""
    return [1.0 if c.startswith(str(a)) else 0.0 for c, a in zip(completions, answer)]


def marked(completion, answer):
    return 1.0


marked.isolate = True


class TwoPartError(Exception):
    """An exception pickle cannot rebuild (its __init__ takes two arguments)."""

    def __init__(self, part, rest):
        super().__init__(f"{part}: {rest}")


def curriculum(prompts, completions, trainer_state, log_metric, log_extra, **kwargs):
    """TRL's extras: a reward that grows with the step, a batch metric and a per-sample column
    (numbers, and text, which is left out)."""
    log_metric("progress", trainer_state.global_step / trainer_state.max_steps)
    log_extra("length", [len(c) for c in completions])
    log_extra("note", [f"step {trainer_state.global_step}" for _ in completions])
    return [float(trainer_state.global_step)] * len(completions)


def second_fails(prompts, completions, **kwargs):
    """TRL signature; the second sample fails with its own exception, the others score 1."""
    return [TwoPartError("judge", "gave up") if i == 1 else 1.0 for i in range(len(completions))]
