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


def char_tokenizer():
    """A character-level fast tokenizer with a ChatML-style chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + ALPHABET)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<eos>", "<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


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
