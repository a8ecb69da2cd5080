"""The prompts of a run: read from its sources (one, or several by name, mixed by weight),
held out, rendered and length-checked at start-up, and the checks that need them
(`checkpoint.best`'s metric). `build_run` calls these before anything is written."""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

from rollover.config import Config, ConfigError
from rollover.data import (DataError, MixedIterator, PromptIterator, content_key, distinct_questions, load_prompts,
                           render_prompt, split_holdout)
from rollover.data.split import image_keys
from rollover.rewards import RewardRunner
from rollover.types import Prompt

log = logging.getLogger("rollover")


def _generated(env_builder, n: int, seed: int, name: str) -> list[Prompt]:
    """The environment's `prompts(n, seed)`, checked to be Prompts (a dict in their place failed
    later, naming neither the environment nor its generator)."""
    call = f"env.name={name!r}: prompts({n}, seed={seed})"
    got = env_builder.prompts(n, seed=seed)
    try:
        prompts = list(got)
    except TypeError:
        raise ConfigError(f"{call} returned {type(got).__name__}, not a list of rollover.types.Prompt") from None
    for i, p in enumerate(prompts):
        if not isinstance(p, Prompt):
            raise ConfigError(f"{call} returned {type(p).__name__} {p!r:.80} as item {i}, not a rollover.types.Prompt "
                              "(Prompt(id=..., text=... or messages=..., answer=...))")
    return prompts


def _prompts(cfg: Config, env_builder=None) -> tuple[list[Prompt], list[Prompt], int, dict[str, str]]:
    """(training prompts, held-out prompts, rows skipped, the set name of each prompt of a named
    set: `data.train` or `data.eval` naming several; their ids get the name in front)."""
    d = cfg.data
    kw = dict(prompt_key=d.prompt_key, answer_key=d.answer_key, require_answer=d.require_answer,
              on_bad_row=d.on_bad_row)
    sets: dict[str, str] = {}
    if d.train == "env":  # the environment's own task generator
        if not callable(getattr(env_builder, "prompts", None)):
            raise ConfigError(f"data.train=env: the environment {cfg.env.name!r} has no prompts(n, seed) task generator; "
                              "give data.train a dataset instead")
        train = _generated(env_builder, cfg.env.tasks, cfg.seed, cfg.env.name)
        # held-out tasks: new instances from another seed (a game's task is its hidden state, so
        # carving distinct prompt texts out of the training tasks does not apply)
        held = _generated(env_builder, d.eval_size, cfg.seed + 1_000_003, cfg.env.name) \
            if d.eval_size and d.eval is None else []
        if d.eval is None:
            return list(train), list(held), 0, sets
        train = SimpleNamespace(prompts=train, num_skipped=0)
    else:
        train = _load_named("data.train", d.train, kw, sets)
    skipped = train.num_skipped
    if isinstance(d.eval, dict):  # several held-out sets, their ids under their names
        held = _load_named("data.eval", d.eval, {**kw, "split": None}, sets)
        return list(train.prompts), held.prompts, skipped + held.num_skipped, sets
    if d.eval is not None:  # (each set's first eval_size that fit data.max_prompt_tokens: `_render_all`)
        held = _load("data.eval", d.eval, {**kw, "split": None})  # from a dataset of splits: the one it names
        skipped += held.num_skipped
        return list(train.prompts), list(held.prompts), skipped, sets
    if d.eval_size == 0:
        return list(train.prompts), [], skipped, sets
    distinct = distinct_questions(train.prompts)  # the held-out prompts are distinct questions, none trained on
    frac = d.eval_size / distinct
    if frac >= 0.5:
        rows = f" (in {len(train.prompts)} rows)" if distinct < len(train.prompts) else ""
        raise ConfigError(f"data.eval_size={d.eval_size} would hold out half or more of the {distinct} distinct "
                          f"training questions{rows}")
    if not sets:
        parts = [split_holdout(train.prompts, frac, seed=cfg.seed)[1]]
    else:  # named sources: each gives its share, so a small one is held out (and trained on) too
        parts = []
        for name in sorted(d.train):
            mine = [p for p in train.prompts if sets[p.id] == name]
            parts.append(split_holdout(mine, frac, seed=cfg.seed)[1] if distinct_questions(mine) > 1 else [])
    # each question once, and none of them trained on from any source (sources may share
    # questions); one past eval_size (a share rounded up) goes back to training
    held, keys = [], set()
    for p in (p for row in itertools.zip_longest(*parts) for p in row if p is not None):
        if len(held) < d.eval_size and (k := content_key(p)) not in keys:
            keys.add(k)
            held.append(p)
    return [p for p in train.prompts if content_key(p) not in keys], held, skipped, sets


