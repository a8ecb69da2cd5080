"""D3S down-sampling (rollover.rollout.downsample): the max-variance sample subset, the
|A| x entropy token selection and its curriculum, hand-computed; in a run, the kept counts; and
`rollover bench learn` end to end on a tiny model with its summary checked by hand."""

from __future__ import annotations

import itertools
import json
import random
import statistics
from types import SimpleNamespace as NS

import pytest

from rollover.rollout.downsample import downsample, max_variance_subset, token_fraction_at, top_tokens
from rollover.types import Group, Prompt, Rollout


def _rollout(gid, reward, logprobs, mask=None):
    n = len(logprobs)
    return Rollout(group_id=gid, prompt_ids=[1], response_ids=[5] * n, logprobs=logprobs, versions=[0] * n,
                   loss_mask=mask or [1] * n, finish="stop", reward=reward, scores={"numeric": reward})


def test_max_variance_subset_by_hand():
    # k=2: the extremes
    assert max_variance_subset([0.1, 0.9, 0.5, 0.2, 0.8], 2) == [0, 1]
    # k=3: {0.1, 0.8, 0.9} and {0.1, 0.2, 0.9} tie at variance 0.38/3; fewer smallest wins
    assert max_variance_subset([0.1, 0.9, 0.5, 0.2, 0.8], 3) == [0, 1, 4]
    # binary rewards, k=4: two of each (variance 1/4); low end the earliest zeros, high end the latest ones
    assert max_variance_subset([1, 0, 0, 1, 0, 0, 0, 1], 4) == [1, 2, 3, 7]
    assert max_variance_subset([3.0, 1.0], 5) == [0, 1] and max_variance_subset([3.0], 0) == []


def test_max_variance_subset_matches_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(2, 9)
        xs = [rng.choice([0.0, 0.5, 1.0, rng.random()]) for _ in range(n)]
        k = rng.randint(1, n)
        best = max(statistics.pvariance([xs[i] for i in c]) for c in itertools.combinations(range(n), k))
        got = max_variance_subset(xs, k)
        assert len(got) == k == len(set(got))
        assert statistics.pvariance([xs[i] for i in got]) == pytest.approx(best, abs=1e-12), (xs, k)


def test_top_tokens_by_abs_advantage_times_entropy():
    a = _rollout("g", 1.0, [-0.5, -1.0, -0.1])
    b = _rollout("g", 0.0, [-0.2, -0.3, -5.0], mask=[1, 1, 0])  # the masked token is never switched on
    # scores: a 0.5, 1.0, 0.1; b (|A| = 2) 0.4, 0.6 -> 2 of 5 kept: a[1] and b[1]
    (ka, kb), dropped = top_tokens([a, b], [1.0, -2.0], 0.4)
    assert dropped == 3 and ka.loss_mask == [0, 1, 0] and kb.loss_mask == [0, 1, 0]
    assert a.loss_mask == [1, 1, 1] and b.loss_mask == [1, 1, 0]  # inputs untouched
    same, none = top_tokens([a, b], [1.0, -2.0], 1.0)
    assert none == 0 and same == [a, b]


def test_token_fraction_curriculum():
    cfg = NS(token_fraction=1.0, token_fraction_start=0.5, anneal_steps=4)
    assert [token_fraction_at(cfg, s) for s in (1, 3, 5, 9)] == [0.5, 0.75, 1.0, 1.0]
    assert token_fraction_at(NS(token_fraction=0.3, token_fraction_start=None, anneal_steps=0), 7) == 0.3


def test_train_batch_keeps_the_subset_with_whole_group_advantages(tmp_path):
    from rollover.config import load_config
    from rollover.loops.batch import train_batch_from
    from rollover.rollout.groups import group_advantages

    cfg = load_config(None, ["rollout.samples_per_prompt=4", "downsample.keep=2", f"run_dir={tmp_path}"])
    p = Prompt(id="p", text="?")
    g1 = Group(id="g1", prompt=p, prompt_ids=[1], rollouts=[_rollout("g1", r, [-1.0]) for r in (1.0, 0.0, 0.0, 0.0)])
    g2 = Group(id="g2", prompt=p, prompt_ids=[1], rollouts=[_rollout("g2", r, [-1.0]) for r in (0.2, 0.6, 0.4, 1.0)])
    full, _ = group_advantages([g1, g2], cfg)
    batch, info = train_batch_from([g1, g2], cfg)
    # g1: the success and a zero (a tie between i = 0 and 1 goes to i = 0: the top two of the
    # stable order, the last zero and the one); g2: 0.2 and 1.0 (samples 0 and 3)
    assert batch.adv_B.tolist() == pytest.approx([full[i].item() for i in (0, 3, 4, 7)])
    assert info["downsample/samples_kept"] == 4 and info["downsample/samples_generated"] == 8
    assert info["downsample/token_fraction"] == 1.0 and info["downsample/tokens_kept"] == 4
    with pytest.raises(ValueError, match="advantages for"):
        downsample([g1], [0.0] * 3, cfg.downsample, 1)


