"""Images in prompts, for vision-language models.

A row brings its images in an `images` (a list) or `image` column: PIL images, file paths
(relative to the data file), `data:image/...;base64,` strings, raw bytes, or the
`{"bytes": ..., "path": ...}` dicts of Hugging Face's `Image` feature. Its prompt says where
they go with `{"type": "image"}` parts in a message's content (TRL's conversational form) or
`<image>` in the text (verl's); a prompt that names none gets them before its first user text,
in order. `MediaRenderer` renders the messages through the model's processor (its chat template,
its image placeholders expanded, its pixel values) into token ids and a `Media`: what the
model's forward takes beside the ids, the same for the engine's prefill and the trainer's pass.

Models with 3-D rotary positions (Qwen2-VL, Qwen2.5-VL) place an image's tokens on its grid:
`rope_positions` asks the model for them (its own `get_rope_index`), and text after the image
continues at a fixed offset from its index (`delta`), which decoding adds.
"""

from __future__ import annotations

import base64
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

import torch

IMAGE_COLUMNS = ("images", "image")
PLACEHOLDER = "<image>"
# what the processor returns that is not an input of the forward beside the ids (the mask and the
# modality types rollover derives itself)
_NOT_INPUTS = ("input_ids", "attention_mask", "mm_token_type_ids")


@dataclass(eq=False)
class Media:
    """A prompt's processed images: `inputs` (pixel values, grids) for the model's forward, CPU
    tensors; `key` a digest of them, equal for equal images (samples of one prompt prefill once)."""

    inputs: dict[str, torch.Tensor]
    key: str
    count: int

    @classmethod
    def of(cls, inputs: dict[str, torch.Tensor], count: int) -> "Media":
        h = hashlib.sha1()
        for name in sorted(inputs):
            t = inputs[name].detach().contiguous().cpu()
            h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return cls(inputs={k: v.detach().cpu() for k, v in inputs.items()}, key=h.hexdigest(), count=count)

    def to(self, device, dtype=None) -> dict[str, torch.Tensor]:
        """The inputs on `device`, floating ones in `dtype`."""
        return {k: v.to(device=device, dtype=dtype if dtype is not None and v.is_floating_point() else v.dtype)
                for k, v in self.inputs.items()}

    @classmethod
    def join(cls, a: "Media | None", b: "Media | None") -> "Media | None":
        """The images of `a`, then those of `b`, as one sequence's (an episode's so far)."""
        if a is None or b is None:
            return a if b is None else b
        return cls.of(cls.concat([a, b]), a.count + b.count)

    @staticmethod
    def concat(items: list["Media | None"]) -> dict[str, torch.Tensor]:
        """The inputs of several sequences' media for one forward, in sequence order (images are
        matched to their placeholders in that order)."""
        present = [m for m in items if m is not None]
        if not present:
            return {}
        names = set(present[0].inputs)
        if any(set(m.inputs) != names for m in present):
            raise ValueError("media of one batch carry different inputs: " + ", ".join(sorted({
                ",".join(sorted(m.inputs)) for m in present})))
        for n in names:
            shapes = {tuple(m.inputs[n].shape[1:]) for m in present}
            if len(shapes) > 1:  # LLaVA-NeXT: patches per image follow its aspect ratio
                raise ValueError(f"images of one batch have {n} of shapes {sorted(shapes)}, which one forward cannot "
                                 "take: this model's images need the same size (resize them in the data)")
        return {n: torch.cat([m.inputs[n] for m in present]) for n in sorted(names)}


def row_images(row: dict, base: Path | None) -> list | None:
    """The row's images (opened, so a bad one fails its row here), or None; raises ValueError
    naming the column and image."""
    for col in IMAGE_COLUMNS:
        if col in row and row[col] is not None:
            value = row[col]
            items = list(value) if isinstance(value, (list, tuple)) else [value]
            out = []
            for i, item in enumerate(items):
                try:
                    out.append(_as_ref(item, base))
                    open_image(out[-1])
                except Exception as e:  # noqa: BLE001 - any reason a file or bytes do not open
                    raise ValueError(f"column {col!r} image {i}: {type(e).__name__}: {e}") from None
            return out or None
    return None


def _as_ref(item, base: Path | None):
    """A loadable reference to one image: the PIL image, its bytes, or an absolute path."""
    if isinstance(item, dict):
        if item.get("bytes"):
            return bytes(item["bytes"])
        item = item.get("path")
        if not item:
            raise ValueError("an image dict needs 'bytes' or 'path'")
    if isinstance(item, (bytes, bytearray)):
        return bytes(item)
    if isinstance(item, str):
        if item.startswith("data:"):
            return base64.b64decode(item.split(",", 1)[1])
        if item.startswith(("http://", "https://")):
            raise ValueError(f"{item[:120]!r}: images are not fetched from URLs; download them and give their paths")
        if len(item) > 4096:  # (no path is this long: base64 without its data: prefix, say)
            raise ValueError(f"{item[:40]!r}... ({len(item)} characters) is no file path; base64 needs its data: "
                             "prefix (data:image/png;base64,...)")
        path = Path(item).expanduser()
        if not path.is_absolute() and base is not None:
            path = base / path
        if not path.is_file():
            raise FileNotFoundError(f"no file {str(path)!r}")
        return str(path)
    if hasattr(item, "convert") and hasattr(item, "size"):  # a PIL image: kept encoded (a dataset's decoded pixels
        buf = io.BytesIO()                                  # would stay in memory for the whole run)
        item.convert("RGB").save(buf, format="PNG")
        return buf.getvalue()
    raise TypeError(f"an image is a path, data URL, bytes, {{'bytes'|'path'}} dict or PIL image, not {type(item).__name__}")


