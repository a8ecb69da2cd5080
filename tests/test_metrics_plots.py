import math

import pytest

from rollover.metrics import MetricsLogger, plot_compare, plot_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path):
    data = path.read_bytes()
    return data.startswith(PNG_MAGIC) and len(data) > 5_000  # a blank canvas alone is smaller


def _write_run(run_dir, steps=12, slope=0.05, entropy=True):
    with MetricsLogger(run_dir, tensorboard=False) as logger:
        for step in range(1, steps + 1):
            metrics = {
                "reward": {"mean": 0.1 + slope * step, "std": 0.2},
                "accuracy": 0.05 * step,
                "response_length": {"mean": 100.0 + step, "max": 256, "clip_ratio": 0.1},
                "actor": {"kl": 1e-3 * step, "clip_frac_low": 0.01, "clip_frac_high": 0.02, "lr": 1e-6},
                "actor/grad_norm": math.nan if step == 5 else 1.0 / step,
                "timing_s": {"generate": 3.0, "reward": 0.5, "update_actor": 1.5, "step": 5.1},
                "perf": {"tokens_per_s": 900.0 + step, "samples_per_s": 2.5},
                "samples_consumed": 32 * step,
            }
            if entropy:
                metrics["actor/entropy"] = 1.0 - 0.01 * step
            logger.log(step, metrics)
            if step % 4 == 0:
                logger.log(step, {"eval/accuracy": 0.04 * step, "eval/reward_mean": 0.05 * step}, kind="eval")


def test_plot_run_writes_one_png_per_panel_with_data(tmp_path):
    _write_run(tmp_path, entropy=False)
    paths = plot_run(tmp_path)
    names = [p.name for p in paths]
    assert names == [
        "reward.png",
        "response_length.png",
        "kl.png",
        "clip_fraction.png",
        "grad_norm.png",
        "timing.png",
        "throughput.png",
    ]  # no entropy or staleness columns: no entropy.png, staleness.png
    assert all(p.parent == tmp_path / "plots" and _is_png(p) for p in paths)


def test_plot_run_with_only_eval_rows_and_custom_out_dir(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step, acc in ((0, 0.1), (10, 0.4)):
            logger.log(step, {"eval/accuracy": acc, "eval/response_length": 90.0, "eval/samples": 64}, kind="eval")
    paths = plot_run(tmp_path, out_dir=tmp_path / "figs")
    assert paths == [tmp_path / "figs" / "reward.png", tmp_path / "figs" / "response_length.png"]
    assert all(_is_png(p) for p in paths)


def test_plot_compare_draws_several_runs_against_a_chosen_column(tmp_path):
    runs = {}
    for name, slope in (("sync", 0.03), ("april", 0.05), ("async", 0.06)):
        _write_run(tmp_path / name, slope=slope, entropy=name != "sync")
        runs[name] = tmp_path / name
    out = plot_compare(runs, "reward/mean", x="samples_consumed", out=tmp_path / "cmp" / "reward.png", smooth=3)
    assert out == tmp_path / "cmp" / "reward.png" and _is_png(out)

    with pytest.raises(ValueError, match="'sync'.*'entropy'"):
        plot_compare(runs, "entropy", out=tmp_path / "x.png")