@pytest.mark.parametrize("over,message", [
    (["downsample.keep=1"], "downsample.keep=1 must be >= 2"),
    (["downsample.keep=4"], "below rollout.samples_per_prompt=4"),
    (["downsample.token_fraction_start=0.5"], "needs downsample.anneal_steps"),
    (["downsample.token_fraction=0"], "token_fraction"),
])
def test_downsample_config_errors_name_the_field(over, message):
    from rollover.config import load_config

    with pytest.raises(ValueError, match=message):
        load_config(None, ["rollout.samples_per_prompt=4", *over])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rollover.testing import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama", seed=3))


def test_a_run_trains_the_kept_samples_and_tokens(model_dir, tmp_path):
    from rollover.loops.sync import train_sync
    from rollover.metrics import read_metrics
    from test_train import tiny_cfg

    train_sync(tiny_cfg(model_dir, tmp_path, **{"rollout.samples_per_prompt": 4, "downsample.keep": 2,
                                                  "downsample.token_fraction_start": 0.5, "downsample.anneal_steps": 2,
                                                  "steps": 3, "eval.every": 0}))
    rows = read_metrics(tmp_path, kind="train")
    assert [r["downsample/samples_kept"] for r in rows] == [6, 6, 6]  # 3 prompts x 2
    assert [r["downsample/samples_generated"] for r in rows] == [12, 12, 12]
    assert [r["downsample/token_fraction"] for r in rows] == [0.5, 0.75, 1.0]
    assert [r["samples_consumed_total"] for r in rows] == [6, 12, 18]
    assert [r["samples"] for r in rows] == [6, 6, 6]  # what each step trained, not what it generated
    ledger = [json.loads(x) for x in open(tmp_path / "trained_groups.jsonl")]
    groups = [g for row in ledger for g in row["groups"]]
    assert all(g["samples"] == 2 == len(g["lengths"]) and g["generated"] == 4 for g in groups)
    assert all(g["tokens"] == sum(g["lengths"]) for g in groups)


def test_bench_learn_fields_and_summary(model_dir, tmp_path):
    from rollover.bench.learn import first_reach, summarize
    from rollover.cli import main

    out = tmp_path / "learn.json"
    png = tmp_path / "learn.png"
    assert main(["bench", "learn", "--model", model_dir, "--policies", "grpo", "d3s", "--seeds", "2",
                 "--steps", "2", "--eval-every", "1", "--eval-size", "2", "--eval-samples", "1",
                 "--prompts-per-step", "2", "--samples-per-prompt", "2", "--threshold", "0.0",
                 "--json", str(out), "--plot", str(png), "rollout.max_new_tokens=4", "rollout.max_rows=8"]) == 0
    r = json.loads(out.read_text())
    assert png.stat().st_size > 0 and len(r["runs"]) == 4
    for run in r["runs"]:
        assert [p["step"] for p in run["curve"]] == [0, 1, 2]
        generated = 2 * (4 if run["policy"] == "d3s" else 2)  # d3s: twice the samples, half trained
        assert [p["samples"] for p in run["curve"]] == [0, generated, 2 * generated]
        assert [p["trained"] for p in run["curve"]] == [0, 4, 8]
        assert run["curve"][0]["train_seconds"] == 0 < run["curve"][1]["train_seconds"] < run["curve"][2]["train_seconds"]
    s = r["summary"]
    assert set(s) == {"grpo", "d3s"} and all(v["reached"] == 2 for v in s.values())  # threshold 0: at step 0
    assert s["grpo"]["seconds_to_threshold"]["mean"] == 0.0
    again = tmp_path / "again.json"  # the same runs summarized at a threshold nobody reaches
    assert main(["bench", "learn", "--summarize", str(out), "--threshold", "1.5", "--json", str(again)]) == 0
    r2 = json.loads(again.read_text())
    assert r2["runs"] == r["runs"] and r2["threshold"] == 1.5
    assert all(v["reached"] == 0 and v["seconds_to_threshold"]["mean"] is None for v in r2["summary"].values())

    # the summary by hand: two seeds, one reaches 0.5 at its second evaluation, one never
    def run(policy, accs):
        return {"policy": policy, "curve": [{"step": i, "samples": 10 * i, "trained": 10 * i,
                                             "train_seconds": 3.0 * i, "accuracy": a} for i, a in enumerate(accs)]}
    runs = [run("a", [0.1, 0.3, 0.6]), run("a", [0.2, 0.4, 0.45]), run("b", [0.0, 0.5, 0.9]), run("b", [0.1, 0.7, 0.8])]
    assert first_reach(runs[0]["curve"], 0.5)["step"] == 2 and first_reach(runs[1]["curve"], 0.5) is None
    got = summarize(runs, 0.5)
    assert got["a"]["reached"] == 1 and got["a"]["seconds_to_threshold"] == {"mean": 6.0, "std": 0.0, "n": 1}
    assert got["b"]["samples_to_threshold"] == {"mean": 10.0, "std": 0.0, "n": 2}
    assert got["a"]["final_accuracy"]["mean"] == pytest.approx(0.525)
    assert got["b"]["final_accuracy"]["std"] == pytest.approx(statistics.stdev([0.9, 0.8]))


