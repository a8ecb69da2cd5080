"""Models outside rollover's own forward (Gemma 2/3, Cohere, Granite, Phi-3, Qwen3-MoE, GPT-2):
TorchEngine runs them through transformers' forward (`rollover.engine.hf_runner`) and the trainer
computes their logits as their forward does (`rollover.train.heads`). Tiny models, CPU."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from rollover.config import load_config
from rollover.engine.torch_engine import TorchEngine
from rollover.testing import GENERIC, save_tiny_model, tiny_model
from rollover.types import Request, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)


def hf_logprobs(model, prompt_ids, response_ids):
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)[len(prompt_ids) - 1: -1]
    return lp.gather(1, torch.tensor(response_ids)[:, None]).squeeze(1)


@pytest.mark.parametrize("arch", sorted(GENERIC))
def test_the_engine_samples_from_the_models_own_distribution(arch):
    """Six requests of different lengths on four rows (rows freed and refilled as they finish),
    sequences longer than Gemma's sliding window of 8: every logprob is the model's forward's."""
    model = tiny_model(arch, seed=2)
    with TorchEngine(model, device="cpu", max_rows=4, max_len=96, eos_token_ids=[]) as eng:
        assert eng.core.runner.arch == "generic"
        outs = eng.generate([Request(id=f"r{i}", prompt_ids=list(range(5, 8 + 2 * i)),
                                     sampling=SamplingParams(temperature=1.0, max_new_tokens=10 + 2 * i, seed=i))
                             for i in range(6)])
    for out in outs:
        ref = hf_logprobs(model, out.prompt_ids, out.response_ids)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4), (arch, out.id)


@pytest.mark.parametrize("arch, options", [("llama", {"attention_bias": True}), ("llama", {"mlp_bias": True}),
                                           ("llama", {"hidden_act": "gelu"}), ("qwen3", {"attention_bias": True})])
def test_a_config_rollovers_forward_lacks_runs_through_the_models_own(arch, options):
    """rollover's forward has SiLU MLPs without biases and no o_proj bias: a Llama or Qwen3 asking
    for more samples from its own forward (random biases, so a dropped one would show), and
    forward='rollover' is refused by name."""
    model = tiny_model(arch, seed=3, **options)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.3)
    with TorchEngine(model, device="cpu", max_rows=2, max_len=64, eos_token_ids=[]) as eng:
        assert eng.core.runner.arch == "generic"
        out = eng.generate([Request(id="b", prompt_ids=[5, 6, 7, 8], sampling=SamplingParams(
            temperature=1.0, max_new_tokens=12, seed=1, ignore_eos=True))])[0]
    assert torch.allclose(torch.tensor(out.logprobs), hf_logprobs(model, out.prompt_ids, out.response_ids), atol=1e-4)
    with pytest.raises(ValueError, match=f"forward='rollover' computes SiLU MLPs .*{next(iter(options))}"):
        TorchEngine(model, device="cpu", max_rows=2, max_len=64, forward="rollover")


