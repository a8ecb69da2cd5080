"""Prompts with images and vision-language models (`rollover.data.media`): rows with images load
and render through the model's processor, TorchEngine samples from the model's own distribution
given the images, the trainer's logprobs are the engine's, and a sync run trains, evaluates,
checkpoints and exports. Tiny Qwen2.5-VL (3-D rotary positions) and LLaVA models, CPU."""

from __future__ import annotations

import base64
import copy
import io
import json
import re
from pathlib import Path

import pytest
import torch

from rollover.config import ConfigError, load_config
from rollover.data import load_prompts
from rollover.data.media import MediaRenderer, place_images, placeholder_ids, stand_in_image
from rollover.engine.torch_engine import TorchEngine
from rollover.testing import save_tiny_vl_model, tiny_model, tiny_vl_model, vl_processor
from rollover.types import Request, Rollout, SamplingParams

ARCHS = ["qwen2_5_vl", "llava"]


def image(seed: int, size: int = 56):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(size, size, 3, generator=g) * 255).to(torch.uint8).numpy())


def own_logprobs(model, ids: list[int], response: list[int], media, image_token: int | None = None) -> torch.Tensor:
    """The model's own forward over prompt + response, as transformers' generate runs it (Qwen's
    modality types let it place the image tokens on their grid)."""
    full = torch.tensor([ids + response])
    kw = dict(media.inputs) if media is not None else {}
    if media is not None and image_token is not None and "image_grid_thw" in kw:
        kw["mm_token_type_ids"] = (full == image_token).int()
    with torch.no_grad():
        logits = model(input_ids=full, **kw).logits[0].float()
    logits[:, placeholder_ids(model.config)] = float("-inf")  # never sampled (the engine and trainer leave them out)
    lp = torch.log_softmax(logits, -1)[len(ids) - 1: -1]
    return lp.gather(1, torch.tensor(response)[:, None]).squeeze(1)


def rendered(arch: str, seeds: list[int], text: str = "Which color?"):
    renderer = MediaRenderer(vl_processor(arch))
    return [renderer.render([{"role": "user", "content": text}], [image(s)], where=f"prompt {s}") for s in seeds]


def test_rows_with_images_load_from_paths_data_urls_and_bytes(tmp_path):
    img = image(1)
    img.save(tmp_path / "a.png")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    raw = buf.getvalue()
    rows = [
        {"prompt": "one", "images": ["a.png"], "answer": "x"},  # relative to the file
        {"prompt": "two <image> here", "image": "data:image/png;base64," + base64.b64encode(raw).decode(), "answer": "y"},
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "three"}]}],
         "images": [{"bytes": list(raw), "path": None}], "answer": "z"},
        {"prompt": "bad", "images": ["missing.png"], "answer": "w"},
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(Exception, match=r"rows.jsonl.*(line|row) 4.*images.*image 0.*missing.png"):
        load_prompts(path)
    got = load_prompts(path, on_bad_row="skip")
    assert [len(p.images) for p in got.prompts] == [1, 1, 1] and got.num_skipped == 1
    assert "images" not in got.prompts[0].fields and "image" not in got.prompts[1].fields
    renderer = MediaRenderer(vl_processor("llava"))
    out = [renderer.render(p.messages or [{"role": "user", "content": p.text}], p.images, where=p.id)
           for p in got.prompts]
    assert out[0][1].key == out[1][1].key == out[2][1].key  # one image, three ways in
    assert all(ids.count(renderer.processor.image_token_id) == 4 for ids, _ in out)
    # a URL, and base64 without its data: prefix, are named for what they are (not as missing files)
    for given, says in [("https://example.com/a.png", "images are not fetched from URLs; download them"),
                        (base64.b64encode(raw * 50).decode(), "is no file path; base64 needs its data: prefix")]:
        path.write_text(json.dumps({"prompt": "p", "images": [given], "answer": "a"}) + "\n")
        with pytest.raises(Exception, match=re.escape(says)) as bad:
            load_prompts(path)
        assert len(str(bad.value)) < 600