def test_bench_learn_policies_set_what_they_name():
    import argparse

    from rollover.bench.learn import POLICIES, _overrides
    from rollover.config import load_config

    args = argparse.Namespace(model="m", steps=40, task="hard", eval_size=64, prompts_per_step=8,
                              samples_per_prompt=4, eval_every=5, eval_samples=2, overrides=[])
    cfgs = {p: load_config(None, _overrides(args, p, 0, "runs/x")) for p in POLICIES}
    assert cfgs["grpo"].selection.dars == "off" and cfgs["grpo"].rollout.samples_per_prompt == 4
    assert cfgs["dars"].selection.dars == "equal" and cfgs["dars"].selection.dars_max_samples == 8
    assert cfgs["vade"].selection.policy == "thompson" and cfgs["xrpo"].selection.allocation == "xrpo"
    assert cfgs["d3s"].rollout.samples_per_prompt == 8 and cfgs["d3s"].downsample.keep == 4
    big = cfgs["large_n"]
    assert big.partial_rollout.enabled and (big.rollout.samples_per_prompt, big.rollout.prompts_per_step) == (16, 2)
    assert not cfgs["grpo"].partial_rollout.enabled
    assert all(c.steps == 40 and c.seed == 0 for c in cfgs.values())


def test_bench_learn_resume_keeps_finished_runs(model_dir, tmp_path):
    from rollover.cli import main

    out = tmp_path / "learn.json"
    common = ["bench", "learn", "--model", model_dir, "--policies", "grpo", "--steps", "1", "--eval-every", "1",
              "--eval-size", "2", "--eval-samples", "1", "--prompts-per-step", "2", "--samples-per-prompt", "2",
              "--threshold", "0.0", "--json", str(out), "rollout.max_new_tokens=4", "rollout.max_rows=8"]
    assert main(common + ["--seeds", "1"]) == 0
    first = json.loads(out.read_text())["runs"]
    assert [(r["policy"], r["seed"]) for r in first] == [("grpo", 0)]
    # a stopped bench goes on: seed 0 is kept as it was, only seed 1 runs
    assert main(common + ["--seeds", "2", "--resume"]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert runs[0] == first[0] and [(r["policy"], r["seed"]) for r in runs] == [("grpo", 0), ("grpo", 1)]
    # other settings than the file's: refused, naming the setting
    other = list(common)
    other[other.index("--steps") + 1] = "2"
    with pytest.raises(SystemExit, match="steps=1, not 2"):
        main(other + ["--resume"])


def test_trl_side_accuracy_counts_samples_as_rollover_evaluation_does(model_dir):
    """`bench learn --policies trl` evaluates TRL's weights with HF generate: every sample of every
    prompt scored by `numeric` against its own prompt's answer (TRL itself is not needed here)."""
    import torch

    from rollover.bench.trl_side import hf_accuracy
    from rollover.config import load_config
    from rollover.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    tok.padding_side = "left"
    cfg = load_config(None, [f"model={model_dir}", "eval.samples_per_prompt=2", "reward.functions=[numeric]"])
    prompts = [Prompt(id="a", text="1+1", answer=2), Prompt(id="b", text="2+2", answer=4),
               Prompt(id="c", text="3+3", answer=6)]
    said = iter(["2", "7", "4", "4", "5", "9"])  # a: one of two right; b: both; c: neither

    class Model:  # returns the prompt followed by the next canned completion, one per sample
        training, device = True, torch.device("cpu")

        def eval(self):
            self.training = False

        def train(self, mode=True):
            self.training = mode

        def generate(self, input_ids, attention_mask, num_return_sequences, **kw):
            rows = [torch.cat([row, torch.tensor(tok.encode(next(said), add_special_tokens=False))])
                    for row in input_ids.repeat_interleave(num_return_sequences, 0)]
            assert len({len(r) for r in rows}) == 1  # one token each: no padding to strip
            return torch.stack(rows)

    model = Model()
    assert hf_accuracy(model, tok, prompts, cfg, batch=2) == pytest.approx(3 / 6)
    assert model.training  # back in training mode for TRL's next step
    # greedy: one completion per prompt (HF refuses several), counted as all its samples
    said = iter(["2", "4", "5"])
    greedy = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"temperature": 0.0})})
    assert hf_accuracy(model, tok, prompts, greedy, batch=2) == pytest.approx(4 / 6)