def test_transformers_forward_on_llama_gives_rollovers_tokens():
    model = tiny_model("llama", seed=1)
    reqs = [Request(id=f"g{i}", prompt_ids=[10 + i, 11, 12], sampling=GREEDY) for i in range(3)]
    outs = {}
    for forward in ("rollover", "transformers"):
        with TorchEngine(model, device="cpu", max_rows=2, max_len=64, eos_token_ids=[], forward=forward) as eng:
            outs[forward] = eng.generate(reqs)
    for a, b in zip(outs["rollover"], outs["transformers"]):
        assert a.response_ids == b.response_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_resumed_and_updated_requests_continue_where_they_stopped():
    """A response resumed from its tokens equals the uninterrupted one; a weight update in the
    middle of a response recomputes its K/V ('continue') and the rest is the new model's."""
    model, new = tiny_model("gemma3_text", seed=3), tiny_model("gemma3_text", seed=4)
    prompt = [20, 21, 22]
    with TorchEngine(model, device="cpu", max_rows=4, max_len=64, eos_token_ids=[]) as eng:
        full = eng.generate([Request(id="full", prompt_ids=prompt, sampling=GREEDY)])[0]
        part = eng.generate([Request(id="p", prompt_ids=prompt, sampling=SamplingParams(
            temperature=0.0, max_new_tokens=7, ignore_eos=True))])[0]
        resumed = eng.generate([part.resume(GREEDY)])[0]
        assert resumed.response_ids == full.response_ids
        assert resumed.logprobs == pytest.approx(full.logprobs, abs=1e-4)

        k, fired = 6, threading.Event()
        timer = Request(id="timer", prompt_ids=[3], sampling=SamplingParams(temperature=0.0, max_new_tokens=k,
                                                                             ignore_eos=True))

        def update(c):  # in the engine thread, between steps: lands right after token k
            if c.id == "timer":
                eng.update_weights(list(new.state_dict().items()), version=1, inflight="continue")
                fired.set()

        _, fut = eng.submit_many([timer, Request(id="w", prompt_ids=prompt, sampling=GREEDY)], on_done=update)
        out = fut.result()
        assert fired.wait(10)
    n = GREEDY.max_new_tokens
    assert out.versions == [0] * k + [1] * (n - k)
    got = torch.tensor(out.logprobs)
    assert torch.allclose(got[:k], hf_logprobs(model, prompt, out.response_ids)[:k], atol=1e-4)
    assert torch.allclose(got[k:], hf_logprobs(new, prompt, out.response_ids)[k:], atol=1e-4)


def test_a_sliding_window_shorter_than_the_cache_leaves_mistral_to_its_own_forward():
    """rollover's forward has no sliding window: a Mistral whose window (6) is shorter than
    max_len runs through transformers' forward, and is refused with forward='rollover'."""
    mistral = tiny_model("mistral", seed=5, sliding_window=6)
    with TorchEngine(mistral, device="cpu", max_rows=2, max_len=64, eos_token_ids=[]) as eng:
        assert eng.core.runner.arch == "generic"
        out = eng.generate([Request(id="m", prompt_ids=[5, 6, 7, 8], sampling=GREEDY)])[0]
    assert torch.allclose(torch.tensor(out.logprobs), hf_logprobs(mistral, out.prompt_ids, out.response_ids), atol=1e-4)
    with TorchEngine(mistral, device="cpu", max_rows=2, max_len=6) as eng:  # the window covers the cache
        assert eng.core.runner.arch == "llama"
    with pytest.raises(ValueError, match="forward='rollover' has no sliding window"):
        TorchEngine(mistral, device="cpu", max_rows=2, max_len=64, forward="rollover")


def test_the_fast_paths_options_and_architectures_are_refused_by_name():
    gpt2 = tiny_model("gpt2")
    with pytest.raises(ValueError, match=r"quantize='int8'.*forward='transformers'"):
        TorchEngine(gpt2, device="cpu", max_rows=2, max_len=32, quantize="int8")
    with pytest.raises(ValueError, match="supported: .*LlamaForCausalLM"):
        TorchEngine(gpt2, device="cpu", max_rows=2, max_len=32, forward="rollover")
    with pytest.raises(ValueError, match="forward must be"):
        TorchEngine(gpt2, device="cpu", max_rows=2, max_len=32, forward="hf")
    with TorchEngine(gpt2, device="cpu", max_rows=2, max_len=32) as eng:
        with pytest.raises(ValueError, match="unknown weight 'transformer.nope'"):
            eng.update_weights([("transformer.nope", torch.zeros(2))], version=1)
        with pytest.raises(ValueError, match="'transformer.ln_f.weight' has shape"):
            eng.update_weights([("transformer.ln_f.weight", torch.zeros(3))], version=1)
        assert eng.version == 0