def test_the_prompt_must_name_as_many_images_as_the_row_has():
    two = place_images([{"role": "user", "content": "a <image> b <image>"}], 2, where="p")
    assert [p["type"] for p in two[0]["content"]] == ["text", "image", "text", "image"]
    first = place_images([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], 2, where="p")
    assert [p["type"] for p in first[1]["content"]] == ["image", "image", "text"]
    with pytest.raises(ValueError, match="prompt 7: the prompt names 1 images .* row has 2"):
        place_images([{"role": "user", "content": "a <image>"}], 2, where="prompt 7")


@pytest.mark.parametrize("arch", ARCHS)
def test_the_engine_samples_from_the_models_own_distribution_given_the_images(arch):
    model = tiny_vl_model(arch, seed=1)
    (ids0, m0), (ids1, m1) = rendered(arch, [0, 1])
    assert ids0 == ids1 and m0.key != m1.key  # the same tokens, other images: no prefill shared between them
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True)
    reqs = [Request(id=f"r{i}-{j}", prompt_ids=ids, sampling=SamplingParams(**{**sp.__dict__, "seed": 10 * i + j}),
                    media=m) for i, (ids, m) in enumerate([(ids0, m0), (ids1, m1)]) for j in range(2)]
    text = Request(id="text", prompt_ids=ids0[:5], sampling=SamplingParams(**{**sp.__dict__, "seed": 9}))
    with TorchEngine(model, max_rows=4, max_len=96, forward="transformers") as engine:
        outs = engine.generate(reqs + [text])
    token = model.config.image_token_id
    for req, c in zip(reqs + [text], outs):
        ref = own_logprobs(model, req.prompt_ids, c.response_ids, req.media, token)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4), (arch, req.id)
    # the images matter: the first sample under the other prompt's image has other logprobs
    other = own_logprobs(model, ids0, outs[0].response_ids, m1, token)
    assert (other - torch.tensor(outs[0].logprobs)).abs().max() > 1e-2


def test_a_weight_update_recomputes_a_running_sequences_images():
    model = tiny_vl_model("qwen2_5_vl", seed=2)
    (ids, media), = rendered("qwen2_5_vl", [3])
    newer = tiny_vl_model("qwen2_5_vl", seed=4)
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5, ignore_eos=True)
    with TorchEngine(model, max_rows=2, max_len=96) as engine:
        core = engine.core
        core.add(Request(id="a", prompt_ids=ids, sampling=sp, media=media))
        for _ in range(4):
            core.step()
        core.update_weights(newer.state_dict().items(), version=1, inflight="continue")
        while core.has_work():
            done, _ = core.step()
            if done:
                c = done[0]
    later = [j for j, v in enumerate(c.versions) if v == 1]
    assert later and later[0] >= 4
    ref = own_logprobs(newer, ids, c.response_ids, media, newer.config.image_token_id)
    assert torch.allclose(torch.tensor(c.logprobs)[later], ref[later], atol=1e-4)


