"""Tiny random-initialised models and a character tokenizer, for tests and examples.

Nothing here touches a hub: the tokenizer is built from a fixed alphabet and the model from a
small config, so tests run offline in seconds.
"""

from __future__ import annotations

import string
from pathlib import Path

SPECIALS = ["<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>"]
ALPHABET = list(string.ascii_letters + string.digits + string.punctuation + " \n")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def char_tokenizer(extra: tuple[str, ...] = ()):
    """A character-level fast tokenizer with a ChatML-style chat template; `extra` special tokens
    after the alphabet (a vision-language model's image placeholders)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + ALPHABET + list(extra))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<eos>", "<|im_start|>", *extra],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


# vision-language: Qwen2.5-VL (3-D rotary positions; its image placeholder is `<|image_pad|>` between
# vision start and end) and LLaVA (a CLIP tower, one `<image>` placeholder per patch)
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<image>")
_IMAGE_PART = {"qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>", "llava": "<image>"}


def vl_chat_template(arch: str) -> str:
    """A ChatML template whose messages may hold `{"type": "text"|"image"}` parts."""
    return ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
            "{% for part in message['content'] %}{% if part['type'] == 'image' %}" + _IMAGE_PART[arch] +
            "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_vl_config(arch: str = "qwen2_5_vl"):
    """A 2-layer vision-language config (`qwen2_5_vl` or `llava`) over `char_tokenizer(VISION_TOKENS)`."""
    from transformers import AutoConfig

    tok = {t: len(SPECIALS) + len(ALPHABET) + i for i, t in enumerate(VISION_TOKENS)}
    vocab = len(SPECIALS) + len(ALPHABET) + len(VISION_TOKENS)
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=SPECIALS.index("<|im_end|>"), pad_token_id=0)
    if arch == "qwen2_5_vl":
        return AutoConfig.for_model(
            arch, text_config={**text, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[1],
                               window_size=56),
            image_token_id=tok["<|image_pad|>"], video_token_id=tok["<|video_pad|>"],
            vision_start_token_id=tok["<|vision_start|>"], vision_end_token_id=tok["<|vision_end|>"],
            eos_token_id=text["eos_token_id"], pad_token_id=0, tie_word_embeddings=False)
    if arch == "llava":
        return AutoConfig.for_model(
            arch, text_config={"model_type": "llama", **text},
            vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32),
            image_token_id=tok["<image>"], vision_feature_layer=-1, vision_feature_select_strategy="default",
            image_seq_length=4, tie_word_embeddings=False)
    raise ValueError(f"no tiny vision-language config for {arch!r}")


def tiny_vl_model(arch: str = "qwen2_5_vl", seed: int = 0):
    """A random-initialised vision-language model (fp32, eval mode)."""
    import torch
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(tiny_vl_config(arch))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    return model.eval()


def vl_processor(arch: str = "qwen2_5_vl"):
    """The processor of `tiny_vl_config(arch)`: its tokenizer, chat template and image processor
    (small images: Qwen's at most 56x56 pixels, 4 tokens an image after merging; LLaVA's 28x28, 4)."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor, Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

    tok = char_tokenizer(VISION_TOKENS)
    template = vl_chat_template(arch)
    tok.chat_template = template
    if arch == "qwen2_5_vl":
        class _ImagesOnly(Qwen2_5_VLProcessor):  # its video processor needs torchvision, which tests do without
            def check_argument_for_proper_class(self, name, arg):
                return None if arg is None else super().check_argument_for_proper_class(name, arg)

        return _ImagesOnly(image_processor=Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56),
                           tokenizer=tok, chat_template=template)
    ip = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
                          chat_template=template, image_token="<image>", num_additional_image_tokens=1)


def save_tiny_vl_model(path: str | Path, seed: int = 0) -> Path:
    """Write a tiny LLaVA and its processor to `path` (a from_pretrained dir). (Qwen2.5-VL's
    processor cannot be saved or loaded without torchvision.)"""
    path = Path(path)
    tiny_vl_model("llava", seed).save_pretrained(path, safe_serialization=True)
    vl_processor("llava").save_pretrained(path)
    return path