def test_built_from_a_config_and_weights_and_reloaded_after_a_release():
    """A Ray worker or a trainer rank's engine gets a config and named tensors, no module; a
    colocated engine frees its weights while the ranks train and takes them back."""
    from types import SimpleNamespace

    model = tiny_model("gpt2", seed=6)  # tied head: the weights arrive without lm_head.weight
    weights = dict(model.named_parameters())
    assert "lm_head.weight" not in weights
    arch = SimpleNamespace(config=model.config, generation_config=None)
    req = Request(id="a", prompt_ids=[5, 6, 7], sampling=GREEDY)
    with TorchEngine(arch, state_dict=weights, device="cpu", max_rows=2, max_len=64, eos_token_ids=[]) as eng:
        before = eng.generate([req])[0]
        assert torch.allclose(torch.tensor(before.logprobs), hf_logprobs(model, req.prompt_ids, before.response_ids),
                              atol=1e-4)
        assert eng.release_weights() > 0 and eng.weight_bytes() == 0
        with pytest.raises(RuntimeError, match="not loaded"):
            eng.generate([req])
        eng.update_weights(list(weights.items()), version=1)
        after = eng.generate([req])[0]
    assert after.response_ids == before.response_ids
    with pytest.raises(RuntimeError, match="not loaded .*transformer.wpe.weight"):
        TorchEngine(arch, state_dict={k: v for k, v in weights.items() if k != "transformer.wpe.weight"},
                    device="cpu", max_rows=2, max_len=64)


def test_models_that_do_not_attend_over_a_kv_cache_are_refused_by_name():
    from transformers import AutoConfig, AutoModelForCausalLM

    rwkv = AutoModelForCausalLM.from_config(AutoConfig.for_model(  # recurrent: no K/V cache at all
        "rwkv", vocab_size=64, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64))
    with pytest.raises(ValueError, match="cannot run RwkvForCausalLM .*did not read its K/V through the cache in 2 of 2"):
        TorchEngine(rwkv, device="cpu", max_rows=2, max_len=32)
    mamba = AutoModelForCausalLM.from_config(AutoConfig.for_model(  # names its layers: refused before it is built
        "mamba", vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2))
    with pytest.raises(ValueError, match="'mamba' also has linear_attention"):
        TorchEngine(mamba, device="cpu", max_rows=2, max_len=32)


def test_a_forward_that_changes_the_logits_after_its_head_is_refused():
    from transformers import GPT2LMHeadModel

    from rollover.testing import tiny_config
    from rollover.train.heads import check_model

    class Tempered(GPT2LMHeadModel):  # a step after the head the trainer does not know
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 3.0
            return out

    from rollover.train.trainer import disable_dropout

    gpt2 = tiny_model("gpt2")
    check_model(gpt2, training=False)  # the plain one passes
    with pytest.raises(ValueError, match="GPT2LMHeadModel computes logits .* apart in training"):
        check_model(gpt2, training=True)  # its dropout is on: training mode differs
    disable_dropout(gpt2)
    check_model(gpt2, training=True)
    with pytest.raises(ValueError, match="Tempered: the trainer's head"):
        check_model(Tempered(tiny_config("gpt2")), training=False)


def test_long_sequences_prefill_in_parts_and_a_window_read_from_the_right_place():
    """Prompts longer than the runner's prefill pass go in parts attending to the keys before
    them (Gemma 3's window of 8 across the parts); a Mistral whose `layer_types` say full
    attention still windows every layer, and runs through its own forward."""
    model = tiny_model("gemma3_text", seed=7)
    mistral = tiny_model("mistral", seed=7, sliding_window=5, layer_types=["full_attention"] * 2)
    for m in (model, mistral):
        with TorchEngine(m, device="cpu", max_rows=4, max_len=96, eos_token_ids=[]) as eng:
            assert eng.core.runner.arch == "generic"
            eng.core.runner.max_prefill_tokens = 5
            outs = eng.generate([Request(id=f"r{i}", prompt_ids=list(range(5, 12 + 3 * i)), sampling=GREEDY)
                                 for i in range(3)])
        for out in outs:
            assert torch.allclose(torch.tensor(out.logprobs), hf_logprobs(m, out.prompt_ids, out.response_ids),
                                  atol=1e-4), (type(m).__name__, out.id)