def test_images_are_refused_by_engines_and_models_that_do_not_take_them():
    from rollover.engine.validation import validate_request

    (ids, media), = rendered("llava", [0])
    req = Request(id="img", prompt_ids=ids, sampling=SamplingParams(max_new_tokens=4), media=media)
    with pytest.raises(ValueError, match="request 'img' has images: only TorchEngine with a vision-language model"):
        validate_request(req, max_len=128, vocab_size=200)  # vLLM, Ray workers, colocated ranks
    with TorchEngine(tiny_model("llama"), max_rows=2, max_len=128) as engine:
        with pytest.raises(ValueError, match="request 'img' has images"):
            engine.submit(req)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_trainers_logprobs_are_the_engines_and_its_update_reaches_the_vision_tower(arch):
    from rollover.train.batch import TrainBatch
    from rollover.train.trainer import Trainer

    model = tiny_vl_model(arch, seed=1)
    prompts = rendered(arch, [0, 1, 2])
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    reqs = [Request(id=f"g{i}/{j}", prompt_ids=ids, sampling=SamplingParams(**{**sp.__dict__, "seed": 3 * i + j}),
                    media=m) for i, (ids, m) in enumerate(prompts) for j in range(3)]
    with TorchEngine(model, max_rows=8, max_len=96) as engine:
        outs = engine.generate(reqs)
    rolls = [Rollout(group_id=r.id.split("/")[0], prompt_ids=r.prompt_ids, response_ids=c.response_ids,
                     logprobs=c.logprobs, versions=c.versions, loss_mask=[1] * len(c.response_ids), finish=c.finish,
                     reward=0.0, media=r.media) for r, c in zip(reqs, outs)]
    batch = TrainBatch.from_rollouts(rolls, [float(i % 3) - 1.0 for i in range(len(rolls))])
    cfg = load_config(**{"device": "cpu", "model": "unused", "run_dir": "unused", "data.train": "gen:arithmetic?n=10",
                         "rollout.samples_per_prompt": 3, "rollout.max_new_tokens": 8, "train.lr": 1e-2})
    trainer = Trainer(copy.deepcopy(model), cfg, device=torch.device("cpu"))
    m = batch.mask_BT
    assert torch.allclose(trainer.logprobs(batch)[m], batch.behav_logp_BT[m], atol=1e-4)
    blind = copy.copy(batch)
    blind.media = None  # the same tokens without their images: other logprobs
    assert (trainer.logprobs(blind)[m] - batch.behav_logp_BT[m]).abs().max() > 1e-2
    vision = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "vision" in n or "visual" in n}
    assert vision
    trainer.train_step(batch)
    moved = {n for n, p in trainer.model.named_parameters() if n in vision and not torch.equal(p, vision[n])}
    assert len(moved) > len(vision) // 2


def _mixed_batch(arch: str, image_groups: int, text_groups: int, seed: int):
    """Groups of 3 samples: some prompts with an image, some with text only."""
    from rollover.train.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    prompts = rendered(arch, list(range(seed, seed + image_groups)))
    units = prompts + [([5, 6, 7, 8, 9 + k], None) for k in range(text_groups)]
    rolls, advs = [], []
    for gi, (ids, m) in enumerate(units):
        for _ in range(3):
            n = int(torch.randint(2, 7, (1,), generator=g))
            rolls.append(Rollout(group_id=f"g{gi}", prompt_ids=ids, response_ids=torch.randint(3, 20, (n,), generator=g).tolist(),
                                 logprobs=(-torch.rand(n, generator=g) - 0.5).tolist(), versions=[0] * n,
                                 loss_mask=[1] * n, finish="stop", reward=0.0, media=m))
            advs.append(float(torch.randn(1, generator=g)))
    return TrainBatch.from_rollouts(rolls, advs)


@pytest.mark.parametrize("arch,over", [("llava", {}), ("qwen2_5_vl", {"train.mini_batches": 2})])
def test_sharded_ranks_train_on_images_as_one_trainer(arch, over):
    """train.parallel=fsdp: a rank whose pass has no image of its own runs the vision tower on a
    stand-in image at zero weight (its peers' passes gather and reduce the tower's layers; without
    it gloo aborts), and N ranks train as one trainer. An update with no image anywhere (the second
    mini-batch of a step) runs no tower, so its weights get no gradient there either. LLaVA takes
    the features of CLIP's last layer but one (its default): the last layer, which no real image's
    pass trains, must get no gradient from a stand-in pass either."""
    from test_fsdp import assert_same_update, cfg_of, weights

    from rollover.train.fsdp import split_batch
    from rollover.train.ranks import ShardedTrainer
    from rollover.train.trainer import Trainer

    cfg = cfg_of(**{"train.ranks": 2, **over})
    model = tiny_vl_model(arch, seed=3)
    if arch == "llava":
        model.config.vision_feature_layer = -2
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    plain = Trainer(copy.deepcopy(model), cfg, device=torch.device("cpu"))
    sharded = ShardedTrainer(copy.deepcopy(model), cfg, pad_id=0)
    try:
        for b in [_mixed_batch(arch, 1, 3, seed=0), _mixed_batch(arch, 2, 0, seed=1), _mixed_batch(arch, 0, 2, seed=2)]:
            if b.media is not None and any(m is None for m in b.media):  # one rank's share holds no image
                assert any(all(b.media[i] is None for i in share) for share in split_batch(b, 2))
            mp, ms = plain.train_step(b), sharded.train_step(b)
            for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
                assert ms[k] == pytest.approx(mp[k], rel=1e-5, abs=1e-7), k
            got, want = weights(sharded), weights(plain)
            # a key's bias has no gradient in exact arithmetic (it adds one constant to a query's scores):
            # Adam turns the two orders of summing its rounding noise into lr-sized steps of either sign
            keep = [k for k in want if not k.endswith("k_proj.bias")]
            assert_same_update(*({k: w[k] for k in keep} for w in (want, got, start)), cfg.train.lr)
            start = want
    finally:
        sharded.close()


