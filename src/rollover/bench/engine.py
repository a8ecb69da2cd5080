"""`rollover bench engine`: TorchEngine vs HF `generate` vs the machine's FLOP-bound limit.

Workload: N chat prompts, M new tokens each with EOS ignored, sampling at temperature 1
(top-k and top-p off), fp32 by default. Both engines run on the same model in the same
process. Tokens/s counts generated tokens only (HF's padding slots are not counted).
TorchEngine runs `--repeats` times and the median run is reported (the machine may be shared).

FLOP-bound decode limit: a decoder spends about 2 x parameters FLOP per generated token
(embedding lookup excluded, LM head included); the limit is the best measured matmul rate
divided by that. Attention FLOPs are ignored, which makes the limit slightly optimistic. The
matmul peak is measured before every engine run and after the last, and the best of all is
kept: on a shared machine a neighbour can slow one measurement, and a peak read low would make
the engine look faster than the hardware allows. A fraction above 1 is impossible and is
flagged (`limit_suspect`) instead of reported as a result.

`--workload nanovllm`: nano-vllm's throughput benchmark, so a figure can be set beside the ones
it publishes: `--prompts` sequences (theirs: 256) of random token ids (0-10000), prompt and
output lengths each drawn uniformly from 100-1024 (Python's `random` seeded 0, as theirs),
temperature 0.6, EOS ignored; tokens/s is the output tokens over the whole generation's wall
time (prefill included), as theirs. No HF baseline for it.

Prefill (TorchEngine): before each decode run the engine prefills every prompt once
(one new token each, nothing else running); its rate in FLOP/s over the best GEMM peak is
`prefill_fraction_of_peak`. A prefill computes the decoder body for every prompt token (2 x the
parameters outside the LM head) and the LM head for each prompt's last token only.
"""

from __future__ import annotations

import json
import os
import time

import torch

QUESTIONS = [
    "What is {a} + {b}? Explain your steps.",
    "Write a short story about a robot named {a}.",
    "List {a} facts about the number {b}.",
    "Why is the sky blue? Answer in {a} sentences.",
]


def bench_prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)].format(a=i % 10 + 2, b=(i * 7) % 97)
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def gemm_shapes(hidden: int = 576, intermediate: int = 1536, rows: int = 64) -> dict:
    """The shapes whose rates are measured: a square one, the model's MLP projection at the decode
    batch (`rows`) and at 512 prefill tokens."""
    return {"1024^3": (1024, 1024, 1024), f"decode {rows}x{hidden}x{intermediate}": (rows, hidden, intermediate),
            f"prefill 512x{hidden}x{intermediate}": (512, hidden, intermediate)}


def matmul_rate(dtype=torch.float32, device="cpu", bursts: int = 10, burst_s: float = 0.1, shapes=None) -> dict:
    """Peak GEMM rate (FLOP/s) per shape: the best of several short bursts, so that a busy
    neighbour on a shared machine lowers no figure (it makes the limit, and so the target,
    higher, never lower)."""
    shapes = dict(shapes or gemm_shapes())
    if device != "cpu":  # a GPU reaches its peak only on large products
        shapes["8192^3"] = (8192, 8192, 8192)
    rates = {}
    for name, (m, k, n) in shapes.items():
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        for _ in range(3):
            a @ b
        best = 0.0
        for _ in range(bursts):
            reps, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < burst_s:
                a @ b
                reps += 1
            if device != "cpu":
                torch.cuda.synchronize()
            best = max(best, 2 * m * k * n * reps / (time.perf_counter() - t0))
        rates[name] = best
    return rates


def nanovllm_workload(n: int, vocab: int = 10001) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py workload: n prompts of random token ids and each one's output budget
    (ids taken modulo `vocab` for a model with fewer than 10,001 tokens: the tests' tiny ones)."""
    import random

    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) % vocab for _ in range(rng.randint(100, 1024))] for _ in range(n)]
    return prompts, [rng.randint(100, 1024) for _ in range(n)]


