"""`rollover bench ray`: what the Ray runtime costs against the local one, and what a weight
update moves.

1. The `rollover bench train` workload (SmolLM2-135M, 8 prompts x 4 samples, at most 48 new
   tokens, synchronous steps) on the local runtime and on Ray with one rollout worker holding
   every core, then with two workers of one core each. Samples trained per second over the
   measured steps (the first step of each run is warm-up, not measured); on a 2-core host the
   trainer and the worker(s) share the cores, as sync mode alternates them.
2. A worker killed mid-generation: a two-worker `RayEngine` generates `--kill-requests`
   sampled requests of 64 tokens (EOS ignored) once undisturbed and once with worker 0
   SIGKILLed as soon as the driver holds tokens of one of its requests; seconds for each,
   requests resumed elsewhere, whether every request completed once with its 64 tokens, and
   whether the completions equal the undisturbed ones token for token (they need not on a real
   model: the resumed prefix is recomputed in another batch, and where the sampled token's
   probability is tiny a last-bit difference can pick its neighbour).
3. Weight synchronisation for the model alone: a one-worker `RayEngine` receives `--updates`
   updates shaped like early Adam steps (every weight moves by lr x sign(noise), lr 1e-6), with
   the engine in float32 (every element changes) and in bfloat16 (most elements keep their
   bits), through the object store with deltas on and off and through a gloo group: seconds per
   update, bytes each worker received, and the share of a whole-model transfer that was sent;
   and the seconds the worker took to start (its process, its engine built from the weights).

On a GPU, `--gpus-per-worker F` gives every Ray worker (and a trainer actor) that fraction of a
GPU, its engine on CUDA; with `device=cuda` among the overrides the trainer in the driver trains
there, so one GPU holds the trainer and the workers (F = 0.5).
"""

from __future__ import annotations

import json
import statistics
import time

from rollover.bench import scratch_run_dir


def _train(args, runtime: str, workers: int = 1, cpus: float = 2.0, trainer_actor: bool = False) -> dict:
    from rollover.bench.train import WORKLOAD
    from rollover.config import load_config
    from rollover.loops.sync import train_sync
    from rollover.metrics import read_metrics

    with scratch_run_dir(f"rollover-bench-ray-{runtime}-") as run_dir:
        overrides = [f"model={args.model}", f"run_dir={run_dir}", f"steps={args.steps + 1}", *WORKLOAD,
                     f"runtime={runtime}"]
        if runtime == "ray":
            overrides += [f"ray.rollout_workers={workers}", f"ray.cpus_per_worker={cpus:g}",
                          f"ray.num_cpus={args.cpus * (2 if trainer_actor else 1)}",
                          f"ray.gpus_per_worker={args.gpus_per_worker:g}"]
        if trainer_actor:  # the trainer reserves the cores too: sync steps alternate it with the worker
            overrides += ["ray.trainer=actor", f"ray.cpus_for_trainer={args.cpus}",
                          f"ray.gpus_for_trainer={args.gpus_per_worker:g}"]
        train_sync(load_config(None, overrides + list(args.overrides)))
        every = read_metrics(run_dir, kind="train")
    rows = every[1:]  # step 1 warms up
    wall = sum(r["timing_s/step"] for r in rows)
    out = {"samples_per_s": (rows[-1]["samples_consumed_total"] - every[0]["samples_consumed_total"]) / wall,
           "seconds_per_step": wall / len(rows),
           "weight_sync_s": statistics.fmean(r["timing_s/weight_sync"] for r in rows),
           "generate_s": statistics.fmean(r["timing_s/generate"] for r in rows)}
    if runtime == "ray":
        out["bytes_per_worker"] = statistics.fmean(r["weights/bytes_per_worker"] for r in rows)
    return out


