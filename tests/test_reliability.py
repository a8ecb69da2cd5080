"""Bad input named before a run starts: devices, loss options, text rows, oversized steps."""

from __future__ import annotations

import logging
import shutil

import pytest

from rollover.config import ConfigError, load_config
from rollover.data.loaders import DataError, load_prompts
from rollover.loops.build import pick_device


def test_an_unavailable_device_is_a_config_error_naming_it():
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with pytest.raises(ConfigError, match=r"device='cuda:7': torch sees no CUDA device here"):
        pick_device("cuda:7")
    with pytest.raises(ConfigError, match=r"device='gpu' is not a device torch knows"):
        pick_device("gpu")
    if not torch.backends.mps.is_available():
        with pytest.raises(ConfigError, match=r"device='mps': torch sees no MPS device here"):
            pick_device("mps")


def test_an_unknown_loss_option_is_a_config_error():
    with pytest.raises(ConfigError, match=r"algorithm.loss_options=\{'eps_lo': 0.1\} for algorithm.loss=ppo: .*eps_lo"):
        load_config(None, ["algorithm.loss_options={eps_lo: 0.1}"])
    with pytest.raises(ConfigError, match=r"algorithm.loss_options=.*is_mode"):
        load_config(None, ["algorithm.loss_options={is_level: token, is_mode: sideways, is_cap: 2}"])
    ok = load_config(None, ["algorithm.loss_options={is_level: sequence, is_mode: truncate, is_cap: 2.0}"])
    assert ok.algorithm.loss_options["is_cap"] == 2.0


def test_a_lone_surrogate_is_a_bad_row_named_by_line_and_skippable(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok", "answer": "1"}\n{"prompt": "bad \\ud800", "answer": "2"}\n'
                    '{"prompt": [{"role": "user", "content": "x \\udfff"}], "answer": "3"}\n')
    with pytest.raises(DataError, match=r"p.jsonl line 2: prompt column 'prompt' holds \\ud800 at character 5"):
        load_prompts(path)
    kept = load_prompts(path, on_bad_row="skip")
    assert [p.answer for p in kept.prompts] == ["1"]
    assert [b.where.rsplit(" ", 1)[1] for b in kept.skipped] == ["2", "3"]


def test_a_step_larger_than_the_data_warns(tmp_path, caplog):
    from rollover.loops.build import build_run
    from rollover.testing import save_tiny_model

    model = save_tiny_model(tmp_path / "m", "llama", seed=3)
    cfg = load_config(None, [f"model={model}", f"run_dir={tmp_path / 'run'}", "device=cpu", "data.train=gen:arithmetic?n=12",
                             "data.eval_size=2", "rollout.prompts_per_step=40", "rollout.max_new_tokens=4",
                             "logging.tensorboard=false"])
    with caplog.at_level(logging.WARNING, logger="rollover"):
        run = build_run(cfg, record=False)
        run.close()
    assert "rollout.prompts_per_step=40 is more than the 10 training prompts" in caplog.text


