"""On-policy distillation (distill.teacher): each trained token's advantage moves by the teacher's
logprob less the sampler's, computed by a frozen teacher over the trainer's own micro-batches, on
one trainer and on FSDP ranks alike (tiny models, CPU)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from rollover.algos.distill import generalized_jsd, teacher_advantages
from rollover.config import ConfigError, load_config
from rollover.loops.sync import train_sync
from rollover.testing import save_swapped_tokenizer_model, save_tiny_model, tiny_model
from rollover.train.batch import TrainBatch
from rollover.train.trainer import Trainer
from rollover.types import Rollout


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama", seed=3))


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """Another network (another size, other weights) with the policy's tokenizer."""
    return str(save_tiny_model(tmp_path_factory.mktemp("t") / "teacher", "llama", seed=11, hidden_size=48))


def test_the_teacher_term_by_hand():
    adv = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]])
    mask = torch.tensor([[True, True, False], [True, False, True]])
    behav = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.1, -4.0]])
    teacher = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, -9.0, -2.0]])
    out, kl = teacher_advantages(adv, mask, behav, teacher, weight=2.0, outcome_weight=0.5)
    torch.testing.assert_close(kl, torch.tensor([[0.5, -1.0, 0.0], [0.0, 0.0, -2.0]]))
    # 0.5·A - 2·(s - q) on the loss tokens, 0 elsewhere
    torch.testing.assert_close(out, torch.tensor([[0.5 - 1.0, 0.5 + 2.0, 0.0], [-0.25, 0.0, -0.25 + 4.0]]))
    alone, _ = teacher_advantages(adv, mask, behav, teacher, outcome_weight=0.0)
    torch.testing.assert_close(alone, torch.tensor([[-0.5, 1.0, 0.0], [0.0, 0.0, 2.0]]))
    with pytest.raises(ValueError, match="teacher_logp_BT \\(2, 2\\) must match adv_BT \\(2, 3\\)"):
        teacher_advantages(adv, mask, behav, teacher[:, :2])


def test_the_generalised_jsd_by_hand():
    """beta 0: KL(teacher ‖ student); 1: KL(student ‖ teacher); between: the mixture's form,
    symmetric at 0.5 and at most log 2 there; 0 where the two agree; the gradient reaches the
    student's log-probabilities only."""
    import math

    s = torch.tensor([[0.7, 0.2, 0.1], [0.25, 0.25, 0.5]]).log().requires_grad_(True)
    q = torch.tensor([[0.1, 0.3, 0.6], [0.25, 0.25, 0.5]]).log()

    def kl(a, b):  # KL(a ‖ b) of each row, by the definition
        return [sum(x * math.log(x / y) for x, y in zip(ra, rb)) for ra, rb in zip(a.exp().tolist(), b.exp().tolist())]

    torch.testing.assert_close(generalized_jsd(s, q, 0.0), torch.tensor(kl(q, s)))
    torch.testing.assert_close(generalized_jsd(s, q, 1.0), torch.tensor(kl(s, q)))
    beta = 0.3
    m = (beta * q.exp() + (1 - beta) * s.exp()).log()
    by_hand = [beta * a + (1 - beta) * b for a, b in zip(kl(q, m), kl(s, m))]
    torch.testing.assert_close(generalized_jsd(s, q, beta), torch.tensor(by_hand))
    half = generalized_jsd(s, q, 0.5)
    torch.testing.assert_close(half, generalized_jsd(q, s.detach(), 0.5))
    assert 0 < float(half[0].detach()) < math.log(2) and abs(float(half[1].detach())) < 1e-7
    generalized_jsd(s, q, 0.5).sum().backward()
    assert s.grad is not None and float(s.grad[0].abs().sum()) > 0
    with pytest.raises(ValueError, match=r"beta=1.5 must lie in \[0, 1\]"):
        generalized_jsd(s, q, 1.5)


