import importlib.util
import json
import math

import numpy as np
import pytest
import torch

from rollover.metrics import MetricsLogger, Timer, flatten, read_metrics, truncate_after
from rollover.metrics import timer as timer_module


def _strict_json(line):
    def reject(token):
        raise ValueError(f"bare {token} in {line!r}")

    return json.loads(line, parse_constant=reject)


def test_flatten_nests_with_slash():
    assert flatten({"timing_s": {"generate": 1.5, "train": {"fwd": 2}}, "loss": 0.1}) == {
        "timing_s/generate": 1.5,
        "timing_s/train/fwd": 2,
        "loss": 0.1,
    }


def test_rows_are_flattened_typed_and_read_back(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(1, {"reward": {"mean": 0.25}, "n": np.int64(3), "kl": torch.tensor(0.5), "ok": True})
        logger.log(1, {"accuracy": 0.75}, kind="eval")
        logger.log(2, {"reward": {"mean": 0.5}})
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["kind"]) for r in rows] == [(1, "train"), (1, "eval"), (2, "train")]
    first = rows[0]
    assert first["reward/mean"] == 0.25 and first["kl"] == 0.5
    assert first["n"] == 3 and isinstance(first["n"], int)
    assert first["ok"] == 1
    assert isinstance(first["time"], float)
    assert [r["accuracy"] for r in read_metrics(tmp_path / "metrics.jsonl", kind="eval")] == [0.75]