def _load(key: str, source: str, kw: dict):
    """`load_prompts` for config key `key`: a missing source is a config error naming the key, a
    data error names it too, and skipped rows (data.on_bad_row=skip) are named in the log, the
    first few with why."""
    try:
        loaded = load_prompts(source, **kw)
    except FileNotFoundError as e:
        raise ConfigError(f"{key}={source}: {e}") from None
    except DataError as e:
        raise DataError(f"{key}: {e}") from None
    for row in loaded.skipped[:SKIPPED_SHOWN]:
        log.warning("data: skipped %s: %s", row.where, row.reason)
    if loaded.num_skipped > SKIPPED_SHOWN:
        log.warning("data: skipped %d more rows of %s", loaded.num_skipped - SKIPPED_SHOWN, source)
    return loaded


SKIPPED_SHOWN = 5  # skipped rows a source names in the log


def _load_named(key: str, source: str | dict[str, str], kw: dict, sets: dict[str, str], first: int | None = None):
    """The prompts of one source, or of several by name in the names' order (so a config that
    lists them in another order has the same data; the first `first` of each; their ids under
    the name, recorded in `sets`)."""
    if not isinstance(source, dict):
        return _load(key, source, kw)
    prompts, skipped = [], 0
    for name, each in sorted(source.items()):
        loaded = _load(f"{key}.{name}", each, kw)
        skipped += loaded.num_skipped
        for p in loaded.prompts[:first]:
            prompts.append(replace(p, id=f"{name}/{p.id}"))
            sets[prompts[-1].id] = name
    return SimpleNamespace(prompts=prompts, num_skipped=skipped)


def eval_sources(cfg: Config, held_out: list[Prompt], sets: dict[str, str]) -> dict[str, str]:
    """Each held-out prompt's source, which `eval/<source>/...` metrics are reported by: its
    set's name when `data.eval` names several (`sets`), else its `data_source` column (verl's)
    where it has one."""
    if _named_eval(cfg):
        return {p.id: sets[p.id] for p in held_out}  # its set's, or the named training source it was carved from
    return {p.id: p.fields["data_source"] for p in held_out
            if isinstance(p.fields.get("data_source"), str) and p.fields["data_source"].strip()}


def _named_eval(cfg: Config) -> bool:
    """Held-out prompts come from named sets: `data.eval`'s, or carved from `data.train`'s."""
    return isinstance(cfg.data.eval, dict) or (cfg.data.eval is None and isinstance(cfg.data.train, dict))


def _train_iterator(cfg: Config, prompts: list[Prompt], sets: dict[str, str]):
    """The training prompts in order: one stream, or with `data.train_weights` a mix of the
    named sources."""
    d = cfg.data
    if d.train_weights is None:
        return PromptIterator(prompts, seed=cfg.seed, shuffle=d.shuffle)
    by_source = {name: [p for p in prompts if sets[p.id] == name] for name in d.train}
    empty = sorted(name for name, ps in by_source.items() if not ps)
    if empty:
        raise ConfigError(f"data.train sources {empty} have no prompt left to train on (too long, held out or bad rows)")
    return MixedIterator(by_source, d.train_weights, seed=cfg.seed, shuffle=d.shuffle)


def _placeholder_ids(tokenizer, media: MediaStore | None) -> set[int]:
    """The token ids of the image and video placeholders of a run with images (none without)."""
    processor = getattr(getattr(media, "renderer", None), "processor", None)
    tokens = [getattr(processor, k, None) for k in ("image_token", "video_token")]
    ids = {tokenizer.convert_tokens_to_ids(x) for x in tokens if isinstance(x, str)}
    return {i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id}


