"""The FSDP trainer on one GPU (world size 1, NCCL): its step time beside the plain trainer's,
and the largest Qwen2.5-shaped model (random weights) that trains one step, with and without
CPU offload, with peak device memory.

    python benchmarks/gpu/fsdp_check.py step [--shape 135m] [--repeats 3] [--json OUT]
    python benchmarks/gpu/fsdp_check.py largest --shapes 1.5b 3b 7b [--offload] [--json OUT]
    python benchmarks/gpu/fsdp_check.py colocated [--shape 0.5b] [--json OUT]

`step`: the demo workload's batch (8 groups x 32 samples, prompts of ~40 tokens, responses of
~290; `rollover bench train`'s GPU size) through `Trainer.train_step` and through
`FSDPTrainer.train_step` in one process, alternating, each timed after one unmeasured step.
`largest`: each shape in a child process of its own (a failure or an out-of-memory ends only
that shape): the model is built on the meta device, sharded, materialised on the GPU (or in CPU
memory with --offload) and initialised there, then one step of 16 samples x 320 tokens in bf16
mixed precision with gradient checkpointing. SMALL=1 shrinks everything to try it on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time

import torch

SMALL = os.environ.get("SMALL") == "1"
SHAPES = {  # Qwen2.5 configs (hidden, intermediate, layers, heads, kv heads, vocab, tied)
    "tiny": (64, 128, 2, 4, 2, 512, True),
    "135m": (576, 1536, 30, 9, 3, 49152, True),  # SmolLM2-135M, as a Qwen2 shape
    "0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "3b": (2048, 11008, 36, 16, 2, 151936, True),
    "7b": (3584, 18944, 28, 28, 4, 152064, False),
    "14b": (5120, 13824, 48, 40, 8, 152064, False),
}


def qwen_config(shape: str):
    from transformers import Qwen2Config

    h, i, n, heads, kv, vocab, tied = SHAPES[shape]
    return Qwen2Config(hidden_size=h, intermediate_size=i, num_hidden_layers=n, num_attention_heads=heads,
                       num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=4096,
                       attn_implementation="sdpa")


def batch(groups: int, per_group: int, prompt: int, response: int, vocab: int, seed: int = 0):
    from rollover.train.batch import TrainBatch
    from rollover.types import Rollout

    rng = random.Random(seed)
    rolls, adv = [], []
    for g in range(groups):
        p = [rng.randrange(100, vocab - 1) for _ in range(prompt + g % 4)]
        for j in range(per_group):
            n = max(8, min(response + response // 4, int(rng.gauss(response, response / 6))))
            rolls.append(Rollout(group_id=f"g{g}", prompt_ids=p, response_ids=[rng.randrange(100, vocab - 1) for _ in range(n)],
                                 logprobs=[-1.0] * n, versions=[0] * n, loss_mask=[1] * n, finish="stop", reward=0.0))
            adv.append(float(j % 4) - 1.5)
    return TrainBatch.from_rollouts(rolls, adv)


def _group(device: torch.device) -> None:
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")


def _cfg(response: int, **over):
    from rollover.config import load_config

    base = {"device": "cuda" if torch.cuda.is_available() else "cpu", "model": "unused", "run_dir": "unused",
            "data.train": "gen:arithmetic?n=10", "data.max_prompt_tokens": 64, "rollout.max_new_tokens": response + response // 4,
            "rollout.samples_per_prompt": 4, "train.lr": 1e-6}
    base.update(over)
    return load_config(**base)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def step(args) -> dict:
    from transformers import AutoModelForCausalLM

    from rollover.train.fsdp import FSDPTrainer
    from rollover.train.trainer import Trainer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _group(device)
    per, resp = (4, 16) if SMALL else (32, 290)
    shape = "tiny" if SMALL else args.shape
    cfg = _cfg(resp)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(qwen_config(shape))
    b = batch(8, per, 40, resp, SHAPES[shape][5])
    import copy

    arms = {"plain": Trainer(copy.deepcopy(model), cfg, device=device),
            "fsdp": FSDPTrainer(copy.deepcopy(model), cfg, device=device)}
    del model
    times = {k: [] for k in arms}
    for k, t in arms.items():  # unmeasured
        t.train_step(b)
    for _ in range(args.repeats):
        for k, t in arms.items():
            _sync(device)
            t0 = time.perf_counter()
            t.train_step(b)
            _sync(device)
            times[k].append(time.perf_counter() - t0)
    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "shape": shape,
           "samples": len(b), "tokens": sum(len(p) + len(r) for p, r in zip(b.prompt_ids, b.response_ids)),
           "seconds": times, "median": {k: sorted(v)[len(v) // 2] for k, v in times.items()}}
    out["fsdp_over_plain"] = out["median"]["fsdp"] / out["median"]["plain"]
    return out


def largest_child(shape: str, offload: bool) -> dict:
    from transformers import AutoModelForCausalLM

    from rollover.train.fsdp import FSDPTrainer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _group(device)
    resp = 16 if SMALL else 256
    cfg = _cfg(resp, **{"train.dtype": "autocast_bf16", "train.gradient_checkpointing": True,
                        "train.fsdp_offload": offload and device.type == "cuda", "train.parallel": "fsdp"})
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(qwen_config(shape))
    params = sum(p.numel() for p in model.parameters())
    model = model.to_empty(device="cpu" if offload or device.type == "cpu" else device)
    trainer = FSDPTrainer(model, cfg, device=device)
    with torch.no_grad():  # materialised memory is garbage: small random weights, unit norms
        for n, p in trainer.model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.dim() > 1:
                local.normal_(0.0, 0.02)
            elif "norm" in n:
                local.fill_(1.0)
            else:
                local.zero_()
        for m in trainer.model.modules():  # buffers (rotary inverse frequencies) were never computed on meta
            if hasattr(m, "inv_freq") and hasattr(m, "compute_default_rope_parameters"):
                inv, _ = m.compute_default_rope_parameters(m.config)
                m.inv_freq = inv.to(m.inv_freq.device)
                m.original_inv_freq = inv.clone().to(m.inv_freq.device)
    built = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    b = batch(4, 4, 64, resp, SHAPES[shape][5])
    t0 = time.perf_counter()
    metrics = trainer.train_step(b)
    _sync(device)
    return {"shape": shape, "offload": offload, "params": params, "ok": True, "build_s": built,
            "step_s": time.perf_counter() - t0, "grad_norm": metrics["actor/grad_norm"],
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}


def largest(args) -> dict:
    out = []
    for shape in args.shapes:
        cmd = [sys.executable, __file__, "_child", shape] + (["--offload"] if args.offload else [])
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            line = [x for x in p.stdout.splitlines() if x.startswith("{")]
            r = json.loads(line[-1]) if p.returncode == 0 and line else \
                {"shape": shape, "offload": args.offload, "ok": False, "error": (p.stderr or p.stdout).strip().splitlines()[-1:]}
        except subprocess.TimeoutExpired:
            r = {"shape": shape, "offload": args.offload, "ok": False, "error": f"over {args.timeout} s"}
        r["wall_s"] = time.perf_counter() - t0
        print(json.dumps(r), flush=True)
        out.append(r)
        if not r["ok"] and "memory" in str(r.get("error", "")).lower():
            break  # a larger shape will not fit either
    return {"runs": out}


def colocated_memory(args) -> dict:
    """A colocated run (train.colocate, one rank on the one GPU) of a Qwen2.5 shape with random
    weights, with the engine freeing its weights while the rank trains and keeping them: the
    step's peak GPU memory (`perf/peak_device_gb`) of each."""
    from transformers import AutoModelForCausalLM

    from rollover.testing import char_tokenizer

    shape = "tiny" if SMALL else args.shape
    model_dir = f"/tmp/colocated_{shape}"
    if not os.path.exists(f"{model_dir}/config.json"):
        AutoModelForCausalLM.from_config(qwen_config(shape)).save_pretrained(model_dir)
        char_tokenizer().save_pretrained(model_dir)
    out = {"shape": shape, "runs": []}
    for free in (True, False):
        run_dir = f"/tmp/colocated_run_{free}"
        subprocess.run(["rm", "-rf", run_dir], check=True)
        cmd = [sys.executable, "-m", "rollover.cli", "train", f"device={'cpu' if SMALL else 'cuda'}", f"model={model_dir}",
               f"run_dir={run_dir}", "steps=2", "data.train=gen:arithmetic?n=120", "data.eval_size=4",
               "rollout.prompts_per_step=8", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=64",
               "eval.every=0", "eval.at_start=false", "checkpoint.every=0", "logging.progress=false",
               "train.parallel=fsdp", "train.ranks=1", "train.colocate=true", f"train.colocate_free_weights={free}"]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        rows = []
        if os.path.exists(f"{run_dir}/metrics.jsonl"):
            rows = [json.loads(x) for x in open(f"{run_dir}/metrics.jsonl") if json.loads(x).get("kind") == "train"]
        out["runs"].append({"free_weights": free, "rc": done.returncode, "seconds": time.perf_counter() - t0,
                            "peak_device_gb": [r.get("perf/peak_device_gb") for r in rows],
                            "error": done.stderr[-600:] if done.returncode else None})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("step", help="FSDP (world size 1) against the plain trainer, one GPU")
    s.add_argument("--shape", default="135m", choices=SHAPES, help="model shape (random weights)")
    s.add_argument("--repeats", type=int, default=3, help="measured steps per arm")
    s.add_argument("--json", help="write the result here")
    big = sub.add_parser("largest", help="the largest shape that trains one step")
    big.add_argument("--shapes", nargs="+", default=["1.5b", "3b", "7b"], help="shapes to try, smallest first")
    big.add_argument("--offload", action="store_true", help="CPU offload of weights, gradients and optimizer state")
    big.add_argument("--timeout", type=float, default=240, help="seconds per shape")
    big.add_argument("--json", help="write the result here")
    co = sub.add_parser("colocated", help="a colocated run's step peak GPU memory, engine weights freed or kept")
    co.add_argument("--shape", default="0.5b", choices=SHAPES, help="model shape (random weights)")
    co.add_argument("--timeout", type=float, default=120, help="seconds per run")
    co.add_argument("--json", help="write the result here")
    c = sub.add_parser("_child")
    c.add_argument("shape")
    c.add_argument("--offload", action="store_true")
    args = p.parse_args()
    if args.cmd == "_child":
        print(json.dumps(largest_child("tiny" if SMALL else args.shape, args.offload)), flush=True)
        return
    out = {"step": step, "largest": largest, "colocated": colocated_memory}[args.cmd](args)
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
