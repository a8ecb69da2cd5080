"""`logging.samples`: what each step trained on, in RUN_DIR/samples/, and `rollover show`
(tiny random models, CPU)."""

from __future__ import annotations

import json

import pytest

from rollover.cli import main
from rollover.config import load_config
from rollover.metrics import samples as samples_mod
from rollover.metrics.samples import mask_spans, read_samples, remove_after, render, written_steps
from rollover.models import load_tokenizer
from rollover.testing import save_tiny_model
from rollover.types import Prompt


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama", seed=21))


def cfg_for(model_dir, run_dir, **over):
    base = {
        "device": "cpu", "model": model_dir, "run_dir": str(run_dir), "steps": 2, "seed": 5,
        "data.train": "gen:arithmetic?n=60", "data.eval_size": 2, "data.max_prompt_tokens": 64,
        "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2, "rollout.max_new_tokens": 6,
        "rollout.max_rows": 4,
        "reward.functions": ["numeric", {"fn": "format", "weight": 0.5, "kwargs": {"pattern": "[0-9]"}}],
        "algorithm.mask_truncated": True,  # truncated samples train no token: empty spans
        "train.lr": 1e-3, "eval.every": 0, "eval.at_start": False, "eval.samples_per_prompt": 1,
        "checkpoint.every": 0, "logging.progress": False, "logging.tensorboard": False, "logging.samples": 1,
    }
    base.update(over)
    return load_config(**base)


def recording(monkeypatch) -> dict:
    """Wrap the loops' `log_samples` (called by `record_step`) to keep each step's (groups, batch)
    as the loop had them."""
    import rollover.loops.batch as module

    seen = {}
    real = module.log_samples

    def spy(run, step, groups, batch, *rest):
        seen[step] = (groups, batch)
        real(run, step, groups, batch, *rest)

    monkeypatch.setattr(module, "log_samples", spy)
    return seen


@pytest.fixture(scope="module")
def sync_run(model_dir, tmp_path_factory):
    """A 2-step sync run writing every step's samples: (run_dir, {step: (groups, batch)})."""
    import rollover.loops.sync as sync

    run_dir = tmp_path_factory.mktemp("sync") / "run"
    with pytest.MonkeyPatch.context() as mp:
        seen = recording(mp)
        sync.train_sync(cfg_for(model_dir, run_dir))
    return run_dir, seen


def test_mask_spans_are_runs_of_ones():
    assert mask_spans([0, 1, 1, 0, 1]) == [[1, 3], [4, 5]]
    assert mask_spans([1, 1, 1]) == [[0, 3]]
    assert mask_spans([0, 0]) == [] and mask_spans([]) == []


def test_off_by_default():
    assert load_config(model="m").logging.samples == 0


def test_sync_samples_round_trip(model_dir, sync_run):
    run_dir, seen = sync_run
    assert written_steps(run_dir) == [1, 2]
    assert sorted(p.name for p in (run_dir / "samples").iterdir()) == ["step_000001.jsonl", "step_000002.jsonl"]
    tok = load_tokenizer(model_dir)
    ledger = [json.loads(x) for x in open(run_dir / "trained_groups.jsonl")]
    for step in (1, 2):
        _, header, rows = read_samples(run_dir, step)
        groups, batch = seen[step]
        flat = [(g, j, r) for g in groups for j, r in enumerate(g.rollouts)]
        assert header["step"] == step and header["samples"] == len(rows) == len(flat) == len(batch)
        assert [g["group"] for g in header["groups"]] == [g["group"] for g in ledger[step - 1]["groups"]]
        assert set(header["dropped"]) >= {"filtered_groups", "skipped_groups"}
        for row, (g, j, r), adv in zip(rows, flat, batch.adv_B.tolist()):
            assert (row["group"], row["sample"], row["prompt_id"]) == (g.id, j, g.prompt.id)
            assert row["prompt_ids"] == r.prompt_ids and row["response_ids"] == r.response_ids
            assert tok.decode(row["prompt_ids"], skip_special_tokens=False) == row["prompt"]
            assert tok.decode(row["response_ids"], skip_special_tokens=False) == row["response"]
            assert row["loss_mask"] == mask_spans(r.loss_mask)
            assert row["reward"] == pytest.approx(r.reward) and row["scores"] == pytest.approx(r.scores)
            assert set(row["scores"]) == {"numeric", "format"}
            assert row["advantage"] == pytest.approx(adv) and row["trained"] and row["dropped"] is None
            assert row["finish"] == r.finish
            assert row["logprob_min"] == pytest.approx(min(r.logprobs))
            assert row["logprob_mean"] == pytest.approx(sum(r.logprobs) / len(r.logprobs))
            assert row["version_min"] == row["version_max"] == step - 1  # sync: the weights before the step
    every = [row for s in (1, 2) for row in read_samples(run_dir, s)[2]]
    assert any(row["finish"] == "length" for row in every)  # 6 tokens: some were truncated ...
    assert all(row["loss_mask"] == [] for row in every if row["finish"] == "length")  # ... and train nothing


