"""The front door: `rollover` commands, short errors, run-directory integrity, eval and export
(tiny random models, CPU)."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

from rollover.cli import main
from rollover.testing import save_tiny_model, tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama", seed=3))


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("m2") / "llama", "llama", seed=4))


def overrides(model_dir, run_dir, *extra: str) -> list[str]:
    """A run of two tiny steps with a checkpoint at step 2."""
    return [f"model={model_dir}", f"run_dir={run_dir}", "steps=2", "seed=7", "data.train=gen:arithmetic?n=60",
            "data.eval_size=4", "data.max_prompt_tokens=64", "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=2", "rollout.max_new_tokens=6", "rollout.max_rows=4",
            "reward.functions=[numeric]", "train.lr=1e-2", "eval.every=0", "eval.at_start=false",
            "eval.samples_per_prompt=2", "checkpoint.every=2", "logging.progress=false",
            "logging.tensorboard=false", *extra]


@pytest.fixture(scope="module")
def trained(model_dir, tmp_path_factory):
    """A finished full fine-tuning run: (run_dir, its overrides). Its second reward scores the
    characters of a completion, so eval metrics tell one set of weights from another."""
    root = tmp_path_factory.mktemp("trained")
    (root / "chars.py").write_text("def chars(completion, answer, **kw):\n"
                                   "    return sum(map(ord, completion)) % 101 / 101\n")
    run_dir = root / "run"
    over = overrides(model_dir, run_dir, f"reward.functions=[numeric, {{fn: '{root}/chars.py:chars'}}]")
    assert main(["train", *over]) == 0
    return run_dir, over


def printed(out: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- commands and usage
def test_help_lists_every_command_with_a_description(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("train", "eval", "export", "plot", "show", "bench"):
        line = next(x for x in out.splitlines() if x.strip().startswith(name + " "))
        assert len(line.split(None, 1)[1]) > 10, line
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_train_without_arguments_explains_and_starts_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train"]) == 2
    err = capsys.readouterr().err
    assert "usage: rollover train" in err and "nothing was started" in err
    assert list(tmp_path.iterdir()) == []
    assert main(["eval"]) == 2 and list(tmp_path.iterdir()) == []


def test_train_help_documents_the_config_change_override(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--allow-config-change" in capsys.readouterr().out


def test_simulate_section_belongs_to_rollover_simulate(tmp_path, monkeypatch, capsys):
    """`rollover train` refuses a config with the simulated cluster, saying whose section it is;
    `rollover simulate --help-config` lists the training keys, then the section's."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sim.yaml").write_text("steps: 1\nsimulate:\n  pools: [{workers: 2}]\n")
    assert main(["train", "sim.yaml"]) == 2
    err = capsys.readouterr().err
    assert "config error: sim.yaml: unknown key 'simulate'" in err and "`rollover simulate`" in err
    assert main(["train", "steps=1", "simulate.fast=true"]) == 2
    assert "unknown key 'simulate'" in capsys.readouterr().err and list(tmp_path.iterdir()) == [tmp_path / "sim.yaml"]
    assert main(["simulate", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert out.index("  steps = 20") < out.index("\n[simulate]\n") < out.index("  simulate.pools[].kv_tokens = None")


# ---------------------------------------------------------------- errors after parsing
@pytest.mark.parametrize("bad, says, code", [
    ("data.train={tmp}/missing.jsonl", "config error: data.train=", 2),
    ("data.eval={tmp}/missing.jsonl", "config error: data.eval=", 2),
    ("model={tmp}/no_such_model", "no_such_model", (1, 2)),
    ("model={tmp}", "config.json", (1, 2)),  # a directory, but not a model
    ("reward.functions=[no_such_reward]", "config error: reward.functions: unknown reward 'no_such_reward'", 2),
    ("reward.functions=[{tmp}/nothing.py:f]", "config error: reward.functions: file not found: ", 2),
    ("reward.functions=[{tmp}/broken.py:f]", "config error: reward.functions: SyntaxError: ", 2),
    ("reward.functions=[{tmp}/ok.py:nope]", "config error: reward.functions: ", 2),
    ("reward.functions=[{tmp}/setup.py:f]", "config error: reward.functions: TypeError at ", 2),  # raised in yours
    ("reward.functions=[{tmp}/exits.py:f]", "config error: reward.functions: ImportError: reward '", 2),  # not rc 0
])
def test_refused_run_is_short_and_leaves_no_run_dir(model_dir, tmp_path, capsys, bad, says, code):
    run_dir = tmp_path / "run"
    (tmp_path / "broken.py").write_text("def f(completion, answer:\n    return 1.0\n")
    (tmp_path / "ok.py").write_text("def f(completion, answer):\n    return 1.0\n")
    (tmp_path / "setup.py").write_text("raise TypeError('setting up went wrong')\n")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\n")
    got = main(["train", *overrides(model_dir, run_dir, bad.format(tmp=tmp_path))])
    assert got in code if isinstance(code, tuple) else got == code
    err = capsys.readouterr().err.strip().splitlines()
    assert 1 <= len(err) <= 3, err
    assert err[0].startswith("rollover train: ") and says in err[0]
    assert not run_dir.exists()


def test_a_run_dir_that_is_a_file_is_refused_before_anything_loads(model_dir, tmp_path, capsys, monkeypatch):
    import rollover.loops.build as build

    monkeypatch.setattr(build, "_inputs", lambda *a: pytest.fail("the data was loaded"))
    (tmp_path / "run").write_text("notes\n")
    assert main(["train", *overrides(model_dir, tmp_path / "run")]) == 2
    assert f"config error: run_dir {tmp_path / 'run'} is a file" in capsys.readouterr().err
    assert (tmp_path / "run").read_text() == "notes\n"
    assert main(["train", *overrides(model_dir, tmp_path / "run" / "sub")]) == 2  # below a file
    assert f"config error: run_dir {tmp_path / 'run' / 'sub'}: {tmp_path / 'run'} is a file" in capsys.readouterr().err


def test_a_key_given_twice_in_a_config_file_is_refused(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("data:\n  max_prompt_tokens: 10\ntrain:\n  lr: 1.0e-4\ndata:\n  train: x.jsonl\n")
    assert main(["train", str(tmp_path / "c.yaml")]) == 2
    assert "c.yaml:5:1: invalid YAML: key 'data' is given twice (first on line 1)" in capsys.readouterr().err


def test_debug_shows_the_traceback(model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "--debug", *overrides(model_dir, run_dir, f"data.train={tmp_path}/missing.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "missing.jsonl" in err.splitlines()[-1]
    assert not run_dir.exists()


def test_interrupt_before_the_first_step_is_one_line_and_exit_130(model_dir, tmp_path, monkeypatch, capsys):
    import rollover.loops.build as build

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "build_run", interrupted)
    assert main(["train", *overrides(model_dir, tmp_path / "run")]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["rollover train: interrupted before the first step; nothing was saved"]


def test_after_a_stop_the_hint_resumes_and_a_stop_while_plotting_says_the_run_is_saved(model_dir, tmp_path,
                                                                                           monkeypatch, capsys):
    """A run started with resume=PATH and stopped by a signal is resumed by resume=auto (the same
    command would go back to PATH, retraining what followed); a signal while the plots are drawn,
    after the run is saved, says so (it had said "interrupted before the first step")."""
    import rollover.loops.build as build
    import rollover.loops.sync as sync
    import rollover.metrics as metrics

    monkeypatch.setattr(build, "build_run", lambda *a, **k: None)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000008"
    monkeypatch.setattr(sync, "train_sync", lambda cfg, run: {"step": 8, "interrupted": "SIGINT", "checkpoint": str(ckpt)})
    assert main(["train", *overrides(model_dir, tmp_path / "run"), "resume=runs/x/checkpoints/step_000005"]) == 130
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith("to resume, run the command again with resume=auto (not resume=runs/x/checkpoints/step_000005, "
                         "which goes back to that checkpoint)")
    assert main(["train", *overrides(model_dir, tmp_path / "run")]) == 130
    assert capsys.readouterr().err.strip().endswith("; run the same command again to resume")

    def plotting(run_dir):
        raise KeyboardInterrupt

    monkeypatch.setattr(sync, "train_sync", lambda cfg, run: {"step": 8})
    monkeypatch.setattr(metrics, "plot_run", plotting)
    assert main(["train", *overrides(model_dir, tmp_path / "run")]) == 130
    assert capsys.readouterr().err.strip() == (f"rollover train: interrupted while drawing the plots; the run trained to "
                                               f"step 8 and is saved (`rollover plot {tmp_path / 'run'}` draws them)")

    def unwritable(run_dir):
        raise FileExistsError(f"{run_dir}/plots")

    monkeypatch.setattr(metrics, "plot_run", unwritable)  # a plot that cannot be written fails no run
    assert main(["train", *overrides(model_dir, tmp_path / "run")]) == 0
    captured = capsys.readouterr()
    assert "the plots were not drawn (FileExistsError" in captured.err and "done: step 8" in captured.out
    assert "\r" not in captured.err  # stderr is no terminal: no frames of transformers' weight bars


def test_sigint_during_training_saves_and_exits_130_with_one_line(model_dir, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    slow = tmp_path / "slow_judge.py"  # each step takes >= 0.3 s
    slow.write_text("import time\ndef judge(completion, answer, **kw):\n    time.sleep(0.3)\n    return 1.0\n")
    run_dir = tmp_path / "run"
    argv = [*overrides(model_dir, run_dir), "steps=50", "checkpoint.every=0", f"reward.functions=[{slow}:judge]"]
    proc = subprocess.Popen([sys.executable, "-m", "rollover.cli", "train", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and '"kind": "train"' in metrics.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    last = [x for x in err.splitlines() if x.startswith("rollover train:")]
    assert len(last) == 1 and "SIGINT: stopped after step" in last[0] and "run the same command again" in last[0]
    step = int(last[0].split("after step ")[1].split()[0])
    assert (run_dir / "checkpoints" / f"step_{step:06d}" / "DONE").exists()


# ---------------------------------------------------------------- resume under a changed config
def test_resume_with_a_changed_config_is_refused_then_allowed(model_dir, other_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *overrides(model_dir, run_dir)]) == 0
    before = snapshot(run_dir)
    capsys.readouterr()

    changed = overrides(other_model_dir, run_dir, "steps=3", "train.lr=2e-2")
    assert main(["train", *changed]) == 2
    err = capsys.readouterr().err
    assert "refused" in err and f'model: "{model_dir}" -> "{other_model_dir}"' in err and "train.lr: 0.01 -> 0.02" in err
    assert "steps" not in err  # steps may change freely
    assert snapshot(run_dir) == before  # nothing written, config.yaml included

    assert main(["train", "--allow-config-change", *changed]) == 0
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"] == other_model_dir and saved["train"]["lr"] == 0.02
    log = (run_dir / "config_changes.log").read_text()
    assert "train.lr: 0.01 -> 0.02" in log and "model:" in log
    assert (run_dir / "checkpoints" / "step_000003" / "DONE").exists()
    ckpt_cfg = yaml.safe_load((run_dir / "checkpoints" / "step_000003" / "config.yaml").read_text())
    assert ckpt_cfg["train"]["lr"] == 0.02

    # only free keys changed: accepted without the flag
    assert main(["train", *overrides(other_model_dir, run_dir, "steps=4", "train.lr=2e-2", "eval.samples_per_prompt=1",
                                     "checkpoint.keep=1")]) == 0
    assert [p.name for p in (run_dir / "checkpoints").glob("step_*")] == ["step_000004"]


def test_changed_training_data_is_refused_then_drawn_from_its_start_under_the_flag(model_dir, tmp_path, capsys,
                                                                                    caplog):
    """The data file edited since the checkpoint, or another seed (each prompt's order), cannot
    continue the checkpoint's place in the data: refused as a config error saying so; under
    --allow-config-change the new data is drawn from its start."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(12)))
    run_dir = tmp_path / "run"
    assert main(["train", *overrides(model_dir, run_dir, f"data.train={data}")]) == 0
    with data.open("a") as f:
        f.write('{"prompt": "20+1=", "answer": "21"}\n')
    before = snapshot(run_dir)
    capsys.readouterr()
    assert main(["train", *overrides(model_dir, run_dir, f"data.train={data}", "steps=3")]) == 2
    err = capsys.readouterr().err
    assert "config error: the training data is not the checkpoint's" in err and "--allow-config-change" in err
    assert snapshot(run_dir) == before
    with caplog.at_level(logging.WARNING, logger="rollover"):
        assert main(["eval", str(run_dir)]) == 0  # evaluates, warning that its carved held-out set may have moved
    assert "may include prompts it trained on" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rollover"):  # filter holds nothing out: nothing to warn of
        assert main(["filter", *overrides(model_dir, run_dir, f"data.train={data}"), "--checkpoint",
                     str(run_dir / "checkpoints" / "step_000002"), "--samples", "1", "--keep", "0:1",
                     "--out", str(tmp_path / "kept.jsonl")]) == 0
    assert "not the checkpoint's" not in caplog.text
    assert main(["train", "--allow-config-change", *overrides(model_dir, run_dir, f"data.train={data}", "steps=3",
                                                            "seed=8")]) == 0
    assert (run_dir / "checkpoints" / "step_000003" / "DONE").exists()


def test_resume_never_on_an_existing_run_is_refused_before_writing(trained, capsys):
    run_dir, over = trained
    before = snapshot(run_dir)
    assert main(["train", *over, "resume=never", "train.lr=5e-2"]) == 2
    assert "resume=never" in capsys.readouterr().err
    assert snapshot(run_dir) == before


def test_fewer_steps_than_trained_and_a_run_without_checkpoint_under_another_config_are_refused(trained, tmp_path,
                                                                                                  capsys, caplog):
    """steps below what the run trained asks for nothing: said, nothing written (config.yaml had been
    rewritten). A run dir with metrics and no checkpoint (stopped before its first) under another
    config: refused, as a resume would be (it had been replaced silently); under its own config it
    starts over with a warning."""
    run_dir, over = trained
    before = snapshot(run_dir)
    assert main(["train", *over, "steps=1"]) == 2
    assert f"the run in {run_dir} has trained 2 steps, past steps=1: nothing to train" in capsys.readouterr().err
    assert snapshot(run_dir) == before
    bare = tmp_path / "bare"
    shutil.copytree(run_dir, bare)
    shutil.rmtree(bare / "checkpoints")
    mine = [o.replace(str(run_dir), str(bare)) for o in over]
    before = snapshot(bare)
    assert main(["train", *mine, "train.lr=5e-2"]) == 2
    err = capsys.readouterr().err
    assert f"run_dir {bare} holds a run with no checkpoint under another config" in err and "train.lr: 0.01 -> 0.05" in err
    assert snapshot(bare) == before
    with caplog.at_level(logging.WARNING, logger="rollover"):
        assert main(["train", *mine, "steps=1"]) == 0
    assert "holds a run's metrics but no checkpoint: the run starts over" in caplog.text


def test_checkpoint_keep_never_removes_the_one_just_written(tmp_path):
    from rollover.train import checkpoint

    model = tiny_model("llama", seed=1)

    def save(step, keep):
        return checkpoint.save(tmp_path, step, model=model, tokenizer=None, trainer_state={}, extra={}, keep=keep)

    with pytest.raises(ValueError, match="keep=0: must be >= 1"):
        save(1, 0)
    save(2, 5), save(4, 5)
    written = save(3, 1)  # e.g. a resume from step 2 while step 4 still exists
    assert [p.name for p in checkpoint.checkpoint_dir(tmp_path).glob("step_*")] == [written.name]


# ---------------------------------------------------------------- eval
def test_eval_run_dir_and_its_config_use_the_latest_checkpoint(trained, capsys):
    run_dir, over = trained
    ckpt = run_dir / "checkpoints" / "step_000002"
    tmp = Path(tempfile.gettempdir())
    temp_before = sorted(p.name for p in tmp.iterdir() if p.name.startswith("rollover"))
    files_before = snapshot(run_dir)

    assert main(["eval", *over, "--checkpoint", str(ckpt)]) == 0
    explicit = printed(capsys.readouterr().out)
    assert explicit["weights"].startswith(f"checkpoint {ckpt} (step 2)")

    for source in (run_dir, run_dir / "config.yaml"):
        assert main(["eval", str(source)]) == 0
        got = printed(capsys.readouterr().out)
        assert got["weights"] == f"checkpoint {ckpt} (step 2) [latest checkpoint of {run_dir}]"
        assert {k: v for k, v in got.items() if k.startswith("eval/")} == \
               {k: v for k, v in explicit.items() if k.startswith("eval/")}

    assert main(["eval", str(ckpt)]) == 0  # a checkpoint directory: its own weights and config
    got = printed(capsys.readouterr().out)
    assert got["weights"] == f"checkpoint {ckpt} (step 2) [--checkpoint]"
    assert {k: v for k, v in got.items() if k.startswith("eval/")} == \
           {k: v for k, v in explicit.items() if k.startswith("eval/")}

    assert main(["eval", str(run_dir), "--base"]) == 0
    base = printed(capsys.readouterr().out)
    assert base["weights"].startswith(f"base model {over[0].split('=', 1)[1]}")
    assert base["eval/reward_mean"] != explicit["eval/reward_mean"]  # other weights, other samples

    assert snapshot(run_dir) == files_before  # eval writes nothing into the run
    assert sorted(p.name for p in tmp.iterdir() if p.name.startswith("rollover")) == temp_before


def test_eval_reads_a_run_recorded_with_the_retired_simulate_section(trained, tmp_path, capsys):
    """Runs recorded before the simulator's section left the training config hold `simulate:`
    in their config.yaml: eval drops it from a recorded config (a training config with it is
    refused, tests above)."""
    import shutil

    run_dir = tmp_path / "old"
    shutil.copytree(trained[0], run_dir)
    for recorded in [run_dir / "config.yaml", *run_dir.glob("checkpoints/*/config.yaml")]:
        recorded.write_text(recorded.read_text() + "simulate:\n  prompts: 512\n  fast: false\n")
    assert main(["eval", str(run_dir)]) == 0
    assert printed(capsys.readouterr().out)["weights"].startswith(f"checkpoint {run_dir / 'checkpoints'}")
    plain = tmp_path / "train.yaml"
    plain.write_text((run_dir / "config.yaml").read_text())
    assert main(["train", str(plain)]) == 2
    assert "unknown key 'simulate'" in capsys.readouterr().err


def test_eval_plain_config_without_checkpoints_uses_the_base_model(model_dir, tmp_path, capsys):
    cfg = tmp_path / "plain.yaml"
    over = overrides(model_dir, tmp_path / "never_trained")
    cfg.write_text(yaml.safe_dump(dict(x.split("=", 1) for x in over[:2])))
    assert main(["eval", str(cfg), *over[2:]]) == 0
    got = printed(capsys.readouterr().out)
    assert got["weights"] == f"base model {model_dir} [{tmp_path / 'never_trained'} has no checkpoint]"
    assert not (tmp_path / "never_trained").exists()
    assert main(["eval", str(tmp_path)]) == 2
    assert "not a run directory (no config.yaml)" in capsys.readouterr().err
    assert main(["eval", str(cfg), *over[2:], "data.eval_size=0"]) == 2  # no held-out prompt: not a success
    assert "nothing to evaluate: data.eval_size=0; give data.eval_size=N" in capsys.readouterr().err


# ---------------------------------------------------------------- export
def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def test_export_of_a_run_still_training_reads_the_checkpoint_retention_left(tmp_path, monkeypatch):
    """The run removes its oldest checkpoint (checkpoint.keep) while export reads it: export reads
    the latest then; a checkpoint directory given as the run is read as --checkpoint; a file
    given as the run says what to give."""
    import shutil
    from types import SimpleNamespace

    import rollover.export as export_mod

    import torch

    run = tmp_path / "run"

    def saved(step: int) -> None:  # a checkpoint's files as far as export looks at them
        (run / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
        torch.save({"step": step}, run / "checkpoints" / f"step_{step:06d}" / "state.pt")
        (run / "checkpoints" / f"step_{step:06d}" / "DONE").touch()

    saved(1)
    read = []

    def load(ckpt, run_dir):
        read.append(ckpt.name)
        if ckpt.name == "step_000001":  # meanwhile step 2 was saved and step 1 removed
            saved(2)
            shutil.rmtree(ckpt)
            raise ValueError("Can't find 'adapter_config.json'")
        saver = SimpleNamespace(save_pretrained=lambda d, **kw: (Path(d) / "config.json").write_text("{}"))
        return saver, SimpleNamespace(save_pretrained=lambda d: None)

    monkeypatch.setattr(export_mod, "_load", load)
    assert export_mod.export(run, tmp_path / "out").name == "step_000002" and read == ["step_000001", "step_000002"]
    assert (tmp_path / "out" / "config.json").exists()
    assert export_mod.export(run / "checkpoints" / "step_000002", tmp_path / "out2").name == "step_000002"
    (run / "config.yaml").write_text("model: m\n")
    with pytest.raises(export_mod.ExportError, match="is a file: give the run directory"):
        export_mod.export(run / "config.yaml", tmp_path / "out3")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_export_round_trip(model_dir, tmp_path, capsys, lora):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, out = tmp_path / "run", tmp_path / "out"
    # a reward that tells any two completions apart: every group has an advantage to train on
    (tmp_path / "chars.py").write_text("def chars(completion, answer, **kw):\n"
                                       "    return sum(map(ord, completion)) % 101 / 101\n")
    extra = [f"reward.functions=[numeric, {{fn: '{tmp_path}/chars.py:chars'}}]"]
    if lora:
        extra += ["train.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj]}", "train.lr=5e-2"]
    assert main(["train", *overrides(model_dir, run_dir, *extra)]) == 0
    ckpt = run_dir / "checkpoints" / "step_000002"
    assert main(["export", str(run_dir), str(out)]) == 0
    assert f"exported {ckpt}" in capsys.readouterr().out

    exported = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    if lora:
        from peft import PeftModel

        trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(ckpt / "adapter"))
        assert torch.allclose(_logits(exported, ids), _logits(trained, ids), atol=1e-5)
    else:
        trained = AutoModelForCausalLM.from_pretrained(ckpt / "model")
        assert torch.equal(_logits(exported, ids), _logits(trained, ids))
    assert not torch.allclose(_logits(exported, ids), _logits(base, ids), atol=1e-4)  # training moved the weights

    if lora:  # eval restores the adapter too
        assert main(["eval", str(run_dir)]) == 0
        assert printed(capsys.readouterr().out)["weights"].startswith(f"checkpoint {ckpt} (step 2)")

    assert main(["export", str(run_dir), str(out)]) == 1  # a model there: refused without --force
    assert "holds a model already; pass --force" in capsys.readouterr().err
    assert main(["export", str(run_dir), str(out), "--force", "--checkpoint", str(ckpt)]) == 0
    assert (out / "config.json").exists() and not list(tmp_path.glob(".out-*"))
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("mine")
    assert main(["export", str(run_dir), str(junk), "--force"]) == 1  # --force replaces only a model directory
    assert (junk / "notes.txt").read_text() == "mine"
    assert main(["export", str(run_dir), str(junk)]) == 1  # without --force: said the same way, not "pass --force"
    assert "is not a model directory" in capsys.readouterr().err.splitlines()[-2]
    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 1
    assert "nowhere: no such run directory" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "x"), "--best"]) == 1
    assert "nowhere: no such run directory" in capsys.readouterr().err
    older = run_dir / "checkpoints" / "step_000001"  # another checkpoint of the run: never written into
    shutil.copytree(ckpt, older)
    before = snapshot(older)
    assert main(["export", str(run_dir), str(older / ("adapter" if lora else "model")), "--force"]) == 1
    assert f"is inside the checkpoint {older.resolve()}, which it would change" in capsys.readouterr().err
    assert snapshot(older) == before
    shutil.rmtree(older)
    assert main(["export", str(run_dir), str(ckpt / "exported")]) == 1  # inside the one exported, not yet there
    assert "overlaps the checkpoint" in capsys.readouterr().err and not (ckpt / "exported").exists()
    (tmp_path / "afile").write_text("x")
    assert main(["export", str(run_dir), str(tmp_path / "afile" / "sub")]) == 1
    assert f"{tmp_path / 'afile'} is a file, not a directory" in capsys.readouterr().err
    before = snapshot(Path(model_dir))  # the run's base model: its checkpoints stand on it
    assert main(["export", str(run_dir), str(model_dir), "--force"]) == 1
    assert f"is the run's base model {Path(model_dir).resolve()}" in capsys.readouterr().err
    assert snapshot(Path(model_dir)) == before
    shutil.rmtree(out)


def test_plot_errors_are_one_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "no metrics.jsonl there" in err[0] and err[1].startswith("hint:")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "kin')  # killed while the model loaded, or mid-row
    assert main(["plot", str(tmp_path)]) == 1
    assert "its metrics.jsonl holds no complete row to plot" in capsys.readouterr().err


@pytest.mark.parametrize("env, first, expect", [
    ({}, "", ("ACTIVE", "100000")),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, "", ("PASSIVE", "100000")),  # the user's setting stands
    ({"ROLLOVER_OPENMP_DEFAULTS": "0"}, "", (None, None)),
    ({}, "import torch; ", (None, None)),  # too late: torch has read the environment
])
def test_the_command_keeps_openmp_threads_spinning_unless_told_otherwise(env, first, expect):
    """`rollover` sets OMP_WAIT_POLICY and GOMP_SPINCOUNT before torch loads (cli._openmp_defaults)."""
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items()
             if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "ROLLOVER_OPENMP_DEFAULTS")}
    code = (first + "import os, rollover.cli; "
            "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))")
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         check=True).stdout.split()
    assert tuple(None if v == "None" else v for v in out) == expect


def test_version_and_every_argument_has_help(monkeypatch, capsys):
    """`rollover --version` prints the version; every argument of every command, tool and bench
    has a help line."""
    import argparse
    import contextlib

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("rollover ")
    parsers = []
    monkeypatch.setattr(argparse.ArgumentParser, "print_help", lambda self, file=None: parsers.append(self))
    for argv in (["train"], ["eval"], ["export"], ["plot"], ["show"], ["bench"], ["simulate"], ["simulate", "calibrate"],
                 ["simulate", "validate"], ["simulate", "plan"]):
        with contextlib.suppress(SystemExit):
            main(argv + ["--help"])
    subs = [sp for p in parsers for a in p._actions if isinstance(a, argparse._SubParsersAction) for sp in a.choices.values()]
    assert len(subs) >= 10  # bench's subcommands
    missing = [(p.prog, a.dest) for p in parsers + subs for a in p._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help]
    assert missing == []


def test_a_closed_pipe_and_an_early_ctrl_c_end_without_a_traceback(monkeypatch, capsys):
    import subprocess
    import sys

    proc = subprocess.run(f"{sys.executable} -m rollover.cli train --help-config | head -n 2", shell=True,
                          capture_output=True, text=True, timeout=120)
    assert len(proc.stdout.splitlines()) == 2 and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr
    from rollover.commands import _guarded  # a guarded command's closed pipe (`rollover show | head`) too

    def printing():
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(BrokenPipeError):  # main() ends it quietly, not "rollover show: error: BrokenPipeError"
        _guarded("rollover show", False, printing)

    import rollover.cli as cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "train", (interrupted, "x"))
    assert main(["train", "steps=1"]) == 130
    assert capsys.readouterr().err.strip() == "rollover: interrupted; nothing was started"


def test_eval_of_a_checkpoint_from_another_directory_uses_its_own_model(model_dir, tmp_path, monkeypatch, capsys):
    """A run trained with a relative model path: its checkpoint is evaluated from elsewhere with
    the model it holds, not the saved config's (now unreachable) relative path."""
    import shutil

    shutil.copytree(model_dir, tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    assert main(["train", *overrides("m", "run")]) == 0
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    capsys.readouterr()
    assert main(["eval", str(ckpt)]) == 0
    assert printed(capsys.readouterr().out)["weights"] == f"checkpoint {ckpt} (step 2) [--checkpoint]"


def test_filter_keeps_the_prompts_whose_pass_rate_lies_in_the_band(tmp_path, capsys):
    """rollover filter: each training prompt sampled --samples times, its pass rate by the first
    reward function; the rows in the band written with pass_rate, the answer under the config's
    answer key (a stray `answer` column does not take its place): a data.train as they are."""
    import json

    from rollover.testing import save_tiny_model

    model = save_tiny_model(tmp_path / "m", "llama", seed=3)
    rows = [{"prompt": f"{i}+{i}=", "solution": str(2 * i), "answer": "B", "level": i % 3} for i in range(12)]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    over = [f"model={model}", f"data.train={data}", "data.answer_key=solution", "data.max_prompt_tokens=64",
            "rollout.max_new_tokens=4", "rollout.max_rows=16", "reward.functions=[{fn: format, kwargs: {pattern: '[0-9]'}}]"]
    out = tmp_path / "kept.jsonl"
    assert main(["filter", *over, "--samples", "4", "--keep", "0:1", "--out", str(out)]) == 0
    every = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["prompt"] for r in every) == sorted(r["prompt"] for r in rows)  # 0:1 keeps all, with rates
    for r in every:
        assert r["solution"] == str(2 * int(r["prompt"].split("+")[0])) and r["answer"] == "B" and "level" in r
        assert r["pass_rate"] in (0, 0.25, 0.5, 0.75, 1)
    printed = capsys.readouterr().out
    assert "filter: 12 prompts x 4 samples with model" in printed and "kept 12 of 12" in printed
    middle = [r for r in every if 0 < r["pass_rate"] < 1]
    assert middle and len(middle) < len(every)  # the band cuts something, and keeps something
    before = out.read_text()
    assert main(["filter", *over, "--samples", "4", "--out", str(out)]) == 2  # there already: --force replaces it
    assert f"--out {out} exists; pass --force to replace it" in capsys.readouterr().err and out.read_text() == before
    assert main(["filter", *over, "--samples", "4", "--out", str(data), "--force"]) == 2  # never the data itself
    assert f"--out {data} is the data it filters (data.train)" in capsys.readouterr().err
    assert sorted(json.loads(line)["prompt"] for line in data.read_text().splitlines()) == sorted(r["prompt"] for r in rows)
    assert main(["filter", *over, "--samples", "0", "--out", str(out)]) == 2
    assert "--samples must be >= 1 (got 0)" in capsys.readouterr().err
    assert main(["filter", *over, "--samples", "4", "--out", str(out), "--force"]) == 0  # default: neither 0 nor 1
    again = [json.loads(line) for line in out.read_text().splitlines()]
    # the same seed samples the same: the middle band is what the first run rated so
    assert sorted((r["prompt"], r["pass_rate"]) for r in again) == sorted((r["prompt"], r["pass_rate"]) for r in middle)
    assert "0 < pass rate < 1" in capsys.readouterr().out
    from rollover.config import load_config
    from rollover.loops.build import build_run

    run = build_run(load_config(None, [*over, f"data.train={out}", "data.eval_size=0", f"run_dir={tmp_path / 'again'}"]),
                    record=False)
    try:  # the kept rows are a data.train of the same config
        assert len(run.train_iter.prompts) + len(run.eval_prompts) == len(again)
    finally:
        run.close()
    named = [o for o in over if not o.startswith("data.train=")] + [f"data.train={{a: {data}, b: {data}}}"]
    assert main(["filter", *named, "--samples", "1", "--keep", "0:1", "--out", str(out), "--force"]) == 0
    both = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["source"] for r in both) == ["a"] * 12 + ["b"] * 12  # which source each row came from
    assert main(["filter", *over, "--keep", "0.9:0.1", "--out", str(out)]) == 2
    assert "--keep '0.9:0.1' must be LOW:HIGH" in capsys.readouterr().err
    assert main(["filter", *over, "--out", str(tmp_path / "nowhere" / "k.jsonl")]) == 2
    assert "must be a .jsonl file in an existing directory" in capsys.readouterr().err
    assert main(["filter", "--out", str(out)]) == 2  # no config: said (it had sampled the built-in demo's 2000 prompts)
    assert "give a YAML config" in capsys.readouterr().err
    for cmd in (["filter", *over, "--out", str(out)], ["eval", *over]):
        assert main([*cmd, "--checkpoint", str(tmp_path / "nowhere")]) == 2
        assert f"--checkpoint {tmp_path / 'nowhere'}: no such directory" in capsys.readouterr().err
        assert main([*cmd, "--checkpoint", str(tmp_path)]) == 2
        assert "not a complete checkpoint directory (no DONE marker)" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "nowhere")]) == 2
    assert "no such run directory, checkpoint or config file" in capsys.readouterr().err


def test_failed_reward_calls_are_counted_in_the_evaluation_and_the_filter(tmp_path, capsys):
    """Under reward.on_error=zero a failed call scores 0: the evaluation's row counts them
    (eval/reward_errors, per function) and says so at the end, and `rollover filter` warns that its
    pass rates counted them as not solved."""
    import json

    from rollover.metrics import read_metrics
    from rollover.testing import save_tiny_model

    model = save_tiny_model(tmp_path / "m", "llama", seed=3)
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) for i in range(20)))
    (tmp_path / "rew.py").write_text("def boom(completion, answer, **_):\n    raise ValueError('boom')\n")
    over = [f"model={model}", f"data.train={data}", "data.max_prompt_tokens=64", "data.eval_size=3",
            "rollout.max_new_tokens=4", "rollout.max_rows=16", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
            f"reward.functions=[{tmp_path / 'rew.py'}:boom]", "reward.on_error=zero", "eval.samples_per_prompt=2",
            "steps=1", "logging.progress=false", "logging.tensorboard=false", f"run_dir={tmp_path / 'run'}"]
    assert main(["train", *over]) == 0
    evals = read_metrics(tmp_path / "run", kind="eval")
    assert evals and all(r["eval/reward_errors"] == r["eval/rewards/boom/errors"] == 6 for r in evals)
    assert "(6 failed reward calls in the evaluation: reward.on_error=zero)" in capsys.readouterr().out
    assert main(["filter", *over, "--samples", "2", "--keep", "0:1", "--out", str(tmp_path / "kept.jsonl")]) == 0
    assert ("warning: 40 of 40 samples had their first reward function fail: scored 0, so counted as not solved "
            "(reward.on_error=zero)") in capsys.readouterr().err