def _color_rows(tmp_path, n: int = 24) -> str:
    from PIL import Image

    colors = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220)}
    tmp_path.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        name = list(colors)[i % 3]
        Image.new("RGB", (28, 28), colors[name]).save(tmp_path / f"img{i}.png")
        lines.append(json.dumps({"prompt": f"Which color? ({i})", "images": [f"img{i}.png"], "answer": name}))
    (tmp_path / "colors.jsonl").write_text("\n".join(lines) + "\n")
    return str(tmp_path / "colors.jsonl")


def _cfg(tmp_path, model_dir, **over):
    return load_config(**{
        "device": "cpu", "model": str(model_dir), "run_dir": str(tmp_path / "run"), "steps": 2, "seed": 7,
        "data.train": _color_rows(tmp_path), "data.eval_size": 4, "data.max_prompt_tokens": 64,
        "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 3, "rollout.max_new_tokens": 8,
        "rollout.max_rows": 8, "reward.functions": ["exact"], "train.lr": 1e-3, "eval.every": 2,
        "checkpoint.every": 2, "logging.progress": False, "logging.tensorboard": False, **over})


def test_a_run_with_images_trains_evaluates_checkpoints_and_exports(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rollover.export import export
    from rollover.loops.sync import train_sync

    model_dir = save_tiny_vl_model(tmp_path / "llava", seed=3)
    result = train_sync(_cfg(tmp_path, model_dir))
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and result["eval/samples"] == 16
    assert all(0 <= r["actor/rollout_kl"] < 1e-6 for r in train)
    export(tmp_path / "run", tmp_path / "out")
    assert type(AutoModelForImageTextToText.from_pretrained(tmp_path / "out")).__name__ == "LlavaForConditionalGeneration"
    assert hasattr(AutoProcessor.from_pretrained(tmp_path / "out"), "image_processor")


@pytest.mark.parametrize("mode", ["april", "async"])
def test_april_and_async_runs_carry_images_with_their_requests(tmp_path, mode):
    """APRIL resubmits cut samples, which prefill again with their images (also after a resume
    from a checkpoint holding them); async mode draws prompts on its own thread. No sample is
    right here (all rewards 0), so the weights stay as they are and every token's logprob must
    be the trainer's: one prefilled without its images would not be."""
    from rollover.loops.async_ import train_async
    from rollover.loops.sync import train_sync

    model_dir = save_tiny_vl_model(tmp_path / "llava", seed=3)
    over = ({"partial_rollout.enabled": True, "partial_rollout.carry": "resubmit", "rollout.max_new_tokens": 24,
             "steps": 3} if mode == "april" else {"mode": "async", "steps": 3})
    cfg = _cfg(tmp_path, model_dir, **over)
    (train_sync if mode == "april" else train_async)(cfg)
    if mode == "april":
        train_sync(cfg.model_copy(update={"steps": 4}))  # resumed from step 2's checkpoint, its carried samples
    train = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if r["kind"] == "train"]
    assert [r["step"] for r in train] == ([1, 2, 3, 4] if mode == "april" else [1, 2, 3])
    assert all(r["reward/mean"] == 0 and r["actor/rollout_kl"] < 1e-6 for r in train)
    if mode == "april":
        assert sum(r["rollout/carried_partial_samples"] for r in train) > 0


