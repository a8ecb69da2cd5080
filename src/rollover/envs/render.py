"""The tokens an environment inserts between turns, rendered without re-tokenising the model.

An episode's token list grows by appending: the sampled tokens of a turn exactly as the engine
returned them, then the tokens that continue the chat after them. Only the environment's part
is ever tokenised; what the model sampled is never decoded and encoded again (a round trip
that can change the ids: BPE merges "hel"+"lo" into "hello", decoding drops or replaces
bytes, templates trim whitespace).

How the inserted tokens are computed (`ChatRenderer.insertion`):

1. Render the conversation as text with the chat template, the assistant turn just sampled
   replaced by a sentinel string (random per call, so no text can contain it), followed by
   the environment's new messages and the generation prompt. The text after the sentinel (the *suffix*) is exactly what the template
   writes after an assistant turn's content: its closing (`<|im_end|>\\n` in ChatML,
   `<|eot_id|>` in Llama 3), the new messages, and the opening of the next assistant turn.
   The sentinel stands in for the content, so the suffix cannot depend on how the sampled
   text would tokenise, and the earlier messages are rendered only so that templates which
   look at the history see a well-formed conversation; their text is thrown away.
2. Tokenise the suffix alone (no BOS added). This equals the tail of tokenising the whole
   conversation text because the suffix starts with a special token: Hugging Face tokenizers
   split the input at special tokens before any pre-tokenisation or merge, so no merge crosses
   the boundary, and the tokens of `text + suffix` are the tokens of `text` followed by those
   of `suffix`. That holds for ChatML-like templates (SmolLM2, Qwen: the closing is
   `<|im_end|>`) and Llama-3-like ones (`<|eot_id|>`); a template whose assistant closing does
   not start with a special token is refused when the renderer is built, rather than rendered
   inexactly.
3. Drop the closing tokens the model already sampled: if the turn ends with the first k ids of
   the tokenised closing (it stopped on `<|im_end|>`), the suffix's first k ids are that same
   text and are dropped; if it was cut off by its token budget (k = 0), the whole closing is
   inserted. Because the closing starts with a special token, k > 0 only when the model did
   emit it.

The trajectory therefore holds the context exactly as the model saw it at each turn. It can
differ from what the template would render for the finished conversation all at once (a
template that trims content or drops earlier turns' reasoning); training on what was sampled,
in the context it was sampled in, is the point.
"""

from __future__ import annotations

import secrets

from jinja2.exceptions import TemplateError

from rollover.data.media import Media, MediaRenderer, blank_images, has_image_parts, message_images
from rollover.types import prefilled

_PROBE = [{"role": "user", "content": "probe"}]  # a conversation to check the template with


def episode_renderer(tokenizer, processor=None, **template_kwargs) -> "ChatRenderer":
    """The renderer a run's episodes use: a vision-language model's processor template when the
    run has a processor, else the tokenizer's chat template."""
    if processor is None:
        return ChatRenderer(tokenizer, **template_kwargs)
    return MediaChatRenderer(processor, **template_kwargs)