def test_what_the_cache_cannot_hold_is_refused_before_the_engine_starts():
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollover.train.heads import check_model

    gpt2 = tiny_model("gpt2")  # 512 learned positions
    with pytest.raises(ValueError, match="learned 512 positions"):
        TorchEngine(gpt2, device="cpu", max_rows=2, max_len=600)
    longrope = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "phi3", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        pad_token_id=0, max_position_embeddings=256, original_max_position_embeddings=32,
        rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}))
    with pytest.raises(ValueError, match="longrope rotary scaling, whose frequencies change past 32 positions"):
        TorchEngine(longrope, device="cpu", max_rows=2, max_len=64)
    with TorchEngine(longrope, device="cpu", max_rows=2, max_len=32):  # within its original length: fine
        pass
    phimoe = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "phimoe", vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    with pytest.raises(ValueError, match="PhimoeForCausalLM computes logits .* apart in training and in evaluation"):
        check_model(phimoe, training=True)


def test_building_an_engine_leaves_the_trainers_config_alone():
    model = tiny_model("gemma2")
    model.config._attn_implementation = "eager"
    before = model.config.to_dict()
    with TorchEngine(model, device="cpu", dtype=torch.bfloat16, max_rows=2, max_len=32):
        pass
    assert model.config.to_dict() == before and model.config._attn_implementation == "eager"


def test_fsdp_shards_the_layers_each_architecture_names():
    from rollover.train.fsdp import decoder_layers
    from rollover.train.lora import apply_lora

    assert [type(m).__name__ for m in decoder_layers(tiny_model("gpt2"))] == ["GPT2Block"] * 2
    assert [type(m).__name__ for m in decoder_layers(tiny_model("qwen3_moe"))] == ["Qwen3MoeDecoderLayer"] * 2
    lora = apply_lora(tiny_model("gemma2"), {"r": 4})
    assert [type(m).__name__ for m in decoder_layers(lora)] == ["Gemma2DecoderLayer"] * 2


@pytest.mark.parametrize("arch, over", [
    ("gemma2", {}), ("cohere", {}), ("granite", {}), ("gpt2", {}), ("qwen3_moe", {}), ("phi3", {}),
    ("opt", {"train.shared_prefix": False, "train.pack_length": 256}),
])
def test_trainer_logprobs_are_the_samplers_before_and_after_an_update(arch, over, tmp_path):
    """The architectures whose forward scales or caps its logits after the head, GPT-2's
    absolute positions, experts, and OPT's own masks with plain packing (its sequences then go
    one to a row): the trainer's logprobs are the engine's."""
    from rollover.loops.batch import train_batch_from
    from rollover.loops.build import build_run
    from rollover.loops.sync import make_collector

    model_dir = save_tiny_model(tmp_path / arch, arch, seed=3)
    cfg = load_config(**{
        "device": "cpu", "model": str(model_dir), "run_dir": str(tmp_path / "run"), "steps": 2, "seed": 7,
        "data.train": "gen:arithmetic?n=40", "data.eval_size": 4, "data.max_prompt_tokens": 64,
        "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 3, "rollout.max_new_tokens": 12,
        "rollout.max_rows": 8, "reward.functions": ["numeric"], "train.lr": 1e-3,
        "logging.progress": False, "logging.tensorboard": False, **over,
    })
    run = build_run(cfg)
    try:
        assert run.engine.core.runner.arch == "generic"
        collector = make_collector(run)
        for step in range(2):
            groups, _ = collector.collect(step)
            batch, _ = train_batch_from(groups, cfg)
            assert (batch.versions_BT[batch.mask_BT] == step).all()
            m = batch.mask_BT
            assert torch.allclose(run.trainer.logprobs(batch)[m], batch.behav_logp_BT[m], atol=1e-4), (arch, step)
            run.trainer.train_step(batch)
            run.engine.update_weights(run.trainer.named_weights(), version=step + 1)
    finally:
        run.close()


