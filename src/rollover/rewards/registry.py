"""Naming reward functions from config, and telling the two signatures apart.

A reward is referenced by a built-in name (`math`, `numeric`, `exact`, `format`, `countdown`,
`code`, `reward_model`, `judge`), by `package.module:function`, or by `path/to/file.py:function`.

Two signatures are accepted, told apart by parameter names:

- per sample (rollover, verifiers): `f(completion, answer, **fields) -> float | dict | None`,
  called once per completion;
- batched (TRL): any function with a parameter named `completions`:
  `f(prompts, completions, **kw) -> list[float | dict | None]`, called once per batch. As in
  TRL it may also take `trainer_state` (`global_step`, `max_steps`), `log_metric(name, value)`
  and `log_extra(column, values)` (`Reward.call_batch`).

Dataset fields reach a function as keyword arguments: all of them if it takes `**kwargs`, else
only those it names (a field it names but the sample lacks is a call error, reported by the
runner). Never a bound argument, and never a built-in's options (its keyword-only parameters,
such as `format`'s `pattern`): a column of that name does not change the built-in's setting.

Isolation. A reward is isolated (the runner calls it in a worker process it can kill, see
`rollover.rewards.pool`) when its spec says `isolate: true`, or, with `isolate` unset, when
the function has a true `isolate` attribute, as the built-in `math` has. A worker rebuilds
the function from a reference, so an isolated reward needs one: the spec's `fn`, or for a
function handed over as an object, its module and name when it is defined at the top level of
an importable module.

Reasoning. A reward whose spec says `reasoning: drop` sees each completion without a thinking
model's reasoning: the text after its last `</think>` (`rollover.types.answer_of`), so the
answer is judged on what the model answered, not on what it tried while thinking; a completion
cut off while thinking has no answer (the text before its `<think>`, usually empty; nothing where
the prompt opened the reasoning; up to the `<think>` where it thought again after answering). The default, `keep`, hands over the whole completion.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rollover.rewards.builtins import BUILTINS
from rollover.types import answer_of, finite_float

REASONING = ("keep", "drop")  # what a reward sees of a thinking model's reasoning


@dataclass(frozen=True)
class TrainerState:
    """What a TRL reward function reads of TRL's `trainer_state`: `global_step`, the training
    steps done when the batch is scored (the version of the weights that generate from then
    on; a step may make several optimizer updates), and `max_steps`, the run's `steps`."""

    global_step: int = 0
    max_steps: int = 0


@dataclass(frozen=True)
class RewardSpec:
    """A reward as config names it."""

    fn: str  # built-in name, "module:function" or "path/to/file.py:function"
    weight: float = 1.0
    kwargs: dict = field(default_factory=dict)  # bound to the function, e.g. {"pattern": ...}
    name: str | None = None  # how it is reported; default: the built-in or function name
    isolate: bool | None = None  # run in a killable worker process; None: the function decides
    reasoning: str = "keep"  # "drop": the completion after its reasoning (`</think>`), see the module's doc

    def __post_init__(self):
        if not isinstance(self.fn, str):
            raise TypeError(f"a reward's fn is a name or a reference, got {self.fn!r:.80}"
                            + (" (a function is named by reference: 'module:function', '__main__:function')"
                               if callable(self.fn) else ""))
        if isinstance(self.weight, bool) or not isinstance(self.weight, numbers.Real) or not math.isfinite(self.weight):
            raise ValueError(f"reward {self.name or self.fn!r}: weight must be a finite number, got {self.weight!r:.40}")

    @property
    def label(self) -> str:
        """How the reward is reported (its `name`, else the built-in or function name)."""
        return self.name or self.fn.rpartition(":")[2]

    def build(self, *, here: bool = True) -> Reward:
        """`here`: this process calls the reward (false: Ray reward workers do, and only they
        load what it needs)."""
        fn = resolve_reward_fn(self.fn)
        name = self.label
        if self.fn in BUILTINS and not hasattr(fn, "_rollover_prepare"):  # a built-in's options are its named parameters
            _check_options(fn, self.kwargs, f"reward {name!r} ({self.fn})")
        isolated = self.isolate if self.isolate is not None else bool(getattr(fn, "isolate", False))
        kwargs = prepare(fn, self.kwargs, f"reward {name!r} ({self.fn})", load=here and not isolated)
        if kwargs:
            fn = functools.partial(fn, **kwargs)
        return Reward(name, fn, self.weight, isolate=self.isolate, ref=_absolute(self.fn), reasoning=self.reasoning)


