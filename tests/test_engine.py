"""TorchEngine contract tests on tiny random models (CPU, fp32)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pytest
import torch

from rollover.engine.torch_engine import TorchEngine
from rollover.testing import generate_from_threads, tiny_model
from rollover.types import Request, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)


def hf_logprobs(model, prompt_ids, response_ids, temperature=1.0):
    """log_softmax of the HF forward at each response position, for the tokens taken."""
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float() / temperature
    lp = torch.log_softmax(logits, -1)[len(prompt_ids) - 1 : -1]
    return lp.gather(1, torch.tensor(response_ids)[:, None]).squeeze(1)


def hf_greedy(model, prompt_ids, n):
    ids = list(prompt_ids)
    for _ in range(n):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=1)


@pytest.fixture()
def engine(model):
    eng = TorchEngine(model, device="cpu", max_rows=8, max_len=160, eos_token_ids=[])
    yield eng
    eng.shutdown()


def abort_after(engine, k, target_ids, **update):
    """Submit a 'timer' request that finishes after k tokens, at the same step as the targets
    reach k tokens (they are admitted together); its done-callback runs in the engine thread
    between steps, so the abort (or weight update) lands exactly after token k."""
    timer = Request(id=f"timer-{k}", prompt_ids=[3], sampling=SamplingParams(temperature=0.0, max_new_tokens=k, ignore_eos=True))
    box = {"fired": threading.Event()}

    def fire(c):  # passed as on_done, so it is attached before the engine can finish anything
        if c.id != timer.id:
            return
        if update:
            box["aborted"] = engine.update_weights(**update)
        else:
            box["aborted"] = engine.abort(target_ids)
        box["fired"].set()

    return timer, fire, box


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_logprobs_match_hf_forward(arch):
    model = tiny_model(arch, seed=2)
    if arch == "qwen2":  # biases are zero-initialised; make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.2)
    with TorchEngine(model, device="cpu", max_rows=4, max_len=128, eos_token_ids=[]) as eng:
        reqs = [
            Request(id=f"r{i}", prompt_ids=list(range(5, 5 + 3 + 2 * i)),
                    sampling=SamplingParams(temperature=1.0, max_new_tokens=16, seed=i))
            for i in range(6)
        ]
        outs = eng.generate(reqs)
    for out in outs:
        ref = hf_logprobs(model, out.prompt_ids, out.response_ids)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4), (arch, out.id)


def test_logprobs_follow_temperature(model):
    with TorchEngine(model, device="cpu", max_rows=4, max_len=64, eos_token_ids=[]) as eng:
        out = eng.generate([Request(id="t", prompt_ids=[7, 8, 9], sampling=SamplingParams(temperature=0.7, max_new_tokens=12, seed=3))])[0]
    ref = hf_logprobs(model, out.prompt_ids, out.response_ids, temperature=0.7)
    assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4)


def test_greedy_matches_hf_greedy(model, engine):
    out = engine.generate([Request(id="g", prompt_ids=[10, 11, 12, 13], sampling=GREEDY)])[0]
    assert out.response_ids == hf_greedy(model, [10, 11, 12, 13], GREEDY.max_new_tokens)
    assert out.finish == "length" and out.versions == [0] * GREEDY.max_new_tokens


@pytest.mark.parametrize("k", [1, 2, 5, 11, 23])
def test_abort_at_token_k_then_resume_equals_uninterrupted(engine, k):
    prompt = [20, 21, 22]
    full = engine.generate([Request(id="full", prompt_ids=prompt, sampling=GREEDY)])[0]
    target = Request(id="t", prompt_ids=prompt, sampling=GREEDY)
    timer, fire, box = abort_after(engine, k, ["t"])
    ft, fx = engine.submit_many([timer, target], on_done=fire)
    part = fx.result()
    assert part.finish == "abort"
    assert part.response_ids == full.response_ids[:k]  # exactly the tokens so far
    assert part.logprobs == pytest.approx(full.logprobs[:k], abs=1e-5)
    resumed = engine.generate([part.resume()])[0]
    assert resumed.response_ids == full.response_ids
    assert resumed.finish == "length"
    assert resumed.logprobs == pytest.approx(full.logprobs, abs=1e-4)


def test_two_resumes_equal_uninterrupted_and_keep_budget(engine):
    prompt = [30, 31]
    full = engine.generate([Request(id="full", prompt_ids=prompt, sampling=GREEDY)])[0]
    req = Request(id="t", prompt_ids=prompt, sampling=GREEDY)
    for k in (4, 9):
        remaining = req.sampling.max_new_tokens - len(req.response_ids)
        timer, fire, _ = abort_after(engine, k, ["t"])
        ft, fx = engine.submit_many([timer, req], on_done=fire)
        part = fx.result()
        assert part.finish == "abort"
        assert len(part.response_ids) == len(req.response_ids) + min(k, remaining)
        req = part.resume()
    final = engine.generate([req])[0]
    assert final.response_ids == full.response_ids
    assert len(final.response_ids) == GREEDY.max_new_tokens


def test_seeded_sampling_survives_abort_and_batching(engine):
    sp = SamplingParams(temperature=1.0, max_new_tokens=20, seed=1234, ignore_eos=True)
    alone = engine.generate([Request(id="a", prompt_ids=[40, 41], sampling=sp)])[0]
    # same request in a crowded batch, aborted after 7 tokens and resumed
    others = [Request(id=f"o{i}", prompt_ids=[50 + i] * (1 + i), sampling=SamplingParams(max_new_tokens=30)) for i in range(5)]
    timer, fire, _ = abort_after(engine, 7, ["a"])
    futs = engine.submit_many([timer, Request(id="a", prompt_ids=[40, 41], sampling=sp), *others], on_done=fire)
    part = futs[1].result()
    assert part.finish == "abort" and len(part.response_ids) == 7
    resumed = engine.generate([part.resume()])[0]
    assert resumed.response_ids == alone.response_ids
    for f in futs[2:]:
        assert f.result().finish == "length"


def test_budget_is_whole_response(engine):
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=0)
    first = engine.generate([Request(id="b", prompt_ids=[9], sampling=sp)])[0]
    assert len(first.response_ids) == 10
    # a resume that already holds the whole budget finishes at once, with no new token
    again = engine.generate([first.resume()])[0]
    assert again.response_ids == first.response_ids and again.finish == "length"
    # a resume with 6 tokens gets exactly 4 more
    partial = first.resume()
    partial.response_ids, partial.response_logprobs, partial.response_versions = (
        partial.response_ids[:6], partial.response_logprobs[:6], partial.response_versions[:6])
    out = engine.generate([partial])[0]
    assert len(out.response_ids) == 10 and out.finish == "length"
    with pytest.raises(ValueError, match="more than max_new_tokens"):
        bad = first.resume(SamplingParams(max_new_tokens=5))
        engine.submit(bad)


def test_update_weights_continue_tags_new_version(model):
    new_model = tiny_model("llama", seed=99)
    with TorchEngine(model, device="cpu", max_rows=4, max_len=96, eos_token_ids=[]) as eng:
        k = 6
        update = dict(named_tensors=list(new_model.state_dict().items()), version=1, inflight="continue")
        timer, fire, box = abort_after(eng, k, None, **update)
        ft, fx = eng.submit_many([timer, Request(id="w", prompt_ids=[60, 61, 62], sampling=GREEDY)], on_done=fire)
        out = fx.result()
        assert box["fired"].wait(10) and box["aborted"] == []
        assert eng.version == 1
    n = GREEDY.max_new_tokens
    assert out.versions == [0] * k + [1] * (n - k)
    # tokens before the update are the old model's, after it the new model's continuation
    assert out.response_ids[:k] == hf_greedy(model, out.prompt_ids, k)
    assert out.response_ids[k:] == hf_greedy(new_model, out.prompt_ids + out.response_ids[:k], n - k)
    ref_old = hf_logprobs(model, out.prompt_ids, out.response_ids)
    ref_new = hf_logprobs(new_model, out.prompt_ids, out.response_ids)
    got = torch.tensor(out.logprobs)
    assert torch.allclose(got[:k], ref_old[:k], atol=1e-4)
    assert torch.allclose(got[k:], ref_new[k:], atol=1e-4)


def test_update_weights_abort_returns_partials(model):
    new_model = tiny_model("llama", seed=98)
    with TorchEngine(model, device="cpu", max_rows=4, max_len=96, eos_token_ids=[]) as eng:
        update = dict(named_tensors=new_model.named_parameters(), version=5, inflight="abort")
        timer, fire, box = abort_after(eng, 4, None, **update)
        ft, fx = eng.submit_many([timer, Request(id="w", prompt_ids=[60, 61], sampling=GREEDY)], on_done=fire)
        out = fx.result()
        assert out.finish == "abort" and len(out.response_ids) == 4
        assert box["fired"].wait(10) and [c.id for c in box["aborted"]] == ["w"]
        resumed = eng.generate([out.resume()])[0]
    assert resumed.versions == [0] * 4 + [5] * (GREEDY.max_new_tokens - 4)


def test_update_weights_rejects_unknown_names(engine):
    with pytest.raises(ValueError, match="unknown weight"):
        engine.update_weights([("model.nope.weight", torch.zeros(2))], version=1)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))], version=1)
    assert engine.version == 0


def test_many_concurrent_requests_of_different_lengths(model):
    with TorchEngine(model, device="cpu", max_rows=4, max_len=128, eos_token_ids=[]) as eng:
        reqs = [
            Request(id=f"c{i}", prompt_ids=[5 + (i % 7)] * (1 + i % 5),
                    sampling=SamplingParams(temperature=1.0, max_new_tokens=3 + (i * 7) % 23, seed=i, ignore_eos=True))
            for i in range(19)
        ]
        outs = eng.generate(reqs)
        stats = eng.stats()
    for req, out in zip(reqs, outs):
        assert out.id == req.id and out.prompt_ids == req.prompt_ids
        assert len(out.response_ids) == req.sampling.max_new_tokens and out.finish == "length"
        ref = hf_logprobs(model, out.prompt_ids, out.response_ids)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4), out.id
    assert stats.busy_row_steps <= stats.total_row_steps
    assert stats.generated_tokens == sum(r.sampling.max_new_tokens for r in reqs)


def test_stop_tokens_finish_with_stop(model, engine):
    full = engine.generate([Request(id="s0", prompt_ids=[70, 71], sampling=GREEDY)])[0]
    stop_tok = full.response_ids[5]
    first = full.response_ids.index(stop_tok)
    sp = SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=(stop_tok,))
    out = engine.generate([Request(id="s1", prompt_ids=[70, 71], sampling=sp)])[0]
    assert out.finish == "stop" and out.response_ids == full.response_ids[: first + 1]
    again = engine.generate([out.resume(sp)])[0]  # a resume whose carried tokens end in the stop token: done
    assert again.finish == "stop" and again.response_ids == out.response_ids


def test_stop_strings_are_found_across_tokens():
    """A stop string is found in the text of the response's last tokens, whichever tokens its
    characters fall in, and only once its last character is sampled."""
    from rollover.engine.stop import StopStrings

    pieces = {0: "ab", 1: "c</", 2: "ans", 3: "wer>x", 4: " ", 5: "é"}
    stops = StopStrings(lambda ids: "".join(pieces[i] for i in ids))
    answer = ("</answer>",)
    assert [stops.ends(answer, [0, 1, 2, 3][:n]) for n in range(1, 5)] == [False, False, False, True]
    assert stops.ends(answer, [4] * 20 + [1, 2, 3])  # a long response: only its tail is decoded
    assert not stops.ends(answer, [1, 2, 4, 3]) and not stops.ends((), [1, 2, 3])
    assert stops.ends(("é ", "zz"), [0, 5, 4])
    assert stops.ends(["zz", "é "], [0, 5, 4])  # a list, as a config gives it
    calls = []
    counted = StopStrings(lambda ids: calls.append(list(ids)) or "".join(pieces[i] for i in ids))
    assert not counted.ends(answer, [0, 1, 2]) and calls == [[2]]  # "ans" cannot end "</answer>": no window
    assert not counted.ends(answer, [0, 1, 2, 2]) and calls == [[2]]  # its text alone is kept
    assert counted.ends(answer, [0, 1, 2, 3]) and calls[-1] == [0, 1, 2, 3]
    dropping = StopStrings(lambda ids: bytes(ids).decode("utf-8", errors="ignore"))  # a decoder that drops part-characters
    assert dropping.ends(("。",), list("ab。".encode()))  # its last byte decodes alone to nothing: not skipped

    def byte_fallback(ids):  # Llama 2's decoder: a run of byte tokens that starts mid-character is all replaced
        raw = bytes(ids)
        return "\ufffd" * len(ids) if 0x80 <= raw[0] < 0xC0 else raw.decode("utf-8", errors="replace")

    stops = StopStrings(byte_fallback)
    text = list("中é".encode())  # 3 bytes, then 2: the 4-token window starts inside 中
    assert not stops.ends(("é",), text[:-1]) and stops.ends(("é",), text)


def test_stop_strings_finish_with_stop(model, engine):
    """rollout.stop on TorchEngine: the response ends at the token that completes the string; a
    resumed request whose carried tokens hold one finishes at once; an engine without a
    tokenizer refuses such requests, naming them."""
    from rollover.engine.stop import StopStrings
    from rollover.testing import char_tokenizer

    tok = char_tokenizer()
    text = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    full = engine.generate([Request(id="t0", prompt_ids=[70, 71], sampling=GREEDY)])[0]
    stop = text(full.response_ids[6:9])
    cut = next(i for i in range(len(full.response_ids)) if stop in text(full.response_ids[: i + 1]))
    sp = replace(GREEDY, stop=(stop, "never"))
    with pytest.raises(ValueError, match="request 't1' has stop strings"):
        engine.generate([Request(id="t1", prompt_ids=[70, 71], sampling=sp)])
    with pytest.raises(ValueError, match="stop must be a tuple of non-empty strings, got 'ab'"):
        engine.generate([Request(id="t1", prompt_ids=[70, 71], sampling=replace(GREEDY, stop="ab"))])
    engine.core.stop_strings = StopStrings(text)
    out = engine.generate([Request(id="t2", prompt_ids=[70, 71], sampling=sp),
                           Request(id="t3", prompt_ids=[70, 71], sampling=GREEDY)])
    assert out[0].finish == "stop" and out[0].response_ids == full.response_ids[: cut + 1]
    assert out[1].response_ids == full.response_ids  # the request beside it runs on
    carried = out[0].resume(sp)
    again = engine.generate([carried])[0]
    assert again.finish == "stop" and again.response_ids == out[0].response_ids


def test_n_samples_share_the_prompt_prefill(engine):
    prompt = list(range(10, 40))
    reqs = [Request(id=f"n{i}", prompt_ids=prompt, sampling=SamplingParams(max_new_tokens=4, seed=i)) for i in range(4)]
    engine.reset_stats()
    outs = engine.generate(reqs)
    assert engine.stats().prefill_tokens == len(prompt)
    assert len({tuple(o.response_ids) for o in outs}) > 1  # different seeds, different samples


@pytest.mark.parametrize(
    "bad, match",
    [
        (Request(id="e", prompt_ids=[]), "empty prompt"),
        (Request(id="long", prompt_ids=[5] * 160), "does not fit the context"),
        (Request(id="m", prompt_ids=[5], sampling=SamplingParams(max_new_tokens=0)), "max_new_tokens"),
        (Request(id="t", prompt_ids=[5], sampling=SamplingParams(temperature=-1.0)), "temperature"),
        (Request(id="u", prompt_ids=[5, 10_000]), "unknown token ids"),
        (Request(id="n", prompt_ids=[5, -1]), "unknown token ids"),
        (Request(id="f", prompt_ids=[5, 3.0]), "unknown token ids"),
        (Request(id="r", prompt_ids=[5], response_ids=[7, 10_000], response_logprobs=[0.0, 0.0],
                 response_versions=[0, 0]), "unknown token ids"),
        (Request(id="p", prompt_ids=[5], sampling=SamplingParams(top_p=0.0)), "top_p"),
        # the wrong types, named: not read as unknown ids, nor failing in the engine's thread
        (Request(id="np", prompt_ids=[5, __import__("numpy").int64(6)]), "holds numpy.int64 values, not Python ints"),
        (Request(id="arr", prompt_ids=torch.tensor([5, 6])), r"must be a list of token ids .*got Tensor .*tolist"),
        (Request(id="tup", prompt_ids=(5, 6)), r"got tuple \(list\(\.\.\.\) gives one\)"),
        (Request(id="str", prompt_ids="hello"), "must be a list of token ids .*got str"),
        (Request(id="d", prompt_ids=[5], sampling={"max_new_tokens": 4}), "sampling must be a SamplingParams, got dict"),
        # sampling fields of the wrong type or past what an engine samples at: refused, not failing its thread
        (Request(id="s", prompt_ids=[5], sampling=SamplingParams(seed=__import__("numpy").int64(3))),
         r"seed must be a Python int, got numpy.int64 3 \(int\(x\) gives one\)"),
        (Request(id="s2", prompt_ids=[5], sampling=SamplingParams(seed=1.5)), "seed must be a Python int"),
        (Request(id="k", prompt_ids=[5], sampling=SamplingParams(top_k=5.0)), "top_k must be a Python int"),
        (Request(id="mf", prompt_ids=[5], sampling=SamplingParams(max_new_tokens=5.5)), "max_new_tokens must be a Python int"),
        (Request(id="tiny", prompt_ids=[5], sampling=SamplingParams(temperature=1e-40)), "temperature must be 0 .*or at least 0.01"),
    ],
)
def test_bad_input_rejected_without_disturbing_others(engine, model, bad, match):
    running = engine.submit(Request(id="ok", prompt_ids=[80, 81], sampling=GREEDY))
    with pytest.raises(ValueError, match=match) as err:
        engine.submit(bad)
    assert repr(bad.id) in str(err.value)  # names the request
    out = running.result()
    assert out.finish == "length" and out.response_ids == hf_greedy(model, [80, 81], GREEDY.max_new_tokens)


def test_an_engine_without_rows_is_refused(model):
    with pytest.raises(ValueError, match="max_rows must be a positive int"):
        TorchEngine(model, device="cpu", max_rows=0, max_len=64)


def test_duplicate_inflight_id_rejected(engine):
    f = engine.submit(Request(id="dup", prompt_ids=[5], sampling=GREEDY))
    with pytest.raises(ValueError, match="unfinished request"):
        engine.submit(Request(id="dup", prompt_ids=[6], sampling=GREEDY))
    assert f.result().finish == "length"


def test_abort_all_and_unknown(engine):
    futs = engine.submit_many([Request(id=f"a{i}", prompt_ids=[5 + i], sampling=SamplingParams(max_new_tokens=100, ignore_eos=True)) for i in range(12)])
    aborted = engine.abort()
    assert {c.id for c in aborted} == {f"a{i}" for i in range(12)}
    for f, c in zip(futs, sorted(aborted, key=lambda c: int(c.id[1:]))):
        assert f.result().finish == "abort"
        assert len(f.result().response_ids) < 100
    assert engine.abort(["never-submitted"]) == []
    assert engine.num_unfinished() == 0


def test_a_cancelled_call_frees_its_row_and_leaves_the_engine_running(engine):
    sp = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)

    async def main():
        call = asyncio.ensure_future(engine.agenerate(Request(id="slow", prompt_ids=[5, 6], sampling=sp)))
        while engine.lengths().get("slow", 0) < 2:  # mid-generation...
            await asyncio.sleep(0.001)
        engine.pause()  # ...and held there, so a fast engine cannot finish it before the cancel lands
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        engine.resume()
        return await engine.agenerate(Request(id="next", prompt_ids=[5, 6], sampling=SamplingParams(max_new_tokens=4)))

    out = asyncio.run(main())
    assert out.finish in ("stop", "length") and engine.num_unfinished() == 0
    assert engine.stats().finished["abort"] == 1  # the cancelled request was aborted, not run to the end
    again = engine.submit(Request(id="slow", prompt_ids=[5, 6], sampling=SamplingParams(max_new_tokens=2)))
    assert again.result(timeout=30).id == "slow"  # its id is free again


def test_a_stream_left_early_aborts_its_request_and_the_engine_goes_on(engine):
    """A consumer that takes one token and returns closes its loop: the request is aborted, its
    listener gone, and the engine's other requests run on (the engine's thread does not die on
    the closed loop)."""
    other = engine.submit(Request(id="other", prompt_ids=[80, 81], sampling=SamplingParams(
        temperature=0.0, max_new_tokens=60, ignore_eos=True)))

    async def first_token():
        async for ev in engine.stream(Request(id="left", prompt_ids=[5, 6], sampling=SamplingParams(
                temperature=0.0, max_new_tokens=400, ignore_eos=True))):
            return ev

    assert asyncio.run(first_token()).token is not None
    assert other.result(timeout=60).finish == "length"
    assert engine.stats().finished["abort"] == 1 and "left" not in engine._listeners
    assert asyncio.run(first_token()).token is not None  # its id is free again at once
    assert engine.generate([Request(id="after", prompt_ids=[5], sampling=GREEDY)])[0].finish == "length"


def test_a_stream_raises_its_requests_error_and_a_second_stream_of_an_id_is_refused(engine):
    sp = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)

    async def main():
        events = []
        first = engine.stream(Request(id="s", prompt_ids=[5, 6], sampling=sp))
        events.append(await first.__anext__())
        with pytest.raises(ValueError, match="'s' is already being streamed"):
            await engine.stream(Request(id="s", prompt_ids=[7], sampling=sp)).__anext__()
        events.append(await first.__anext__())  # the first stream still hears its tokens
        engine.shutdown()  # its request's future fails: the stream raises, not waits forever
        with pytest.raises(RuntimeError, match="shut down"):
            async for ev in first:
                events.append(ev)
        return events

    assert all(e.token is not None for e in asyncio.run(asyncio.wait_for(main(), 60))[:2])


def test_asyncio_api_and_threads(model, engine):
    async def main():
        sp = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
        events = [ev async for ev in engine.stream(Request(id="st", prompt_ids=[90, 91], sampling=sp))]
        outs = await asyncio.gather(*(engine.agenerate(Request(id=f"ag{i}", prompt_ids=[90, 91], sampling=sp)) for i in range(3)))
        return events, outs

    events, outs = asyncio.run(main())
    final = events[-1].completion
    assert [e.token for e in events[:-1]] == final.response_ids == outs[0].response_ids
    assert all(o.response_ids == final.response_ids for o in outs)

    results = generate_from_threads(engine, [Request(id=f"th{i}", prompt_ids=[90, 91], sampling=GREEDY) for i in range(4)])
    assert len({tuple(r.response_ids) for r in results}) == 1


def test_sampler_draws_from_the_reported_distribution():
    """Empirical frequencies match exp(reported logprob) under temperature, top-k and top-p."""
    from rollover.engine.sampler import Sampler

    sampler = Sampler(torch.device("cpu"))
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, -30.0]])
    for temp, top_k, top_p, min_p in [(1.0, 0, 1.0, 0), (0.5, 0, 1.0, 0), (1.0, 2, 1.0, 0), (1.0, 0, 0.8, 0),
                                      (1.0, 0, 1.0, 0.3)]:
        counts = torch.zeros(5)
        probs = torch.zeros(5)
        for i in range(3000):
            sp = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=i)
            tok, lp = sampler.sample(logits.clone(), [sp], [0])
            counts[tok] += 1
            probs[tok] = lp.exp()  # the probability the engine reports for this token
        assert (counts / 3000 - probs).abs().max() < 0.035, (temp, top_k, top_p, min_p)
        assert counts[4] == 0
        if top_k == 2 or min_p == 0.3:
            assert counts[[0, 3]].sum() == 0  # outside the top-2 set; below 0.3 x the likeliest


def processed_logprobs(model, prompt_ids, response_ids, temperature=1.0, min_p=0.0, repetition_penalty=1.0):
    """The log-probabilities of the tokens taken under transformers' own logits processors (the
    reference for the engine's min-p and repetition penalty): penalty, temperature, min-p."""
    from transformers.generation.logits_process import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    out = []
    for i, tok in enumerate(response_ids):
        z = logits[len(prompt_ids) - 1 + i][None]
        z = RepetitionPenaltyLogitsProcessor(repetition_penalty)(ids[:, : len(prompt_ids) + i], z) / temperature
        if min_p:
            z = MinPLogitsWarper(min_p)(None, z)
        out.append(torch.log_softmax(z[0], -1)[tok])
    return torch.stack(out)