def test_samples_left_out_by_down_sampling_are_marked(model_dir, tmp_path, monkeypatch):
    import rollover.loops.sync as sync

    seen = recording(monkeypatch)
    sync.train_sync(cfg_for(model_dir, tmp_path, steps=1, **{"rollout.samples_per_prompt": 4, "downsample.keep": 2}))
    _, header, rows = read_samples(tmp_path)
    _, batch = seen[1]
    trained = [r for r in rows if r["trained"]]
    assert header["trained_samples"] == len(trained) == len(batch) == 4 and len(rows) == 8
    assert all(r["dropped"] == "downsample" for r in rows if not r["trained"])
    assert [r["response_ids"] for r in trained] == batch.response_ids
    assert [r["advantage"] for r in trained] == pytest.approx(batch.adv_B.tolist())


def test_show_prints_the_latest_or_a_chosen_step(sync_run, capsys):
    run_dir, _ = sync_run
    assert main(["show", str(run_dir)]) == 0
    out = capsys.readouterr().out
    _, _, rows = read_samples(run_dir, 2)
    assert out.startswith("step 2: 2 groups, 4 samples, 4 trained")
    assert f"=== group {rows[0]['group']}" in out and "reward " in out and "numeric " in out and "adv " in out
    assert main(["show", str(run_dir), "--step", "1", "--full"]) == 0
    out = capsys.readouterr().out
    _, _, rows = read_samples(run_dir, 1)
    assert out.startswith("step 1:") and rows[0]["prompt"].splitlines()[-1] in out
    assert main(["show", str(run_dir), "--step", "7"]) == 1
    assert "no samples of step 7; written: steps 1, 2" in capsys.readouterr().err


