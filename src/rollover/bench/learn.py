"""`rollover bench learn`: held-out accuracy against training time and samples, plain GRPO
against the prompt-selection and allocation policies, over several seeds.

Every run trains the same task, model, batch and length budget in synchronous mode with
evaluation every `--eval-every` steps (the same held-out prompts for every run of a seed).
Training time is the sum of the steps' own wall times (`timing_s/step`): generation, rewards,
the update and the weight push, without evaluation or checkpoints, which cost every policy the
same. For each policy the summary gives, over seeds, the training seconds and the samples to
reach `--threshold` held-out accuracy (runs that never reach it are counted, not averaged in),
and the final accuracy; `--plot` draws mean curves with their spread.

Policies (config overrides on top of the task's):

- `grpo`: plain GRPO, prompts in data order, `samples_per_prompt` each.
- `vade`: VADE-style Thompson sampling over per-prompt Beta posteriors (`selection.policy=thompson`).
- `skip`: skip prompts always or never solved, re-probed later (`selection.policy=skip_saturated`).
- `xrpo`: XRPO-style group sizes (`selection.allocation=xrpo`).
- `vade_xrpo`: both.
- `dars`: DARS's second stage, equal-treatment schedule (`selection.dars=equal`): prompts solved
  by fewer than half their samples get extra samples in the same step, each group capped at
  twice `--samples-per-prompt` (DARS's own cap, 32, would let one step cost up to 8x a GRPO step
  at 4 samples a prompt).
- `d3s`: D3S down-sampling: twice the samples per prompt, the max-variance half trained
  (`downsample.keep`), and of their tokens the top |A| x entropy fraction, relaxed from 0.5 to
  all over the first half of the steps.
- `large_n`: BroRL-style large groups with APRIL's partial rollouts: four times the samples per
  prompt on a quarter of the prompts (the same samples a step, at least one prompt), with
  `partial_rollout.enabled=true` (APRIL's defaults: 2x over-provisioning, carry chosen by the
  engine and loss). BroRL scales the samples a step as well; here the step's budget is held so
  that the comparison is per second of the same work.
- `trl`: not a rollover policy: the same run (task, model, batch, length budget, learning rate,
  seed, evaluation prompts) through TRL's GRPOTrainer (`pip install trl`), for the library a
  user would otherwise pick (rollover.bench.trl_side.learn_trl says what is matched).
"""

from __future__ import annotations

import json
import statistics
import tempfile

from rollover.bench import drop_checkpoints

TASKS = {
    # the README's demo: SmolLM2-135M goes from 0.30 to 0.97 in 20 steps
    "demo": ["data.train=gen:arithmetic?digits=1&n=4000", "rollout.max_new_tokens=48"],
    # 2-digit addition: not saturated in minutes
    "hard": ["data.train=gen:arithmetic?digits=2&n=4000", "rollout.max_new_tokens=64"],
}

POLICIES = {
    "grpo": [],
    "vade": ["selection.policy=thompson"],
    "skip": ["selection.policy=skip_saturated"],
    "xrpo": ["selection.allocation=xrpo"],
    "vade_xrpo": ["selection.policy=thompson", "selection.allocation=xrpo"],
    "dars": ["selection.dars=equal"],  # its cap is set in _overrides: it depends on the group size
    "d3s": [],  # set in _overrides: it depends on the group size
    "large_n": ["partial_rollout.enabled=true"],  # group size and prompts a step set in _overrides
    "trl": [],  # plain GRPO through TRL's GRPOTrainer (rollover.bench.trl_side.learn_trl)
}


def _overrides(args, policy: str, seed: int, run_dir: str) -> list[str]:
    over = [
        f"model={args.model}", f"run_dir={run_dir}", "resume=never", f"steps={args.steps}", f"seed={seed}",
        *TASKS[args.task], f"data.eval_size={args.eval_size}", "data.max_prompt_tokens=64",
        f"rollout.prompts_per_step={args.prompts_per_step}", f"rollout.samples_per_prompt={args.samples_per_prompt}",
        "reward.functions=[numeric]", f"eval.every={args.eval_every}", "eval.at_start=true",
        f"eval.samples_per_prompt={args.eval_samples}", f"checkpoint.every={10**6}",
        "logging.progress=false", "logging.tensorboard=false",
        *POLICIES[policy],
    ]
    if policy == "dars":
        over += [f"selection.dars_max_samples={2 * args.samples_per_prompt}"]
    if policy == "d3s":
        # D3S generates more and trains on a subset: twice the samples, half of them kept
        over += [f"rollout.samples_per_prompt={2 * args.samples_per_prompt}",
                 f"downsample.keep={args.samples_per_prompt}", "downsample.token_fraction_start=0.5",
                 f"downsample.anneal_steps={max(1, args.steps // 2)}"]
    if policy == "large_n":
        over += [f"rollout.samples_per_prompt={4 * args.samples_per_prompt}",
                 f"rollout.prompts_per_step={max(1, args.prompts_per_step // 4)}"]
    return over + list(args.overrides)