def open_image(ref):
    """The image `ref` names, as RGB."""
    from PIL import Image

    if isinstance(ref, bytes):
        img = Image.open(io.BytesIO(ref))
    elif isinstance(ref, str):
        img = Image.open(ref)
    else:
        img = ref
    return img.convert("RGB")


def place_images(messages: list[dict], count: int, where: str) -> list[dict]:
    """`messages` with content as parts and exactly `count` image parts: those it names
    (`{"type": "image"}` parts or `<image>` in text), or else `count` before the first user
    message's text. Raises ValueError when the prompt names another number of images."""
    out, named = [], 0
    for m in messages:
        content = m["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else [dict(p) for p in content]
        split = []
        for p in parts:
            if p.get("type") == "text" and PLACEHOLDER in p.get("text", ""):
                pieces = p["text"].split(PLACEHOLDER)
                for k, piece in enumerate(pieces):
                    if k:
                        split.append({"type": "image"})
                    if piece:
                        split.append({"type": "text", "text": piece})
            else:
                split.append(p)
        named += sum(p.get("type") == "image" for p in split)
        out.append({**m, "content": split})
    if named == 0 and count:
        first = next((m for m in out if m["role"] == "user"), None)
        if first is None:
            raise ValueError(f"{where}: {count} images but no user message to put them in")
        first["content"] = [{"type": "image"} for _ in range(count)] + first["content"]
    elif named != count:
        raise ValueError(f"{where}: the prompt names {named} images ({{'type': 'image'}} parts or {PLACEHOLDER!r}) "
                         f"but the row has {count}")
    return out


class MediaRenderer:
    """Prompts with images as token ids and `Media`, through the model's processor."""

    def __init__(self, processor):
        if not hasattr(processor, "image_processor"):
            raise ValueError(f"{type(processor).__name__} processes no images: the model's processor is needed "
                             "for prompts with images (a vision-language model's directory has one)")
        self.processor = processor

    def render(self, messages: list[dict], images: list, *, where: str,
               template_kwargs: dict | None = None) -> tuple[list[int], Media]:
        messages = place_images(messages, len(images), where)
        go_on = messages[-1].get("role") == "assistant"  # a prefill is continued (as `render_prompt`)
        text = self.processor.apply_chat_template(messages, add_generation_prompt=not go_on, continue_final_message=go_on,
                                                  tokenize=False, **(template_kwargs or {}))
        return self.process(text, images, where=where)

    def process(self, text: str, images: list, *, where: str) -> tuple[list[int], Media]:
        """The ids of rendered `text`, its image placeholders expanded for `images` (loadable
        references or PIL images, in order), and their `Media`."""
        try:
            out = self.processor(text=[text], images=[open_image(r) for r in images], return_tensors="pt",
                                 add_special_tokens=False)
        except Exception as e:  # noqa: BLE001 - a processor raises what it likes (StopIteration on a count mismatch)
            raise ValueError(f"{where}: the processor refused its {len(images)} images "
                             f"({type(e).__name__}: {str(e) or 'its placeholders and images do not match'})") from None
        ids = out["input_ids"][0].tolist()
        inputs = {k: v for k, v in out.items() if k not in _NOT_INPUTS and isinstance(v, torch.Tensor)}
        per_token = sorted(k for k, v in inputs.items() if v.dim() == 2 and v.shape == (1, len(ids)))
        if per_token:  # Gemma 3's token types: its image tokens attend both ways, which the engine does not mask
            raise ValueError(f"{type(self.processor).__name__} gives per-token inputs ({', '.join(per_token)}) that "
                             "change the model's attention; rollover does not run this model with images yet")
        return ids, Media.of(inputs, len(images))


IMAGE_PARTS = ("image", "image_url")  # content part types that carry an image (OpenAI's is image_url)


def message_images(messages: list[dict]) -> tuple[list[dict], list]:
    """Messages whose content parts hold their images (`{"type": "image", "image": ref}` with a
    path, data URL, bytes or PIL image, or OpenAI's `{"type": "image_url", "image_url": {"url":
    data URL}}`), as a chat template takes them (`{"type": "image"}`), and the images in order
    (loadable references). Raises ValueError naming the message for an image part without its
    image, one that does not load, or a part that is neither text nor an image."""
    out, images = [], []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for p in content:
            kind = p.get("type") if isinstance(p, dict) else None
            if kind in IMAGE_PARTS:
                ref = p.get("image") if kind == "image" else (p.get("image_url") or {}).get("url")
                if ref is None:
                    raise ValueError(f"message {i}: an image part without its image ({{'type': 'image', 'image': ...}})")
                try:
                    images.append(_as_ref(ref, None))
                except Exception as e:  # noqa: BLE001 - any reason bytes, a path or a URL do not load
                    raise ValueError(f"message {i}: image {len(images)}: {type(e).__name__}: {e}") from None
                parts.append({"type": "image"})
            elif kind == "text":
                parts.append(p)
            else:
                raise ValueError(f"message {i}: a content part of type {kind!r}; parts are text or image")
        out.append({**m, "content": parts})
    return out, images


def blank_images(messages: list[dict]) -> list[dict]:
    """`messages` with each image part as a chat template takes it (`{"type": "image"}`), its
    image left out unread (a conversation's earlier messages, rendered only for context)."""
    return _images_as(messages, {"type": "image"})


def _images_as(messages: list[dict], part: dict) -> list[dict]:
    """`messages` with each image part replaced by (a copy of) `part`."""
    return [{**m, "content": [dict(part) if isinstance(p, dict) and p.get("type") in IMAGE_PARTS else p
                              for p in m["content"]]}
            if isinstance(m.get("content"), list) else m for m in messages]


def has_image_parts(messages: list[dict]) -> bool:
    return any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS for m in messages
               if isinstance(m.get("content"), list) for p in m["content"])