def _warn_unread_template_kwargs(cfg: Config, tokenizer) -> None:
    """A warning for each `data.chat_template_kwargs` key the model's chat template never reads
    (a misspelt `enable_thinking` would render every prompt as if it were not given)."""
    import difflib

    from rollover.data.render import template_variables

    given = cfg.data.chat_template_kwargs
    read = template_variables(getattr(tokenizer, "chat_template", None)) if given else None
    for key in [k for k in given if k not in read] if read is not None else ():
        near = difflib.get_close_matches(key, sorted(read), n=1)
        log.warning("data.chat_template_kwargs.%s: the chat template of model=%r never reads %r, so it changes "
                    "nothing%s", key, cfg.model, key, f" (did you mean {near[0]!r}?)" if near else "")


def _render_all(cfg: Config, tokenizer, train: list[Prompt], held_out: list[Prompt], media: "MediaStore | None" = None,
                sets: dict[str, str] | None = None) -> tuple[dict[str, list[int]], list[Prompt], list[Prompt], int]:
    """Render every prompt once: (token ids by prompt id, train, held_out, number dropped);
    prompts with images through `media` (their pixel values are made again when drawn).

    A prompt over data.max_prompt_tokens is an error naming it, or under data.on_bad_row=skip
    is dropped from whichever list holds it, so neither the iterator nor eval ever sees it. Of a
    `data.eval` file (each of its named sets, by `sets`), the first `data.eval_size` that fit are
    held out: the rows after them are not rendered.
    """
    d, episodes = cfg.data, cfg.env.name is not None
    texts = any(not p.images for p in itertools.chain(train, held_out))  # (images: the processor's template)
    if (d.chat_template or episodes) and texts and getattr(tokenizer, "chat_template", None) is None:
        how = "which episodes (env.name) need" if episodes else \
            "data.chat_template=false encodes text prompts as they are (a base model's way)"
        raise ConfigError(f"model={cfg.model!r}: its tokenizer has no chat template; {how}")
    if (d.chat_template or episodes) and texts:
        _warn_unread_template_kwargs(cfg, tokenizer)
    out: dict[str, list[int]] = {}
    placeholders = _placeholder_ids(tokenizer, media)
    _images_of: dict[str, list[str]] = {}  # (prompts with the same text under one id may differ in their images)
    too_long: list[str] = []
    unusable: list[str] = []  # prompts that do not render, their images or their messages (data.on_bad_row=skip)

    def fits(p: Prompt) -> bool:
        if p.images and media is None:  # a held-out row past those `_media_store` looked at (first_held_out)
            unusable.append(f"{p.id}: images past the first data.eval_size held-out rows, which have none")
            return False
        if p.images:
            try:
                ids = media.render(p)[0]
            except ConfigError as e:
                if d.on_bad_row == "raise":
                    raise
                unusable.append(str(e))
                return False
        else:
            try:
                if episodes:  # (an environment writes each opening: only its length is checked here)
                    ids = render_prompt(tokenizer, p, template_kwargs=d.chat_template_kwargs)
                else:
                    ids = render_prompt(tokenizer, p, system_prompt=d.system_prompt, instruction=d.instruction,
                                        template_kwargs=d.chat_template_kwargs, use_chat_template=d.chat_template)
            except Exception as e:  # noqa: BLE001 - the template's own errors (a role it refuses) are any type
                why = f"prompt {p.id!r} does not render: {type(e).__name__}: {' '.join(str(e).split())}"
                if d.on_bad_row == "raise":
                    raise ConfigError(f"{why}; fix or drop the row, or set data.on_bad_row=skip") from e
                unusable.append(why)
                return False
        if not p.images and (typed := set(ids) & placeholders):  # the forward would look for images there
            why = (f"prompt {p.id!r} has no images but its text writes the image placeholder "
                   f"{tokenizer.convert_ids_to_tokens(min(typed))!r}")
            if d.on_bad_row == "raise":
                raise ConfigError(f"{why}; drop the row or set data.on_bad_row=skip")
            unusable.append(why)
            return False
        if len(ids) > d.max_prompt_tokens:
            if d.on_bad_row == "raise":
                raise ConfigError(f"prompt {p.id!r} renders to {len(ids)} tokens, more than data.max_prompt_tokens="
                                  f"{d.max_prompt_tokens}; raise the limit, drop the row or set data.on_bad_row=skip")
            too_long.append(f"{p.id} ({len(ids)} tokens)")
            return False
        # the loop looks prompts up by id: two different prompts under one id (two generator
        # sources with the same seed, two files with the same stem) would train on the wrong one
        images = image_keys(p)
        if out.setdefault(p.id, ids) != ids or _images_of.setdefault(p.id, images) != images:
            raise ConfigError(f"prompt id {p.id!r} names two different prompts in data.train and data.eval; "
                              "give the eval file another name or the generator another seed")
        return True

    train = [p for p in train if fits(p)]
    if d.eval is None:  # carved from the training prompts: eval_size of them already
        held_out = [p for p in held_out if fits(p)]
    else:
        held_out = first_held_out(cfg, held_out, sets, fits)
    if too_long:
        log.warning("data: skipped %d prompts longer than data.max_prompt_tokens=%d (data.on_bad_row=skip): %s%s",
                    len(too_long), d.max_prompt_tokens, ", ".join(too_long[:5]), ", ..." if len(too_long) > 5 else "")
    if unusable:
        log.warning("data: skipped %d prompts that do not render (data.on_bad_row=skip): %s%s",
                    len(unusable), "; ".join(unusable[:3]), "; ..." if len(unusable) > 3 else "")
    if not train:
        raise ConfigError(f"no training prompt fits in data.max_prompt_tokens={d.max_prompt_tokens} "
                          f"({len(too_long)} skipped as too long, {len(unusable)} that do not render"
                          + (f", the first: {unusable[0]}" if unusable else "") + ")")
    return out, train, held_out, len(too_long) + len(unusable)