def curve(run_dir: str) -> list[dict]:
    """At every evaluation of a run: the step, the samples generated for the groups trained so
    far (`samples`; D3S trains a subset of them), the samples trained, the training seconds
    and the held-out accuracy."""
    from rollover.metrics import read_metrics

    train = read_metrics(run_dir, kind="train")
    out = []
    for ev in read_metrics(run_dir, kind="eval"):
        done = [r for r in train if r["step"] <= ev["step"]]
        out.append({"step": ev["step"], "samples": sum(r.get("downsample/samples_generated", r["samples"]) for r in done),
                    "trained": done[-1]["samples_consumed_total"] if done else 0,
                    "train_seconds": sum(r["timing_s/step"] for r in done), "accuracy": ev["eval/accuracy"]})
    return out


def first_reach(points: list[dict], threshold: float) -> dict | None:
    """The first evaluation at or above `threshold`, None if the run never got there."""
    return next((p for p in points if p["accuracy"] >= threshold), None)


def _spread(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


def summarize(runs: list[dict], threshold: float) -> dict:
    """Per policy: time and samples to the threshold over the seeds that reached it, how many
    did, and the final accuracy."""
    out = {}
    for policy in dict.fromkeys(r["policy"] for r in runs):
        mine = [r for r in runs if r["policy"] == policy]
        hits = [first_reach(r["curve"], threshold) for r in mine]
        reached = [h for h in hits if h is not None]
        out[policy] = {
            "seeds": len(mine),
            "reached": len(reached),
            "seconds_to_threshold": _spread([h["train_seconds"] for h in reached]),
            "samples_to_threshold": _spread([h["samples"] for h in reached]),
            "final_accuracy": _spread([r["curve"][-1]["accuracy"] for r in mine]),
            "train_seconds": _spread([r["curve"][-1]["train_seconds"] for r in mine]),
        }
    return out


def plot(runs: list[dict], threshold: float, out: str) -> str:
    """Mean held-out accuracy per policy against training seconds and samples, shaded by the
    spread over seeds (evaluations are at the same steps for every run)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for policy in dict.fromkeys(r["policy"] for r in runs):
        curves = [r["curve"] for r in runs if r["policy"] == policy]
        n = min(len(c) for c in curves)
        acc = [[c[i]["accuracy"] for c in curves] for i in range(n)]
        mean = [statistics.fmean(a) for a in acc]
        std = [statistics.stdev(a) if len(a) > 1 else 0.0 for a in acc]
        for ax, key in zip(axes, ("train_seconds", "samples")):
            xs = [statistics.fmean(c[i][key] for c in curves) for i in range(n)]
            (line,) = ax.plot(xs, mean, marker="o", ms=3, label=f"{policy} ({len(curves)} seed{'s' if len(curves) > 1 else ''})")
            ax.fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                            color=line.get_color(), alpha=0.15)
    for ax, label in zip(axes, ("training seconds (mean over seeds)", "samples generated")):
        ax.axhline(threshold, color="grey", ls="--", lw=0.8)
        ax.set(xlabel=label)
        ax.grid(alpha=0.3)
    axes[0].set(ylabel="held-out accuracy (mean ± std over seeds)")
    axes[1].legend()
    fig.savefig(out, dpi=100)
    return out


def _fmt(s: dict, digits: int = 0) -> str:
    return "—" if s["mean"] is None else f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}"


def main(args) -> dict:
    from rollover.config import load_config
    from rollover.loops.sync import train_sync

    if args.summarize:
        return report(json.loads(open(args.summarize).read()), args)
    unknown = [p for p in args.policies if p not in POLICIES]
    if unknown:
        raise SystemExit(f"rollover bench learn: unknown policy {unknown[0]!r} (known: {', '.join(POLICIES)})")
    result = {"model": args.model, "task": args.task, "steps": args.steps,
              "prompts_per_step": args.prompts_per_step, "samples_per_prompt": args.samples_per_prompt,
              "eval_size": args.eval_size, "eval_samples": args.eval_samples, "eval_every": args.eval_every,
              "overrides": list(args.overrides), "runs": []}
    if args.resume:
        result["runs"] = _earlier_runs(args.json, result)
    done = {(r["policy"], r["seed"]) for r in result["runs"]}
    for seed in range(args.seed, args.seed + args.seeds):
        for policy in args.policies:  # seeds outermost: a drift of the host's speed hits every policy alike
            if (policy, seed) in done:
                print(f"  {policy:10s} seed {seed}: in {args.json} already", flush=True)
                continue
            run_dir = tempfile.mkdtemp(prefix=f"rollover-learn-{policy}-{seed}-")
            cfg = load_config(args.config, _overrides(args, policy, seed, run_dir))
            if policy == "trl":
                from rollover.bench.trl_side import learn_trl

                points = learn_trl(cfg)
            else:
                train_sync(cfg)
                points = curve(run_dir)
            drop_checkpoints(run_dir)  # the curve's metrics stay where the JSON says
            result["runs"].append({"policy": policy, "seed": seed, "run_dir": run_dir, "curve": points})
            print(f"  {policy:10s} seed {seed}: accuracy {points[0]['accuracy']:.3f} -> {points[-1]['accuracy']:.3f} "
                  f"in {points[-1]['train_seconds']:.0f} s, {points[-1]['samples']} samples", flush=True)
            if args.json:  # a bench stopped later keeps the runs finished so far (--resume goes on from them)
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=2)
    return report(result, args)


def _earlier_runs(path: str | None, settings: dict) -> list[dict]:
    """The runs of an earlier `--json` file, which must have been made with the same settings
    (none: no file yet)."""
    import os

    if not path:
        raise SystemExit("rollover bench learn: --resume needs --json (the file to go on from)")
    if not os.path.exists(path):
        return []
    earlier = json.loads(open(path).read())
    for key, value in settings.items():
        if key != "runs" and earlier.get(key) != value:
            raise SystemExit(f"rollover bench learn: {path} was made with {key}={earlier.get(key)!r}, not "
                             f"{value!r}; --resume goes on only from the same settings")
    return earlier["runs"]


def report(result: dict, args) -> dict:
    """The summary at `args.threshold`, printed, plotted and written (also for the runs of an
    earlier JSON with `--summarize`)."""
    runs = result["runs"]
    result = {**result, "threshold": args.threshold, "summary": summarize(runs, args.threshold)}
    seeds = len({r["seed"] for r in runs})
    print(f"\nrollover bench learn — {result['model']}, task {result['task']}, {seeds} seeds, "
          f"threshold {args.threshold}")
    print(f"  {'policy':10s} {'reached':>8s} {'seconds to threshold':>22s} {'samples to threshold':>22s} "
          f"{'final accuracy':>16s}")
    for policy, s in result["summary"].items():
        print(f"  {policy:10s} {s['reached']:>4d}/{s['seeds']:<3d} {_fmt(s['seconds_to_threshold']):>22s} "
              f"{_fmt(s['samples_to_threshold']):>22s} {_fmt(s['final_accuracy'], 3):>16s}")
    if args.plot:
        result["plot"] = plot(runs, args.threshold, args.plot)
        print(f"  curves: {result['plot']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def add_arguments(p) -> None:
    from rollover.bench import at_least

    p.add_argument("--model", default="smollm2-135m-instruct", help="model: a local path, hub id or alias (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--config", default=None, help="a config file under the task's overrides (optional)")
    p.add_argument("--task", choices=sorted(TASKS), default="demo", help="demo (1-digit addition) or hard (2-digit addition, prompts that repeat)")
    p.add_argument("--policies", nargs="+", default=["grpo", "vade", "xrpo"],
                   help=f"from: {', '.join(POLICIES)}")
    p.add_argument("--seeds", type=at_least(1), default=3, help="seeds per policy")
    p.add_argument("--seed", type=int, default=0, help="the first seed")
    p.add_argument("--steps", type=at_least(1), default=16, help="training steps of each run")
    p.add_argument("--eval-every", type=at_least(1), default=2, help="evaluate every this many steps")
    p.add_argument("--eval-size", type=at_least(1), default=32, help="held-out prompts")
    p.add_argument("--eval-samples", type=at_least(1), default=2, help="samples per held-out prompt")
    p.add_argument("--prompts-per-step", type=at_least(1), default=8, help="prompts per step")
    p.add_argument("--samples-per-prompt", type=at_least(2), default=4, help="samples per prompt (the group size)")
    p.add_argument("--threshold", type=float, default=0.8, help="held-out accuracy whose time to reach is reported")
    p.add_argument("--plot", default=None, help="PNG of the curves")
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
    p.add_argument("--resume", action="store_true",
                   help="go on from the --json file of an earlier, stopped bench: its runs are kept, not run again "
                        "(the file is written after every run)")
    p.add_argument("--summarize", default=None, metavar="JSON",
                   help="no runs: the summary (and --plot, --json) again from an earlier --json file, at --threshold")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides for every run")
