"""`rollover simulate calibrate`: fit a profile's cost models from measured runs on this machine.

Decode: batches of `rows` requests (distinct random prompts of `prompt` tokens, EOS ignored,
`new_tokens` each) through the real engine; the engine's own counters give the mean decode-step
time of each batch (all its rows run every step) and the time of its first, pure-prefill step.
Each point is measured twice (rounds interleaved) and the faster kept. Least squares then
fits step = step_s + per_row_s * rows + per_context_token_s * context (context: the batch's
mean tokens held per step) and prefill = prefill_s + prefill_per_token_s * T for the T tokens
of the step (TorchEngine pads a step's prompts to the longest: `prefill_padded`). The
quadratic prefill term is left at 0: on this grid it fits noise and extrapolates badly. A
step's time is not linear in rows (on this CPU: steep up to ~8 rows, flatter after), so the
profile also keeps each measured batch size's step time (context term removed) as
`rows_table`, interpolated between the measured sizes. A coefficient the fit makes negative is dropped (set to 0) and
the rest refitted, so the model never predicts a faster step for more work.

Train: `Trainer.train_step` on synthetic groups of two sizes (the first call, which warms
allocators, is not measured), fitted to step_s + per_token_s * tokens.

Contention (with train): a training step and decode steps alone, then together (the engine
decoding on its thread while the trainer steps, in one process as the async loop runs them);
the two slowdowns are the profile's `contention`, used where `simulate.shared_device` is set.

The profile records every measurement and the fit's relative RMS error in `fit`, and the
command and host in `source`.
"""

from __future__ import annotations

import platform
import random
import time
from dataclasses import replace

import numpy as np
import torch

from rollover.engine.cpu.weight_packs import PACK_SWITCH_STEPS
from rollover.sim.costs import Contention, DecodeCost, Profile, SyncCost, TrainCost
from rollover.types import Request, SamplingParams

SETTLE_STEPS = PACK_SWITCH_STEPS + 2  # decode steps at a batch size before it is measured
DECODE_GRID = ((1, 16), (4, 16), (8, 16), (16, 16), (32, 16), (64, 16), (8, 128), (32, 128), (64, 64))  # (rows, prompt tokens)
# a GPU runs many more rows per step before a step slows down: the grid goes to 256 rows and longer prompts
GPU_DECODE_GRID = ((1, 64), (8, 64), (32, 64), (64, 64), (128, 64), (256, 64), (32, 512), (128, 256), (256, 256))
GPU_TRAIN_SIZES = ((8, 8, 128, 256), (16, 8, 128, 512))