@pytest.mark.parametrize("temperature, min_p, penalty", [(1.0, 0.2, 1.0), (0.8, 0.0, 1.5), (1.2, 0.1, 0.7)])
def test_min_p_and_repetition_penalty_report_the_processed_distribution(model, temperature, min_p, penalty):
    sp = SamplingParams(temperature=temperature, min_p=min_p, repetition_penalty=penalty, max_new_tokens=20,
                        seed=5, ignore_eos=True)
    with TorchEngine(model, device="cpu", max_rows=4, max_len=64, eos_token_ids=[]) as eng:
        outs = eng.generate([Request(id=f"m{i}", prompt_ids=[7 + i, 8, 9, 8], sampling=sp) for i in range(3)])
        plain = eng.generate([Request(id="p", prompt_ids=[7, 8, 9, 8], sampling=replace(sp, min_p=0.0, repetition_penalty=1.0))])[0]
    for o in outs:
        want = processed_logprobs(model, o.prompt_ids, o.response_ids, temperature, min_p, penalty)
        assert torch.allclose(torch.tensor(o.logprobs), want, atol=1e-4), o.id
        assert all(lp > float("-inf") for lp in o.logprobs)  # never a token the processing removed
    # the same seed without them draws other tokens or reports other logprobs: the settings act
    assert (plain.response_ids, plain.logprobs) != (outs[0].response_ids, outs[0].logprobs)


