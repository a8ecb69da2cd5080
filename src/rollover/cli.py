"""The `rollover` command: train, eval, export, plot, show, bench.

Errors in a command's arguments or config are one line (exit 2); an error while a run is built
or runs is one line plus a hint (exit 1), with the traceback behind `--debug`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from rollover.commands import _guarded, _load_config, _split_config  # noqa: F401 (tools import them here too)


def _openmp_defaults() -> None:
    """Keep OpenMP's idle threads spinning between parallel regions (unless the environment
    says otherwise, or torch is already loaded and has read it).

    rollover runs torch on two threads: the engine's and the caller's (the trainer, model
    loading). Each thread that starts a parallel region gets its own OpenMP team, and once the
    teams hold more threads than there are cores, GNU OpenMP's idle threads stop spinning almost
    at once and sleep; every small element-wise op then waits for them to wake. On a 2-core host
    an RMS norm of 64 x 576 floats took 216 us on the engine's thread against 25 us on the
    caller's; with these settings 33 us (docs/benchmarks.md, "OpenMP's wait policy"). A thread
    about to wait also hands its pool back (`rollover.engine.cpu.openmp`), which removes the rest of
    the cost. ROLLOVER_OPENMP_DEFAULTS=0 leaves the environment alone."""
    if os.environ.get("ROLLOVER_OPENMP_DEFAULTS", "1") == "0" or "torch" in sys.modules:
        return
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", "100000")


_openmp_defaults()


def _bench(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollover bench", description="benchmarks (see docs/benchmarks.md)")
    sub = p.add_subparsers(dest="which", required=True)
    from rollover.bench import april as bench_april
    from rollover.bench import async_ as bench_async
    from rollover.bench import engine as bench_engine
    from rollover.bench import envs as bench_envs
    from rollover.bench import faults as bench_faults
    from rollover.bench import fsdp as bench_fsdp
    from rollover.bench import learn as bench_learn
    from rollover.bench import memory as bench_memory
    from rollover.bench import ray as bench_ray
    from rollover.bench import sim as bench_sim
    from rollover.bench import train as bench_train

    benches = {"engine": bench_engine, "april": bench_april, "train": bench_train, "async": bench_async,
               "faults": bench_faults, "envs": bench_envs, "memory": bench_memory,
               "ray": bench_ray, "learn": bench_learn, "sim": bench_sim, "fsdp": bench_fsdp}
    bench_engine.add_arguments(sub.add_parser("engine", help="TorchEngine vs HF generate vs FLOP limit"))
    bench_april.add_arguments(sub.add_parser("april", help="synchronous rollouts vs APRIL (longtail, natural)"))
    bench_train.add_arguments(sub.add_parser("train", help="seconds per synchronous training step, by phase"))
    bench_async.add_arguments(sub.add_parser("async", help="samples trained/s: sync vs APRIL vs async (eta 1, 2, 4)"))
    bench_faults.add_arguments(sub.add_parser("faults", help="kill -9 at random moments + resume: hangs, losses, duplicates"))
    bench_envs.add_arguments(sub.add_parser("envs", help="multi-turn episodes, slow envs: rollout-wise vs batch-synchronous turns"))
    bench_memory.add_arguments(sub.add_parser("memory", help="peak resident memory per phase: 135M demo and a ~0.5B model"))
    bench_fsdp.add_arguments(sub.add_parser("fsdp", help="the sharded trainer at world sizes 1, 2, 4: step time, bytes held per rank, time in collectives"))
    bench_learn.add_arguments(sub.add_parser("learn", help="held-out accuracy vs training time and samples: GRPO vs selection policies, several seeds"))
    bench_ray.add_arguments(sub.add_parser("ray", help="local vs Ray runtime (samples/s), weight-sync time and bytes per update"))
    bench_sim.add_arguments(sub.add_parser("sim", help="the simulator's fast path: 1,024 workers x 1,000 steps, and its agreement with the schedulers' path"))
    args = p.parse_args(argv)
    benches[args.which].main(args)
    return 0


def _simulate(argv: list[str]) -> int:
    from rollover.sim.cli import main

    return main(argv)


def _train(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="rollover train", description="RL-train a model from a YAML config and key.path=value overrides.",
        epilog="A config path or at least one override is needed, e.g. `rollover train examples/arith.yaml` or "
               "`rollover train run_dir=runs/try steps=5`. An existing run_dir with a checkpoint is continued "
               "(resume=auto) only under a config that trains the same thing; see --allow-config-change.")
    p.add_argument("config", nargs="?", help="YAML config (optional when overrides are given)")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. rollout.temperature=0.7")
    p.add_argument("--help-config", action="store_true", help="list every config key with its default and meaning")
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume a checkpoint even though this config changes what is trained (model, data, reward, "
                        "algorithm, train, sampling, partial_rollout, async, seed, mode); the differences are logged "
                        "and appended to RUN_DIR/config_changes.log, and the new config is recorded (a changed "
                        "model= gives the tokenizer and the KL reference: the weights go on from the checkpoint's)")
    p.add_argument("--debug", action="store_true", help="on an error, print the traceback")
    args = p.parse_intermixed_args(argv)  # flags anywhere among the overrides
    if args.help_config:
        from rollover.config import describe

        print(describe())
        return 0
    if args.config is None and not args.overrides:
        p.print_usage(sys.stderr)
        print("rollover train: nothing to train: give a YAML config and/or key.path=value overrides "
              "(e.g. `rollover train examples/arith.yaml`); nothing was started", file=sys.stderr)
        return 2
    from rollover.train.torchrun import torchrun_env

    job = torchrun_env()  # started by torchrun: RANK 0 drives, the others are trainer ranks
    if job is not None and job["rank"] > 0:
        from rollover.train.torchrun import serve_rank

        _setup_logging()
        return serve_rank(job)
    path, overrides = _split_config(args.config, args.overrides)
    cfg = _torchrun_config(path, overrides, job["world"]) if job is not None else \
        _load_config("rollover train", path, overrides)
    if cfg is None:
        return 2
    _setup_logging()
    return _guarded("rollover train", args.debug, lambda: _run_training(cfg, args.allow_config_change))


def _torchrun_config(path: str | None, overrides: list[str], world: int):
    """The config of a run torchrun started with `world` processes, which are its trainer's
    ranks: `train.ranks` becomes the world size (checked with it, as `train.sequence_parallel`
    must divide it), or None after printing why not."""
    from rollover.config import ConfigError, load_config

    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:  # perhaps only for want of the ranks (sequence_parallel > 1): with them, or as it was
        try:
            cfg = load_config(path, [*overrides, f"train.ranks={world}"])
        except ConfigError:
            cfg = None
        if cfg is None or cfg.train.parallel != "fsdp" or cfg.runtime != "local" or \
                _given_ranks(path, overrides) not in (None, 1, world):
            print(f"rollover train: config error: {e}", file=sys.stderr)
            return None
        return cfg
    if cfg.train.parallel != "fsdp" or cfg.train.ranks not in (1, world) or cfg.runtime != "local":
        print(f"rollover train: torchrun started {world} processes, which are the trainer's ranks: set "
              f"train.parallel=fsdp (and train.ranks={world} or leave it unset) with runtime=local "
              "(runtime=ray places rank actors of its own: run it without torchrun); nothing was started",
              file=sys.stderr)
        return None
    return _load_config("rollover train", path, [*overrides, f"train.ranks={world}"])


def _given_ranks(path: str | None, overrides: list[str]):
    """`train.ranks` as the config file and overrides give it (None: not given)."""
    from rollover.config import Config, ConfigError, parse_overrides, read_yaml

    try:
        given = (read_yaml(path).get("train") or {}).get("ranks") if path else None
        for key, value in parse_overrides(overrides, Config):  # (read as load_config reads them)
            given = value if key == "train.ranks" else value.get("ranks", given) if key == "train" and \
                isinstance(value, dict) else given
    except (ConfigError, AttributeError):
        return None
    return given


def _run_training(cfg, allow_config_change: bool) -> int:
    from rollover.loops.build import build_run
    from rollover.metrics import plot_run

    run = build_run(cfg, allow_config_change=allow_config_change)
    if cfg.mode == "async":
        from rollover.loops.async_ import train_async

        result = train_async(cfg, run=run)
    else:
        from rollover.loops.sync import train_sync

        result = train_sync(cfg, run=run)
    if "interrupted" in result:  # a signal: the step finished, a checkpoint was saved
        again = "run the same command again to resume" if cfg.resume == "auto" else \
            f"to resume, run the command again with resume=auto (not resume={cfg.resume}" + \
            (", which starts a new run)" if cfg.resume == "never" else ", which goes back to that checkpoint)")
        print(f"rollover train: {result['interrupted']}: stopped after step {result['step']} with a checkpoint in "
              f"{result['checkpoint']}; {again}", file=sys.stderr)
        return 128 + getattr(signal, result["interrupted"])
    try:
        plots = plot_run(cfg.run_dir)
    except KeyboardInterrupt:  # the run is over and saved: only its plots are missing
        print(f"\nrollover train: interrupted while drawing the plots; the run trained to step {result['step']} and is "
              f"saved (`rollover plot {cfg.run_dir}` draws them)", file=sys.stderr)
        return 128 + signal.SIGINT
    except Exception as e:  # noqa: BLE001 - the same: a plot that cannot be drawn or written fails no run
        print(f"rollover train: the plots were not drawn ({type(e).__name__}: {e}); the run trained to step "
              f"{result['step']} and is saved (`rollover plot {cfg.run_dir}` draws them)", file=sys.stderr)
        plots = []
    errors, failed = result.get("eval/reward_errors", 0), result.get("eval/failed", 0)
    print(f"done: step {result['step']}" + (f", held-out accuracy {result['eval/accuracy']:.3f}" if "eval/accuracy" in result else "")
          + (f" ({errors:g} failed reward calls in the evaluation: reward.on_error={cfg.reward.on_error})" if errors else "")
          + (f" ({failed:g} of {result.get('eval/samples', 0):g} held-out episodes failed: counted as wrong)"
             if failed else ""))
    print(f"metrics: {cfg.run_dir}/metrics.jsonl; plots: {', '.join(str(x) for x in plots) or 'none'}")
    return 0


def _eval(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="rollover eval", description="Held-out reward and accuracy of a run's latest checkpoint, a given "
                                          "checkpoint, or a base model. Prints which weights it used.",
        epilog="SOURCE is a run directory (its config.yaml and latest checkpoint), a run's config.yaml (the same), "
               "a checkpoint directory (its weights and config), "
               "or a YAML config (the latest checkpoint in its run_dir, else its base model). Overrides apply on "
               "top, e.g. eval.samples_per_prompt=8 data.eval=test.jsonl. Nothing is written.")
    p.add_argument("source", nargs="?", help="run directory, checkpoint directory or YAML config")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides")
    p.add_argument("--checkpoint", default=None, help="evaluate this checkpoint directory")
    p.add_argument("--base", action="store_true", help="evaluate the config's base model, ignoring checkpoints")
    p.add_argument("--best", action="store_true", help="evaluate the run's best checkpoint by its checkpoint.best "
                                                       "metric (unset: eval/accuracy)")
    p.add_argument("--debug", action="store_true", help="on an error, print the traceback")
    args = p.parse_intermixed_args(argv)  # flags anywhere among the overrides
    if args.source is None:
        p.print_usage(sys.stderr)
        print("rollover eval: give a run directory or a YAML config", file=sys.stderr)
        return 2
    if (wrong := _bad_checkpoint("rollover eval", args.checkpoint)) is not None:
        return wrong
    path, overrides = _split_config(args.source, args.overrides)
    if path is not None and not Path(path).exists():
        print(f"rollover eval: error: {path}: no such run directory, checkpoint or config file", file=sys.stderr)
        return 2
    run_dir = None
    if args.best and path is not None and (Path(path) / "DONE").is_file():
        print(f"rollover eval: error: --best picks among a run's checkpoints: give the run directory, not the "
              f"checkpoint {path}", file=sys.stderr)
        return 2
    if path is not None and (Path(path) / "DONE").is_file() and args.checkpoint is None and not args.base:
        args.checkpoint, path = path, Path(path) / "config.yaml"  # a checkpoint dir: its weights, its config
        if not path.is_file():
            print(f"rollover eval: error: checkpoint {args.checkpoint} has no config.yaml (saved by an older "
                  "version): give the run's config and --checkpoint", file=sys.stderr)
            return 2
    elif path is not None and Path(path).is_dir():
        run_dir, path = Path(path), Path(path) / "config.yaml"
        if not path.is_file():
            print(f"rollover eval: error: {run_dir} is not a run directory (no config.yaml)", file=sys.stderr)
            return 2
    recorded = path is not None and Path(path).name == "config.yaml"  # a run's own record, maybe an older version's
    cfg = _load_config("rollover eval", path, overrides, recorded=recorded)
    if cfg is None:
        return 2
    if sum((args.checkpoint is not None, args.base, args.best)) > 1:
        print("rollover eval: error: --checkpoint, --base and --best exclude each other", file=sys.stderr)
        return 2
    if args.best:
        from rollover.train.checkpoint import best_of_run

        where = run_dir if run_dir is not None else Path(cfg.run_dir)
        best, metric, _ = best_of_run(where)
        if best is None:
            print(f"rollover eval: error: {where}: no checkpoint holds an evaluation with {metric} (eval.json)",
                  file=sys.stderr)
            return 2
        args.checkpoint = str(best)
    _setup_logging()
    given = "--best" if args.best else "--checkpoint"
    return _guarded("rollover eval", args.debug, lambda: _run_eval(cfg, path, run_dir, args.checkpoint, args.base, given))


def _bad_checkpoint(prog: str, ckpt: str | None) -> int | None:
    """Exit status 2, after saying why, when `--checkpoint` names no complete checkpoint; else None."""
    if ckpt is None or (Path(ckpt) / "DONE").is_file():
        return None
    why = "no such directory" if not Path(ckpt).exists() else "not a complete checkpoint directory (no DONE marker)"
    print(f"{prog}: error: --checkpoint {ckpt}: {why}", file=sys.stderr)
    return 2


def _run_eval(cfg, path: str | Path | None, run_dir: Path | None, ckpt: str | None, base: bool,
              given: str = "--checkpoint") -> int:
    """Evaluate the weights the arguments name; print which, then the metrics."""
    from rollover.loops.build import build_run
    from rollover.train import checkpoint

    if cfg.data.eval_size == 0:  # (of a data.eval source too, the first eval_size rows are asked)
        print("rollover eval: error: nothing to evaluate: data.eval_size=0; give data.eval_size=N (N held-out "
              "questions: of data.eval, or carved from the training data as the run carved them)", file=sys.stderr)
        return 2
    if ckpt is None and not base:
        if run_dir is None:  # a run's own config.yaml sits beside its checkpoints
            beside = Path(path).parent if path is not None else None
            run_dir = beside if beside is not None and (beside / "checkpoints").is_dir() else Path(cfg.run_dir)
        ckpt = checkpoint.latest_intact(run_dir, "evaluating", "--base evaluates the model it started from")
        why = f"latest checkpoint of {run_dir}" if ckpt is not None else f"{run_dir} has no checkpoint"
    else:
        why = "--base" if base else given
    run = build_run(cfg.model_copy(update=_weights_of(ckpt)), record=False)
    try:
        weights = (f"checkpoint {run.checkpoint} (step {run.start_step})" if run.checkpoint
                   else f"base model {cfg.model}")
        print(f"weights: {weights} [{why}]", flush=True)
        if not run.eval_prompts:
            why = f" ({run.data_skipped} rows were skipped: data.on_bad_row=skip)" if run.data_skipped else ""
            print(f"rollover eval: error: nothing to evaluate: no held-out prompt{why}", file=sys.stderr)
            return 2
        metrics = run.evaluate(run.start_step)
    finally:
        run.close()
    for k, v in metrics.items():
        print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    return 0


def _weights_of(ckpt: str | Path | None) -> dict:
    """Config updates that sample with `ckpt`'s weights (None: the config's model): resume from
    it, and where it holds a full model, its own model and tokenizer (the saved config's model
    path may be relative to another directory)."""
    update = {"resume": str(ckpt) if ckpt is not None else "never"}
    if ckpt is not None and (Path(ckpt) / "model" / "config.json").is_file():
        update["model"] = str(Path(ckpt) / "model")
    return update


def _export(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="rollover export", description="Write a run's checkpoint as a Hugging Face model directory: full "
                                            "weights (LoRA merged into the base model), tokenizer and chat template, "
                                            "loadable with from_pretrained.")
    p.add_argument("run_dir", help="the run directory")
    p.add_argument("out", help="output directory: absent or empty, or a model directory that --force replaces")
    p.add_argument("--checkpoint", default=None, help="this checkpoint directory instead of the run's latest")
    p.add_argument("--best", action="store_true", help="the run's best checkpoint by its checkpoint.best metric "
                                                       "(unset: eval/accuracy) instead of its latest")
    p.add_argument("--force", action="store_true", help="replace OUT when it is an existing model directory")
    p.add_argument("--debug", action="store_true", help="on an error, print the traceback")
    args = p.parse_args(argv)
    _setup_logging()

    if args.best and args.checkpoint is not None:
        print("rollover export: error: --best and --checkpoint exclude each other", file=sys.stderr)
        return 2

    def run() -> int:
        from rollover.export import export

        used = export(args.run_dir, args.out, checkpoint=args.checkpoint, force=args.force, best=args.best)
        print(f"exported {used} to {args.out}")
        return 0

    return _guarded("rollover export", args.debug, run)


def _filter(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="rollover filter", description="Sample each training prompt of a config with its model (or a "
                                            "checkpoint), and write the prompts whose pass rate lies in a range as "
                                            "a dataset (with a pass_rate column) to train on.",
        epilog="Before RL, drop the prompts the model always or never solves: their groups train nothing under "
               "GRPO. Samples use rollout.temperature and rollout.max_new_tokens; a sample is correct when the "
               "first reward function scores it at least reward.correct_threshold.")
    p.add_argument("config", nargs="?", help="YAML config (its data.train, model and rewards)")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides")
    p.add_argument("--out", required=True, help="the JSONL file to write")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (default 8)")
    p.add_argument("--keep", default=None, help="LOW:HIGH, the pass rates kept, inclusive (default: every rate "
                                                 "but 0 and 1, neither never nor always solved)")
    p.add_argument("--checkpoint", default=None, help="sample with this checkpoint's weights instead of the model")
    p.add_argument("--force", action="store_true", help="replace an existing --out file (never one of the data's)")
    p.add_argument("--debug", action="store_true", help="on an error, print the traceback")
    args = p.parse_intermixed_args(argv)  # flags anywhere among the overrides
    low = high = None
    if args.samples < 1:
        print(f"rollover filter: error: --samples must be >= 1 (got {args.samples})", file=sys.stderr)
        return 2
    try:
        if args.keep is not None:
            low, high = (float(x) for x in args.keep.split(":"))
        if args.keep is not None and not 0 <= low <= high <= 1:
            raise ValueError
    except ValueError:
        print(f"rollover filter: error: --keep {args.keep!r} must be LOW:HIGH with 0 <= LOW <= HIGH <= 1",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.suffix != ".jsonl" or not out.parent.is_dir():
        print(f"rollover filter: error: --out {args.out}: must be a .jsonl file in an existing directory",
              file=sys.stderr)
        return 2
    if (wrong := _bad_checkpoint("rollover filter", args.checkpoint)) is not None:
        return wrong
    path, overrides = _split_config(args.config, args.overrides)
    if path is None and not overrides:
        print("rollover filter: error: give a YAML config (its data.train, model and rewards) and/or key.path=value "
              "overrides; nothing was sampled", file=sys.stderr)
        return 2
    cfg = _load_config("rollover filter", path, overrides)
    if cfg is None:
        return 2
    if out.exists() and not args.force:
        print(f"rollover filter: error: --out {args.out} exists; pass --force to replace it", file=sys.stderr)
        return 2
    sources = cfg.data.train.values() if isinstance(cfg.data.train, dict) else [cfg.data.train]
    if any(Path(str(src).partition("?")[0]).resolve() == out.resolve() for src in sources):
        print(f"rollover filter: error: --out {args.out} is the data it filters (data.train); write it elsewhere",
              file=sys.stderr)
        return 2
    _setup_logging()

    def run() -> int:
        from rollover.curate import histogram, pass_rates, rows_of, write_kept
        from rollover.loops.build import build_run

        data = cfg.data.model_copy(update={"eval": None, "eval_size": 0})  # every training prompt, none held out
        update = {"data": data, "checkpoint": cfg.checkpoint.model_copy(update={"best": None}),
                  **_weights_of(args.checkpoint)}
        run = build_run(cfg.model_copy(update=update), record=False)
        try:
            prompts = list(run.train_iter.prompts)
            rows = rows_of(prompts, cfg.data.prompt_key, cfg.data.answer_key,  # a column JSON cannot hold: now
                           sources=isinstance(cfg.data.train, dict))
            print(f"filter: {len(prompts)} prompts x {args.samples} samples with "
                  f"{f'checkpoint {run.checkpoint}' if run.checkpoint else f'model {cfg.model}'}"
                  + (f" ({run.data_skipped} rows skipped: data.on_bad_row=skip)" if run.data_skipped else ""), flush=True)
            rates, failed = pass_rates(run, prompts, args.samples, cfg.rollout.temperature)
        finally:
            run.close()
        kept = write_kept(args.out, rows, rates, low, high)
        print(histogram(rates))
        if failed:
            if cfg.env.name is not None:
                what = "were failed episodes, left out of the rates"
            else:
                what = ("had their first reward function fail: "
                        + ("scored 0, so counted as not solved" if cfg.reward.on_error == "zero" else "left out of the rates")
                        + f" (reward.on_error={cfg.reward.on_error})")
            print(f"rollover filter: warning: {failed} of {len(prompts) * args.samples} samples {what}", file=sys.stderr)
        band = "0 < pass rate < 1" if low is None else f"pass rate in [{low:g}, {high:g}]"
        print(f"kept {kept} of {len(prompts)} prompts ({band}) in {args.out}")
        if not kept:
            print("rollover filter: warning: no prompt was kept", file=sys.stderr)
        return 0

    return _guarded("rollover filter", args.debug, run)


def _plot(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollover plot", description="PNG curves from a run's metrics.jsonl")
    p.add_argument("run_dir", help="a run directory (with metrics.jsonl) or a metrics.jsonl file")
    p.add_argument("--out", default=None, help="directory for the PNGs (default: RUN_DIR/plots)")
    p.add_argument("--debug", action="store_true", help="on an error, print the traceback")
    args = p.parse_args(argv)
    from rollover.metrics import plot_run

    def plot() -> int:
        if not (Path(args.run_dir) / "metrics.jsonl").is_file() and not Path(args.run_dir).is_file():
            raise FileNotFoundError(f"{args.run_dir}: no metrics.jsonl there (give a run directory)")
        paths = plot_run(args.run_dir, args.out)
        if not paths:
            raise ValueError(f"{args.run_dir}: its metrics.jsonl holds no complete row to plot (a run stopped before "
                             "its first step)")
        for path in paths:
            print(path)
        return 0

    return _guarded("rollover plot", args.debug, plot)


def _show(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="rollover show", description="Print the samples a step trained on: per group its prompt, per sample "
                                          "its reward (and parts), advantage, finish and response.",
        epilog="A run writes them when logging.samples=N is set (every N-th step, to RUN_DIR/samples/); "
               "docs/logging.md describes the file.")
    p.add_argument("run_dir", help="the run directory")
    p.add_argument("--step", type=int, default=None, help="this step's samples (default: the latest step written)")
    p.add_argument("--eval", action="store_true", help="the held-out samples of an evaluation instead (written "
                                                       "with logging.eval_samples=N)")
    p.add_argument("--full", action="store_true", help="print prompts and responses whole (default: long ones are "
                                                       "cut in the middle)")
    p.add_argument("--debug", action="store_true", help="on an error, print the traceback")
    args = p.parse_args(argv)

    def show() -> int:
        from rollover.metrics.samples import read_samples, render, samples_path

        kind = "eval" if args.eval else "step"
        step, header, rows = read_samples(args.run_dir, args.step, kind)
        print(render(step, header, rows, full=args.full, source=str(samples_path(args.run_dir, step, kind))))
        return 0

    return _guarded("rollover show", args.debug, show)


def _setup_logging() -> None:
    import logging
    import os

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not sys.stderr.isatty():  # a log file: no carriage-return frames of transformers' weight bars
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # (read when transformers is imported)
        if "transformers" in sys.modules:
            sys.modules["transformers"].utils.logging.disable_progress_bar()


COMMANDS = {
    "train": (_train, "train a model with RL from a YAML config and key.path=value overrides"),
    "eval": (_eval, "measure held-out reward and accuracy of a run, a checkpoint or a base model"),
    "export": (_export, "write a run's checkpoint as a Hugging Face model directory (LoRA merged)"),
    "filter": (_filter, "keep the training prompts a model neither always nor never solves (pass rates by sampling)"),
    "plot": (_plot, "draw PNG curves from a run's metrics.jsonl"),
    "show": (_show, "print the samples a step trained on (prompts, responses, rewards; logging.samples)"),
}
TOOLS = {  # for measuring and planning, listed apart from the user commands
    "bench": (_bench, "measure speed, memory, learning and fault recovery (docs/benchmarks.md)"),
    "simulate": (_simulate, "predict a run's throughput on a cluster without running it (docs/simulator.md)"),
}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("rollover")
    except PackageNotFoundError:  # a source tree on PYTHONPATH
        return "unknown (not installed)"


def usage() -> str:
    width = max(map(len, {**COMMANDS, **TOOLS}))
    rows = lambda table: "\n".join(f"  {name:<{width}}  {desc}" for name, (_, desc) in table.items())  # noqa: E731
    return ("usage: rollover <command> [arguments]\n\n"
            "RL post-training of LLMs: GRPO/DAPO/GSPO, APRIL partial rollouts, async training.\n\n"
            f"commands:\n{rows(COMMANDS)}\n\ntools:\n{rows(TOOLS)}\n\n"
            "`rollover <command> --help` describes a command's arguments; "
            "`rollover train --help-config` lists every config key; `rollover --version` prints the version.")


def main(argv: list[str] | None = None) -> int:
    """The command line; a reader that closes the pipe (`| head`) and a Ctrl-C before a command
    took over end it quietly, never with a traceback."""
    try:
        return _main(argv)
    except BrokenPipeError:  # stdout's reader went away: say nothing more (and let exit's flush not fail)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:  # before a command's own handling began (importing torch, say)
        print("\nrollover: interrupted; nothing was started", file=sys.stderr)
        return 128 + signal.SIGINT


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv and argv[0] in ("-V", "--version"):
        print(f"rollover {version()}")
        return 0
    if argv and argv[0] in TOOLS:
        return TOOLS[argv[0]][0](argv[1:])
    if not argv or argv[0] not in COMMANDS:
        print(usage(), file=sys.stderr)
        if argv:
            print(f"\nrollover: unknown command {argv[0]!r}", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]][0](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