def test_read_metrics_refuses_a_kind_the_file_does_not_hold(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(1, {"loss": 0.5})
        logger.log(1, {"x": 1.0}, kind="probe")
    assert read_metrics(tmp_path, kind="eval") == []  # a kind rollover writes: no evaluation yet
    assert [r["x"] for r in read_metrics(tmp_path, kind="probe")] == [1.0]
    with pytest.raises(ValueError, match=r"kind 'evals'.*'eval', 'probe', 'train'"):
        read_metrics(tmp_path, kind="evals")


def test_nonfinite_values_are_strict_json_strings_and_come_back_as_floats(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(1, {"a": math.nan, "b": math.inf, "c": -math.inf, "d": 1.0})
    raw = _strict_json((tmp_path / "metrics.jsonl").read_text().strip())
    assert (raw["a"], raw["b"], raw["c"], raw["d"]) == ("NaN", "Infinity", "-Infinity", 1.0)
    (row,) = read_metrics(tmp_path)
    assert math.isnan(row["a"]) and row["b"] == math.inf and row["c"] == -math.inf
    assert row["kind"] == "train"  # the row's own string fields are left alone


def test_each_row_is_on_disk_before_close(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(7, {"x": 1.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [7]
    logger.close()


def test_bad_metrics_are_rejected(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        with pytest.raises(TypeError, match="'name'"):
            logger.log(1, {"name": "gsm8k"})
        with pytest.raises(TypeError, match="'v'"):
            logger.log(1, {"v": torch.ones(2)})
        with pytest.raises(ValueError, match="reserved"):
            logger.log(1, {"step": 3})
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_fresh_run_refuses_a_dir_with_metrics(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(1, {"x": 1.0})
    with pytest.raises(FileExistsError, match="resume="):
        MetricsLogger(tmp_path, tensorboard=False)
    with pytest.raises(TypeError, match="step"):
        MetricsLogger(tmp_path, tensorboard=False, resume=True)


def test_resume_drops_rows_after_the_checkpoint(tmp_path):
    # The killed run logged steps 1..5 (plus an eval at 4) but its last checkpoint is step 3.
    logger = MetricsLogger(tmp_path, tensorboard=False)
    for step in range(1, 6):
        logger.log(step, {"x": float(step)})
    logger.log(4, {"acc": 0.5}, kind="eval")
    logger.close()

    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "reward.png").write_bytes(b"drawn up to step 5")
    with MetricsLogger(tmp_path, tensorboard=False, resume=3) as logger:
        for step in (4, 5):
            logger.log(step, {"x": 10.0 * step})
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["x"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
    assert not (tmp_path / "plots" / "reward.png").exists()  # drawn from the lost rows: drawn again at the end


def test_torn_last_line_is_ignored_then_removed_by_truncation(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "kind": "train", "time": 0.0, "x": 1}\n{"step": 2, "kind": "tr')
    assert [r["step"] for r in read_metrics(path)] == [1]
    assert truncate_after(path, 10) == 0
    assert path.read_text() == '{"step": 1, "kind": "train", "time": 0.0, "x": 1}\n'

    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=":2:"):
        read_metrics(path)


@pytest.mark.parametrize("line, why", [
    ('{"step": 2, "kind": "train", "note": "lr bumped here"}', "note='lr bumped here' is not a number"),
    ('{"step": 2, "kind": "train", "x": NaN}', 'a bare NaN, which JSON has not'),
])
def test_a_hand_edited_row_is_named_before_a_resume_trains(tmp_path, line, why):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "kind": "train", "time": 0.0, "x": 1}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"metrics.jsonl:2: not a metrics row \\({why}"):
        truncate_after(path, 1)


def test_tensorboard_scalars_written(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, tensorboard=True) as logger:
        logger.log(1, {"reward": {"mean": 0.25}})
        logger.log(2, {"reward": {"mean": 0.5}})
        logger.log(2, {"reward/mean": 0.75}, kind="eval")
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.25), (2, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars("eval/reward/mean")] == [(2, 0.75)]


def test_missing_optional_packages_name_the_extra(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name in ("tensorboard", "wandb") else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ImportError, match=r"rollover\[tensorboard\]"):
        MetricsLogger(tmp_path / "a", tensorboard=True)
    with pytest.raises(ImportError, match=r"rollover\[wandb\]"):
        MetricsLogger(tmp_path / "b", tensorboard=False, wandb={"mode": "offline"})
    MetricsLogger(tmp_path / "c").close()  # tensorboard=None: quietly off
    assert not (tmp_path / "c" / "tb").exists()


def test_wandb_offline_run_records_metrics(tmp_path):
    wandb = pytest.importorskip("wandb")
    config = {"project": "rollover-test", "mode": "offline", "settings": {"silent": True}}
    with MetricsLogger(tmp_path, tensorboard=False, wandb=config) as logger:
        logger.log(1, {"reward": {"mean": 0.125}})
        logger.log(2, {"reward": {"mean": 0.375}})
    wandb.teardown()  # finish() can return before W&B's service process has written the run file
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    data = run_file.read_bytes()
    assert b"reward/mean" in data and b"0.125" in data and b"0.375" in data


def test_a_resumed_wandb_run_holds_the_rows_on_record(tmp_path):
    """A killed process's W&B file can hold none of its rows (W&B's service writes them when the
    run finishes): a resume logs the rows kept on record (up to its checkpoint) to the new W&B
    run first, then its own."""
    wandb = pytest.importorskip("wandb")
    config = {"project": "rollover-test", "mode": "offline", "settings": {"silent": True}}
    with MetricsLogger(tmp_path, tensorboard=False) as logger:  # the killed run: its W&B file lost
        logger.log(1, {"reward": {"mean": 0.125}})
        logger.log(2, {"accuracy": 0.25}, kind="eval")
        logger.log(3, {"reward": {"mean": 0.875}})  # after the checkpoint of step 2: trained again
    with MetricsLogger(tmp_path, tensorboard=False, wandb=config, resume=2) as logger:
        logger.log(3, {"reward": {"mean": 0.375}})
    wandb.teardown()
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    data = run_file.read_bytes()
    assert b"0.125" in data and b"eval/accuracy" in data and b"0.375" in data and b"0.875" not in data


def test_wandb_gets_the_samples_as_a_table(tmp_path):
    wandb = pytest.importorskip("wandb")
    config = {"project": "rollover-test", "mode": "offline", "settings": {"silent": True}}
    row = {"kind": "sample", "group": "g0", "sample": 0, "prompt": "What is 2+2?", "response": "four, I think",
           "reward": 1.0, "correct": True}
    with MetricsLogger(tmp_path, tensorboard=False, wandb=config) as logger:
        logger.log_samples(3, [{"kind": "eval", "step": 3}, row], kind="eval")
    wandb.teardown()
    (table,) = tmp_path.glob("wandb/offline-run-*/files/media/table/samples/eval_*.table.json")
    data = json.loads(table.read_text())
    assert data["columns"] == ["group", "sample", "prompt", "response", "reward", "correct"]
    assert data["data"] == [["g0", 0, "What is 2+2?", "four, I think", 1.0, True]]


def test_timer_accumulates_per_phase(monkeypatch):
    clock = iter([0.0, 2.0, 2.0, 2.5, 3.0, 4.0, 10.0, 11.0])
    monkeypatch.setattr(timer_module.time, "perf_counter", lambda: next(clock))
    timer = Timer()
    with timer("generate"):  # 0 -> 2
        pass
    with timer("train"):  # 2 -> 2.5
        pass
    with timer("generate"):  # 3 -> 4, added to the first
        pass
    assert timer.pop() == {"timing_s/generate": 3.0, "timing_s/train": 0.5}
    with timer("reward"):  # 10 -> 11
        pass
    assert timer.pop() == {"timing_s/reward": 1.0}