@pytest.mark.parametrize("fails", ["engine", "data", "resume check"])
def test_a_start_that_fails_closes_what_it_had_built(tmp_path, monkeypatch, fails):
    """A run whose engine cannot start (or whose data is refused after the rewards were built)
    closes its rewards and trainer before the error reaches the caller: nothing is left holding
    a reward model, a reward pool or a trainer's processes."""
    from rollover.loops import build
    from rollover.rewards.runner import RewardRunner
    from rollover.testing import save_tiny_model
    from rollover.train.trainer import Trainer

    closed = []
    monkeypatch.setattr(RewardRunner, "close", lambda self: closed.append("rewards"))
    monkeypatch.setattr(Trainer, "close", lambda self: closed.append("trainer"))

    def no_engine(*args, **kwargs):
        raise RuntimeError("no engine today")

    def refused(*args):
        raise ConfigError("the training data is not the checkpoint's")

    if fails == "resume check":
        monkeypatch.setattr(build, "_check_data", refused)
    model = save_tiny_model(tmp_path / "m", "llama", seed=3)
    data = str(tmp_path / "missing.jsonl") if fails == "data" else "gen:arithmetic?n=12"
    cfg = load_config(None, [f"model={model}", f"run_dir={tmp_path / 'run'}", "device=cpu", f"data.train={data}",
                             "data.eval_size=2", "rollout.max_new_tokens=4", "logging.tensorboard=false"])
    why = {"engine": "no engine today", "data": "missing", "resume check": "not the checkpoint's"}[fails]
    with pytest.raises((RuntimeError, DataError, ConfigError), match=why):
        build.build_run(cfg, engine_factory=no_engine)
    assert closed == (["rewards", "trainer"] if fails == "engine" else ["rewards"])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("damaged", ["state.pt", "model/model.safetensors"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before_and_names_the_file(tmp_path, caplog, capsys,
                                                                                     damaged):
    from rollover.loops.sync import train_sync
    from rollover.testing import save_tiny_model

    model = save_tiny_model(tmp_path / "m", "llama", seed=3)
    over = [f"model={model}", f"run_dir={tmp_path / 'run'}", "device=cpu", "steps=2", "data.train=gen:arithmetic?n=40",
            "data.eval_size=2", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4",
            "eval.every=0", "eval.at_start=false", "checkpoint.every=1", "logging.progress=false", "logging.tensorboard=false"]
    train_sync(load_config(None, over))
    target = tmp_path / "run" / "checkpoints" / "step_000002" / damaged
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])  # cut short, as a full disk or a crash leaves it
    with caplog.at_level(logging.WARNING, logger="rollover"):
        result = train_sync(load_config(None, over[:3] + ["steps=3"] + over[4:]))
    assert f"checkpoint step_000002 is damaged ({target}" in caplog.text
    assert result["step"] == 3
    from rollover.metrics import read_metrics

    # step 2 trained again from step 1's checkpoint: its first row was dropped, none repeats
    assert [r["step"] for r in read_metrics(tmp_path / "run", kind="train")] == [1, 2, 3]
    # evaluating or exporting the run takes the newest intact checkpoint too, naming the damaged one
    from rollover.cli import main

    target = tmp_path / "run" / "checkpoints" / "step_000003" / damaged
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rollover"):
        assert main(["eval", str(tmp_path / "run"), "eval.samples_per_prompt=1"]) == 0
        assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    assert caplog.text.count(f"checkpoint step_000003 is damaged ({target}") == 2
    assert "evaluating the one before it" in caplog.text and "exporting the one before it" in caplog.text
    out = capsys.readouterr().out
    assert "step_000002 (step 2)" in out and f"exported {tmp_path / 'run' / 'checkpoints' / 'step_000002'}" in out
    # a damaged checkpoint named explicitly is refused, naming the file
    from rollover.loops.build import build_run

    target = tmp_path / "run" / "checkpoints" / "step_000003" / damaged
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    with pytest.raises(ConfigError, match=rf"the checkpoint is damaged: {target}"):
        build_run(load_config(None, over[:3] + ["steps=4"] + over[4:] + [f"resume={target.parents[len(damaged.split('/')) - 1]}"]),
                  record=False)


def test_a_sharded_checkpoints_cut_or_missing_shard_is_damage_named_by_its_file(tmp_path):
    """The sharded trainer's `torch.distributed.checkpoint` files are checked too (a resume passes
    such a checkpoint over for the one before, as it does a cut safetensors file): each shard file
    must hold the bytes its `.metadata` lists, and the metadata must read back."""
    import torch
    import torch.distributed.checkpoint as dcp

    from rollover.train.checkpoint import damage

    ckpt = tmp_path / "step_000002"
    ckpt.mkdir()
    torch.save({"step": 2}, ckpt / "state.pt")
    dcp.save({"a": torch.randn(64, 8), "b": torch.randn(300)}, checkpoint_id=str(ckpt / "sharded"))
    assert damage(ckpt) is None
    (shard,) = (ckpt / "sharded").glob("*.distcp")
    whole = shard.read_bytes()
    shard.write_bytes(whole[:100])
    assert damage(ckpt) == f"{shard}: 100 bytes, its metadata lists {len(whole)}"
    shard.unlink()
    assert damage(ckpt) == f"{shard}: missing, its metadata lists {len(whole)}"
    shard.write_bytes(whole)
    (ckpt / "sharded" / ".metadata").write_bytes(b"cut")
    assert damage(ckpt).startswith(f"{ckpt / 'sharded' / '.metadata'}: ")
    # the whole folder removed (it holds the optimizer state: a user freeing disk space): the
    # ranks' state.pt says it was saved
    shutil.rmtree(ckpt / "sharded")
    assert damage(ckpt) is None  # one trainer's checkpoint has none
    torch.save({"step": 2, "trainer": {"sharded": True}}, ckpt / "state.pt")
    assert damage(ckpt) == f"{ckpt / 'sharded'}: missing (the sharded trainer's weights and optimizer state were saved there)"