@dataclass(frozen=True)
class Reward:
    """A resolved reward function with its weight in the total."""

    name: str
    fn: Callable
    weight: float = 1.0
    isolate: bool | None = None  # None: the function's `isolate` attribute, else False
    ref: str | None = None  # what `fn` was resolved from, kwargs unbound; see `reference`
    reasoning: str = "keep"  # "drop": it sees each completion after its reasoning (`sees`)

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"reward {self.name!r}: {self.fn!r} is not callable")
        if self.reasoning not in REASONING:
            raise ValueError(f"reward {self.name!r}: reasoning={self.reasoning!r}: must be one of {', '.join(REASONING)}")
        _check_signature(self.name, self.fn)
        if self.isolated:
            self.reference  # raises now, naming the reward, if a worker cannot rebuild it

    @functools.cached_property
    def isolated(self) -> bool:
        """True if the runner calls this reward in a worker process, which it can kill."""
        if self.isolate is not None:
            return self.isolate
        base = self.fn.func if isinstance(self.fn, functools.partial) else self.fn
        return bool(getattr(base, "isolate", False))

    @functools.cached_property
    def reference(self) -> tuple[str, dict]:
        """(reference, bound kwargs): what a worker process rebuilds `fn` from."""
        base, kwargs = self.fn, {}
        if isinstance(base, functools.partial) and not base.args:
            base, kwargs = base.func, dict(base.keywords)
        ref = self.ref or _importable_name(base)
        if ref is None or ref.partition(":")[0] == "__main__":  # a worker's __main__ is not this script
            what = f"{ref!r} names this process's script, which a worker does not run" if ref else \
                f"{self.fn!r} cannot be named from another process"
            raise TypeError(
                f"reward {self.name!r} is isolated (it runs in a worker process, which rebuilds "
                f"it by reference), but {what}: "
                "give it as 'module:function' or 'path/to/file.py:function', define it at the "
                "top level of an importable module, or set isolate=False to run it in a thread (not with "
                "ray.reward_workers, whose actors rebuild every reward by reference)"
            )
        return ref, kwargs

    def sees(self, completion: str, opened: bool = False) -> str:
        """What this reward scores of `completion`: all of it, or with `reasoning="drop"` the text
        after its reasoning (`opened`: its prompt ended in an open `<think>`). Once: the runner calls
        this, the call methods do not."""
        return answer_of(completion, opened) if self.reasoning == "drop" else completion

    @functools.cached_property
    def batched(self) -> bool:
        """True for the TRL signature (a parameter named `completions`)."""
        return "completions" in self._params

    def call_one(self, completion: str, answer: object, fields: dict) -> object:
        """Per-sample signature: f(completion, answer, **accepted fields)."""
        positional = [
            name
            for name, p in self._params.items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ][:2]
        kwargs = {k: self._own(v) for k, v in self._accepted(fields).items() if k not in positional}
        return self.fn(completion, self._own(answer), **kwargs)

    def call_batch(
        self,
        prompts: list,
        completions: list[str],
        answers: list,
        fields: list[dict],
        completion_ids: list[list[int]] | None,
        timeout_s: float | None = None,
        trainer_state: TrainerState | None = None,
    ) -> object:
        """TRL signature: f(prompts=..., completions=..., answer=..., <column>=[...], ...).

        Every field becomes a per-sample list. `answer` is the list of `Prompt.answer`s, and so
        is `solution` unless a field has that name, since TRL's own rewards read it. A function
        that names a parameter `reward_timeout_s` gets the runner's timeout for the whole call.

        As TRL does, a function that takes them (by name or through `**kwargs`) gets
        `trainer_state` and two loggers: `log_metric(name, value)`, one number for the batch,
        and `log_extra(column, values)`, one value per sample. Their numbers join the sample's
        extras (logged as `rewards/<fn>/<name>/mean`, and shown per sample by `rollover show`),
        as a returned dict's other keys are; text is left out, as a dict's text is.
        """
        keys = dict.fromkeys(key for f in fields for key in f)
        columns = {key: [f.get(key) for f in fields] for key in keys}
        available = {**columns, "answer": answers}
        available.setdefault("solution", answers)
        available.update(prompts=prompts, completions=completions)
        if completion_ids is not None:
            available["completion_ids"] = completion_ids
        accepted = {k: v if k == "completions" else self._own(v) for k, v in self._accepted(available).items()}
        logged = _Logged(len(completions))
        given = {"trainer_state": trainer_state or TrainerState(), "log_metric": logged.metric,
                 "log_extra": logged.extra}
        accepted.update(self._accepted(given))  # after the columns: TRL's names, not a column's
        bound = self.fn.keywords if isinstance(self.fn, functools.partial) else {}
        if timeout_s is not None and "reward_timeout_s" in self._params and "reward_timeout_s" not in bound:
            accepted["reward_timeout_s"] = timeout_s
        result = self.fn(**accepted)
        if inspect.iscoroutine(result):
            async def listed():
                return logged.folded(_listed(await result))

            return listed()
        return logged.folded(_listed(result))

    @functools.cached_property
    def _params(self) -> dict[str, inspect.Parameter]:
        return dict(inspect.signature(self.fn).parameters)

    @functools.cached_property
    def _options(self) -> frozenset[str]:
        """A built-in's options: its keyword-only parameters (`format`'s pattern, `judge`'s rubric,
        `code`'s limits). They are configuration, set by `kwargs` or left at their defaults, and
        never filled from a dataset field that happens to share the name: a `rubric` column would
        send the judge every row's rubric as one list. A function of yours keeps TRL's convention,
        fields reach the parameters they name."""
        base = self.fn.func if isinstance(self.fn, functools.partial) else self.fn
        if not any(base is builtin for builtin in BUILTINS.values()):
            return frozenset()
        return frozenset(name for name, p in self._params.items() if p.kind is p.KEYWORD_ONLY)

    @functools.cached_property
    def _trusted(self) -> bool:
        """rollover's own rewards change nothing they are given: no copies for them."""
        base = self.fn.func if isinstance(self.fn, functools.partial) else self.fn
        return (getattr(base, "__module__", None) or "").startswith("rollover.")

    def _own(self, value):
        """`value` as this call's own: a copy of a list, dict or other container the data holds
        (what the function changes in it must not reach the next sample, step or evaluation);
        strings and numbers as they are."""
        if self._trusted or value is None or isinstance(value, (str, bytes, int, float, bool)):
            return value
        try:
            return copy.deepcopy(value)
        except Exception:  # noqa: BLE001 - a value that cannot be copied is passed as it is
            return value

    def _accepted(self, available: dict) -> dict:
        """The entries of `available` the function takes as keyword arguments (never the
        ones already bound with `kwargs`, nor a built-in's options)."""
        bound = self.fn.keywords if isinstance(self.fn, functools.partial) else {}
        refused = bound.keys() | self._options
        if any(p.kind is p.VAR_KEYWORD for p in self._params.values()):
            return {k: v for k, v in available.items() if k not in refused}
        accepted = {
            name
            for name, p in self._params.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name not in refused
        }
        return {k: v for k, v in available.items() if k in accepted}


