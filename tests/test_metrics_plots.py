import math
import random
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from rollover.config import load_config
from rollover.metrics import MetricsLogger, plot_compare, plot_run
from rollover.rollout.groups import rollout_metrics
from rollover.types import Group, Prompt, Rollout

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
        "truncation.png",
        "kl.png",
        "clip_fraction.png",
        "grad_norm.png",
        "timing.png",
        "throughput.png",
    ]  # no entropy or staleness columns: no entropy.png, staleness.png
    assert all(p.parent == tmp_path / "plots" and _is_png(p) for p in paths)


def test_a_rewards_extra_numbers_are_not_drawn_on_the_reward_axis():
    """`rewards/<fn>/<key>/mean` (a dict's extra keys, TRL's log_extra: a length, a count) would
    share the reward's axis; each function's own mean is drawn."""
    from rollover.metrics.plots import _PANELS, _matching

    reward = next(p for p in _PANELS if p.name == "reward")
    rows = [{"reward/mean": 0.5, "rewards/math/mean": 0.5, "rewards/math/length/mean": 412.0}]
    assert _matching(rows, reward.train) == ["reward/mean", "rewards/math/mean"]


def test_distillations_distance_to_the_teacher_has_its_own_panel(tmp_path):
    """distill/reverse_kl and distill/divergence are drawn apart from the policy's KL terms."""
    from rollover.metrics.plots import _PANELS, _matching

    panels = {p.name: p for p in _PANELS}
    cols = ["actor/kl", "actor/rollout_kl", "distill/reverse_kl", "distill/divergence"]
    rows = [{c: 0.1 for c in cols}]
    assert _matching(rows, panels["kl"].train) == ["actor/kl", "actor/rollout_kl"]
    assert _matching(rows, panels["distill"].train) == ["distill/reverse_kl", "distill/divergence"]
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(1, 6):
            logger.log(step, {"distill/divergence": 0.05 / step, "actor/grad_norm": 1.0})
    assert [p.name for p in plot_run(tmp_path)] == ["distill.png", "grad_norm.png"]