def without_images(messages: list[dict]) -> list[dict]:
    """`messages` as a log can write them: each image part replaced by `{"type": "image", "image": "<image>"}`."""
    return _images_as(messages, {"type": "image", "image": PLACEHOLDER})


def placeholder_ids(config) -> list[int]:
    """Token ids that stand for an image or video in the ids (the forward puts features there):
    never sampled, so a response cannot hold one the images do not fill. The engine and the
    trainer both leave them out of the distribution (their logits -inf)."""
    ids = {getattr(config, k, None) for k in ("image_token_id", "image_token_index", "video_token_id")}
    return sorted(i for i in ids if isinstance(i, int) and i >= 0)


def rope_index_of(model):
    """The model's `get_rope_index` (3-D rotary positions of image tokens), or None."""
    for m in (model, getattr(model, "model", None)):
        if m is not None and callable(getattr(m, "get_rope_index", None)):
            return m.get_rope_index
    return None


def rope_positions(model, config, ids: list[int], media: Media | None) -> tuple[torch.Tensor, int] | None:
    """Positions [3, len(ids)] of a sequence for a model with 3-D rotary positions, and the
    offset of text past its images (position = index + delta); None for other models."""
    index = rope_index_of(model)
    if index is None:
        return None
    ids_t = torch.tensor([ids], dtype=torch.long)
    types = torch.zeros_like(ids_t, dtype=torch.int)
    image_token = getattr(config, "image_token_id", None)
    if media is None or image_token is None:
        n = len(ids)
        return torch.arange(n)[None].expand(3, n).clone(), 0
    types[ids_t == image_token] = 1
    grid = media.inputs.get("image_grid_thw")
    pos, delta = index(input_ids=ids_t, mm_token_type_ids=types, image_grid_thw=grid)
    return pos[:, 0].cpu(), int(delta.reshape(-1)[0])


# the models whose image features reach the text model through `get_image_features(...)
# .pooler_output` alone, so a stand-in pass through it uses exactly the weights a real image's does
# (Qwen3-VL's deepstack features and LLaVA-NeXT's image sizes take other paths)
STAND_IN_MODELS = ("qwen2_vl", "qwen2_5_vl", "llava")


def stand_in_image(config) -> dict[str, torch.Tensor]:
    """The smallest input the model's vision tower takes (one black image), for a pass that must
    run the tower without an image of its own: a sharded trainer's rank whose pass holds none
    (its peers' passes gather and reduce the tower's weights). Raises ValueError for a model
    this does not know (`STAND_IN_MODELS`)."""
    kind = getattr(config, "model_type", type(config).__name__)
    if kind not in STAND_IN_MODELS:
        raise ValueError(f"{kind}: no stand-in image is known for its vision tower (known: {', '.join(STAND_IN_MODELS)})")
    v = config.vision_config
    if hasattr(v, "spatial_merge_size") and hasattr(v, "temporal_patch_size"):
        # Qwen2-VL's patches: one merge window of patches, one frame
        m, p, t = v.spatial_merge_size, v.patch_size, v.temporal_patch_size
        channels = getattr(v, "in_channels", None) or getattr(v, "in_chans", 3)
        return {"pixel_values": torch.zeros(m * m, channels * t * p * p),
                "image_grid_thw": torch.tensor([[1, m, m]], dtype=torch.long)}
    if isinstance(getattr(v, "image_size", None), int) and hasattr(v, "num_channels"):
        # a CLIP or SigLIP tower (LLaVA): one image of its size
        return {"pixel_values": torch.zeros(1, v.num_channels, v.image_size, v.image_size)}
    raise ValueError(f"{kind}: its vision tower ({getattr(v, 'model_type', type(v).__name__)}) has no known stand-in image")