def _fit(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Non-negative least squares by dropping negative coefficients; (coefficients, relative RMS error)."""
    keep = list(range(X.shape[1]))
    while True:
        coef_k, *_ = np.linalg.lstsq(X[:, keep], y, rcond=None)
        if (coef_k >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef_k)))
    coef = np.zeros(X.shape[1])
    coef[keep] = np.maximum(coef_k, 0)
    pred = X @ coef
    return coef, float(np.sqrt(np.mean(((pred - y) / y) ** 2)))


def measure_decode(engine, vocab: int, grid=DECODE_GRID, new_tokens: int = 24, seed: int = 0,
                   repeats: int = 2) -> list[dict]:
    """Each grid point `repeats` times, the rounds interleaved; the fastest of each (a shared
    machine only ever slows a measurement down). Before each measured batch a short one of the
    same size settles the engine at that size (TorchEngine builds its weight pack for a size only
    after a few steps there), so the step time is the size's own, not a switch's."""
    rng = random.Random(seed)
    best: dict[tuple, dict] = {}
    for round_ in range(repeats):
        for i, (rows, prompt) in enumerate([grid[0], *grid] if round_ == 0 else grid):  # the first batch warms up
            engine.generate([Request(id=f"set{round_}-{i}-{j}", prompt_ids=[rng.randrange(3, vocab) for _ in range(prompt)],
                                     sampling=SamplingParams(max_new_tokens=SETTLE_STEPS, ignore_eos=True, seed=j))
                             for j in range(rows)])
            reqs = [Request(id=f"cal{round_}-{i}-{j}", prompt_ids=[rng.randrange(3, vocab) for _ in range(prompt)],
                            sampling=SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, seed=j))
                    for j in range(rows)]
            engine.reset_stats()
            engine.generate(reqs)
            s = engine.stats()
            if round_ == 0 and i == 0:
                continue
            point = {"rows": rows, "prompt": prompt, "step_s": s.decode_s / s.decode_steps,
                     "context": rows * (prompt + new_tokens / 2), "prefill_tokens": s.prefill_tokens,
                     "prefill_s": s.prefill_s}
            old = best.get((rows, prompt))
            if old is None:
                best[(rows, prompt)] = point
            else:
                old["step_s"] = min(old["step_s"], point["step_s"])
                old["prefill_s"] = min(old["prefill_s"], point["prefill_s"])
    return list(best.values())


def refit(profile: Profile) -> Profile:
    """The profile's cost models fitted again from the measurements it holds (after a change of
    the fitting rule; nothing is measured)."""
    decode, fit = fit_decode(profile.fit["decode_points"])
    decode = replace(decode, separate_admission=profile.decode.separate_admission)  # a fact of the engine, not fitted
    train, tfit = fit_train(profile.fit["train_points"]) if "train_points" in profile.fit else (profile.train, {})
    return replace(profile, decode=decode, train=train, fit={**profile.fit, **fit, **tfit})


def fit_decode(rows: list[dict]) -> tuple[DecodeCost, dict]:
    X = np.array([[1.0, r["rows"], r["context"]] for r in rows])
    coef, err = _fit(X, np.array([r["step_s"] for r in rows]))
    P = np.array([[1.0, r["prefill_tokens"]] for r in rows])
    pcoef, perr = _fit(P, np.array([r["prefill_s"] for r in rows]))
    by_rows: dict[int, list[float]] = {}
    for r in rows:  # each measured batch size's step time with the fitted context term taken out
        by_rows.setdefault(r["rows"], []).append(r["step_s"] - coef[2] * r["context"])
    table = tuple((n, float(np.mean(v))) for n, v in sorted(by_rows.items()))
    cost = DecodeCost(step_s=float(coef[0]), per_row_s=float(coef[1]), per_context_token_s=float(coef[2]),
                      prefill_s=float(pcoef[0]), prefill_per_token_s=float(pcoef[1]), prefill_padded=True,
                      rows_table=table if len(table) > 1 else ())
    return cost, {"decode_rel_rms": err, "prefill_rel_rms": perr, "decode_points": rows}


def _batch(cfg, vocab: int, groups: int, n: int, prompt: int, resp: int, rng: random.Random):
    """A synthetic training batch: `groups` prompts of `n` samples, random tokens."""
    from rollover.loops.batch import train_batch_from
    from rollover.types import Group, Prompt, Rollout

    batch = []
    for g in range(groups):
        p_ids = [rng.randrange(3, vocab) for _ in range(prompt)]
        rollouts = [Rollout(group_id=f"g{g}", prompt_ids=p_ids, response_ids=[rng.randrange(3, vocab) for _ in range(resp)],
                            logprobs=[-2.0] * resp, versions=[0] * resp, loss_mask=[1] * resp, finish="length",
                            reward=float(j % 2), scores={})
                    for j in range(n)]
        batch.append(Group(id=f"g{g}", prompt=Prompt(id=f"p{g}", text=""), prompt_ids=p_ids, rollouts=rollouts))
    return train_batch_from(batch, cfg)[0]


def measure_train(trainer, cfg, vocab: int, sizes=((4, 4, 32, 32), (8, 4, 32, 64)), seed: int = 0,
                  device: str = "cpu") -> list[dict]:
    """Seconds of `trainer.train_step` on synthetic batches: (groups, samples, prompt, response) each."""
    rng = random.Random(seed)
    out = []
    for i, (groups, n, prompt, resp) in enumerate([sizes[0], *sizes]):
        tb = _batch(cfg, vocab, groups, n, prompt, resp, rng)
        t0 = time.perf_counter()
        trainer.train_step(tb)
        _sync(device)
        dt = time.perf_counter() - t0
        if i:
            out.append({"tokens": groups * n * (prompt + resp), "seconds": dt})
    return out


def measure_contention(engine, trainer, cfg, vocab: int, rows: int = 32, prompt: int = 32, new_tokens: int = 24,
                       size=(8, 4, 32, 32), seed: int = 1, device: str = "cpu") -> dict:
    """Decode steps and a training step alone, then together (the engine decoding batches of
    `rows` on its thread while the trainer steps, as the async loop runs them in one process):
    the slowdowns of each, for `Contention`."""
    import threading

    rng = random.Random(seed)
    serial = iter(range(10**9))

    def batch():
        return [Request(id=f"con{next(serial)}", prompt_ids=[rng.randrange(3, vocab) for _ in range(prompt)],
                        sampling=SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, seed=j)) for j in range(rows)]

    def decode_step_s(where: str) -> float:
        s = engine.stats()
        if not s.decode_steps:
            raise RuntimeError(f"calibrate: no decode step ran {where} (a longer training batch is needed)")
        return s.decode_s / s.decode_steps

    tb = _batch(cfg, vocab, *size, rng)
    trainer.train_step(tb)  # warm
    alone_train = []
    for _ in range(2):
        t0 = time.perf_counter()
        trainer.train_step(tb)
        _sync(device)
        alone_train.append(time.perf_counter() - t0)
    alone_decode = []
    for _ in range(2):
        engine.reset_stats()
        engine.generate(batch())
        alone_decode.append(decode_step_s("alone"))
    stop, failed = threading.Event(), []

    def decode_loop():
        try:
            while not stop.is_set():
                engine.generate(batch())
        except BaseException as e:  # reported below: a dead loop would measure training alone
            failed.append(e)

    thread = threading.Thread(target=decode_loop, daemon=True)
    thread.start()
    try:
        time.sleep(0.5)
        shared_train, shared_decode = [], []
        for _ in range(2):
            engine.reset_stats()
            t0 = time.perf_counter()
            trainer.train_step(tb)
            _sync(device)
            shared_train.append(time.perf_counter() - t0)
            if failed:
                raise RuntimeError(f"calibrate: the decode loop failed while training: {failed[0]!r}") from failed[0]
            shared_decode.append(decode_step_s("during the training step"))
    finally:
        stop.set()
        thread.join(timeout=120)
    decode, train = min(shared_decode) / min(alone_decode), min(shared_train) / min(alone_train)
    # a ratio under 1 is noise (sharing never speeds either up): kept in `points`, used as 1
    return {"decode": max(1.0, decode), "train": max(1.0, train),
            "points": {"decode_ratio": decode, "train_ratio": train,"alone_train_s": alone_train, "shared_train_s": shared_train,
                       "alone_decode_step_s": alone_decode, "shared_decode_step_s": shared_decode,
                       "rows": rows, "train_tokens": size[0] * size[1] * (size[2] + size[3])}}


def fit_train(rows: list[dict]) -> tuple[TrainCost, dict]:
    X = np.array([[1.0, r["tokens"]] for r in rows])
    coef, err = _fit(X, np.array([r["seconds"] for r in rows]))
    return TrainCost(step_s=float(coef[0]), per_token_s=float(coef[1])), {"train_rel_rms": err, "train_points": rows}


def calibrate(model: str, *, name: str | None = None, train: bool = True, grid=None, new_tokens: int = 24,
              train_sizes=None, contention: bool = True, command: str = "", device: str = "cpu",
              dtype: str | None = None) -> Profile:
    """Measure this machine with `model`: TorchEngine in float32 on the CPU (as the CPU runs use), in
    bfloat16 on a GPU unless `dtype` says otherwise; the trainer in the config's default precision."""
    from rollover.config import load_config
    from rollover.engine.torch_engine import TorchEngine
    from rollover.models import load_hf_model

    gpu = device.startswith("cuda")
    grid = grid or (GPU_DECODE_GRID if gpu else DECODE_GRID)
    train_sizes = train_sizes or (GPU_TRAIN_SIZES if gpu else ((4, 4, 32, 32), (8, 4, 32, 64)))
    engine_dtype = getattr(torch, dtype or ("bfloat16" if gpu else "float32"))
    torch.manual_seed(0)
    hf = load_hf_model(model)
    vocab = hf.config.vocab_size
    longest = max(p for _, p in grid) + new_tokens + 8

    def open_engine(rows: int):
        return TorchEngine(hf, device=device, dtype=engine_dtype, max_rows=rows, max_len=longest)

    engine = open_engine(max(r for r, _ in grid))
    try:
        decode, fit = fit_decode(measure_decode(engine, vocab, grid, new_tokens))
        # with CUDA graphs a step that admits beside decoding rows prefills in a pass of its own
        decode = replace(decode, separate_admission=engine.core.runner.separate_admission)
        # one process: the update is a copy of every tensor into the engine
        named = [(k, v.detach().to(device).clone()) for k, v in hf.state_dict().items()]  # as a trainer's, on its device
        times = []
        for version in (1, 2, 3):
            t0 = time.perf_counter()
            engine.update_weights(named, version=version)
            _sync(device)
            times.append(time.perf_counter() - t0)
        sync = SyncCost(latency_s=min(times))
        fit["sync_points"] = times
    finally:
        engine.shutdown()
    train_cost, shared = TrainCost(), Contention()
    if train:
        from rollover.train.trainer import Trainer

        # on a GPU the synthetic sequences outgrow the default pack length: size it to hold them
        sized = [f"data.max_prompt_tokens={max(s[2] for s in train_sizes)}",
                 f"rollout.max_new_tokens={max(s[3] for s in train_sizes)}"] if gpu else []
        cfg = load_config(None, ["train.lr=1e-7", f"device={device}", *sized])
        trainer = Trainer(hf, cfg, device=torch.device(device))
        train_cost, tfit = fit_train(measure_train(trainer, cfg, vocab, train_sizes, device=device))
        fit.update(tfit)
        if contention:
            engine = open_engine(64)
            try:
                c = measure_contention(engine, trainer, cfg, vocab, prompt=max(p for _, p in grid),
                                       new_tokens=new_tokens, size=GPU_TRAIN_SIZES[0] if gpu else (8, 4, 32, 32),
                                       device=device)
            finally:
                engine.shutdown()
            shared = Contention(decode=c["decode"], train=c["train"])
            fit["contention_points"] = c["points"]
    where = _gpu_name(device) if gpu else f"{_cpu_name()}, {torch.get_num_threads()} threads"
    host = f"{platform.node()} ({where}, engine {str(engine_dtype).removeprefix('torch.')})"
    return Profile(name=name or f"{model}@{platform.node()}", decode=decode, train=train_cost, sync=sync, contention=shared,
                   source=f"{command or 'rollover simulate calibrate'} on {host}, {time.strftime('%Y-%m-%d')}", fit=fit)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _gpu_name(device: str) -> str:
    return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