class ChatRenderer:
    """Renders an episode's messages with a tokenizer's chat template.

    `template_kwargs` go to every `apply_chat_template` call (e.g. `tools=[...]` for a template
    that describes tools itself, `enable_thinking=False`), so the opening and every insertion
    are rendered alike.
    """

    def __init__(self, tokenizer, **template_kwargs):
        self.tokenizer = tokenizer
        self.template_kwargs = template_kwargs
        if not getattr(self._templater, "chat_template", None):
            raise ValueError("multi-turn episodes need a tokenizer with a chat template")
        closing = self._closing(_PROBE)
        closing_ids = self._encode(closing)
        # Added tokens (special or not) are split off before any merge, so all of them qualify.
        atomic = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
        if not closing or closing_ids[0] not in atomic:
            raise ValueError(
                f"the chat template closes an assistant turn with {closing!r}, which does not start "
                "with a special token: the environment's tokens could not be rendered separately "
                "from the sampled ones exactly (see rollover.envs.render)"
            )

    @property
    def _templater(self):
        """What renders the chat template."""
        return self.tokenizer

    def initial_media(self, messages: list[dict], prefill: bool = True,
                      **template_kwargs) -> tuple[list[int], Media | None]:
        """`initial`, and the images of the messages as the forward takes them (None: none)."""
        _refuse_images(messages)
        return self.initial(messages, prefill, **template_kwargs), None

    def insertion_media(self, history: list[dict], sampled_ids: list[int],
                        new_messages: list[dict]) -> tuple[list[int], Media | None]:
        """`insertion`, and the images of `new_messages` as the forward takes them (None: none)."""
        _refuse_images(new_messages)
        return self.insertion(history, sampled_ids, new_messages), None

    def initial(self, messages: list[dict], prefill: bool = True, **template_kwargs) -> list[int]:
        """Token ids of the opening messages with the assistant turn opened (as
        `rollover.data.render_prompt`: the template writes any BOS, encoding adds none);
        `template_kwargs`: this episode's own, over the renderer's (an `Opening`'s); a template
        that writes the same text without them ignores them, which is refused (the episode fails
        saying so: a model never shown its tools would be trained as if it had been)."""
        return self._encode(self._opening(messages, prefill, **template_kwargs))

    def _opening(self, messages: list[dict], prefill: bool, **template_kwargs) -> str:
        """The opening's text with the assistant's turn open: a new one, or with `prefill` the
        last message's when it is the assistant's (the model continues it, as `render_prompt`
        does a data prompt's)."""
        go_on = prefill and prefilled(messages)
        how = {"add_generation_prompt": not go_on, **({"continue_final_message": True} if go_on else {})}
        try:
            text = self._text(messages, **how, **template_kwargs)
        except ValueError as e:  # (transformers': the template rewrites or drops the message it is to continue)
            if not go_on:
                raise
            from jinja2.exceptions import TemplateError

            raise TemplateError(f"the opening's last message is the assistant's, to be continued, and the chat "
                                f"template does not write it as given ({' '.join(str(e).split())[:200]})") from None
        if template_kwargs and text == self._text(messages, **how):
            from jinja2.exceptions import TemplateError

            raise TemplateError(f"the chat template ignores {', '.join(sorted(template_kwargs))}= (it renders the "
                                "opening the same without them)")
        return text

    def insertion(self, history: list[dict], sampled_ids: list[int], new_messages: list[dict]) -> list[int]:
        """The ids to append after an assistant turn: the rest of its closing, `new_messages`,
        and the next generation prompt.

        `history` is the conversation before the assistant turn (its content is only used to
        give the template a well-formed conversation), `sampled_ids` the turn's sampled ids.
        """
        closing = self._closing(history)
        suffix = self._suffix(history, new_messages)
        if not suffix.startswith(closing):
            raise ValueError(
                f"the chat template closes an assistant turn with {closing!r} when it is last but "
                f"not when messages follow it ({suffix[:len(closing) + 20]!r}...)"
            )
        suffix_ids, closing_ids = self._encode(suffix), self._encode(closing)
        if suffix_ids[: len(closing_ids)] != closing_ids:
            raise ValueError(
                f"the closing {closing!r} tokenises differently inside the continuation: the "
                "text after it does not start at a token boundary"
            )
        already = _overlap(sampled_ids, closing_ids)
        return suffix_ids[already:]

    def continuation(self, history: list[dict], sampled_ids: list[int], text: str) -> list[int]:
        """The ids of text that goes on inside the assistant's turn (`StepResult.continuation`):
        no closing, no template. Tokenised after a special token whose ids are then dropped, so a
        SentencePiece tokenizer does not begin it with a word's leading space, as it does the
        start of a text. A TemplateError when the turn ended with its closing (the model
        finished its message: text after it would be outside any message)."""
        if _overlap(sampled_ids, self._encode(self._closing(history))):
            raise TemplateError("a continuation after the model ended its message (its turn ended with the end of "
                                "turn, not at a rollout.stop string): answer with messages instead")
        anchor = self.tokenizer.eos_token or ""
        added = getattr(self.tokenizer, "added_tokens_decoder", {}).get(self.tokenizer.eos_token_id)
        if getattr(added, "rstrip", False):  # it would take the text's leading whitespace with it
            anchor = ""
        head = self._encode(anchor) if anchor else []
        ids = self._encode(anchor + text)
        ids = ids[len(head):] if head and ids[:len(head)] == head else self._encode(text)
        if ids and not text.startswith(" ") and self.tokenizer.convert_ids_to_tokens(ids[0]) == "\u2581":
            ids = ids[1:]  # a SentencePiece tokenizer that puts a space before every text (prepend_scheme always)
        return ids

    def _closing(self, history: list[dict]) -> str:
        """What the template writes after an assistant turn's content when it is last."""
        return self._after_assistant(history, [], add_generation_prompt=False)

    def _suffix(self, history: list[dict], new_messages: list[dict]) -> str:
        return self._after_assistant(history, new_messages, add_generation_prompt=True)

    def _after_assistant(self, history: list[dict], new_messages: list[dict], *, add_generation_prompt: bool) -> str:
        """The text the template writes after an assistant turn's content (a sentinel)."""
        sentinel = f"\u27e6sampled-{secrets.token_hex(8)}\u27e7"
        messages = [*history, {"role": "assistant", "content": sentinel}, *new_messages]
        text = self._text(messages, add_generation_prompt=add_generation_prompt)
        if text.count(sentinel) != 1:
            raise ValueError(
                "the chat template did not write the assistant content exactly once as given "
                f"(found the placeholder {text.count(sentinel)} times): it rewrites or drops content"
            )
        return text[text.index(sentinel) + len(sentinel) :]

    def _text(self, messages: list[dict], *, add_generation_prompt: bool, **extra) -> str:
        """The template's text; a TemplateError where the template fails on the messages (a
        template that joins contents as strings, given a list of parts: the episode fails)."""
        try:
            return self._templater.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **{**self.template_kwargs, **extra}
            )
        except (TypeError, AttributeError, KeyError, IndexError) as e:
            raise TemplateError(f"the chat template fails on the messages ({type(e).__name__}: {e}): "
                                f"{messages[-3:]!r:.300}") from None

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