def batch_of(seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    rolls, advs = [], []
    for gi in range(4):
        prompt = torch.randint(3, 60, (5,), generator=g).tolist()
        for _ in range(3):
            n = int(torch.randint(2, 8, (1,), generator=g))
            rolls.append(Rollout(group_id=f"g{gi}", prompt_ids=prompt, response_ids=torch.randint(3, 60, (n,), generator=g).tolist(),
                                 logprobs=(-torch.rand(n, generator=g) - 0.5).tolist(), versions=[0] * n,
                                 loss_mask=[1] * (n - 1) + [gi % 2], finish="stop", reward=0.0))
            advs.append(float(torch.randn(1, generator=g)))
    return TrainBatch.from_rollouts(rolls, advs)


def cfg_of(**over):
    base = {"device": "cpu", "model": "unused", "run_dir": "unused", "data.train": "gen:arithmetic?n=10",
            "rollout.samples_per_prompt": 3, "rollout.max_new_tokens": 8, "rollout.temperature": 0.7, "train.lr": 1e-2}
    base.update(over)
    return load_config(**base)


def test_the_trainer_moves_each_tokens_advantage_by_the_teachers_logprob_at_the_sampling_temperature(teacher_dir):
    """The teacher's pass gives each token the log-softmax of the teacher's logits over its whole
    sequence, divided by the rollout temperature; the update trains on
    `outcome_weight·A - weight·(s - q)`."""
    from transformers import AutoModelForCausalLM

    cfg = cfg_of(**{"distill.teacher": teacher_dir, "distill.weight": 0.5, "distill.outcome_weight": 0.25})
    trainer = Trainer(tiny_model("llama", seed=3), cfg, device=torch.device("cpu"))
    batch = batch_of()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    q = torch.zeros_like(batch.behav_logp_BT)
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
            logits = teacher(torch.tensor([p + r])).logits[0, len(p) - 1: len(p) + len(r) - 1] / 0.7
            q[i, : len(r)] = logits.log_softmax(-1).gather(-1, torch.tensor(r)[:, None])[:, 0]
    q = q.masked_fill(~batch.mask_BT, 0.0)
    seen = {}
    update = trainer._update

    def spy(b, *a, **kw):  # the batch the update trains on
        seen["adv_BT"] = b.adv_BT
        return update(b, *a, **kw)

    trainer._update = spy
    metrics = trainer.train_step(batch)
    expected = (0.25 * batch.adv_B[:, None] - 0.5 * (batch.behav_logp_BT - q)).masked_fill(~batch.mask_BT, 0.0)
    torch.testing.assert_close(seen["adv_BT"], expected, rtol=1e-5, atol=1e-5)
    kl = float((batch.behav_logp_BT - q)[batch.mask_BT].mean())
    assert metrics["distill/reverse_kl"] == pytest.approx(kl, rel=1e-5, abs=1e-6)
    assert trainer.teacher is not None and not any(p.requires_grad for p in trainer.teacher.parameters())


def test_a_bfloat16_teacher_holds_half_the_bytes_and_scores_the_tokens_as_the_float32_one(teacher_dir):
    """distill.dtype=bfloat16: the teacher's weights in bfloat16, its logits taken in float32;
    its logprobs are the float32 teacher's to bfloat16's precision."""
    batch = batch_of(2)
    scored = {}
    for dtype in ("float32", "bfloat16"):
        cfg = cfg_of(**{"distill.teacher": teacher_dir, "distill.dtype": dtype})
        trainer = Trainer(tiny_model("llama", seed=3), cfg, device=torch.device("cpu"))
        assert {p.dtype for p in trainer.teacher.parameters()} == {getattr(torch, dtype)}
        scored[dtype] = (trainer.logprobs(batch, trainer.teacher), sum(p.nbytes for p in trainer.teacher.parameters()))
    (q32, bytes32), (q16, bytes16) = scored["float32"], scored["bfloat16"]
    assert bytes16 * 2 == bytes32 and q16.dtype == torch.float32
    assert 0 < float((q16 - q32).abs().max()) < 0.1
    torch.testing.assert_close(q16, q32, rtol=0.02, atol=0.03)


@pytest.mark.parametrize("extra_rows, masked", [(0, False), (40, False), (0, True)])
def test_with_jsd_the_update_descends_the_divergence_of_whole_distributions(teacher_dir, tmp_path, extra_rows, masked):
    """distill.loss=jsd: the update's gradient is `weight` times that of the token-mean of the
    generalised JSD between the policy's and the teacher's next-token distributions (at the
    rollout temperature) over the loss tokens; with outcome_weight 0 the rewards add nothing.
    The step's `distill/divergence` is that mean. A teacher with more embedding rows than the
    policy (a larger padded vocabulary) is compared over the policy's rows; importance
    sampling's mask (here cutting most tokens, whose sampler logprobs are made up) leaves the
    divergence whole."""
    from transformers import AutoModelForCausalLM

    if extra_rows:
        rows = tiny_model("llama").config.vocab_size + extra_rows
        teacher_dir = str(save_tiny_model(tmp_path / "wide", "llama", seed=11, hidden_size=48, vocab_size=rows))
    over = {"distill.teacher": teacher_dir, "distill.loss": "jsd", "distill.beta": 0.3, "distill.weight": 0.5,
            "distill.outcome_weight": 0.0}
    if masked:
        over["algorithm.loss_options"] = {"is_level": "token", "is_mode": "mask", "is_cap": 1.5}
    cfg = cfg_of(**over)
    policy = tiny_model("llama", seed=3)
    mine = copy.deepcopy(policy)
    trainer = Trainer(policy, cfg, device=torch.device("cpu"))
    batch = batch_of(3)
    if masked:  # a sampler far less sure than the policy: ratios past the cap, masked
        from dataclasses import replace

        batch = replace(batch, behav_logp_BT=batch.behav_logp_BT - 10.0)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    total, count = 0.0, int(batch.mask_BT.sum())
    for i, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
        ids = torch.tensor([p + r])
        span = slice(len(p) - 1, len(p) + len(r) - 1)
        student = (mine(ids).logits[0, span] / 0.7).log_softmax(-1)
        with torch.no_grad():
            theirs = (teacher(ids).logits[0, span, : student.shape[-1]] / 0.7).log_softmax(-1)
        total = total + generalized_jsd(student, theirs, 0.3)[batch.mask_BT[i, : len(r)]].sum()
    (0.5 * total / count).backward()
    grads = {}
    step = trainer._optimizer_step

    def spy(finite):
        grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
        return step(finite)

    trainer._optimizer_step = spy
    metrics = trainer.train_step(batch)
    assert metrics["distill/divergence"] == pytest.approx(float(total.detach()) / count, rel=1e-4)
    assert not masked or metrics["actor/masked_frac"] > 0.5
    assert "distill/reverse_kl" not in metrics
    expected = dict(mine.named_parameters())
    assert grads.keys() == {n for n, p in expected.items() if p.grad is not None}
    for name, g in grads.items():
        torch.testing.assert_close(g, expected[name].grad, rtol=1e-3, atol=1e-6, msg=name)


def run_cfg(model_dir, run_dir, **over):
    base = {
        "device": "cpu", "model": model_dir, "run_dir": str(run_dir), "steps": 8, "seed": 7, "resume": "auto",
        "data.train": "gen:arithmetic?n=120", "data.eval_size": 4, "data.max_prompt_tokens": 64,
        "rollout.prompts_per_step": 8, "rollout.samples_per_prompt": 1, "rollout.max_new_tokens": 8,
        "rollout.max_rows": 8, "reward.functions": ["numeric"], "train.lr": 3e-3, "eval.every": 0,
        "eval.at_start": False, "checkpoint.every": 4, "logging.progress": False, "logging.tensorboard": False,
        "distill.outcome_weight": 0.0,
    }
    base.update(over)
    return load_config(**base)


def train_rows(run_dir):
    return [r for r in map(json.loads, open(run_dir / "metrics.jsonl")) if r["kind"] == "train"]


def test_a_student_distilled_from_a_teacher_comes_closer_to_it(model_dir, teacher_dir, tmp_path):
    """With the teacher alone (distill.outcome_weight 0, one sample a prompt) the reverse KL to the
    teacher falls as the student trains; the policy as its own teacher is at KL 0 on-policy; a run
    killed after step 4 and resumed ends with the straight run's weights."""
    from safetensors.torch import load_file

    train_sync(run_cfg(model_dir, tmp_path / "straight", **{"distill.teacher": teacher_dir}))
    kl = [r["distill/reverse_kl"] for r in train_rows(tmp_path / "straight")]
    # each step's KL is over ~50 fresh tokens, so noisy: the first two steps against the last three
    assert len(kl) == 8 and sum(kl[-3:]) / 3 < 0.6 * sum(kl[:2]) / 2, kl
    train_sync(run_cfg(model_dir, tmp_path / "resumed", steps=4, **{"distill.teacher": teacher_dir}))
    train_sync(run_cfg(model_dir, tmp_path / "resumed", **{"distill.teacher": teacher_dir}))
    a = load_file(str(tmp_path / "straight" / "checkpoints" / "step_000008" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "checkpoints" / "step_000008" / "model" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    train_sync(run_cfg(model_dir, tmp_path / "self", steps=1, **{"distill.teacher": model_dir}))
    assert abs(train_rows(tmp_path / "self")[0]["distill/reverse_kl"]) < 1e-4  # the sampler is the teacher


def test_a_student_taught_by_jsd_alone_comes_closer_to_the_teacher(model_dir, teacher_dir, tmp_path):
    """distill.loss=jsd with the teacher alone: the divergence of whole distributions falls as
    the student trains, and the step's metrics carry it (not the sampled reverse KL)."""
    train_sync(run_cfg(model_dir, tmp_path / "jsd", **{"distill.teacher": teacher_dir, "distill.loss": "jsd",
                                                         "distill.beta": 0.5}))
    rows = train_rows(tmp_path / "jsd")
    div = [r["distill/divergence"] for r in rows]
    assert len(div) == 8 and all(d >= 0 for d in div) and "distill/reverse_kl" not in rows[0]
    assert sum(div[-3:]) / 3 < 0.6 * sum(div[:2]) / 2, div


@pytest.mark.parametrize("loss, sp", [("sampled", 1), ("jsd", 1), ("jsd", 2)])
def test_on_two_ranks_the_teacher_is_sharded_and_the_step_is_one_trainers(teacher_dir, loss, sp):
    """train.parallel=fsdp: rank 0 reads the teacher (here in bfloat16), the other rank takes its
    shards; the teacher's metric is over both ranks' tokens and the update is one trainer's
    (jsd: the teacher's output layer applied whole on each rank; with sequence parallelism
    each rank's slice of every row)."""
    from rollover.train.ranks import ShardedTrainer

    cfg = cfg_of(**{"distill.teacher": teacher_dir, "train.parallel": "fsdp", "train.ranks": 2,
                    "distill.dtype": "bfloat16", "distill.loss": loss, "train.sequence_parallel": sp})
    model = tiny_model("llama", seed=3)
    plain = Trainer(copy.deepcopy(model), cfg, device=torch.device("cpu"))
    start = {n: t.clone() for n, t in plain.named_weights()}
    sharded = ShardedTrainer(copy.deepcopy(model), cfg, pad_id=0)
    try:
        b = batch_of(1)
        mp, ms = plain.train_step(b), sharded.train_step(b)
        for k in ("distill/reverse_kl" if loss == "sampled" else "distill/divergence", "actor/pg_loss",
                  "actor/grad_norm"):
            assert ms[k] == pytest.approx(mp[k], rel=1e-4, abs=1e-6), k
        after = dict(sharded.named_weights())
        moved = max(float((t - start[n]).abs().max()) for n, t in plain.named_weights())
        assert moved > 0.5 * cfg.train.lr
        assert max(float((t - after[n]).abs().max()) for n, t in plain.named_weights()) < 0.05 * cfg.train.lr
    finally:
        sharded.close()


def sequence_classifier(path):
    from transformers import AutoModelForSequenceClassification

    from rollover.testing import char_tokenizer, tiny_config

    AutoModelForSequenceClassification.from_config(tiny_config("llama", num_labels=1)).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("make, match", [
    (save_swapped_tokenizer_model, r"distill.teacher=.* another tokenizer than the policy's \(token 'a' is .* in the teacher's\)"),
    (lambda d: save_tiny_model(d, max_position_embeddings=16), "a context of 16 tokens; the run's sequences reach 40"),
    (lambda d: save_tiny_model(d, "gpt2"), "is a gpt2 model: the teacher must be of the Llama, Mistral or Qwen families"),
    (sequence_classifier, "LlamaForSequenceClassification: the teacher gives each token a probability"),
    (lambda d: d / "absent", "not a model with a tokenizer"),
    (lambda d: (d / "checkpoints").mkdir(parents=True) or d, r"is a rollover run directory, not a model: give one of "
                                                             r"its checkpoints' model/ directory, or export it first"),
])
def test_a_teacher_that_cannot_score_the_policys_tokens_is_refused(model_dir, tmp_path, make, match):
    from rollover.models import load_tokenizer
    from rollover.train.teacher import check_teacher_model

    path = str(make(tmp_path / "teacher"))
    with pytest.raises(ValueError, match=match):
        check_teacher_model(path, load_tokenizer(model_dir), tiny_model("llama").config, 40)


def test_a_teacher_with_fewer_rows_than_the_policys_head_samples_is_refused(model_dir, teacher_dir):
    """A policy whose head is wider than its tokenizer (padded vocabularies) can sample ids the
    tokenizer does not name; a teacher without rows for them is refused, one with them is not."""
    from rollover.models import load_tokenizer
    from rollover.testing import tiny_config
    from rollover.train.teacher import check_teacher_model

    tokenizer = load_tokenizer(model_dir)
    n = len(tokenizer)
    check_teacher_model(teacher_dir, tokenizer, tiny_config("llama", vocab_size=n), 40)
    with pytest.raises(ValueError, match=rf"embeds {n} tokens, fewer than the {n + 8} the policy's head can sample "
                                         rf"\(ids {n}-{n + 7} have no row in the teacher's embedding\)"):
        check_teacher_model(teacher_dir, tokenizer, tiny_config("llama", vocab_size=n + 8), 40)


def test_a_teacher_checkpoint_missing_weights_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from rollover.train.teacher import teacher_model

    path = save_tiny_model(tmp_path / "teacher")
    weights = load_file(str(path / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 of the model's weights \(e.g. model.layers.1.mlp.up_proj.weight\)"):
        teacher_model(str(path))
    (path / "model.safetensors").write_bytes(b"\x07")  # truncated
    with pytest.raises(ValueError, match=r"distill.teacher=.*: its weights do not load \(\w+Error"):
        teacher_model(str(path))
    (path / "model.safetensors").unlink()  # no weight file at all
    with pytest.raises(ValueError, match=r"distill.teacher=.*: its weights do not load \(OSError: .*model.safetensors"):
        teacher_model(str(path))


@pytest.mark.parametrize("over, match", [
    ({"distill.teacher": "t", "algorithm.advantage": "gae"}, "distill.teacher with algorithm.advantage=gae"),
    ({"distill.teacher": "t", "algorithm.loss": "gspo", "algorithm.aggregation": "seq-mean-token-mean"},
     "algorithm.loss=gspo clips one ratio per sequence"),
    ({"distill.weight": 2.0, "distill.dtype": "bfloat16"},
     "distill.weight, distill.dtype without distill.teacher: set the teacher they apply to"),
    ({"distill.teacher": "t", "rollout.samples_per_prompt": 1}, "compares samples of a group"),
    ({"distill.teacher": "t", "downsample.token_fraction": 0.5}, "D3S picks samples and tokens by the rewards'"),
    ({"distill.teacher": "t", "distill.outcome_weight": 0.0, "algorithm.dynamic_sampling": True},
     "the rewards, which do not train, would still drop"),
    ({"distill.teacher": "t", "rollout.top_p": 0.9, "rollout.repetition_penalty": 1.1},
     r"rollout.top_p=0.9, rollout.repetition_penalty=1.1: the sampler's logprobs are then of a cut"),
    ({"distill.teacher": "t", "distill.beta": 0.9}, "distill.beta=0.9 weighs the divergence of distill.loss=jsd"),
    ({"distill.loss": "jsd"}, "distill.loss without distill.teacher"),
    ({"distill.teacher": "t", "distill.loss": "jsd", "algorithm.advantage": "gae"}, "with algorithm.advantage=gae"),
    ({"distill.teacher": "t", "distill.loss": "jsd", "downsample.keep": 2, "rollout.samples_per_prompt": 4},
     "distill.teacher with downsample"),
])
def test_distill_config_conflicts_are_refused(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(model="unused", run_dir="unused", **over)


def test_jsd_takes_what_only_the_sampled_term_refuses():
    """The divergence of whole distributions uses neither the sampler's logprobs nor one
    advantage a token: a cut sampling distribution and GSPO's sequence ratio are allowed."""
    cfg = load_config(model="unused", run_dir="unused", **{
        "distill.teacher": "t", "distill.loss": "jsd", "rollout.top_p": 0.9, "algorithm.loss": "gspo",
        "algorithm.aggregation": "seq-mean-token-mean"})
    assert cfg.distill.loss == "jsd" and cfg.algorithm.loss == "gspo"


def test_the_teacher_alone_allows_one_sample_a_prompt():
    cfg = load_config(model="unused", run_dir="unused", **{"distill.teacher": "t", "distill.outcome_weight": 0.0,
                                                           "rollout.samples_per_prompt": 1})
    assert cfg.distill.outcome_weight == 0.0