def test_a_sharded_run_with_images_on_the_ranks_engines_ends_with_one_trainers_weights(tmp_path):
    """train.parallel=fsdp with train.colocate: each rank's own engine prefills its requests'
    images, and the run trains what the one-trainer run trains, step by step."""
    from test_fsdp import assert_same_update
    from transformers import AutoModelForImageTextToText

    from rollover.loops.sync import train_sync

    model_dir = save_tiny_vl_model(tmp_path / "llava", seed=3)
    (tmp_path / "parity.py").write_text(  # a tiny random model never names a colour: a reward it earns about half the time
        "def parity(completion, answer=None, **_):\n    return float(sum(map(ord, completion)) % 2)\n")
    over = {"reward.functions": [f"{tmp_path / 'parity.py'}:parity"], "train.lr": 1e-2}
    train_sync(_cfg(tmp_path / "one", model_dir, **over))
    train_sync(_cfg(tmp_path / "two", model_dir, **over, **{"train.parallel": "fsdp", "train.ranks": 2,
                                                             "train.colocate": True}))
    rows = [[r for r in map(json.loads, open(tmp_path / d / "run" / "metrics.jsonl")) if r["kind"] == "train"]
            for d in ("one", "two")]
    assert all(r["actor/grad_norm"] > 0 and r["actor/rollout_kl"] < 1e-6 for r in rows[1])
    for a, b in zip(*rows):
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-4)
    # the ranks write the modules' own names, transformers' save_pretrained its older ones: both load
    one, two = (AutoModelForImageTextToText.from_pretrained(tmp_path / d / "run" / "checkpoints" / "step_000002" / "model")
                .state_dict() for d in ("one", "two"))
    start = AutoModelForImageTextToText.from_pretrained(model_dir).state_dict()
    assert_same_update(one, two, start, over["train.lr"])