class MediaChatRenderer(ChatRenderer):
    """A `ChatRenderer` for a vision-language model: the processor's chat template renders the
    messages, and the images in them (`{"type": "image", "image": ...}` parts, in the opening and
    in any insertion) get their placeholders expanded by the processor, which also makes their
    pixel values. The insertion's rules hold as for text: its images' placeholders are special
    tokens, so the suffix still tokenises on its own. A placeholder the environment wrote as text
    (`<image>`) has no image: the episode fails saying so."""

    def __init__(self, processor, **template_kwargs):
        self.media = MediaRenderer(processor)
        self._placeholders = [t for t in (getattr(processor, "image_token", None), getattr(processor, "video_token", None))
                              if isinstance(t, str) and t]
        super().__init__(processor.tokenizer, **template_kwargs)

    @property
    def _templater(self):
        return self.media.processor

    def initial_media(self, messages: list[dict], prefill: bool = True,
                      **template_kwargs) -> tuple[list[int], Media | None]:
        messages, images = _split_images(messages)
        return self._process(self._opening(messages, prefill, **template_kwargs), images, "the opening")

    def insertion_media(self, history: list[dict], sampled_ids: list[int],
                        new_messages: list[dict]) -> tuple[list[int], Media | None]:
        history = blank_images(history)
        new_messages, images = _split_images(new_messages)
        closing, suffix = self._closing(history), self._suffix(history, new_messages)
        suffix_ids, media = self._process(suffix, images, "the environment's messages")
        closing_ids = self._encode(closing)
        if not suffix.startswith(closing) or suffix_ids[: len(closing_ids)] != closing_ids:
            raise ValueError(f"the chat template closes an assistant turn with {closing!r} when it is last but "
                             f"not as tokens when messages follow it ({suffix[:len(closing) + 20]!r}...)")
        return suffix_ids[_overlap(sampled_ids, closing_ids):], media

    def continuation(self, history: list[dict], sampled_ids: list[int], text: str) -> list[int]:
        self._process(text, [], "the environment's continuation")  # no placeholder typed as text
        return super().continuation(blank_images(history), sampled_ids, text)

    def _process(self, text: str, images: list, where: str) -> tuple[list[int], Media | None]:
        written = sum(text.count(t) for t in self._placeholders)
        if written != len(images):  # the environment typed a placeholder, or the template dropped an image
            raise TemplateError(f"{where}: {written} image placeholders in the rendered text for {len(images)} images "
                                f"(a message may not write {' or '.join(map(repr, self._placeholders))} as text)")
        if not images:
            return self._encode(text), None
        try:
            return self.media.process(text, images, where=where)
        except ValueError as e:  # the environment's images: its episode fails, not the run
            raise TemplateError(str(e)) from None


def _split_images(messages: list[dict]) -> tuple[list[dict], list]:
    try:
        return message_images(messages)
    except ValueError as e:
        raise TemplateError(str(e)) from None


def _refuse_images(messages: list[dict]) -> None:
    if has_image_parts(messages):
        raise TemplateError("the environment's messages hold images, which this model does not take (a "
                            "vision-language model does, with TorchEngine)")


def _overlap(sampled_ids: list[int], closing_ids: list[int]) -> int:
    """The largest k such that the turn ends with the first k ids of the closing."""
    for k in range(min(len(closing_ids), len(sampled_ids)), 0, -1):
        if sampled_ids[-k:] == closing_ids[:k]:
            return k
    return 0