def test_plot_run_with_only_eval_rows_and_custom_out_dir(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step, acc in ((0, 0.1), (10, 0.4)):
            logger.log(step, {"eval/accuracy": acc, "eval/response_length": 90.0, "eval/samples": 64}, kind="eval")
    paths = plot_run(tmp_path, out_dir=tmp_path / "figs")
    assert paths == [tmp_path / "figs" / "reward.png", tmp_path / "figs" / "response_length.png"]
    assert all(_is_png(p) for p in paths)
    # the metrics file itself: the PNGs go beside it, in the run's plots/ (it had tried metrics.jsonl/plots)
    assert plot_run(tmp_path / "metrics.jsonl") == [tmp_path / "plots" / "reward.png", tmp_path / "plots" / "response_length.png"]


def test_plot_compare_draws_several_runs_against_a_chosen_column(tmp_path):
    runs = {}
    for name, slope in (("sync", 0.03), ("april", 0.05), ("async", 0.06)):
        _write_run(tmp_path / name, slope=slope, entropy=name != "sync")
        runs[name] = tmp_path / name
    out = plot_compare(runs, "reward/mean", x="samples_consumed", out=tmp_path / "cmp" / "reward.png", smooth=3)
    assert out == tmp_path / "cmp" / "reward.png" and _is_png(out)

    with pytest.raises(ValueError, match="'sync'.*'entropy'"):
        plot_compare(runs, "entropy", out=tmp_path / "x.png")


# --- the reward panel, fed with the metrics the training loop logs --------------------------------


def _step_metrics(scores_per_sample, weights):
    """What `rollout_metrics` logs for one step of 8-sample groups with these per-function scores."""
    cfg = load_config(model="m", run_dir="r", **{"data.train": "d"})
    rolls = [
        Rollout(group_id=f"g{i // 8}", prompt_ids=[1], response_ids=[2] * 5, logprobs=[0.0] * 5, versions=[0] * 5,
                loss_mask=[1] * 5, finish="stop", reward=sum(weights[f] * v for f, v in scores.items()), scores=scores)
        for i, scores in enumerate(scores_per_sample)
    ]
    groups = [Group(id=f"g{k}", prompt=Prompt(id=f"p{k}", text="q"), prompt_ids=[1], rollouts=rolls[k : k + 8])
              for k in range(0, len(rolls), 8)]
    return rollout_metrics(groups, cfg, primary=next(iter(weights)))


def _figures(run_dir, monkeypatch) -> dict:
    """The figures `plot_run` draws, by file name."""
    figures = {}
    savefig = Figure.savefig

    def keep(fig, path, *args, **kwargs):
        figures[Path(path).stem] = fig
        return savefig(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    plot_run(run_dir)
    return figures


def _reward_axes(run_dir, monkeypatch):
    """The axes `plot_run` draws reward.png on."""
    (ax,) = _figures(run_dir, monkeypatch)["reward"].axes
    return ax


def _band(ax):
    """(x, low, high) of the one shaded band."""
    (band,) = ax.collections
    vertices = band.get_paths()[0].vertices
    lows, highs = {}, {}
    for x, y in vertices:
        lows[x], highs[x] = min(y, lows.get(x, y)), max(y, highs.get(x, y))
    return sorted((x, lows[x], highs[x]) for x in lows)


def test_the_timing_of_a_one_step_run_is_drawn(tmp_path, monkeypatch):
    """One step: a stacked area has no width, so the phases are stacked bars, the total a marker."""
    _write_run(tmp_path, steps=1)
    (ax,) = _figures(tmp_path, monkeypatch)["timing"].axes
    heights = sorted(round(bar.get_height(), 6) for bar in ax.patches)
    assert heights == [0.5, 1.5, 3.0]  # generate, reward, update_actor
    assert [line.get_marker() for line in ax.lines] == ["."]  # the step's total


def test_one_binary_reward_draws_one_line_not_three(tmp_path, monkeypatch):
    rng = random.Random(1)
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(1, 11):  # 48 samples a step: means such as 7/48 differ in float32 and float64
            scores = [{"math": float(rng.random() < 0.05 * step)} for _ in range(48)]
            logger.log(step, _step_metrics(scores, {"math": 1.0}))
            if step % 5 == 0:
                logger.log(step, {"eval/accuracy": 0.07 * step, "eval/reward_mean": 0.07 * step}, kind="eval")
    ax = _reward_axes(tmp_path, monkeypatch)
    labels = [line.get_label() for line in ax.lines]
    assert labels == ["reward/mean (= rewards/math/mean = accuracy)", "eval: eval/accuracy (= eval/reward_mean)"]
    assert ax.get_legend() is not None and len(ax.get_legend().get_texts()) == 3  # two lines and the band


def test_different_series_are_all_drawn(tmp_path, monkeypatch):
    rng = random.Random(2)
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(1, 6):
            scores = [{"math": float(rng.random() < 0.5), "format": float(rng.random() < 0.8)} for _ in range(16)]
            metrics = _step_metrics(scores, {"math": 1.0, "format": 0.1})
            # verl's name, equal to the total reward at every step but one: a series of its own
            metrics["critic/score/mean"] = metrics["reward/mean"] + (0.25 if step == 3 else 0.0)
            logger.log(step, metrics)
    labels = [line.get_label() for line in _reward_axes(tmp_path, monkeypatch).lines]
    assert labels == ["reward/mean", "rewards/format/mean", "rewards/math/mean (= accuracy)", "critic/score/mean"]


def test_a_legend_of_many_series_stays_inside_the_figure(tmp_path, monkeypatch):
    """Five reward functions equal at every step (and the accuracy, 0 with these scores) are one
    entry naming two and counting the rest;
    ten distinct ones put the legend in columns below the plot, inside the saved figure."""
    rng = random.Random(4)
    names = [f"check_{k}" for k in range(15)]
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(1, 6):
            scores = []
            for _ in range(16):
                row = {name: rng.random() for name in names[:10]}
                row.update({name: 0.0 for name in names[10:]})  # five functions that never score
                scores.append(row)
            logger.log(step, _step_metrics(scores, {name: 1.0 for name in names}))
    fig = _figures(tmp_path, monkeypatch)["reward"]
    (ax,) = fig.axes
    labels = [line.get_label() for line in ax.lines]
    assert "rewards/check_10/mean (= rewards/check_11/mean = rewards/check_12/mean and 3 more)" in labels
    assert len(labels) == 12  # the total, ten distinct functions, one for the five equal ones
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)  # lays the figure out as the saved PNG
    (legend,) = fig.legends
    legend = legend.get_window_extent(renderer)
    assert legend.y1 <= ax.get_window_extent(renderer).y0  # below the plot, not over its lines
    assert fig.bbox.contains(legend.x0, legend.y0) and fig.bbox.contains(legend.x1, legend.y1)


def test_reward_band_is_the_standard_error_inside_each_steps_range(tmp_path, monkeypatch):
    rng = random.Random(3)
    steps = {}
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(1, 13):
            if step <= 3:  # one success in 64: mean ± std would be 0.016 ± 0.124
                values = [1.0] + [0.0] * 63
            else:
                values = [rng.choice([0.0, 0.0, 0.5, 1.0]) * rng.random() for _ in range(64)]
            steps[step] = values
            logger.log(step, _step_metrics([{"score": v} for v in values], {"score": 1.0}))
    band = _band(_reward_axes(tmp_path, monkeypatch))
    assert [x for x, _, _ in band] == list(range(1, 13))
    for x, low, high in band:
        values = steps[x]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        sem = std / math.sqrt(len(values))
        assert low == pytest.approx(mean - sem, abs=1e-6) and high == pytest.approx(mean + sem, abs=1e-6)
        assert min(values) - 1e-9 <= low <= high <= max(values) + 1e-9


def test_repetition_frac_is_the_share_of_responses_that_end_in_a_loop():
    """rollout/repetition_frac: responses whose last tokens are one block written again and again
    (3+ times, 32+ tokens, a block of at most 512); a closing token after it is not part of it."""
    from rollover.envs.base import INSERTED_VERSION
    from rollover.rollout.groups import ends_in_loop, last_turn_loops

    assert ends_in_loop([5] * 32) and not ends_in_loop([5] * 31)
    assert ends_in_loop(list(range(50)) + [7, 8, 9, 10] * 8) and not ends_in_loop([7, 8, 9, 10] * 8 + [1])
    assert ends_in_loop(list(range(20)) + list(range(40)) * 3) and not ends_in_loop(list(range(40)) * 2)
    assert not ends_in_loop(list(range(513)) * 3) and not ends_in_loop(list(range(300))) and not ends_in_loop([])
    assert ends_in_loop([7, 8, 9, 10] * 8 + [1], closing=True) and not ends_in_loop([7, 8, 9, 10] * 8 + [1, 2], closing=True)
    cfg = load_config(model="m", run_dir="r", **{"data.train": "d"})
    looped, stopped_loop, fine = [3] + [9, 4] * 20, [3] + [9, 4] * 20 + [0], [3, 1, 4, 1, 5, 9, 2, 6] * 2
    rolls = [Rollout(group_id="g", prompt_ids=[1], response_ids=ids, logprobs=[0.0] * len(ids), versions=[0] * len(ids),
                     loss_mask=[1] * len(ids), finish=finish, reward=0.0, scores={"math": 0.0})
             for ids, finish in [(looped, "length"), (stopped_loop, "stop"), (fine, "stop"), (fine, "length")]]
    metrics = rollout_metrics([Group(id="g", prompt=Prompt(id="p", text="q"), prompt_ids=[1], rollouts=rolls)], cfg, "math")
    assert metrics["rollout/repetition_frac"] == 0.5 and metrics["response_length/clip_ratio"] == 0.5
    assert ends_in_loop(list(range(70)) * 3) and not ends_in_loop(list(range(70)) * 2)  # a paragraph of 70 tokens
    # an episode: only its last turn counts (a policy that repeats one action turn after turn is not a loop of text)
    turn, said = [21, 22, 23, 24, 25, 26, 27, 0], [31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43]
    ids = (turn + said) * 4 + turn
    versions = ([0] * len(turn) + [INSERTED_VERSION] * len(said)) * 4 + [0] * len(turn)
    looped_last = (turn + said) + [9, 4] * 20 + [0]  # its last turn loops, then closes
    loop_versions = [0] * len(turn) + [INSERTED_VERSION] * len(said) + [0] * 41
    episodes = [Rollout(group_id="e", prompt_ids=[1], response_ids=x, logprobs=[0.0] * len(x), versions=v,
                        loss_mask=[1] * len(x), finish="length", reward=0.0, scores={"math": 0.0})
                for x, v in [(ids, versions), (looped_last, loop_versions)]]
    assert ends_in_loop(ids)  # as text the whole response would look like a loop
    assert not last_turn_loops(ids, versions) and last_turn_loops(looped_last, loop_versions)
    metrics = rollout_metrics([Group(id="e", prompt=Prompt(id="p", text="q"), prompt_ids=[1], rollouts=episodes)], cfg, "math")
    assert metrics["rollout/repetition_frac"] == 0.5



def test_the_reward_panels_eval_lines_are_accuracies_not_a_rewards_error_counts():
    from rollover.metrics.plots import _PANELS, _matching

    rows = [{"step": 0, "kind": "eval", "eval/accuracy": 0.5, "eval/gsm8k/accuracy": 0.4, "eval/reward_mean": 0.5,
             "eval/reward_errors": 2, "eval/rewards/accuracy_reward/errors": 2, "eval/pass_at_k": 0.75,
             "eval/maj_at_k": 0.5}]
    reward = next(p for p in _PANELS if p.name == "reward")
    assert _matching(rows, reward.eval) == ["eval/accuracy", "eval/gsm8k/accuracy", "eval/reward_mean",
                                            "eval/pass_at_k", "eval/maj_at_k"]


def test_the_reward_band_is_its_standard_error_over_the_samples_its_statistics_cover():
    """reward/std over sqrt(samples): under D3S down-sampling the statistics cover every sample
    generated (downsample/samples_generated), not the fewer trained (samples)."""
    from rollover.metrics.plots import _sem_band

    class Axes:
        def fill_between(self, xs, lo, hi, **kw):
            self.band = (xs, lo, hi)

    rows = [{"step": 1, "reward/mean": 0.5, "reward/std": 0.4, "samples": 4},
            {"step": 2, "reward/mean": 0.5, "reward/std": 0.4, "samples": 4, "downsample/samples_generated": 16}]
    ax = Axes()
    _sem_band(ax, rows, "k")
    xs, lo, hi = ax.band
    assert xs == [1, 2] and hi[0] - 0.5 == pytest.approx(0.2) and hi[1] - 0.5 == pytest.approx(0.1)


def test_a_phase_timed_within_another_and_lag_counts_stay_out_of_their_panels(tmp_path, monkeypatch):
    """`timing_s/weight_transfer` is part of `weight_sync`: no layer of its own (it would be
    counted twice); `staleness/hist/<lag>` counts groups: not drawn on the staleness axis."""
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(1, 4):
            logger.log(step, {"reward/mean": 0.1, "timing_s": {"train": 1.0, "weight_sync": 0.5, "weight_transfer": 0.4,
                                                               "step": 1.5},
                              "staleness": {"max": 1, "mean": 0.5, "hist/0": 2, "hist/1": 2}})
    figures = _figures(tmp_path, monkeypatch)
    timing = {t.get_text() for ax in figures["timing"].axes for t in ax.get_legend().get_texts()}
    staleness = {t.get_text() for ax in figures["staleness"].axes for t in ax.get_legend().get_texts()}
    assert not any("weight_transfer" in t for t in timing) and any("weight_sync" in t for t in timing)
    assert not any("hist" in t for t in staleness) and any("max" in t for t in staleness)
