"""The package's layout: no import cycles among rollover's modules, and imports only downward
through the layers (docs/layout.md):

    cli > bench, sim > loops, curate > runtime, rollout > envs, engine, train > config, rewards, data > algos, metrics, types

Module-level imports are checked for cycles and direction; an import inside a function is
checked for direction too (it is where an upward dependency hides), but may close a cycle
(that is what deferring an import is for: torch-free CLI start-up, optional packages)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "rollover"

LAYERS = [
    {"cli", "__main__"},
    {"bench", "sim"},
    {"loops", "curate"},
    {"runtime", "rollout"},
    {"envs", "engine", "train", "export"},
    {"config", "rewards", "data", "models", "commands", "testing"},
    {"algos", "metrics", "types"},
]


def modules() -> dict[str, Path]:
    out = {}
    for f in SRC.rglob("*.py"):
        parts = f.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def layer(name: str) -> int:
    top = name.split(".")[1] if "." in name else ""
    for i, group in enumerate(LAYERS):
        if top in group:
            return i
    raise AssertionError(f"{name}: its package {top!r} is in no layer of tests/test_layout.py")


def imports(name: str, path: Path, mods: dict) -> list[tuple[str, int, bool]]:
    """(imported rollover module, line, at module level) for every import in the file."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    top_level = set()
    for node in tree.body:
        body = [node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.If, ast.Try)):
            body = [n for n in ast.walk(node)]
        top_level.update(id(n) for n in body)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods:
                t = t.rsplit(".", 1)[0] if "." in t else ""
            if t.startswith("rollover") and t != name and t != "rollover":
                out.append((t, node.lineno, id(node) in top_level))
    return out


def test_every_package_has_a_layer():
    for name in modules():
        if name != "rollover":
            layer(name)


def test_no_import_cycles_among_module_level_imports():
    mods = modules()
    graph = {n: {t for t, _, top in imports(n, p, mods) if top} for n, p in mods.items()}
    # Tarjan's strongly connected components
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


# Upward imports not removed yet, each with why; the set must match exactly (a new one fails,
# and so does one removed without striking it off here).
KNOWN_UPWARD: set = set()


def test_imports_only_run_down_the_layers():
    mods = modules()
    upward = {(n, t) for n, p in mods.items() if n != "rollover" for t, _, _ in imports(n, p, mods)
              if layer(t) < layer(n)}
    assert upward == KNOWN_UPWARD


def test_every_trainer_and_collector_offers_the_calls_the_loops_make():
    """The loops call trainers and collectors through `TrainerAPI` / `CollectorAPI`, never
    probing for a method: every implementation has every call."""
    import inspect

    from rollover.rollout.api import CollectorAPI
    from rollover.rollout.april import AprilCollector
    from rollover.rollout.sync_collect import SyncCollector
    from rollover.runtime.trainer import RemoteTrainer
    from rollover.runtime.trainer_group import RayShardedTrainer
    from rollover.train.api import TrainerAPI
    from rollover.train.ranks import ShardedTrainer
    from rollover.train.trainer import Trainer

    def calls(protocol):
        return {n for n, v in vars(protocol).items() if inspect.isfunction(v) and not n.startswith("_")}

    assert calls(TrainerAPI) == {"train_step", "named_weights", "state_dict", "load_state_dict", "close"}
    for cls in (Trainer, RemoteTrainer, ShardedTrainer, RayShardedTrainer):
        missing = {n for n in calls(TrainerAPI) | {"architecture"} if not hasattr(cls, n)}
        assert not missing, f"{cls.__name__} lacks {missing}"
    for cls in (SyncCollector, AprilCollector):
        assert not {n for n in calls(CollectorAPI) if not callable(getattr(cls, n, None))}, cls.__name__


def test_a_trainer_in_this_process_is_a_trainer_api(tmp_path):
    import torch

    from rollover.config import load_config
    from rollover.testing import tiny_model
    from rollover.train.api import TrainerAPI
    from rollover.train.trainer import Trainer

    t = Trainer(tiny_model("llama", seed=0), load_config(device="cpu"), device=torch.device("cpu"))
    assert isinstance(t, TrainerAPI) and t.architecture is t.model and not t.sharded
    t.close()


def test_every_weight_push_reports_one_kind_of_report():
    """The weight seams (in-process, the ranks' own engines, Ray) keep a `SyncReport` of their last
    push, and each Ray transport delivers an update in one call that returns one."""
    import inspect

    from rollover.runtime.collective import GlooTransport
    from rollover.runtime.colocated import ColocatedWeightSync
    from rollover.runtime.weights import ObjectStoreTransport
    from rollover.train.weight_sync import InProcessWeightSync, RayWeightSync, SyncReport

    for cls in (InProcessWeightSync, RayWeightSync, ColocatedWeightSync):
        assert callable(cls.push) and callable(cls.metrics), cls.__name__
    for cls in (ObjectStoreTransport, GlooTransport):
        params = list(inspect.signature(cls.deliver).parameters)
        assert params == ["self", "engine", "workers", "named_tensors", "version", "inflight", "lost", "out"], cls
        assert inspect.signature(cls.deliver).return_annotation in (SyncReport, "SyncReport")
    assert set(SyncReport().metrics()) >= {"weights/bytes_per_worker", "timing_s/weight_transfer"}