def test_flags_may_come_between_the_config_and_the_overrides(model_dir, tmp_path, monkeypatch):
    """`rollover train CONFIG --allow-config-change steps=7` (where the refusal's hint leads): the
    flag and every override are read (argparse had refused the overrides after a flag)."""
    import rollover.cli as cli

    seen = []
    monkeypatch.setattr(cli, "_run_training", lambda cfg, allow: seen.append((cfg.steps, cfg.train.lr, allow)) or 0)
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {model_dir}\nrun_dir: {tmp_path / 'run'}\n")
    assert main(["train", str(config), "--allow-config-change", "steps=7", "train.lr=0.02"]) == 0
    assert main(["train", str(config), "steps=8", "--allow-config-change"]) == 0
    assert seen == [(7, 0.02, True), (8, 1e-5, True)]


def test_export_finds_a_relative_base_model_from_another_directory(tmp_path, monkeypatch):
    """A run started in /proj with `model: models/base` and exported from elsewhere: the base is
    still recognised (read from a directory above RUN_DIR) and never written over."""
    from rollover.export import ExportError, _check_not_base

    proj = tmp_path / "proj"
    (proj / "models" / "base").mkdir(parents=True)
    run_dir = proj / "runs" / "r"
    (run_dir / "checkpoints" / "step_000001").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("model: models/base\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ExportError, match=f"is the run's base model {proj / 'models' / 'base'}"):
        _check_not_base(proj / "models" / "base", run_dir / "checkpoints" / "step_000001", run_dir)
    _check_not_base(tmp_path / "out", run_dir / "checkpoints" / "step_000001", run_dir)  # elsewhere: fine