def _weight_sync(args, dtype: str, delta: bool, transport: str = "object_store") -> dict:
    import torch

    from rollover.config import load_config
    from rollover.models import load_hf_model
    from rollover.runtime.router import RayEngine

    model = load_hf_model(args.model)
    cfg = load_config(model=args.model, runtime="ray", **{"rollout.dtype": dtype, "ray.weight_delta": delta,
                                                          "ray.weight_transport": transport,
                                                          "ray.cpus_per_worker": 1, "ray.num_cpus": args.cpus,
                                                          "ray.gpus_per_worker": args.gpus_per_worker})
    weights = {k: v.detach().clone() for k, v in model.named_parameters()}  # tied weights once, as the trainer sends them
    t0 = time.perf_counter()
    eng = RayEngine(cfg, model, weights=list(weights.items()), device=torch.device("cpu"), max_len=256,
                    eos_token_ids=(2,))
    start_s = time.perf_counter() - t0  # the worker's process started, its engine built from the weights sent
    gen = torch.Generator().manual_seed(0)
    seconds, sent, fraction = [], [], []
    try:
        for v in range(1, args.updates + 1):
            for t in weights.values():  # an early Adam step: every weight moves by lr in some direction
                t.add_(torch.randn(t.shape, generator=gen).sign_().mul_(1e-6))
            t0 = time.perf_counter()
            eng.update_weights(weights.items(), version=v)
            seconds.append(time.perf_counter() - t0)
            sent.append(eng.last_sync.bytes_per_worker)
            fraction.append(eng.last_sync.bytes_per_worker / eng.last_sync.dense_bytes)
    finally:
        eng.shutdown()
    return {"transport": transport, "dtype": dtype, "delta": delta, "seconds_per_update": statistics.fmean(seconds),
            "bytes_per_worker": statistics.fmean(sent), "sent_fraction": statistics.fmean(fraction),
            "worker_start_s": start_s}


def _kill(args) -> dict:
    import torch

    from rollover.config import load_config
    from rollover.models import load_hf_model
    from rollover.runtime.router import RayEngine
    from rollover.types import Request, SamplingParams

    model = load_hf_model(args.model)
    cfg = load_config(model=args.model, runtime="ray", **{"ray.rollout_workers": 2, "ray.cpus_per_worker": 1,
                                                          "ray.num_cpus": args.cpus, "rollout.max_rows": 64,
                                                          "ray.gpus_per_worker": args.gpus_per_worker})
    eng = RayEngine(cfg, model, weights=[(k, v.detach()) for k, v in model.named_parameters()],
                    device=torch.device("cpu"), max_len=256, eos_token_ids=(2,))
    eng.poll_s = 0.1

    def reqs(tag):
        v = model.config.vocab_size
        return [Request(id=f"{tag}{i}", prompt_ids=[(97 * i + 13 * k) % (v - 3) + 3 for k in range(8)],
                        sampling=SamplingParams(max_new_tokens=64, seed=i, ignore_eos=True))
                for i in range(args.kill_requests)]

    try:
        t0 = time.perf_counter()
        clean = eng.generate(reqs("c"))
        clean_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        futs = eng.submit_many(reqs("k"))
        killed, deadline = False, time.monotonic() + cfg.ray.sync_timeout_s
        while not killed and not all(f.done() for f in futs) and time.monotonic() < deadline:
            if any(live.ids and live.worker is not None and live.worker.index == 0 for live in list(eng._live.values())):
                eng.kill_worker(0)
                killed = True
            time.sleep(0.005)
        answers = [f.result(timeout=cfg.ray.sync_timeout_s) for f in futs]
        kill_s = time.perf_counter() - t0
        identical = all(a.response_ids == b.response_ids for a, b in zip(clean, answers))
        complete = all(len(c.response_ids) == 64 and c.finish == "length" for c in answers)
        return {"requests": args.kill_requests, "killed": killed, "complete": complete, "seconds_clean": clean_s, "seconds_with_kill": kill_s,
                "resubmitted": eng.resubmitted, "restarts": eng.restarts, "identical": identical}
    finally:
        eng.shutdown()


def main(args) -> dict:
    result: dict = {"model": args.model, "steps_measured": args.steps, "gpus_per_worker": args.gpus_per_worker}

    def save() -> None:  # after every part, so that a run cut off (a lent GPU's time limit) keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)

    import ray

    from rollover.config import load_config
    from rollover.runtime import start_ray

    owns_ray = False
    try:
        if not args.skip_train:
            local = _train(args, "local")  # before Ray starts: its processes idle beside the local run
        # one Ray instance for every part, where each part alone would start and stop its own
        owns_ray = start_ray(load_config(None, [f"model={args.model}", "runtime=ray",
                                                f"ray.num_cpus={args.cpus * (2 if args.trainer_actor else 1)}",
                                                *args.overrides]))
        _parts(args, result, save, None if args.skip_train else local)
    finally:
        if owns_ray:
            ray.shutdown()
    _report(args, result)
    save()
    return result