def _check_best(cfg: Config, env_builder, sources: dict[str, str], rewards: RewardRunner, held_out: list) -> None:
    """checkpoint.best names a metric the evaluations will report: refused before anything runs."""
    from types import SimpleNamespace

    from rollover.rollout.groups import PER_SOURCE, _eval_summary

    best = cfg.checkpoint.best
    if best is None:
        return
    if not held_out:
        raise ConfigError(f"checkpoint.best={best}: there are no held-out prompts to evaluate (data.eval_size=0)")
    if env_builder is None:
        names = set(_eval_summary([], SimpleNamespace(cfg=cfg, primary_reward=rewards.rewards[0].name)))
    else:
        from rollover.rollout.episodes import _episode_summary

        names = set(_episode_summary([], cfg))
    sets = set(sources.values())
    if len(sets) >= (1 if _named_eval(cfg) else 2):
        names |= {f"eval/{s}/{k}" for s in sets for k in PER_SOURCE if f"eval/{k}" in names}
    if best not in names:
        raise ConfigError(f"checkpoint.best={best} is not among the evaluation's metrics: {', '.join(sorted(names))}")


def _warn_if_a_step_exceeds_the_data(cfg: Config, n: int) -> None:
    if cfg.rollout.prompts_per_step > n:
        log.warning("rollout.prompts_per_step=%d is more than the %d training prompts: every step trains each prompt "
                    "about %.1f times", cfg.rollout.prompts_per_step, n, cfg.rollout.prompts_per_step / n)


def _steps_from_epochs(cfg: Config, n: int) -> None:
    """With `epochs` set: the run's steps from the number of training prompts, written into `cfg`
    (which then records steps, not epochs)."""
    if cfg.epochs is None:
        return
    B = cfg.rollout.prompts_per_step
    drawn = B if cfg.selection.policy == "uniform" else max(B, math.ceil(cfg.selection.candidates * B))
    steps = max(1, math.ceil(cfg.epochs * n / drawn - 1e-9))
    how = f"{drawn} prompts drawn a step" + (f" (selection.candidates={cfg.selection.candidates:g} x {B} trained)"
                                             if drawn != B else "")
    log.info("epochs=%g: %g x %d training prompts / %s = %d steps", cfg.epochs, cfg.epochs, n, how, steps)
    cfg.__dict__.update(steps=steps, epochs=None)  # as given; an assignment would validate the whole config again


