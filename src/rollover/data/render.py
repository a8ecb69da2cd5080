"""A `Prompt` as chat messages, and as the token ids the engine is given.

Rollouts are token-in/token-out: the prompt is templated and tokenized once, here, and never
re-templated later.
"""

from __future__ import annotations

from rollover.types import Prompt

BOXED_INSTRUCTION = "Put the final answer in \\boxed{}."


def render_messages(
    prompt: Prompt, system_prompt: str | None = None, instruction: str | None = None
) -> list[dict]:
    """The chat messages for `prompt`.

    A text prompt becomes a single user message. `instruction` (for example
    `BOXED_INSTRUCTION`) is appended to the last user message after a blank line;
    `system_prompt` becomes a leading system message, and is refused for a prompt that already
    has one rather than silently replacing or duplicating it.
    """
    if (prompt.text is None) == (prompt.messages is None):
        raise ValueError(f"prompt {prompt.id}: exactly one of text and messages must be set")
    if prompt.text is not None:
        messages = [{"role": "user", "content": prompt.text}]
    else:
        messages = [dict(m) for m in prompt.messages]
    if instruction:
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last_user is None:
            raise ValueError(f"prompt {prompt.id}: no user message to append the instruction to")
        content = messages[last_user]["content"]
        if isinstance(content, str):
            messages[last_user]["content"] = content + "\n\n" + instruction
        else:  # parts (a prompt with images): the instruction is the last text
            messages[last_user]["content"] = [*content, {"type": "text", "text": "\n\n" + instruction}]
    if system_prompt is not None:
        if any(m["role"] == "system" for m in messages):
            raise ValueError(
                f"prompt {prompt.id} already has a system message; drop system_prompt or the "
                "system message in the data"
            )
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def render_media_prompt(renderer, prompt: Prompt, system_prompt: str | None = None, instruction: str | None = None,
                        template_kwargs: dict | None = None):
    """Token ids and `Media` of a prompt with images, through `renderer` (a `MediaRenderer`)."""
    messages = render_messages(prompt, system_prompt, instruction)
    return renderer.render(messages, prompt.images or [], where=f"prompt {prompt.id}", template_kwargs=template_kwargs)


def render_prompt(
    tokenizer,
    prompt: Prompt,
    system_prompt: str | None = None,
    instruction: str | None = None,
    use_chat_template: bool = True,
    template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids of `prompt` ready for generation (the assistant turn is opened);
    `template_kwargs` go to the chat template (e.g. `enable_thinking=False`).

    With `use_chat_template=False` (base models without a template) a text prompt plus
    instruction is encoded as is, with the tokenizer's usual special tokens; chat-form prompts
    need a template and are refused.
    """
    if prompt.images:
        raise ValueError(f"prompt {prompt.id} has images: render it with rollover.data.media.MediaRenderer")
    if not use_chat_template:
        if prompt.text is None:
            raise ValueError(f"prompt {prompt.id} is in chat form and needs use_chat_template")
        if system_prompt is not None:
            raise ValueError("system_prompt needs use_chat_template")
        if template_kwargs:
            raise ValueError("chat template arguments need use_chat_template")
        text = prompt.text + ("\n\n" + instruction if instruction else "")
        return list(tokenizer.encode(text))
    messages = render_messages(prompt, system_prompt, instruction)
    # a prompt ending in an assistant message (TRL's prefill) is continued, not closed and answered anew
    go_on = messages[-1].get("role") == "assistant"
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=not go_on, continue_final_message=go_on,
                                         tokenize=False, **(template_kwargs or {}))
    # The template already wrote any BOS it wants; encoding must not add a second one.
    return list(tokenizer.encode(text, add_special_tokens=False))


def opens_reasoning(tokenizer, ids: list[int]) -> bool:
    """Whether token ids a model goes on from (a prompt, or a conversation before a turn) end in an
    open `<think>`: a chat template that opens the reasoning in its generation prompt (Qwen3.5's,
    Qwen3's Thinking-2507 models') starts the reply inside it."""
    return tokenizer.decode(ids[-16:], skip_special_tokens=False).rstrip().endswith("<think>")



def template_variables(template) -> set[str] | None:
    """The variables a chat template (its Jinja source, or a dict of named ones) reads from its
    caller (messages, add_generation_prompt, enable_thinking, ...); None when it cannot be parsed
    here (nothing is claimed about it)."""
    import jinja2
    from jinja2 import meta
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    sources = list(template.values()) if isinstance(template, dict) else [template]
    if not sources or not all(isinstance(s, str) for s in sources):
        return None

    class Generation(jinja2.ext.Extension):  # transformers' {% generation %} block tag
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(extensions=[loopcontrols, Generation])
    read: set[str] = set()
    for source in sources:
        try:
            read |= meta.find_undeclared_variables(env.parse(source))
        except jinja2.TemplateError:
            return None
    return read