# architectures TorchEngine runs through transformers' own forward (rollover.engine.hf_runner), with
# what their tiny configs need beside the common keys: Gemma 2 caps its logits and mixes sliding and
# full layers, Gemma 3 too (sliding window 8: shorter than a test's sequences), Cohere scales its
# logits, Granite divides them, GPT-2 learns absolute positions, Qwen3-MoE routes to experts, OPT
# builds its own masks (packed sequences would see each other without explicit ones)
GENERIC = {
    "gemma2": dict(head_dim=16, sliding_window=8, final_logit_softcapping=5.0),
    "gemma3_text": dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "cohere": dict(logit_scale=0.5),
    "granite": dict(logits_scaling=2.0),
    "phi3": dict(),
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "gpt2": dict(),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64),  # its masks ignore packed position ids
}


def tiny_config(arch: str = "llama", vocab_size: int | None = None, **overrides):
    """A 2-layer config of the Llama, Mistral, Qwen2 or Qwen3 family with GQA, or of one of `GENERIC`."""
    from transformers import AutoConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    vocab_size = vocab_size or len(SPECIALS) + len(ALPHABET)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=SPECIALS.index("<|im_end|>"),
        pad_token_id=0,
    )
    common.update(overrides)
    if arch == "gpt2":  # its own key names; no GQA
        return AutoConfig.for_model("gpt2", vocab_size=vocab_size, n_embd=common["hidden_size"], n_inner=128,
                                    n_layer=common["num_hidden_layers"], n_head=common["num_attention_heads"],
                                    n_positions=common["max_position_embeddings"], bos_token_id=1,
                                    eos_token_id=common["eos_token_id"], pad_token_id=0,
                                    **{k: v for k, v in overrides.items() if k not in common or k == "tie_word_embeddings"})
    if arch in GENERIC:
        return AutoConfig.for_model(arch, **{**GENERIC[arch], **common})
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    if arch == "qwen3":
        common.setdefault("head_dim", 16)
    return cls(**common)


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    """A random-initialised causal LM (fp32, eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides))
    # Larger-than-default init so that random models produce peaked, varied distributions.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    return model.eval()


def save_tiny_model(path: str | Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a tiny model and the character tokenizer to `path` (a from_pretrained dir)."""
    path = Path(path)
    tiny_model(arch, seed, **overrides).save_pretrained(path, safe_serialization=True)
    char_tokenizer().save_pretrained(path)
    return path


def save_swapped_tokenizer_model(path: str | Path) -> Path:
    """A tiny model whose tokenizer gives "a" and "b" each other's ids (another tokenizer than
    `char_tokenizer`'s, with the same tokens)."""
    import json

    path = save_tiny_model(path)
    spec = json.loads((path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return path


def generate_from_threads(engine, requests: list) -> list:
    """Call `engine.generate([r])` for each request from its own plain thread; returns the
    completions in request order, or raises the first error a thread met."""
    import threading

    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            results[i] = engine.generate([requests[i]])[0]
        except BaseException as e:  # re-raised below, in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [results[i] for i in range(len(requests))]


def assert_provenance(rollout, models: dict, atol: float = 1e-4) -> bool:
    """Check that each response token's behaviour logprob is what the model of its recorded
    version gives it (`models`: version -> HF module); True when the rollout spans several
    versions (it was carried across a weight update)."""
    import torch

    ids = torch.tensor([rollout.prompt_ids + rollout.response_ids])
    P = len(rollout.prompt_ids)
    for v in sorted(set(rollout.versions)):
        with torch.no_grad():
            lp = torch.log_softmax(models[v](ids).logits[0].float(), -1)[P - 1: -1]
        ref = lp.gather(1, torch.tensor(rollout.response_ids)[:, None]).squeeze(1)
        sel = torch.tensor([x == v for x in rollout.versions])
        assert torch.allclose(torch.tensor(rollout.logprobs)[sel], ref[sel], atol=atol), (v, rollout.group_id)
    return len(set(rollout.versions)) > 1