def _parts(args, result: dict, save, local: dict | None) -> None:
    if local is not None:
        ray1 = _train(args, "ray", workers=1, cpus=args.cpus)
        result.update(local_samples_per_s=local["samples_per_s"], ray_samples_per_s=ray1["samples_per_s"],
                      ray_over_local=ray1["samples_per_s"] / local["samples_per_s"], local=local, ray_one_worker=ray1)
        if args.cpus >= 2:
            ray2 = _train(args, "ray", workers=2, cpus=args.cpus / 2)
            result.update(ray_two_workers_samples_per_s=ray2["samples_per_s"], ray_two_workers=ray2)
        if args.trainer_actor:
            actor = _train(args, "ray", workers=1, cpus=args.cpus, trainer_actor=True)
            result.update(ray_trainer_actor_samples_per_s=actor["samples_per_s"], ray_trainer_actor=actor,
                          trainer_actor_over_driver=actor["samples_per_s"] / ray1["samples_per_s"])
        save()
    if args.cpus >= 2 and args.kill_requests:
        result["kill"] = _kill(args)
        save()
    result["weight_sync"] = []
    if not args.skip_weight_sync:
        settings = [(dtype, delta, "object_store") for dtype in ("float32", "bfloat16") for delta in (True, False)]
        for dtype, delta, transport in settings + [(dtype, False, "gloo") for dtype in ("float32", "bfloat16")]:
            result["weight_sync"].append(_weight_sync(args, dtype, delta, transport))
            save()


def _report(args, result: dict) -> None:
    print(f"\nrollover bench ray — {args.model}, {args.steps} measured sync steps per runtime")
    if "local" in result:
        print(f"  samples/s  local {result['local_samples_per_s']:.3f}   ray, 1 worker {result['ray_samples_per_s']:.3f}"
              f"   ({result['ray_over_local']:.2f}x local)")
        if "ray_two_workers" in result:
            print(f"             ray, 2 workers {result['ray_two_workers_samples_per_s']:.3f}")
        if "ray_trainer_actor" in result:
            print(f"             ray, 1 worker, trainer actor {result['ray_trainer_actor_samples_per_s']:.3f}"
                  f"   ({result['trainer_actor_over_driver']:.2f}x the trainer in the driver)")
    if "kill" in result:
        k = result["kill"]
        if k["killed"]:
            print(f"  worker killed mid-generation: {k['seconds_with_kill']:.1f} s vs {k['seconds_clean']:.1f} s "
                  f"undisturbed, {k['resubmitted']} requests resumed elsewhere, completions identical: {k['identical']}")
        else:  # every request finished before the worker held one mid-way: nothing was measured
            print(f"  worker kill: not done (the {k['requests']} requests finished before worker 0 held one mid-way; "
                  "raise --kill-requests)")
    for w in result["weight_sync"]:
        print(f"  weight sync {w['transport']:12s} {w['dtype']:8s} delta={'on ' if w['delta'] else 'off'}  "
              f"{w['seconds_per_update']:.3f} s/update  "
              f"{w['bytes_per_worker'] / 2**20:8.1f} MiB per worker ({w['sent_fraction']:.1%} of the model)  "
              f"worker started in {w['worker_start_s']:.1f} s")


def add_arguments(p) -> None:
    from rollover.bench import at_least

    p.add_argument("--model", default="smollm2-135m-instruct", help="model: a local path, hub id or alias (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--steps", type=at_least(1), default=3, help="measured steps per runtime (one more runs first)")
    p.add_argument("--updates", type=at_least(1), default=5, help="weight updates timed per transport setting")
    p.add_argument("--cpus", type=at_least(1), default=2, help="CPUs of the local Ray instance")
    p.add_argument("--gpus-per-worker", type=float, default=0.0,
                   help="GPU share of each Ray worker and trainer actor (0: CPU workers; 0.5 shares one GPU with the trainer)")
    p.add_argument("--skip-train", action="store_true", help="skip the training runs")
    p.add_argument("--kill-requests", type=at_least(0), default=32, help="requests of the kill measurement (0: skip it)")
    p.add_argument("--trainer-actor", action="store_true",
                   help="also train with the trainer as a Ray actor (ray.trainer=actor), one worker")
    p.add_argument("--skip-weight-sync", action="store_true", help="skip the weight synchronisation timings")
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
    p.add_argument("overrides", nargs="*", help="extra key.path=value config overrides (both runtimes)")