def test_show_without_samples_names_the_directory_and_the_key(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(["show", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'samples'}: no samples written" in err and "logging.samples" in err
    assert main(["show", str(tmp_path / "nowhere")]) == 1
    assert "no such run directory" in capsys.readouterr().err
    (tmp_path / "elsewhere").mkdir()
    assert main(["show", str(tmp_path / "elsewhere")]) == 1
    assert f"{tmp_path / 'elsewhere'}: not a run directory" in capsys.readouterr().err


def test_show_names_the_line_of_a_damaged_samples_file(sync_run, capsys, tmp_path):
    import shutil

    run_dir = tmp_path / "copy"
    shutil.copytree(sync_run[0], run_dir)
    path = next((run_dir / "samples").glob("step_*2.jsonl"))
    path.write_text(path.read_text().replace("{", "{{", 1).replace("\n", "\n{oops\n", 1))
    assert main(["show", str(run_dir)]) == 1
    assert f"{path} line 1: not valid JSON" in capsys.readouterr().err


def test_a_column_json_cannot_write_is_named_by_filter():
    import datetime

    from rollover.curate import rows_of

    prompts = [Prompt(id="p0", text="q", answer="1", fields={"when": datetime.datetime(2020, 1, 1), "n": 3})]
    with pytest.raises(ValueError, match=r"prompt p0: column 'when' cannot be written as JSON"):
        rows_of(prompts, "prompt", None)


def test_filter_writes_a_rows_images_as_the_loader_reads_them_back(tmp_path):
    """`rollover filter`'s rows keep their images: paths (absolute), other images as data URLs."""
    from PIL import Image

    from rollover.curate import rows_of
    from rollover.data import load_prompts

    Image.new("RGB", (4, 4), (200, 10, 10)).save(tmp_path / "a.png")
    png = (tmp_path / "a.png").read_bytes()
    prompts = [Prompt(id="p0", text="color?", answer="red", images=[str(tmp_path / "a.png"), png])]
    (row,) = rows_of(prompts, "prompt", None)
    assert row["images"][0] == str(tmp_path / "a.png") and row["images"][1].startswith("data:image;base64,")
    (tmp_path / "kept.jsonl").write_text(json.dumps(row) + "\n")
    (back,) = load_prompts(str(tmp_path / "kept.jsonl")).prompts
    assert back.images == [str(tmp_path / "a.png"), png]


def test_show_cuts_long_texts_unless_full():
    row = {"group": "g0", "prompt_id": "p", "sample": 0, "trained": True, "dropped": None, "reward": 1.0,
           "scores": {"numeric": 1.0}, "advantage": 0.5, "finish": "stop", "version_min": 0, "version_max": 0,
           "prompt": "Q" * 1000, "response": "A" * 5000 + "END", "response_ids": [1, 2]}
    header = {"kind": "step", "step": 3, "samples": 1, "trained_samples": 1,
              "groups": [{"group": "g0", "prompt_id": "p", "samples": 1, "failed_samples": 0}]}
    short = render(3, header, [row])
    assert "not trained this step" not in short
    assert "filtered_groups 2" in render(3, {**header, "dropped": {"filtered_groups": 2, "skipped_groups": 0}}, [row])
    assert "chars cut" in short and "END" in short and len(short) < 2000
    assert "A" * 5000 in render(3, header, [row], full=True)


def test_the_file_is_utf8_whatever_the_decoder_gave(tmp_path):
    path = samples_mod.write_samples(tmp_path, 5, [{"kind": "step", "step": 5, "text": "caf\u00e9 \ufffd \udcff"}])
    assert path.name == "step_000005.jsonl"
    assert json.loads(path.read_bytes().decode("utf-8"))["text"] == "caf\u00e9 \ufffd ?"


def test_a_value_json_cannot_hold_is_written_as_text(tmp_path):
    """An environment's message may carry a key the chat template ignores (a datetime): the step
    trained, so its samples file is written (as str), not the run ended by json's TypeError."""
    import datetime

    when = datetime.datetime(2026, 12, 2, 1, 2, 3)
    path = samples_mod.write_samples(tmp_path, 1, [{"turns": [{"messages": [{"role": "user", "content": "x", "sent_at": when}]}]}])
    row = json.loads(path.read_text())
    assert row["turns"][0]["messages"][0]["sent_at"] == "2026-12-02 01:02:03"


def test_resume_removes_the_samples_of_later_steps(tmp_path):
    for step in (1, 2, 3):
        samples_mod.write_samples(tmp_path, step, [{"kind": "step", "step": step}])
        samples_mod.write_samples(tmp_path, step, [{"kind": "eval", "step": step}], "eval")
    (tmp_path / "samples" / ".step_000004.jsonl-torn").write_text("{")
    assert remove_after(tmp_path, 2) == 2
    assert written_steps(tmp_path) == written_steps(tmp_path, "eval") == [1, 2]
    assert len(list((tmp_path / "samples").iterdir())) == 4


def test_episode_rows_hold_the_turns(model_dir, tmp_path):
    from rollover.loops.sync import train_sync

    cfg = cfg_for(model_dir, tmp_path, steps=1, **{
        "data.train": "env", "data.max_prompt_tokens": 256, "env.name": "guess_number",
        "env.options": {"low": 1, "high": 8, "max_guesses": 3}, "env.max_total_tokens": 400,
        "rollout.max_rows": 8, "algorithm.mask_truncated": False, "logging.eval_samples": 1})
    train_sync(cfg)
    _, header, held = read_samples(tmp_path, 1, "eval")  # the evaluation at the end: one held-out game
    assert header["samples"] == len(held) == 1 and held[0]["turns"] and held[0]["correct"] == (held[0]["reward"] >= 1.0)
    _, header, rows = read_samples(tmp_path)
    assert len(rows) == 4 and header["samples"] == 4
    for row in rows:
        assert row["turns"] and row["scores"] == {"env": row["reward"]}
        for turn in row["turns"]:
            assert turn["messages"][0]["role"] == "assistant"
            assert all({"role", "content"} <= set(m) for m in turn["messages"])
        # the policy sampled exactly the turns' tokens; the environment's replies train nothing
        assert row["loss_mask"] == [t["span"] for t in row["turns"] if t["span"][1] > t["span"][0]]
        assert row["reward"] == pytest.approx(sum(t["reward"] for t in row["turns"]))
        if len(row["turns"]) > 1:
            assert any(m["role"] != "assistant" for m in row["turns"][0]["messages"])


def test_async_loop_writes_samples_every_n_steps(model_dir, tmp_path, monkeypatch):
    import rollover.loops.async_ as async_loop

    seen = recording(monkeypatch)
    async_loop.train_async(cfg_for(model_dir, tmp_path, steps=3, mode="async", **{"logging.samples": 2}))
    assert written_steps(tmp_path) == [2]
    _, header, rows = read_samples(tmp_path)
    groups, batch = seen[2]
    assert "dropped" not in header and len(rows) == len(batch)
    assert [r["response_ids"] for r in rows] == [r.response_ids for g in groups for r in g.rollouts]
    assert all(r["version_max"] <= 1 for r in rows)  # trained at step 2: sampled by weights 0 or 1


def test_eval_samples_are_written_at_every_evaluation_and_shown(model_dir, tmp_path, capsys):
    """logging.eval_samples: the held-out samples of the first N prompts, with the reward, its
    parts and whether each is correct; their share correct is the evaluation's accuracy when N
    covers every held-out prompt."""
    from rollover.loops.sync import train_sync

    train_sync(cfg_for(model_dir, tmp_path, **{"eval.at_start": True, "eval.samples_per_prompt": 2,
                                               "logging.eval_samples": 2, "logging.samples": 0}))
    assert written_steps(tmp_path, "eval") == [0, 2] and written_steps(tmp_path) == []
    evals = {r["step"]: r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if r["kind"] == "eval"}
    for step in (0, 2):
        _, header, rows = read_samples(tmp_path, step, "eval")
        assert header["kind"] == "eval" and header["samples"] == len(rows) == 4
        for r in rows:
            assert r["trained"] is False and r["advantage"] is None and r["loss_mask"] == []
            assert r["correct"] == (r["scores"]["numeric"] >= 1.0)
            assert r["reward"] == pytest.approx(r["scores"]["numeric"] + 0.5 * r["scores"]["format"])
        assert sum(r["correct"] for r in rows) / 4 == pytest.approx(evals[step]["eval/accuracy"])
    assert main(["show", str(tmp_path), "--eval"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("evaluation after step 2: 2 held-out prompts, 4 samples,") and "correct" in out
    assert main(["show", str(tmp_path), "--eval", "--step", "1"]) == 1
    assert "no held-out samples of step 1; written: steps 0, 2" in capsys.readouterr().err


def test_a_gdpo_run_trains_on_the_advantages_of_its_functions_scores(model_dir, tmp_path):
    """algorithm.advantage=gdpo: each logged sample's advantage is GDPO recomputed from the logged
    per-function scores and the config's weights (the wiring: scores, names, weights, groups)."""
    import math

    import torch

    import rollover.loops.sync as sync
    from rollover.algos.advantages import gdpo

    run_dir = tmp_path / "gdpo"
    sync.train_sync(cfg_for(model_dir, run_dir, **{"algorithm.advantage": "gdpo", "rollout.prompts_per_step": 3,
                                                   "rollout.samples_per_prompt": 4, "algorithm.mask_truncated": False}))
    moved = 0
    for step in (1, 2):
        _, _, rows = read_samples(run_dir, step)
        names = {"numeric": 1.0, "format": 0.5}
        scores = torch.tensor([[r["scores"].get(n, math.nan) for n in names] for r in rows], dtype=torch.float32)
        groups = sorted({r["group"] for r in rows})
        gid = torch.tensor([groups.index(r["group"]) for r in rows])
        want, _ = gdpo(scores, torch.tensor(list(names.values())), gid)
        assert [r["advantage"] for r in rows] == pytest.approx(want.tolist(), abs=1e-5)
        moved += int((want != 0).sum())
    assert moved > 0  # some group's scores moved: the check compared non-zero advantages


def test_stop_strings_end_the_trained_responses(model_dir, tmp_path):
    """rollout.stop in a run: the engine gets the model's tokenizer, and every response ends at
    the first token that completes a stop string (none appears earlier in it); those finish as
    stop without an EOS."""
    from rollover.loops.sync import train_sync
    from rollover.models import load_tokenizer

    stops = list("0123456789")
    run_dir = tmp_path / "run"
    train_sync(cfg_for(model_dir, run_dir, steps=1, **{"rollout.stop": stops, "rollout.max_new_tokens": 12}))
    tok = load_tokenizer(model_dir)
    text = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    _, _, rows = read_samples(run_dir, 1)
    by_string = 0
    for row in rows:
        ids = row["response_ids"]
        assert not any(s in text(ids[:-1]) for s in stops), row["response"]
        if any(s in text(ids) for s in stops):
            assert row["finish"] == "stop" and ids[-1] != tok.eos_token_id
            by_string += 1
    assert by_string >= 1


def test_samples_files_are_readable_as_the_runs_other_files(tmp_path):
    """Written whole then renamed, with the umask's mode (mkstemp's 0600 kept a teammate out)."""
    import os

    from rollover.metrics.samples import write_samples

    mask = os.umask(0o022)
    os.umask(mask)
    path = write_samples(tmp_path, 1, [{"kind": "step", "step": 1}])
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask
