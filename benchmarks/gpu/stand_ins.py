"""Random-weight stand-ins for a GPU machine that cannot reach a model hub.

The lent GPU machines here reach nothing outside, and the embedded SmolLM2 GGUF (98 MB) is
larger than what may be carried there. Speed depends on a model's shapes, not its weights, when
EOS is ignored (`rollover bench engine`, `bench april --workload longtail`, `simulate calibrate`,
`bench train`'s phases with responses run to the cap), so those run on models of the right
architecture with random weights. Nothing about quality is measured with them.

    python benchmarks/gpu/stand_ins.py --tokenizer DIR --cache CACHE --qwen OUT [--device cuda]

DIR holds SmolLM2-135M-Instruct's config.json and tokenizer files (no weights). Written:
- CACHE/models/smollm2-135m-instruct: SmolLM2-135M's architecture, random weights (so the
  alias `smollm2-135m-instruct` resolves there with ROLLOVER_CACHE=CACHE);
- OUT: Qwen2.5-0.5B's architecture (24 layers, hidden 896, 14 query and 2 KV heads, MLP 4,864,
  151,936-token vocabulary, tied embeddings), random weights, SmolLM2's tokenizer (prompt ids
  stay below 49,152; sampled ids cover the whole vocabulary and are never decoded by the engine
  benchmark).
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def save_random(config, out: Path, tokenizer_dir: Path, device: str, seed: int) -> int:
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="SmolLM2's config.json and tokenizer files")
    p.add_argument("--cache", required=True, help="ROLLOVER_CACHE for the 135M stand-in")
    p.add_argument("--qwen", default=None, help="where to write the Qwen2.5-0.5B-shaped stand-in")
    p.add_argument("--device", default="cpu", help="where to initialise the weights (cuda is faster)")
    args = p.parse_args()
    src = Path(args.tokenizer)
    t0 = time.perf_counter()
    n = save_random(AutoConfig.from_pretrained(src), Path(args.cache) / "models" / "smollm2-135m-instruct", src,
                    args.device, seed=0)
    print(f"smollm2-135m-instruct stand-in: {n / 1e6:.1f}M parameters ({time.perf_counter() - t0:.1f} s)")
    if args.qwen:
        t0 = time.perf_counter()
        base = AutoConfig.from_pretrained(src).to_dict()
        keep = {k: base[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in base}
        n = save_random(Qwen2Config(**keep, **QWEN25_05B), Path(args.qwen), src, args.device, seed=1)
        print(f"Qwen2.5-0.5B-shaped stand-in: {n / 1e6:.1f}M parameters ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