def test_a_gemma3_run_trains_evaluates_checkpoints_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM

    from rollover.export import export
    from rollover.loops.sync import train_sync

    model_dir = save_tiny_model(tmp_path / "gemma3", "gemma3_text", seed=3)
    run_dir = tmp_path / "run"
    cfg = load_config(**{
        "device": "cpu", "model": str(model_dir), "run_dir": str(run_dir), "steps": 2, "seed": 7,
        "data.train": "gen:arithmetic?n=40", "data.eval_size": 4, "data.max_prompt_tokens": 64,
        "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 3, "rollout.max_new_tokens": 12,
        "rollout.max_rows": 8, "reward.functions": ["numeric"], "train.lr": 1e-3, "eval.every": 2,
        "checkpoint.every": 2, "logging.progress": False, "logging.tensorboard": False,
    })
    result = train_sync(cfg)
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and "eval/accuracy" in result
    # one copy of the weights (the engine lends the trainer its tensors) and no sampler-trainer gap
    assert all(0 <= r["actor/rollout_kl"] < 1e-6 for r in train)
    export(run_dir, tmp_path / "out")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(exported).__name__ == "Gemma3ForCausalLM"


def test_a_sharded_step_on_another_architecture_equals_one_trainers():
    """FSDP over two ranks, sharding Gemma 2's own layers (its logit cap in the head): one
    trainer's update, as for the Llama family (tests/test_fsdp.py)."""
    import copy

    from rollover.train.ranks import ShardedTrainer
    from rollover.train.trainer import Trainer
    from rollover.types import Rollout
    from rollover.train.batch import TrainBatch

    cfg = load_config(**{"device": "cpu", "model": "unused", "run_dir": "unused", "data.train": "gen:arithmetic?n=10",
                         "rollout.samples_per_prompt": 3, "rollout.max_new_tokens": 8, "train.lr": 1e-2,
                         "train.parallel": "fsdp", "train.ranks": 2})
    g = torch.Generator().manual_seed(0)
    rolls, advs = [], []
    for gi in range(4):
        prompt = torch.randint(3, 60, (5,), generator=g).tolist()
        for _ in range(3):
            n = int(torch.randint(2, 8, (1,), generator=g))
            rolls.append(Rollout(group_id=f"g{gi}", prompt_ids=prompt, response_ids=torch.randint(3, 60, (n,), generator=g).tolist(),
                                 logprobs=[-1.0] * n, versions=[0] * n, loss_mask=[1] * n, finish="stop", reward=0.0))
            advs.append(float(torch.randn(1, generator=g)))
    batch = TrainBatch.from_rollouts(rolls, advs)
    model = tiny_model("gemma2", seed=3)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    plain = Trainer(copy.deepcopy(model), cfg, device=torch.device("cpu"))
    sharded = ShardedTrainer(copy.deepcopy(model), cfg, pad_id=0)
    try:
        mp, ms = plain.train_step(batch), sharded.train_step(batch)
        assert ms["actor/pg_loss"] == pytest.approx(mp["actor/pg_loss"], rel=1e-5, abs=1e-7)
        a, b = dict(plain.named_weights()), dict(sharded.named_weights())
        moved = max(float((a[k] - start[k]).abs().max()) for k in a)
        assert moved > 0.5 * cfg.train.lr and max(float((a[k] - b[k]).abs().max()) for k in a) < 0.05 * cfg.train.lr
    finally:
        sharded.close()