def run_engine(open_engine, prompts, new_tokens, prefill: bool = False, budgets: list[int] | None = None,
               temperature: float = 1.0) -> dict:
    """Time one generation of every prompt on the engine `open_engine()` starts (a context
    manager); start-up and a short warm-up request are not timed. With `prefill`, first time a
    prefill of every prompt alone (one new token each; the engine has no cache across requests),
    twice: the second gives the rate, the first (one-time costs included) is kept beside it."""
    from rollover.types import Request, SamplingParams

    from dataclasses import replace

    sp = SamplingParams(temperature=temperature, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    sps = [sp if budgets is None else replace(sp, max_new_tokens=b) for b in (budgets or [None] * len(prompts))]
    t0 = time.perf_counter()
    pre = None
    with open_engine() as eng:
        startup = time.perf_counter() - t0
        if prefill:
            # the first prefill of the whole batch also pays one-time costs (on a CPU the first
            # touch of the activations' memory: about 2x the later ones on the Intel host), so it
            # is timed apart and the second one is the prefill rate
            times = []
            for k in range(2):
                eng.reset_stats()
                t1 = time.perf_counter()
                eng.generate([Request(id=f"pre{k}-{i}", prompt_ids=p, sampling=SamplingParams(max_new_tokens=1))
                              for i, p in enumerate(prompts)])
                times.append(time.perf_counter() - t1)
            pre = {"tokens": eng.stats().prefill_tokens, "seconds": times[1], "first_seconds": times[0]}
        # a full batch: TorchEngine packs its weights for a decode batch size at first use
        eng.generate([Request(id=f"warm{i}", prompt_ids=p, sampling=SamplingParams(max_new_tokens=2))
                      for i, p in enumerate(prompts)])
        eng.reset_stats()
        t0 = time.perf_counter()
        outs = eng.generate([Request(id=str(i), prompt_ids=p, sampling=sps[i]) for i, p in enumerate(prompts)])
        dt = time.perf_counter() - t0
        st = eng.stats()
    n = sum(len(o.response_ids) for o in outs)
    return {"tokens": n, "seconds": dt, "tokens_per_s": n / dt, "startup_s": startup, "prefill_s": st.prefill_s,
            "decode_s": st.decode_s, "decode_steps": st.decode_steps, "occupancy": st.occupancy,
            **({"prefill_only": pre} if pre else {})}


def run_torch_engine(model, prompts, new_tokens, *, dtype, device, max_rows, quantize=None, cuda_graphs=True,
                     compile_decode=False, adapt_threads=True, prefill=True, budgets=None, temperature=1.0,
                     attention="torch", forward="auto") -> dict:
    from rollover.engine.torch_engine import TorchEngine

    max_len = max(map(len, prompts)) + max(budgets or [new_tokens]) + 1
    out = run_engine(lambda: TorchEngine(model, max_rows=max_rows, max_len=max_len, dtype=dtype, device=device,
                                         quantize=quantize, cuda_graphs=cuda_graphs, compile_decode=compile_decode,
                                         adapt_threads=adapt_threads, attention=attention, forward=forward),
                     prompts, new_tokens, prefill=prefill, budgets=budgets, temperature=temperature)
    return {**out, "compile_decode": compile_decode}


def contend(args, model, prompts, dtype, device) -> dict:
    """`--contend`: the same generation alone and beside one busy process (a Python loop) bound
    to one of this process's cores, as a job pinned to a core or a neighbour the OS keeps on one
    is; the busy process at normal priority and niced (19), each with the engine adapting its
    threads (the default) and with the thread count fixed (`adapt_threads=False`). The
    conditions alternate within each repeat, so a drift of the host hits all alike; medians."""
    import subprocess
    import sys

    from rollover.engine.cpu import share as cpu_share

    core = max(os.sched_getaffinity(0))

    def competitor(niced: bool):
        def setup():
            os.sched_setaffinity(0, {core})
            if niced:
                os.nice(19)
        return subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=setup)

    conditions = {"idle": (None, True), "busy": (False, True), "busy_niced": (True, True),
                  "busy_fixed_threads": (False, False), "busy_niced_fixed_threads": (True, False)}
    runs: dict[str, list[float]] = {k: [] for k in conditions}
    for _ in range(args.repeats):
        for name, (niced, adapt) in conditions.items():
            cpu_share.restore()  # every condition starts from torch's own thread count
            proc = competitor(niced) if niced is not None else None
            try:
                if proc is not None:
                    time.sleep(1.0)  # the competitor is running before the engine starts
                r = run_torch_engine(model, prompts, args.new_tokens, dtype=dtype, device=device, max_rows=args.max_rows,
                                     quantize=args.quantize, adapt_threads=adapt, prefill=False)
            finally:
                if proc is not None:
                    proc.kill()
                    proc.wait()
            runs[name].append(r["tokens_per_s"])
    med = {k: sorted(v)[len(v) // 2] for k, v in runs.items()}
    out = {"model": args.model, "device": device, "dtype": args.dtype, "prompts": args.prompts,
           "new_tokens": args.new_tokens, "threads": torch.get_num_threads(), "cores": len(os.sched_getaffinity(0)),
           "runs_tokens_per_s": runs, "tokens_per_s": med,
           "slowdown": {k: med["idle"] / med[k] for k in med if k != "idle"}}
    print(f"\nrollover bench engine --contend  model={args.model} device={device} dtype={args.dtype} "
          f"prompts={args.prompts} new_tokens={args.new_tokens} threads={out['threads']} cores={out['cores']}")
    for k, v in med.items():
        slow = "" if k == "idle" else f"   {out['slowdown'][k]:.2f}x slower than idle"
        print(f"  {k:20s} {v:8.1f} tokens/s{slow}   (runs {', '.join(f'{x:.1f}' for x in runs[k])})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


def run_vllm_engine(args, prompts, budgets=None, temperature=1.0) -> dict:
    """`--engine vllm`: the same workload on VLLMEngine (the optional extra)."""
    import vllm

    from rollover.engine.vllm_engine import VLLMEngine

    max_len = max(map(len, prompts)) + max(budgets or [args.new_tokens]) + 1
    out = run_engine(lambda: VLLMEngine(args.model, dtype=args.dtype, max_rows=args.max_rows, max_len=max_len),
                     prompts, args.new_tokens, budgets=budgets, temperature=temperature)
    return {**out, "vllm_version": vllm.__version__}


def run_hf_generate(model, tokenizer, prompts, new_tokens, *, batch: int) -> dict:
    tokenizer.padding_side = "left"
    n_tok, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        enc = tokenizer.pad({"input_ids": chunk}, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(
                **enc.to(model.device), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id,
            )
        n_tok += (out.shape[1] - enc["input_ids"].shape[1]) * len(chunk)
    dt = time.perf_counter() - t0
    return {"tokens": n_tok, "seconds": dt, "tokens_per_s": n_tok / dt, "batch": batch}


def _torch_repeats(args, model, prompts, dtype, device, shapes, peaks: list, budgets, temperature: float):
    """TorchEngine `--repeats` times per decode-step variant (eager, compiled), alternating so a
    drift of the host's speed hits both alike, a GEMM peak read after each run (into `peaks`);
    each variant's median run (with every run's rate), and all runs."""
    variants = {"off": [False], "on": [True], "both": [False, True]}[args.compile_decode]
    by_variant = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:
            by_variant[v].append(run_torch_engine(model, prompts, args.new_tokens, dtype=dtype, device=device,
                                                  max_rows=args.max_rows, quantize=args.quantize,
                                                  cuda_graphs=args.cuda_graphs == "on", compile_decode=v,
                                                  budgets=budgets, temperature=temperature, attention=args.attention,
                                                  forward=args.forward))
            peaks.append(matmul_rate(dtype, device, shapes=shapes))
    medians = {}
    for v, vruns in by_variant.items():
        med = dict(sorted(vruns, key=lambda r: r["tokens_per_s"])[len(vruns) // 2])  # the median run
        med["runs_tokens_per_s"] = [r["tokens_per_s"] for r in vruns]
        medians[v] = med
    return medians, [r for vruns in by_variant.values() for r in vruns]


def main(args) -> dict:
    from rollover.models import load_hf_model, load_tokenizer

    dtype = getattr(torch, args.dtype)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_hf_model(args.model, dtype=dtype, device=device).eval()
    tokenizer = load_tokenizer(args.model)
    prompts = bench_prompts(tokenizer, args.prompts)
    budgets, temperature = None, 1.0
    if args.workload == "nanovllm":
        prompts, budgets = nanovllm_workload(args.prompts, model.config.vocab_size)
        temperature, args.skip_hf = 0.6, True
    if args.contend:
        return contend(args, model, prompts, dtype, device)
    n_params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    if getattr(model.config, "tie_word_embeddings", False):
        n_params += model.get_input_embeddings().weight.numel()  # the LM head reuses it
    shapes = gemm_shapes(model.config.hidden_size, model.config.intermediate_size, min(args.max_rows, args.prompts))
    decode_key = next(k for k in shapes if k.startswith("decode"))
    peaks = [matmul_rate(dtype, device, shapes=shapes)]  # before every engine run and after the last (module docstring)
    if args.engine == "vllm":
        eng = run_vllm_engine(args, prompts, budgets, temperature)
        peaks.append(matmul_rate(dtype, device, shapes=shapes))
    else:
        medians, runs = _torch_repeats(args, model, prompts, dtype, device, shapes, peaks, budgets, temperature)
        eng = medians[max(medians)]  # the compiled step's when it ran
    rates = {shape: max(p[shape] for p in peaks) for shape in peaks[0]}
    limit = max(rates.values()) / (2 * n_params)
    result = {
        "model": args.model, "device": device, "dtype": args.dtype, "quantize": args.quantize, "prompts": args.prompts,
        **({"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "cuda_graphs": args.cuda_graphs}
           if device.startswith("cuda") else {}),
        "attention": args.attention, "forward": args.forward,
        "new_tokens": args.new_tokens if budgets is None else "100-1024", "workload": args.workload,
        "threads": torch.get_num_threads(),
        "matmul_flops": rates, "matmul_flops_each": peaks, "flops_per_token": 2 * n_params,
        "flop_limit_tokens_per_s": limit,
        # the same bound at the GEMM shape the decode batch actually runs (less optimistic)
        "decode_gemm_limit_tokens_per_s": rates[decode_key] / (2 * n_params),
    }
    result[f"{args.engine}_engine"] = eng
    result[f"{args.engine}_tokens_per_s"] = eng["tokens_per_s"]
    if args.engine == "torch" and len(medians) == 2:  # --compile-decode both: the eager step beside it
        result["eager_engine"] = medians[False]
        result["eager_tokens_per_s"] = medians[False]["tokens_per_s"]
        result["compiled_over_eager"] = eng["tokens_per_s"] / medians[False]["tokens_per_s"]
    result["fraction_of_limit"] = eng["tokens_per_s"] / limit
    result["fraction_of_decode_gemm_limit"] = eng["tokens_per_s"] / result["decode_gemm_limit_tokens_per_s"]
    if args.engine == "torch":
        pre = [r["prefill_only"] for r in runs]
        best_pre = max(pre, key=lambda x: x["tokens"] / x["seconds"])
        head = model.get_output_embeddings().weight.numel()
        flop = 2 * (n_params - head) * best_pre["tokens"] + 2 * head * len(prompts)
        result["prefill_tokens_per_s"] = best_pre["tokens"] / best_pre["seconds"]
        result["prefill_flops"] = flop / best_pre["seconds"]
        result["prefill_fraction_of_peak"] = result["prefill_flops"] / max(rates.values())
        result["prefill_first_fraction_of_peak"] = flop / best_pre["first_seconds"] / max(rates.values())
    fractions = [result["fraction_of_limit"], result["fraction_of_decode_gemm_limit"],
                 result.get("prefill_fraction_of_peak", 0.0)]
    result["limit_suspect"] = any(f > 1 for f in fractions)
    if not args.skip_hf:
        hf = run_hf_generate(model, tokenizer, prompts, args.new_tokens, batch=args.hf_batch or args.prompts)
        result["hf_generate"] = hf
        result["hf_tokens_per_s"] = hf["tokens_per_s"]
        result["speedup_vs_hf"] = eng["tokens_per_s"] / hf["tokens_per_s"]
    print_table(result, args.engine)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def print_table(r: dict, engine: str) -> None:
    print(f"\nrollover bench engine  model={r['model']} device={r.get('gpu', r['device'])} dtype={r['dtype']} "
          f"{'cuda_graphs=' + r['cuda_graphs'] + ' ' if 'cuda_graphs' in r else ''}"
          f"{'quantize=' + r['quantize'] + ' ' if r.get('quantize') else ''}"
          f"prompts={r['prompts']} new_tokens={r['new_tokens']} threads={r['threads']}")
    print(f"  {'':28s} {'tokens/s':>10s}")
    runs = r[f"{engine}_engine"].get("runs_tokens_per_s")
    print(f"  {engine + ' engine':28s} {r[f'{engine}_tokens_per_s']:10.1f}"
          + (f"   (median of runs {', '.join(f'{x:.1f}' for x in runs)})" if runs and len(runs) > 1 else ""))
    if "eager_tokens_per_s" in r:
        print(f"  {'eager decode step':28s} {r['eager_tokens_per_s']:10.1f}   (median of runs "
              f"{', '.join(f'{x:.1f}' for x in r['eager_engine']['runs_tokens_per_s'])}; compiled over eager "
              f"{r['compiled_over_eager']:.2f}x)")
    if "hf_tokens_per_s" in r:
        print(f"  {'HF generate (batch %d)' % r['hf_generate']['batch']:28s} {r['hf_tokens_per_s']:10.1f}")
        print(f"  speedup vs HF: {r['speedup_vs_hf']:.2f}x")
    print(f"  FLOP-bound limit: {r['flop_limit_tokens_per_s']:.1f} tokens/s "
          f"(best matmul {max(r['matmul_flops'].values()) / 1e9:.0f} GFLOP/s, {r['flops_per_token'] / 1e6:.0f} MFLOP/token)")
    print(f"  fraction of limit: {r['fraction_of_limit']:.1%}  (of the decode-shaped GEMM limit "
          f"{r['decode_gemm_limit_tokens_per_s']:.0f} tokens/s: {r['fraction_of_decode_gemm_limit']:.1%})")
    if "prefill_tokens_per_s" in r:
        print(f"  prefill: {r['prefill_tokens_per_s']:.0f} tokens/s = {r['prefill_flops'] / 1e9:.0f} GFLOP/s, "
              f"{r['prefill_fraction_of_peak']:.1%} of the best GEMM peak (best of the runs; the batch's "
              f"first prefill, one-time costs included: {r['prefill_first_fraction_of_peak']:.1%})")
    if r["limit_suspect"]:
        print("  WARNING: a fraction above 100% is impossible: the GEMM peak was read low (a busy machine); "
              "rerun on an idle one")


def add_arguments(p) -> None:
    from rollover.bench import at_least

    p.add_argument("--model", default="smollm2-135m-instruct", help="model: a local path, hub id or alias (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--engine", choices=["torch", "vllm"], default="torch", help="rollout engine: torch (TorchEngine) or vllm")
    p.add_argument("--prompts", type=at_least(1), default=64, help="prompts generated together")
    p.add_argument("--new-tokens", type=at_least(1), default=128, help="tokens generated per prompt")
    p.add_argument("--max-rows", type=at_least(1), default=64, help="sequences the engine decodes together")
    p.add_argument("--dtype", default="float32", help="engine dtype: float32, bfloat16 or float16")
    p.add_argument("--quantize", choices=["int8"], default=None, help="TorchEngine's int8 weight matrices")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    p.add_argument("--hf-batch", type=at_least(1), default=None, help="HF generate batch (default: all prompts)")
    p.add_argument("--repeats", type=at_least(1), default=3, help="engine runs; the median is reported")
    p.add_argument("--skip-hf", action="store_true", help="skip the HF generate baseline")
    p.add_argument("--cuda-graphs", choices=["on", "off"], default="on",
                   help="TorchEngine's CUDA-graph decode (on a GPU; off: every step eager)")
    p.add_argument("--compile-decode", choices=["off", "on", "both"], default="off",
                   help="TorchEngine's decode step compiled by torch.compile; both: eager and compiled runs "
                        "alternating, the compiled one reported as the engine and the eager one beside it")
    p.add_argument("--attention", choices=["torch", "triton"], default="torch",
                   help="TorchEngine's decode attention on CUDA: torch's batched products, or the Triton kernel "
                        "reading each row's own keys (rollover.engine.triton_attention)")
    p.add_argument("--forward", choices=["auto", "rollover", "transformers"], default="auto",
                   help="TorchEngine's decoder forward: rollover's own (Llama / Mistral / Qwen2 / Qwen3), the model's "
                        "transformers forward over the same cache, or auto (rollover's where it serves the model)")
    p.add_argument("--workload", choices=["default", "nanovllm"], default="default",
                   help="default: chat prompts, --new-tokens each; nanovllm: nano-vllm's benchmark (random prompts and "
                        "outputs of 100-1024 tokens, temperature 0.6; use --prompts 256 for theirs)")
    p.add_argument("--contend", action="store_true",
                   help="measure tokens/s alone and beside one busy process bound to a core (normal and niced), with "
                        "the engine adapting its threads and with their count fixed (CPU)")
    p.add_argument("--json", default=None, help="write the results here")