class MediaStore:
    """The images of a run's prompts as the model takes them (`Media`), made through the model's
    processor when a prompt is drawn and kept for the `keep` prompts drawn last (pixel values of
    a whole dataset would not fit in memory)."""

    def __init__(self, cfg: Config, processor, keep: int = 256):
        from rollover.data.media import MediaRenderer

        if not cfg.data.chat_template:
            raise ConfigError("prompts with images need data.chat_template: true (the processor's template places them)")
        self.renderer, self.cfg, self.keep = MediaRenderer(processor), cfg, keep
        self._kept: dict[str, object] = {}
        self._lock = threading.Lock()  # async mode draws prompts on the engine's thread while the loop evaluates

    def render(self, prompt: Prompt):
        """(token ids, Media) of a prompt with images."""
        from rollover.data import render_media_prompt

        d = self.cfg.data
        try:
            return render_media_prompt(self.renderer, prompt, system_prompt=d.system_prompt, instruction=d.instruction,
                                       template_kwargs=d.chat_template_kwargs)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def __call__(self, prompt: Prompt):
        """The prompt's `Media`, or None for a prompt without images."""
        if not prompt.images:
            return None
        with self._lock:
            media = self._kept.pop(prompt.id, None)
        media = media or self.render(prompt)[1]
        with self._lock:
            self._kept[prompt.id] = media  # the newest last
            while len(self._kept) > self.keep:
                self._kept.pop(next(iter(self._kept)))
        return media


def first_held_out(cfg: Config, held_out: list[Prompt], sets: dict[str, str] | None, fits=lambda p: True
                   ) -> list[Prompt]:
    """Of a `data.eval` file's prompts (each named set's, by `sets`), the first `data.eval_size`
    that `fits`; the rows after them are not looked at."""
    taken: Counter = Counter()  # held out so far, by named set (None: the one file)
    kept = []
    for p in held_out:
        name = (sets or {}).get(p.id)
        if taken[name] < cfg.data.eval_size and fits(p):
            kept.append(p)
            taken[name] += 1
    return kept


def _media_store(cfg: Config, prompts: list[Prompt]) -> MediaStore | None:
    """The run's `MediaStore` when a prompt has images, with the parts that take them checked
    (so far: TorchEngine in the driver, on Ray rollout workers or on the trainer's ranks; sync,
    APRIL or async; any trainer). An environment gets its task's images in `Prompt.images` and
    shows them in its own messages."""
    with_images = sum(bool(p.images) for p in prompts)
    if not with_images:
        return None
    from rollover.models import load_processor

    if cfg.rollout.engine == "vllm":
        raise ConfigError(f"{with_images} prompts have images; prompts with images train with TorchEngine so far, "
                          "not with rollout.engine=vllm")
    try:
        return MediaStore(cfg, load_processor(cfg.model))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _env_processor(cfg: Config, model):
    """Episodes with a vision-language model on TorchEngine: the processor that renders the
    images their environments' messages may hold. None for other models and engines, and where
    the processor does not load or has no chat template (warned): the tokenizer renders the
    episodes then, and one given an image fails saying so."""
    from rollover.models import is_vision_language, load_processor

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not is_vision_language(base.config) or cfg.rollout.engine != "torch":
        return None
    try:
        processor = load_processor(cfg.model)
    except ValueError as e:
        log.warning("env: %s; episodes render text only (an image in their messages fails the episode)", e)
        return None
    if not getattr(processor, "chat_template", None):
        log.warning("env: model %r's processor has no chat template; episodes render text only with the tokenizer's "
                    "(an image in their messages fails the episode)", cfg.model)
        return None
    return processor


def _check_stand_in(model) -> None:
    """Sharded ranks run the vision tower on a stand-in image in a pass with no image of its own
    (`rollover.train.fsdp`): the model's tower must have one."""
    from rollover.data.media import stand_in_image

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        stand_in_image(base.config)
    except ValueError as e:
        raise ConfigError(f"train.parallel=fsdp with prompts with images: {e}") from None