def test_a_model_path_that_is_no_usable_model_is_named_with_what_is_wrong(tmp_path):
    """A file given as the model, a model directory without tokenizer files, or one whose weights
    were copied in part: errors that say so, not transformers' (a missing sentencepiece, a bad
    header length) without the file."""
    import os
    import shutil

    from rollover.models import load_hf_model, load_tokenizer
    from rollover.testing import save_tiny_model

    model = save_tiny_model(tmp_path / "m", "llama", seed=3)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=f"model '{tmp_path / 'afile'}' is a file: give a model directory"):
        load_tokenizer(str(tmp_path / "afile"))
    shutil.copytree(model, tmp_path / "notok")
    for f in (tmp_path / "notok").glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ValueError, match=r"holds no tokenizer: no file like tokenizer.json, \*.model"):
        load_tokenizer(str(tmp_path / "notok"))
    shutil.copy(model / "tokenizer.json", tmp_path / "notok" / "tekken.json")  # a name the hint knows: no hint
    with pytest.raises(Exception) as info:
        load_tokenizer(str(tmp_path / "notok"))
    assert "holds no tokenizer" not in str(info.value)
    shutil.copytree(model, tmp_path / "cut")
    os.truncate(tmp_path / "cut" / "model.safetensors", 1000)
    with pytest.raises(ValueError, match=r"model.safetensors does not read as safetensors \(.*\); copied or downloaded"):
        load_hf_model(str(tmp_path / "cut"))
    assert load_tokenizer(str(model)) is not None and load_hf_model(str(model)) is not None


def test_a_checkpoints_cut_json_or_config_is_damage_named_by_its_file(tmp_path):
    """An adapter's or model's JSON file, or the recorded config.yaml, left empty by a write cut
    short makes the checkpoint damaged (resume, eval and export pass over it), not a bare
    JSONDecodeError or a config read as all defaults."""
    import torch

    from rollover.train.checkpoint import damage

    ckpt = tmp_path / "step_000002"
    (ckpt / "adapter").mkdir(parents=True)
    torch.save({"step": 2}, ckpt / "state.pt")
    (ckpt / "adapter" / "adapter_config.json").write_text('{"r": 8}')
    (ckpt / "config.yaml").write_text("steps: 4\n")
    assert damage(ckpt) is None
    (ckpt / "adapter" / "adapter_config.json").write_text("")
    assert damage(ckpt).startswith(f"{ckpt / 'adapter' / 'adapter_config.json'}: not readable as JSON")
    (ckpt / "adapter" / "adapter_config.json").write_text('{"r": 8}')
    (ckpt / "config.yaml").write_text("")
    assert damage(ckpt) == f"{ckpt / 'config.yaml'}: holds no config (cut short?)"


def test_a_full_disk_at_checkpoint_time_says_so_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    import torch

    from rollover.testing import tiny_model
    from rollover.train import checkpoint

    def full(*a, **kw):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 512 vs 0")

    monkeypatch.setattr(torch, "save", full)
    # the disk is full while the partial checkpoint is there; removing it frees its space again
    partial = lambda: any((tmp_path / "checkpoints").glob(".step_*"))  # noqa: E731
    monkeypatch.setattr(checkpoint.shutil, "disk_usage",
                        lambda p: type("U", (), {"free": 1024 if partial() else 2**30})())
    with pytest.raises(OSError, match=r"no space left on the device of .*checkpoints while writing checkpoint step 3") as e:
        checkpoint.save(tmp_path, 3, model=tiny_model("llama"), tokenizer=None, trainer_state={}, extra={}, keep=2)
    assert e.value.errno == errno.ENOSPC
    assert list((tmp_path / "checkpoints").iterdir()) == []  # no temporary directory left behind