def test_repetition_penalty_greedy_matches_hf_generate_and_survives_abort(model, engine):
    from transformers import GenerationConfig

    prompt = [20, 21, 22, 21]
    sp = SamplingParams(temperature=0.0, repetition_penalty=1.8, max_new_tokens=16, ignore_eos=True)
    full = engine.generate([Request(id="full", prompt_ids=prompt, sampling=sp)])[0]
    gen = GenerationConfig(do_sample=False, repetition_penalty=1.8, max_new_tokens=16, min_new_tokens=16,
                           pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), generation_config=gen)[0, len(prompt):].tolist()
    assert full.response_ids == want
    assert full.response_ids != hf_greedy(model, prompt, 16)  # the penalty changed the greedy path
    # seeded sampling with a penalty, aborted after 6 tokens and resumed: the prompt then holds the
    # first tokens, and the penalty, which looks at prompt and response alike, gives the same draws
    sampled = replace(sp, temperature=1.0, seed=11)
    alone = engine.generate([Request(id="a", prompt_ids=prompt, sampling=sampled)])[0]
    timer, fire, _ = abort_after(engine, 6, ["a"])
    futs = engine.submit_many([timer, Request(id="a", prompt_ids=prompt, sampling=sampled)], on_done=fire)
    part = futs[1].result()
    assert part.finish == "abort" and len(part.response_ids) == 6
    resumed = engine.generate([part.resume()])[0]
    assert resumed.response_ids == alone.response_ids
    assert resumed.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_seeded_uniforms_are_the_position_hash_and_uniform():
    """A seeded token's uniform is the top 53 bits of the (seed, position) mix, for any int seed,
    and the mix spreads consecutive seeds and positions evenly over [0, 1)."""
    from rollover.engine.sampler import position_uniforms

    def reference(seed, pos):
        m = 2**64 - 1
        x = (seed * 0x9E3779B97F4A7C15 + pos * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & m
        x ^= x >> 31
        x = (x * 0xD6E8FEEB86659FD9) & m
        x ^= x >> 29
        return (x >> 11) * 2.0**-53

    pairs = [(0, 0), (5, 7), (-3, 2), (2**70, 1), (123456789, 4000)]
    got = position_uniforms([s for s, _ in pairs], [p for _, p in pairs])
    assert got.dtype == torch.float64 and got.tolist() == [reference(s, p) for s, p in pairs]
    u = position_uniforms(list(range(50_000)) * 2, [0] * 50_000 + list(range(50_000)))
    counts = torch.histc(u.float(), bins=10, min=0.0, max=1.0)
    chi2 = float(((counts - 10_000) ** 2 / 10_000).sum())
    assert 0.0 <= u.min() and u.max() < 1.0 and chi2 < 30, chi2  # 9 degrees of freedom: p < 0.001 above 27.9


def test_a_seeded_row_samples_alike_in_an_all_seeded_batch_and_a_mixed_one():
    """The sampler moves an all-seeded batch's uniforms to the device in one copy and places
    them by index beside unseeded or greedy rows: a seeded row's token and logprob are the same."""
    from rollover.engine.sampler import Sampler

    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 3
    seeded = [SamplingParams(seed=s, temperature=0.8) for s in (11, 12, 13, 14)]
    positions = [0, 5, 9, 2]
    tok_all, lp_all = Sampler(torch.device("cpu")).sample(logits.clone(), seeded, positions)
    mixed = [seeded[0], SamplingParams(temperature=0.8), seeded[2], SamplingParams(temperature=0.0)]
    tok_mix, lp_mix = Sampler(torch.device("cpu")).sample(logits.clone(), mixed, positions)
    assert tok_mix[[0, 2]].tolist() == tok_all[[0, 2]].tolist()
    assert torch.equal(lp_mix[[0, 2]], lp_all[[0, 2]])
    assert tok_mix[3] == logits[3].argmax()  # the greedy row
    assert len(set(tok_all.tolist())) > 1  # the uniforms differ from row to row


# ------------------------------------------------------------------ int8 weight matrices
def test_int8_runner_computes_with_its_dequantized_weights(model):
    from rollover.engine.model_runner import ModelRunner

    sd = model.state_dict()
    q = ModelRunner(model.config, sd, max_rows=4, max_len=64, quantize="int8")
    ref = ModelRunner(model.config, sd, max_rows=4, max_len=64, pack_weights=False)
    with torch.no_grad():  # the reference holds exactly what the int8 rows and scales stand for
        for w in ref._matrices():
            rows, scale = ref._quantized(w)
            assert rows.dtype == torch.int8 and (rows.abs().amax(1) == 127).all()  # each row's largest is +-127
            w.copy_(rows.float() * scale[:, None])
    ref.drop_packs()
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    torch.testing.assert_close(q.prefill([0, 1], prompts), ref.prefill([0, 1], prompts), rtol=1e-4, atol=1e-4)
    tokens, positions = torch.tensor([12, 13]), torch.tensor([4, 3])
    torch.testing.assert_close(q.decode(tokens, positions), ref.decode(tokens, positions), rtol=1e-4, atol=1e-4)
    plain = ModelRunner(model.config, sd, max_rows=4, max_len=64, pack_weights=False).prefill([0, 1], prompts)
    assert not torch.allclose(q.prefill([0, 1], prompts), plain, atol=1e-6)  # it is not the fp32 forward


def test_int8_engine_follows_weight_updates(model):
    other = tiny_model("llama", seed=9)
    eng = TorchEngine(model, device="cpu", max_rows=4, max_len=128, quantize="int8")
    fresh = TorchEngine(other, device="cpu", max_rows=4, max_len=128, quantize="int8")
    fp32 = TorchEngine(model, device="cpu", max_rows=4, max_len=128)
    try:
        reqs = [Request(id=f"q{i}", prompt_ids=[5 + i, 6, 7], sampling=GREEDY) for i in range(3)]
        before = eng.generate(reqs)
        near = fp32.generate(reqs)  # the first token's logprob: int8 and fp32 agree to the rounding of the weights
        gaps = [abs(x.logprobs[0] - y.logprobs[0]) for x, y in zip(before, near) if x.response_ids[0] == y.response_ids[0]]
        assert gaps and max(gaps) < 0.05
        eng.update_weights(other.state_dict().items(), version=1)  # the int8 copies are made again
        after = eng.generate(reqs)
        want = fresh.generate(reqs)
        assert [c.response_ids for c in after] == [c.response_ids for c in want]
        assert [c.response_ids for c in after] != [c.response_ids for c in before]
        assert all(c.versions == [1] * len(c.response_ids) for c in after)
    finally:
        for e in (eng, fresh, fp32):
            e.shutdown()


def test_int8_is_refused_where_it_cannot_pay(model):
    from rollover.config import ConfigError, load_config
    from rollover.engine import make_engine

    cfg = load_config(**{"rollout.quantize": "int8"})
    with pytest.raises(ConfigError, match="rollout.quantize=int8 on a CPU needs rollout.dtype=bfloat16"):
        make_engine(cfg, model, weights=list(model.state_dict().items()), device=torch.device("cpu"), max_len=64,
                    eos_token_ids=(2,))
    with pytest.raises(ConfigError, match="rollout.quantize=int8 is TorchEngine's"):
        load_config(**{"rollout.quantize": "int8", "rollout.engine": "vllm"})


def test_packed_weights_can_be_turned_off_with_the_same_outputs(model):
    reqs = [Request(id=f"p{i}", prompt_ids=[5 + i, 6, 7], sampling=GREEDY) for i in range(8)]
    on, off = TorchEngine(model, device="cpu", max_rows=8, max_len=64), TorchEngine(model, max_rows=8, max_len=64, pack_weights=False)
    try:
        mkl = torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
        kernels = on.core.runner.kernels
        packing = "native" if kernels is not None and kernels.gemm_vector_bits >= 512 else "mkl" if mkl else None
        assert off.core.runner.packing is None and on.core.runner.packing == packing
        assert off.core.runner.pack_sizes == [] and on.core.runner.pack_sizes == ([4, 6, 8] if packing == "mkl" else [])
        a, b = on.generate(reqs), off.generate(reqs)
        assert bool(on.core.runner._packs) == (packing is not None) and not off.core.runner._packs
        assert [c.response_ids for c in a] == [c.response_ids for c in b]
        assert max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p.logprobs, q.logprobs)) < 1e-4
    finally:
        on.shutdown()
        off.shutdown()