class _Logged:
    """What a batched function logged through `log_metric` / `log_extra` during one call,
    folded into its scores as per-sample extras."""

    def __init__(self, n: int):
        self.n = n
        self.numbers: dict[str, list] = {}  # per sample
        self.metrics: dict[str, list] = {}  # per batch: every value logged under the name

    def metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(str(name), []).append(value)

    def extra(self, column: str, values) -> None:
        values = list(values)
        if len(values) != self.n:
            raise ValueError(f"log_extra({column!r}, ...) got {len(values)} values for {self.n} completions")
        self.numbers[str(column)] = values

    def folded(self, scores: object) -> object:
        """Each score as a dict with the logged numbers beside it (the function's own keys
        win). Scores the runner will refuse (a wrong count, an exception) pass unchanged."""
        if not (self.numbers or self.metrics) or not isinstance(scores, (list, tuple)) or len(scores) != self.n:
            return scores
        for name, values in self.metrics.items():  # a name logged twice: its mean, as TRL's
            kept = [x for x in map(finite_float, values) if x is not None]
            self.numbers[name] = [sum(kept) / len(kept) if kept else None] * self.n
        out = []
        for i, score in enumerate(scores):
            if isinstance(score, Exception):
                out.append(score)
                continue
            logged = {k: x for k, v in self.numbers.items() if (x := finite_float(v[i])) is not None}
            out.append({**logged, **score} if isinstance(score, dict) else {**logged, "score": score})
        return out


def _listed(scores: object) -> object:
    """A batched reward's scores as a list where they came as another iterable (a NumPy array,
    a tensor, a generator: TRL takes any of them), read here, in the call's own thread or
    worker, where its errors and time count against the call."""
    if isinstance(scores, (list, tuple, str, bytes, dict)) or not hasattr(scores, "__iter__") \
            or getattr(scores, "ndim", 1) == 0:
        return scores
    return list(scores)


def _check_options(fn: Callable, kwargs: dict, what: str) -> None:
    """A built-in takes every dataset field through `**_`, so a misspelt option would pass
    unnoticed: its options are the parameters it names after the completion and the answer."""
    params = list(inspect.signature(fn).parameters.values())[2:]
    options = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    wrong = [k for k in kwargs if k not in options]
    if wrong:
        raise ValueError(f"{what} has no option {', '.join(map(repr, wrong))}; its options: "
                         f"{', '.join(options) or 'none'}")


def prepare(fn: Callable, kwargs: dict, what: str, *, load: bool = True) -> dict:
    """The bound kwargs as a built-in that does work before its first call wants them (its
    `_rollover_prepare(load, **kwargs)` checks them and returns them, the built-in reward_model
    with its path made absolute), so that a wrong setting fails when the rewards are built.
    `load`: this process will call the reward, so the work is done here (reward_model loads its
    model; no call's timeout pays for it): true in the process that calls it, whether the driver
    or a worker process or actor rebuilding it."""
    hook = getattr(fn, "_rollover_prepare", None)
    if hook is None:
        return kwargs
    try:
        return hook(load, **kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what}: {e}") from None


