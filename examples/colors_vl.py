"""A vision-language model to train offline, and a task it can only solve by looking.

No vision-language checkpoint is on this machine, so this builds one: the real
SmolLM2-135M-Instruct as the language model of a LLaVA, with a small CLIP vision tower and
projector initialised at random. At first the model cannot see (its image tokens carry noise it
has learned nothing from) and names a colour at chance; RL must teach the tower and projector to
say what the image shows, through the language model that already knows the words.

    python examples/colors_vl.py runs/colors_vl      # the model and the data, once
    rollover train examples/colors_vl.yaml
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

COLORS = {"red": (200, 30, 30), "green": (30, 170, 40), "blue": (30, 50, 210)}
QUESTION = "What color is this image? Answer with one word: red, green or blue."
# ChatML, as SmolLM2's own template, with image parts: one `<image>` for the processor to expand
TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
            "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
            "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def reward(completion: str, answer: str, **_) -> float:
    """1.0 when the first colour word of the answer is the image's."""
    words = [w.strip(".,!:;\"'").lower() for w in completion.split()]
    said = next((w for w in words if w in COLORS), None)
    return 1.0 if said == answer else 0.0


def build_model(out: Path, seed: int = 0) -> Path:
    """SmolLM2-135M-Instruct with a random CLIP tower (28x28 images, 4 image tokens) as a LLaVA."""
    import torch
    from transformers import (AutoModelForCausalLM, CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration,
                              LlavaProcessor)

    from rollover.models import load_tokenizer, resolve_model

    torch.manual_seed(seed)
    lm = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m-instruct"), dtype=torch.float32)
    tok = load_tokenizer("smollm2-135m-instruct")
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_id = tok.convert_tokens_to_ids("<image>")
    text = lm.config.to_dict()
    text["vocab_size"] = max(lm.config.vocab_size, image_id + 1)
    config = LlavaConfig(
        text_config=text, image_token_id=image_id, image_seq_length=4, vision_feature_layer=-1,
        vision_feature_select_strategy="default", tie_word_embeddings=lm.config.tie_word_embeddings,
        vision_config=dict(model_type="clip_vision_model", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, image_size=28, patch_size=14, projection_dim=128))
    model = LlavaForConditionalGeneration(config)
    lm.resize_token_embeddings(text["vocab_size"])
    missing = model.model.language_model.load_state_dict(lm.model.state_dict(), strict=True)
    assert not missing.missing_keys
    model.lm_head.weight.data.copy_(lm.lm_head.weight.data)
    model.tie_weights()
    model.generation_config = lm.generation_config
    model.save_pretrained(out, safe_serialization=True)
    tok.chat_template = TEMPLATE
    images = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
                   chat_template=TEMPLATE, image_token="<image>", num_additional_image_tokens=1).save_pretrained(out)
    return out


def build_data(out: Path, n: int, seed: int) -> Path:
    """`n` rows of a solid colour with noise (shade and pixels vary), the question and the answer."""
    from PIL import Image

    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        name = rng.choice(sorted(COLORS))
        shade = [min(255, max(0, c + rng.randint(-40, 40))) for c in COLORS[name]]
        img = Image.new("RGB", (28, 28))
        img.putdata([tuple(min(255, max(0, c + rng.randint(-25, 25))) for c in shade) for _ in range(28 * 28)])
        img.save(out / f"{seed}-{i}.png")
        rows.append({"prompt": QUESTION, "images": [f"{seed}-{i}.png"], "answer": name})
    path = out / f"colors-{seed}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/colors_vl")
    build_model(root / "model")
    build_data(root / "data", 2000, seed=0)
    build_data(root / "data", 48, seed=1)
    print(f"wrote {root / 'model'} and {root / 'data'}")