@pytest.mark.slow
def test_compiled_decode_step_gives_the_eager_outputs_and_follows_weight_updates(model):
    # torch.compile of the decode step (one dynamic graph): the same greedy tokens and logprobs
    # within float rounding as the eager step, while the batch shrinks (requests of different
    # lengths) and the attended length grows; then after an in-place weight update
    def reqs(tag):
        return [Request(id=f"{tag}{i}", prompt_ids=[5 + i, 6, 7][: 1 + i % 3],
                        sampling=SamplingParams(temperature=0.0, max_new_tokens=6 + 3 * i, ignore_eos=True))
                for i in range(6)]

    eager = TorchEngine(model, device="cpu", max_rows=8, max_len=64, pack_weights=False, eos_token_ids=[])
    comp = TorchEngine(model, device="cpu", max_rows=8, max_len=64, compile_decode=True, eos_token_ids=[])
    try:
        from torch._dynamo.utils import counters

        assert comp.core.runner.compiled is not None and comp.core.runner.pack_sizes == []
        frames = counters["frames"]["ok"]
        rounds = []
        for tag in ("a", "b"):  # the same requests before and after a weight update
            a, b = eager.generate(reqs(tag)), comp.generate(reqs(tag))
            assert [c.response_ids for c in a] == [c.response_ids for c in b]
            assert max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p.logprobs, q.logprobs)) < 1e-4
            rounds.append([lp for c in b for lp in c.logprobs])
            torch.manual_seed(7)
            noisy = [(n, t + 0.05 * torch.randn_like(t)) for n, t in model.state_dict().items() if "layers.0." in n]
            eager.update_weights(noisy, version=len(rounds))
            comp.update_weights(noisy, version=len(rounds))
        assert max(abs(x - y) for x, y in zip(*rounds)) > 1e-3  # the compiled step saw the new weights
        # the step was compiled, not run eagerly, and once: one graph for every batch size (one row
        # too) and attended length, whether the caller's tensors were made in inference mode or not
        assert counters["frames"]["ok"] == frames + 1
    finally:
        eager.shutdown()
        comp.shutdown()
    with pytest.raises(ValueError, match="compile_decode"):
        TorchEngine(model, device="cpu", max_rows=8, max_len=64, compile_decode=True, quantize="int8",
                    dtype=torch.bfloat16)