def test_episodes_whose_environment_shows_images_train_on_them(tmp_path):
    """An environment whose opening and replies hold images: each turn prefills the episode's
    images so far, the trainer runs the episode with all of them, and every sampled token's
    logprob is the trainer's (a turn prefilled without an image, or the trainer without one,
    would not be); the samples log writes "<image>" for each image. APRIL carries cut turns
    into the next step, resumed with the episode's images. The tasks are dataset rows with
    images, which the environment shows in its opening (`Prompt.images`)."""
    from pathlib import Path

    from rollover.loops.sync import train_sync
    from rollover.metrics.samples import samples_path

    model_dir = save_tiny_vl_model(tmp_path / "llava", seed=3)
    fixtures = Path(__file__).with_name("env_fixtures.py")
    over = {"partial_rollout.enabled": True, "partial_rollout.carry": "resubmit", "steps": 3}
    cfg = load_config(**{
        "device": "cpu", "model": str(model_dir), "run_dir": str(tmp_path / "run"), "steps": 2, "seed": 7,
        "data.train": _color_rows(tmp_path, 8), "data.eval_size": 2, "data.max_prompt_tokens": 64,
        "env.name": f"{fixtures}:SeeColors",
        "env.max_turns": 2, "env.max_total_tokens": 160, "env.inline": True, "rollout.prompts_per_step": 2,
        "rollout.samples_per_prompt": 2, "rollout.max_new_tokens": 8, "rollout.max_rows": 8, "train.lr": 1e-3,
        "eval.every": 2, "eval.samples_per_prompt": 2, "checkpoint.every": 2, "logging.progress": False,
        "logging.tensorboard": False, "logging.samples": 1, **over})
    train_sync(cfg)
    train = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if r["kind"] == "train"]
    assert all(r["actor/rollout_kl"] < 1e-6 for r in train)
    assert max(r["rollout/env/turns_mean"] for r in train) > 1  # a second turn, after an image in the reply
    samples = [json.loads(x) for x in open(samples_path(tmp_path / "run", 1))][1:]
    replies = [t["messages"][1] for s in samples for t in s["turns"] if len(t["messages"]) > 1]
    assert replies and all(p == {"type": "image", "image": "<image>"} for m in replies for p in m["content"]
                           if p["type"] == "image")
    assert sum(r["rollout/carried_partial_samples"] for r in train) > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_an_episodes_images_are_the_whole_conversations_and_the_engine_and_trainer_see_them(arch):
    """An opening with an image, a sampled turn, a reply with another image of another size: the
    episode's images equal the processor's for the whole conversation at once (same order, same
    pixels, Qwen's grids), and the next turn, prefilled with both, samples from the model's own
    distribution given both (Qwen's 3-D positions after the second image included), which the
    trainer's logprobs equal."""
    from rollover.data.media import Media
    from rollover.envs.render import MediaChatRenderer
    from rollover.train.batch import TrainBatch
    from rollover.train.trainer import Trainer

    processor, model = vl_processor(arch), tiny_vl_model(arch, seed=1)
    renderer = MediaChatRenderer(processor)
    opening = [{"role": "user", "content": [{"type": "image", "image": image(0)}, {"type": "text", "text": "Which?"}]}]
    reply = [{"role": "user", "content": [{"type": "text", "text": "No. This:"}, {"type": "image", "image": image(1, 84)}]}]
    ids, media = renderer.initial_media(opening)
    sp = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True, seed=1)
    with TorchEngine(model, max_rows=4, max_len=400) as engine:
        first = engine.generate([Request(id="t1", prompt_ids=ids, sampling=sp, media=media)])[0]
        inserted, more = renderer.insertion_media(opening, first.response_ids, reply)
        ids, media = ids + first.response_ids + inserted, Media.join(media, more)
        second = engine.generate([Request(id="t2", prompt_ids=ids, sampling=SamplingParams(**{**sp.__dict__, "seed": 2}),
                                          media=media)])[0]
    whole = processor(text=[processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which?"}]},
         {"role": "assistant", "content": "x"},
         {"role": "user", "content": [{"type": "text", "text": "No. This:"}, {"type": "image"}]}],
        add_generation_prompt=True, tokenize=False)], images=[image(0), image(1, 84)], return_tensors="pt")
    assert media.count == 2 and set(media.inputs) <= set(whole)
    assert all(torch.equal(media.inputs[k], whole[k]) for k in media.inputs)
    token = processor.image_token_id
    assert ids.count(token) == whole["input_ids"][0].tolist().count(token)
    ref = own_logprobs(model, ids, second.response_ids, media, token)
    assert torch.allclose(torch.tensor(second.logprobs), ref, atol=1e-4)
    n = len(first.response_ids) + len(inserted)
    roll = Rollout(group_id="g", prompt_ids=ids[:-n], response_ids=ids[-n:] + second.response_ids,
                   logprobs=first.logprobs + [0.0] * len(inserted) + second.logprobs, versions=[0] * (n + 4),
                   loss_mask=[1] * len(first.response_ids) + [0] * len(inserted) + [1] * 4, finish="length",
                   reward=0.0, media=media)
    batch = TrainBatch.from_rollouts([roll], [1.0])
    cfg = load_config(**{"device": "cpu", "model": "unused", "run_dir": "unused", "data.train": "gen:arithmetic?n=10",
                         "rollout.max_new_tokens": 400})
    got = Trainer(copy.deepcopy(model), cfg, device=torch.device("cpu")).logprobs(batch)[0]
    m = batch.mask_BT[0]
    assert torch.allclose(got[m], batch.behav_logp_BT[0][m], atol=1e-4) and bool(torch.isfinite(got).all())