def _spec(spec: RewardSpec | dict | str) -> RewardSpec:
    if isinstance(spec, str):
        return RewardSpec(spec)
    if isinstance(spec, dict):
        return RewardSpec(**spec)
    if not isinstance(spec, RewardSpec):
        raise TypeError(f"a reward entry is a name, a RewardSpec or a mapping of its fields, got {spec!r:.80}"
                        + (" (a function is named by reference: 'module:function', '__main__:function')"
                           if callable(spec) else ""))
    return spec


def reward_weights(specs: list[RewardSpec | dict | str]) -> dict[str, float]:
    """Each configured reward's name and weight, without loading any function."""
    return {s.label: s.weight for s in map(_spec, specs)}


def build_rewards(specs: list[RewardSpec | dict | str], *, here: bool = True) -> list[Reward]:
    """Rewards from config entries: a spec, a dict of RewardSpec fields, or a bare name.
    `here`: see `RewardSpec.build`."""
    if isinstance(specs, (str, dict, RewardSpec)):
        raise ValueError(f"build_rewards takes a list of rewards, got the {type(specs).__name__} {specs!r:.80}: "
                         f"[{specs!r:.80}]")
    rewards = [_spec(spec).build(here=here) for spec in specs]
    slashed = sorted(r.name for r in rewards if "/" in r.name)
    if slashed:  # rewards/<name>/<key>/mean names a reward's extra numbers
        raise ValueError(f"reward names may not contain '/': {slashed}")
    names = [r.name for r in rewards]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"reward names must be unique; give `name` to tell apart {duplicates}")
    return rewards


def resolve_reward_fn(ref: str) -> Callable:
    """The function a reference names; raises naming what could not be found."""
    if ref in BUILTINS:
        return BUILTINS[ref]
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr:
        import difflib

        near = difflib.get_close_matches(ref, list(BUILTINS), n=1, cutoff=0.75)
        raise ValueError(
            f"unknown reward {ref!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
            + f": expected a built-in ({sorted(BUILTINS)}), 'module:function' or 'path/to/file.py:function'"
        )
    return load_reference(ref, "reward")


def load_reference(ref: str, what: str):
    """The object `module:name` or `path/to/file.py:name` names (rewards, environments);
    errors name `what` and the reference."""
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"{what} {ref!r}: expected 'module:name' or 'path/to/file.py:name'")
    try:
        module = _load_file(target) if target.endswith(".py") else importlib.import_module(target)
    except SystemExit as e:  # the module's own sys.exit(): would end the run as if it had succeeded
        raise ImportError(f"{what} {ref!r}: importing {target} called sys.exit({e.code!r})") from None
    except ModuleNotFoundError as e:
        if target.endswith(".py") or e.name != target.partition(".")[0]:
            raise  # a module the file or module itself imports is missing: its own message says which
        file = Path(*target.split(".")).with_suffix(".py")
        there = f" ({file} is in the current directory: write '{file}:{attr}' to load that file)" if file.is_file() else ""
        raise ModuleNotFoundError(f"{what} {ref!r}: no module named {target!r} on the Python path{there}",
                                  name=e.name) from None
    if not hasattr(module, attr):
        raise AttributeError(f"{what} {ref!r}: {target} has no attribute {attr!r}")
    return getattr(module, attr)


def _absolute(ref: str) -> str:
    """`ref` with a relative `file.py` path made absolute, so a worker finds the same file."""
    target, sep, attr = ref.rpartition(":")
    if sep and target.endswith(".py"):
        return f"{Path(target).resolve()}:{attr}"
    return ref


def _importable_name(fn: Callable) -> str | None:
    """'module:function' if that names `fn` in a fresh interpreter, else None."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module in (None, "__main__") or not name.isidentifier():
        return None
    return f"{module}:{name}" if getattr(sys.modules.get(module), name, None) is fn else None


def _load_file(path_text: str):
    path = Path(path_text).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"file not found: {path}")
    # A name unique to the path, so two files called rewards.py do not collide.
    name = f"rollover_user_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_signature(name: str, fn: Callable) -> None:
    params = inspect.signature(fn).parameters
    if "completions" in params:
        return
    positional = [
        p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    has_varargs = any(p.kind is p.VAR_POSITIONAL for p in params.values())
    if len(positional) < 2 and not has_varargs:
        raise TypeError(
            f"reward {name!r} must take (completion, answer, **fields) or, TRL-style, "
            f"(prompts, completions, **kwargs); its signature is {inspect.signature(fn)}"
        )