def test_make_engine_starts_at_a_given_version(monkeypatch):
    """A Ray worker's replacement starts at the current version (vLLM refuses a weightless update)."""
    from rollover.config import load_config
    from rollover.engine import make_engine
    model = tiny_model("llama", seed=3)
    cfg = load_config(**{"rollout.max_rows": 2})
    eng = make_engine(cfg, model, weights=list(model.state_dict().items()), device=torch.device("cpu"), max_len=64,
                      eos_token_ids=(2,), version=4)
    try:
        (c,) = eng.generate([Request(id="v", prompt_ids=[5, 6], sampling=SamplingParams(max_new_tokens=3, ignore_eos=True))])
        assert eng.version == 4 and c.versions == [4, 4, 4]
    finally:
        eng.shutdown()
    pytest.importorskip("vllm")
    from rollover.engine.vllm_engine import VLLMEngine

    seen = {}
    monkeypatch.setattr(VLLMEngine, "__init__", lambda self, model, **kw: seen.update(kw))
    make_engine(load_config(**{"rollout.engine": "vllm"}), model, weights=[], device=torch.device("cpu"), max_len=64,
                eos_token_ids=(2,), version=4)
    assert seen["version"] == 4


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_a_plain_config_builds_the_engine_the_model_builds(arch):
    """What a Ray worker is given (`portable_architecture`): the config's attributes as a
    `PlainConfig`, from which TorchEngine generates what it generates from the model; the
    model's own config where rollover's forward does not build from attributes alone."""
    import pickle
    from types import SimpleNamespace

    from rollover.config import load_config
    from rollover.engine import PlainConfig, portable_architecture

    model = tiny_model(arch, seed=3)
    config, generation = portable_architecture(model, load_config(), 64)
    assert type(config) is PlainConfig and generation is None and config.model_type == arch
    config = pickle.loads(pickle.dumps(config))
    reqs = [Request(id=f"p{i}", prompt_ids=[5 + i, 6, 7], sampling=SamplingParams(max_new_tokens=8, seed=i,
                                                                                 temperature=0.8, ignore_eos=True))
            for i in range(3)]
    a = TorchEngine(model, device="cpu", max_rows=4, max_len=64, eos_token_ids=[])
    b = TorchEngine(SimpleNamespace(config=config), state_dict=model.state_dict(), device="cpu", max_rows=4, max_len=64,
                    eos_token_ids=[])
    try:
        x, y = a.generate(reqs), b.generate(reqs)
        assert [c.response_ids for c in x] == [c.response_ids for c in y]
        assert [c.logprobs for c in x] == [c.logprobs for c in y]
    finally:
        a.shutdown()
        b.shutdown()
    # where the config itself is needed: a rotary embedding transformers computes, the model's own
    # forward, another engine, a window shorter than the sequences
    scaled = tiny_model(arch, seed=3, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    assert portable_architecture(scaled, load_config(), 64)[0] is scaled.config
    own = load_config(**{"rollout.engine_options": {"forward": "transformers"}})
    assert portable_architecture(model, own, 64)[0] is model.config
    assert portable_architecture(model, load_config(**{"rollout.engine": "vllm"}), 64)[0] is model.config
    if arch == "mistral":
        windowed = tiny_model(arch, seed=3, sliding_window=16)
        assert portable_architecture(windowed, load_config(), 64)[0] is windowed.config


def test_a_decode_step_at_a_graph_bucket_shape_equals_the_exact_shape(model):
    """What a CUDA graph replays (model_runner's docstring): the batch padded with free rows at
    position 0 and the attended length rounded up to the bucket give the same logits."""
    import torch.nn.functional as F

    from rollover.engine.model_runner import ModelRunner

    runner = ModelRunner(model.config, model.state_dict(), max_rows=8, max_len=160, pack_weights=False)
    with torch.inference_mode():
        runner.prefill([0, 1, 2], [[5, 6, 7], [8, 9, 10, 11, 12], [13] * 20])
        tokens, positions = torch.tensor([3, 4, 5]), torch.tensor([3, 5, 20])
        exact = runner._decode(tokens, positions)
        B, Lk = runner._bucket(3, 1, 8), runner._bucket(21, 64, 160)
        assert (B, Lk) == (4, 64) and runner._bucket(100, 64, 160) == 128 and runner._bucket(150, 64, 160) == 160
        padded = runner._decode(F.pad(tokens, (0, B - 3)), F.pad(positions, (0, B - 3)), Lk)[:3]
    assert torch.allclose(exact, padded, atol=1e-5)


def test_admission_apart_from_decode_gives_the_fused_tokens(model):
    """With CUDA graphs a step that admits while others decode runs decode, then prefill
    (`separate_admission`); on the CPU the same split must give what the fused `mixed` pass gives."""
    reqs = lambda: [Request(id=f"a{i}", prompt_ids=list(range(4, 6 + 3 * i)),  # noqa: E731
                            sampling=SamplingParams(temperature=0.0, max_new_tokens=30 - 4 * i, ignore_eos=True))
                    for i in range(7)]
    outs = {}
    for separate in (False, True):
        with TorchEngine(model, device="cpu", max_rows=3, max_len=96, eos_token_ids=[]) as eng:
            eng.core.runner.separate_admission = separate
            outs[separate] = eng.generate(reqs())  # 7 requests in 3 rows: admissions while others decode
            assert eng.stats().decode_steps > 0
    for a, b in zip(outs[False], outs[True]):
        assert a.response_ids == b.response_ids, a.id
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_admission_waits_for_a_batch_while_others_decode(model):
    """`admit_batch`: while others decode, waiting requests are admitted in batches (fewer
    admitting steps, each an eager prefill on a GPU), never later than `admit_max_wait` steps;
    greedy and seeded outputs do not depend on when a request was admitted."""
    reqs = lambda: [Request(id=f"b{i}", prompt_ids=list(range(4, 7 + i % 5)),  # noqa: E731
                            sampling=SamplingParams(temperature=float(i % 2), seed=i, ignore_eos=True,
                                                    max_new_tokens=6 + (7 * i) % 23))
                    for i in range(24)]
    outs, stats = {}, {}
    for batch in (1, 4):
        with TorchEngine(model, device="cpu", max_rows=8, max_len=96, eos_token_ids=[], admit_batch=batch,
                         admit_max_wait=6) as eng:
            assert eng.core.admit_batch == batch
            outs[batch], stats[batch] = eng.generate(reqs()), eng.stats()
    for a, b in zip(outs[1], outs[4]):
        assert a.response_ids == b.response_ids, a.id
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert 0 < stats[4].admission_steps <= stats[1].admission_steps // 2, (stats[4], stats[1])
    # a deferral costs idle rows: more decode steps, but at most admit_max_wait per admission
    extra = stats[4].decode_steps - stats[1].decode_steps
    assert 0 <= extra <= 6 * stats[4].admission_steps, (extra, stats[4].admission_steps)


def test_admit_batch_defaults_by_whether_admission_is_separate(model):
    with TorchEngine(model, device="cpu", max_rows=16, max_len=32, eos_token_ids=[]) as eng:
        assert eng.core.admit_batch == 1  # the CPU's fused mixed pass: admit every step
    from rollover.engine.core import EngineCore

    runner = type("R", (), {"max_rows": 64, "separate_admission": True, "device": torch.device("cpu")})()
    assert EngineCore(runner, eos_token_ids=()).admit_batch == 8
    with pytest.raises(ValueError, match="admit_batch"):
        EngineCore(runner, eos_token_ids=(), admit_batch=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_packed_prefill_equals_the_padded_one(arch, monkeypatch):
    """Prompts of very different lengths prefill packed (no padding through the linear layers):
    the same last-token logits and the same K/V in every row as the padded [N, T] batch."""
    from rollover.engine import prefill as prefill_module
    from rollover.engine.model_runner import ModelRunner

    model = tiny_model(arch, seed=3)
    prompts = [list(range(5, 5 + n)) for n in (3, 40, 11, 64, 1, 27)]
    rows = [4, 0, 5, 2, 1, 3]
    out = {}
    for packed in (False, True):
        monkeypatch.setattr(prefill_module, "PACK_PREFILL_ABOVE", 1.0 if packed else 1e9)
        runner = ModelRunner(model.config, model.state_dict(), max_rows=6, max_len=80)
        logits = runner.prefill(rows, prompts)
        kv = [(runner.k_cache[li][r, :, :len(p)].clone(), runner.v_cache[li][r, :, :len(p)].clone())
              for li in range(runner.n_layers) for r, p in zip(rows, prompts)]
        out[packed] = logits, kv
    assert torch.allclose(out[True][0], out[False][0], atol=1e-5)
    for (k1, v1), (k0, v0) in zip(out[True][1], out[False][1]):
        assert torch.allclose(k1, k0, atol=1e-5) and torch.allclose(v1, v0, atol=1e-5)
    ref = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts])
    assert torch.allclose(out[True][0], ref, atol=1e-4)