def test_images_in_an_environments_messages_that_cannot_be_shown_fail_its_episode():
    """A model without images (the text renderer) or an image part without its image: the
    renderer raises TemplateError, which fails the episode naming it (not the run)."""
    from jinja2.exceptions import TemplateError

    from rollover.envs.render import ChatRenderer, MediaChatRenderer

    processor = vl_processor("llava")
    shown = [{"role": "user", "content": [{"type": "image", "image": image(0)}, {"type": "text", "text": "Which?"}]}]
    with pytest.raises(TemplateError, match="hold images, which this model does not take"):
        ChatRenderer(processor.tokenizer).initial_media(shown)
    media = MediaChatRenderer(processor)
    ids, m = media.initial_media(shown)
    assert m.count == 1 and ids.count(processor.image_token_id) == 4
    with pytest.raises(TemplateError, match="message 0: an image part without its image"):
        media.insertion_media(shown, [5, 6], [{"role": "user", "content": [{"type": "image"}]}])
    with pytest.raises(TemplateError, match="1 image placeholders in the rendered text for 0 images"):
        media.insertion_media(shown, [5, 6], [{"role": "tool", "content": "it said <image>"}])
    with pytest.raises(TemplateError, match="image 0: .*no file"):
        media.initial_media([{"role": "user", "content": [{"type": "image", "image": "missing.png"}]}])
    raw = io.BytesIO()
    image(2).save(raw, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(raw.getvalue()).decode()
    _, m2 = media.initial_media([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
    assert m2.key == media.initial_media([{"role": "user", "content": [{"type": "image", "image": image(2)}]}])[1].key


def test_modes_that_do_not_take_images_yet_are_refused_before_anything_starts(tmp_path):
    from rollover.loops.build import build_run

    model_dir = save_tiny_vl_model(tmp_path / "llava", seed=3)
    with pytest.raises(ConfigError, match=r"24 prompts have images; .* not with rollout.engine=vllm$"):
        build_run(_cfg(tmp_path, model_dir, **{"rollout.engine": "vllm"}))
    with pytest.raises(ValueError, match="no stand-in image is known"):  # a sharded trainer's rank needs one
        stand_in_image(tiny_model("llama").config)
    with pytest.raises(ConfigError, match="no image processor|processor does not load"):
        build_run(_cfg(tmp_path, save_tiny_model_dir(tmp_path)))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def save_tiny_model_dir(tmp_path):
    from rollover.testing import save_tiny_model

    return save_tiny_model(tmp_path / "text", "llama")


def test_rows_and_processors_that_cannot_work_are_named(tmp_path):
    from rollover.data.media import Media

    rows = [{"prompt": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
             "answer": "x"},  # parts without images: the text as it reads
            {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what"}]}],
             "answer": "y"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(Exception, match="line 2: the prompt has image parts but the row no images"):
        load_prompts(path)
    assert load_prompts(path, on_bad_row="skip").prompts[0].messages == [{"role": "user", "content": "ab"}]
    renderer = MediaRenderer(vl_processor("qwen2_5_vl"))
    with pytest.raises(ValueError, match=r"prompt 9: the processor refused its 1 images \(StopIteration"):
        renderer.render([{"role": "user", "content": "a <|image_pad|> b"}], [image(0)], where="prompt 9")

    class PerToken:  # Gemma 3's processor: token types that make its image tokens attend both ways
        image_processor = None

        def apply_chat_template(self, messages, **kw):
            return "x"

        def __call__(self, **kw):
            return {"input_ids": torch.ones(1, 6, dtype=torch.long), "pixel_values": torch.zeros(1, 3, 4, 4),
                    "token_type_ids": torch.zeros(1, 6, dtype=torch.long)}

    with pytest.raises(ValueError, match=r"per-token inputs \(token_type_ids\)"):
        MediaRenderer(PerToken()).render([{"role": "user", "content": "q"}], [image(0)], where="p")
    a, b = Media.of({"pixel_values": torch.zeros(1, 2, 3)}, 1), Media.of({"pixel_values": torch.zeros(1, 3, 3)}, 1)
    with pytest.raises(ValueError, match=r"pixel_values of shapes \[\(2, 3\), \(3, 3\)\]"):
        Media.concat([a, None, b])


def test_a_model_that_arrives_pickled_records_its_vision_towers_outputs():
    """A trainer actor (ray.trainer: actor) gets its model pickled: transformers' note of what a
    CLIP tower can record is made when a model is built, so LLaVA's tower gave no hidden states
    there until the trainer restores it."""
    from transformers.utils import output_capturing

    from rollover.train.batch import TrainBatch
    from rollover.train.trainer import Trainer

    model = tiny_vl_model("llava", seed=1)
    (ids, media), = rendered("llava", [0])
    registry = output_capturing._CAN_RECORD_REGISTRY
    clip = str(type(model.model.vision_tower))
    saved = registry.pop(clip)  # as in a process that unpickled the model
    roll = Rollout(group_id="g", prompt_ids=ids, response_ids=[10, 11, 12], logprobs=[-1.0] * 3, versions=[0] * 3,
                   loss_mask=[1] * 3, finish="stop", reward=0.0, media=media)
    cfg = load_config(**{"device": "cpu", "model": "unused", "run_dir": "unused", "data.train": "gen:arithmetic?n=10"})
    try:
        trainer = Trainer(model, cfg, device=torch.device("cpu"))
        assert registry.get(clip) is not None
        assert torch.isfinite(trainer.logprobs(TrainBatch.from_rollouts([roll], [1.0]))).all()
    finally:
        registry[clip] = saved


def test_prompts_of_the_same_text_with_other_images_are_other_prompts(tmp_path):
    """A train and an eval file of the same name whose rows ask the same text of other images are
    refused as one id naming two prompts (the held-out images would train under the training
    answers); and carving a held-out set tells such rows apart (none is lost from training)."""
    from rollover.config import ConfigError
    from rollover.data import split_holdout
    from rollover.loops.build import build_run
    from rollover.types import Prompt

    model_dir = save_tiny_vl_model(tmp_path / "llava", seed=3)
    train = _color_rows(tmp_path / "train", 6)
    held = Path(_color_rows(tmp_path / "test", 7)).read_text().splitlines()[1:]  # the same texts, shifted images
    held = [json.dumps({**json.loads(line), "prompt": f"Which color? ({i})"}) for i, line in enumerate(held)]
    (tmp_path / "test" / "colors.jsonl").write_text("\n".join(held) + "\n")
    with pytest.raises(ConfigError, match=r"prompt id 'colors:0' names two different prompts in data.train and data.eval"):
        build_run(_cfg(tmp_path, model_dir, **{"data.train": train, "data.eval": str(tmp_path / "test" / "colors.jsonl"),
                                               "data.eval_size": 2}), record=False)
    rows = [Prompt(id=f"r{i}", text="Which color?", images=[f"/img{i}.png"], answer=str(i)) for i in range(12)]
    kept, out = split_holdout(rows, 0.1, seed=0)
    assert len(kept) + len(out) == 12 and len(out) == 2


def test_a_text_row_that_writes_the_image_placeholder_is_a_bad_row(tmp_path):
    """A row without images whose text holds the processor's image token (`<image>`) would have the
    forward look for image features there, failing the step that trains it beside image rows:
    it is a bad row at start-up, named (skipped under data.on_bad_row=skip)."""
    from rollover.config import ConfigError
    from rollover.loops.build import build_run

    model_dir = save_tiny_vl_model(tmp_path / "llava", seed=3)
    rows = Path(_color_rows(tmp_path / "rows", 6)).read_text()
    (tmp_path / "rows" / "mixed.jsonl").write_text(rows + json.dumps({"prompt": "What is the HTML <image> tag?",
                                                                      "answer": "img"}) + "\n")
    over = {"data.train": str(tmp_path / "rows" / "mixed.jsonl"), "data.eval_size": 0}
    with pytest.raises(ConfigError, match=r"prompt 'mixed:6' has no images but its text writes the image "
                                          r"placeholder '<image>'; drop the row or set data.on_bad_row=skip"):
        build_run(_cfg(tmp_path, model_dir, **over), record=False)
    run = build_run(_cfg(tmp_path, model_dir, **over, **{"data.on_bad_row": "skip"}), record=False)
    try:
        assert "mixed:6" not in run.prompt_ids and len(run.prompt_ids) == 6
    finally:
        run.close()