def test_lora_on_another_architecture_trains_and_syncs_merged_weights(tmp_path):
    pytest.importorskip("peft")
    from rollover.loops.batch import train_batch_from
    from rollover.loops.build import build_run
    from rollover.loops.sync import make_collector

    model_dir = save_tiny_model(tmp_path / "phi3", "phi3", seed=3)
    cfg = load_config(**{
        "device": "cpu", "model": str(model_dir), "run_dir": str(tmp_path / "run"), "steps": 2, "seed": 7,
        "data.train": "gen:arithmetic?n=40", "data.eval_size": 4, "data.max_prompt_tokens": 64,
        "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 3, "rollout.max_new_tokens": 8,
        "rollout.max_rows": 8, "reward.functions": ["numeric"], "train.lr": 5e-2, "train.lora": {"r": 4, "alpha": 8},
        "logging.progress": False, "logging.tensorboard": False,
    })
    run = build_run(cfg)
    try:
        collector = make_collector(run)
        groups, _ = collector.collect(0)
        batch, _ = train_batch_from(groups, cfg)
        run.trainer.train_step(batch)
        run.engine.update_weights(run.trainer.named_weights(), version=1)
        groups, _ = collector.collect(1)
        batch, _ = train_batch_from(groups, cfg)
        assert torch.allclose(run.trainer.logprobs(batch)[batch.mask_BT], batch.behav_logp_BT[batch.mask_BT], atol=1e-4)
        trainable = [n for n, p in run.trainer.model.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in n for n in trainable)
    finally:
        run.close()


def test_a_model_with_linear_attention_trains_each_sequence_in_a_row_of_its_own(tmp_path):
    """Qwen3.5's linear-attention layers carry a state along a row, which neither packed position ids
    nor the shared-prefix masks stop: the trainer gives each sequence a row of its own, so its logprobs
    are each sequence's alone (packed, they are not); sequence parallelism is refused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollover.models import stateful_layers
    from rollover.testing import char_tokenizer
    from rollover.train.trainer import Trainer
    from rollover.train.ulysses import check
    from test_train import batch_of, rollout

    config = AutoConfig.for_model("qwen3_5_text", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                                  linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                                  layer_types=["linear_attention", "full_attention"], eos_token_id=2, pad_token_id=0)
    assert stateful_layers(config) == ["linear_attention"] and stateful_layers(tiny_model("qwen3").config) == []
    for kind, found in (("rwkv", ["recurrent"]), ("jamba", ["linear_attention"]), ("nemotron_h", ["linear_attention"]),
                        ("recurrent_gemma", ["recurrent"]), ("gemma3_text", []), ("llama4_text", ["chunked_attention"])):
        # hybrids' feed-forward layers are not states; Llama 4's chunks are laid out by place in the row
        assert stateful_layers(AutoConfig.for_model(kind)) == found, kind
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "m")
    char_tokenizer().save_pretrained(tmp_path / "m")
    cfg = load_config(**{"device": "cpu", "model": str(tmp_path / "m"), "run_dir": str(tmp_path / "run"),
                         "data.train": "gen:arithmetic?n=8", "data.max_prompt_tokens": 16, "rollout.max_new_tokens": 8})
    trainer = Trainer(model, cfg, device=torch.device("cpu"))
    assert trainer.one_per_row and not trainer.shared_prefix
    batch = batch_of([rollout("g", [5, 6, 7], [8, 9, 10, 11], 1.0), rollout("g", [5, 6, 7], [12, 13], 0.5),
                      rollout("h", [14, 15], [16, 17, 18], -1.0)])
    alone = [hf_logprobs(model.eval(), p, r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    got = trainer.logprobs(batch)
    for i, ref in enumerate(alone):
        assert torch.allclose(got[i, :len(ref)], ref, atol=1e-5), i
    trainer.one_per_row = False  # packed after one another: the state runs from one sequence into the next
    packed = trainer.logprobs(batch)
    assert not all(torch.allclose(packed[i, :len(ref)], ref, atol=1e-5) for i, ref in enumerate(alone))
    with pytest.raises(ValueError, match="linear_attention layers run along the whole row"):
        check(config, 2)