_TRITON_CHECK = r"""
import math, os
import torch
from rollover.engine.triton_attention import decode_attention
from rollover.engine.torch_engine import TorchEngine
from rollover.testing import tiny_model
from rollover.types import Request, SamplingParams

def exact(q, kc, vc, pos):  # float64, each row over its own keys
    B, H, D = q.shape
    G = H // kc.shape[1]
    out = torch.empty(B, H, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            k, v = kc[b, h // G, : int(pos[b]) + 1].double(), vc[b, h // G, : int(pos[b]) + 1].double()
            out[b, h] = torch.softmax(k @ q[b, h].double() / math.sqrt(D), 0) @ v
    return out.reshape(B, H * D)

torch.manual_seed(0)
for H, KV, D, dtype, tol in [(9, 3, 64, torch.float32, 1e-5), (14, 2, 64, torch.float32, 1e-5),
                             (4, 4, 32, torch.float32, 1e-5), (9, 3, 64, torch.float16, 3e-3)]:
    kc, vc = (torch.randn(6, KV, 200, D, dtype=dtype) for _ in range(2))
    q = torch.randn(5, H, D, dtype=dtype)
    pos = torch.tensor([0, 5, 63, 64, 150])  # one key; a block's edge; past one block; three blocks
    kc[:, :, 151:] = float("nan")  # past every row's keys: never read
    vc[:, :, 151:] = float("nan")
    err = float((decode_attention(q, kc, vc, pos).double() - exact(q, kc, vc, pos)).abs().max())
    assert err < tol, (H, KV, D, dtype, err)

model = tiny_model("llama", seed=4)
reqs = lambda: [Request(id=f"r{i}", prompt_ids=list(range(5, 8 + 7 * i)),
                        sampling=SamplingParams(temperature=0.0, max_new_tokens=30 - 3 * i, ignore_eos=True))
                for i in range(5)]  # five into four rows: admissions beside decoding rows too
outs = {}
for attention in ("torch", "triton"):
    with TorchEngine(model, device="cpu", dtype=torch.float32, max_rows=4, max_len=128, eos_token_ids=[],
                     attention=attention) as eng:
        outs[attention] = eng.generate(reqs())
        assert eng.core.runner.attention.impl == attention
for a, b in zip(outs["torch"], outs["triton"]):
    assert a.response_ids == b.response_ids, a.id
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4, a.id
print("ok")
"""


def test_triton_decode_attention_reads_each_rows_keys_and_gives_the_torch_tokens():
    """attention='triton' (CUDA; here through Triton's interpreter on the CPU, in its own process):
    the kernel equals float64 attention over each row's own keys (keys past them, NaN here, are
    never read) for grouped-query shapes in fp32 and fp16, and an engine using it decodes the
    torch attention's greedy tokens with the same logprobs. bf16 runs on a GPU only
    (tests/test_cuda.py): the interpreter's bf16 products are wrong."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    done = subprocess.run([sys.executable, "-c", _TRITON_CHECK], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_triton_attention_is_refused_where_it_cannot_run(model):
    with pytest.raises(ValueError, match="attention='triton' runs on CUDA"):
        TorchEngine(model, device="cpu", max_rows=2, max_len=32, attention="triton")
    with pytest.raises(ValueError, match="attention must be 'torch' or 'triton'"):
        TorchEngine(model, device="cpu", max_rows=2, max_len=32, attention="flash")
    with pytest.raises(ValueError, match="does not yet go with compile_decode"):
        TorchEngine(model, device="cpu", max_rows=2, max_len=32, attention="triton", compile_decode=True)
