"""Request checks shared by every engine: bad input fails at submission, naming the request."""

from __future__ import annotations

from rollover.types import Request, SamplingParams


def validate_request(req: Request, *, max_len: int, vocab_size: int, media: bool = False,
                     stop_strings: bool = False) -> None:
    """Raise ValueError naming the request and the problem; nothing is queued. `media`: whether
    the engine takes images; `stop_strings`: whether it can look for stop strings (it was given a
    tokenizer)."""
    where = f"request {getattr(req, 'id', '?')!r}"
    if not isinstance(req, Request):
        raise ValueError(f"{where}: a Request is needed, got {type(req).__name__}")
    if not isinstance(req.sampling, SamplingParams):
        raise ValueError(f"{where}: sampling must be a SamplingParams, got {type(req.sampling).__name__} "
                         "(SamplingParams(**mapping) builds one)")
    for name in ("prompt_ids", "response_ids"):
        ids = getattr(req, name)
        if not isinstance(ids, list):
            hint = " (its .tolist() gives one)" if hasattr(ids, "tolist") else " (list(...) gives one)" if \
                isinstance(ids, tuple) else ""
            raise ValueError(f"{where}: {name} must be a list of token ids (Python ints), got {type(ids).__name__}{hint}")
    if req.sampling.stop and not isinstance(req.sampling.stop, str) and not stop_strings:
        raise ValueError(f"{where} has stop strings {list(req.sampling.stop)}: this engine was built without a "
                         "tokenizer to find them (a run's engines get one when rollout.stop or env.name is set)")
    if req.media is not None and not media:
        raise ValueError(f"{where} has images: only TorchEngine with a vision-language model takes them "
                         "(not vLLM yet)")
    try:
        req.sampling.validate()
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if not req.prompt_ids:
        raise ValueError(f"{where}: empty prompt")
    n_resp = len(req.response_ids)
    if not (n_resp == len(req.response_logprobs) == len(req.response_versions)):
        raise ValueError(
            f"{where}: response_ids, response_logprobs and response_versions must have equal "
            f"lengths, got {n_resp}, {len(req.response_logprobs)}, {len(req.response_versions)}"
        )
    if n_resp > req.sampling.max_new_tokens:
        raise ValueError(
            f"{where}: carries {n_resp} response tokens, more than max_new_tokens="
            f"{req.sampling.max_new_tokens}"
        )
    total = len(req.prompt_ids) + n_resp
    if total >= max_len:
        raise ValueError(
            f"{where}: prompt{' + response' if n_resp else ''} of {total} tokens does not fit "
            f"the context of {max_len} tokens (need room for one new token)"
        )
    V = vocab_size
    for name, ids in (("prompt_ids", req.prompt_ids), ("response_ids", req.response_ids)):
        if len(ids) and not (set(map(type, ids)) <= {int} and min(ids) >= 0 and max(ids) < V):  # a fast pass
            odd = next((t for t in ids if not isinstance(t, int) and hasattr(t, "__index__")), None)
            if odd is not None:  # numpy's or torch's integers: valid ids of the wrong type
                raise ValueError(f"{where}: {name} holds {type(odd).__module__}.{type(odd).__name__} values, not "
                                 "Python ints (int(x) for each, or an array's .tolist())")
            bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < V)]
            if bad:
                raise ValueError(f"{where}: unknown token ids {bad[:5]} (vocabulary size {V})")
    if any(not isinstance(t, int) or t < 0 for t in req.sampling.stop_token_ids):
        raise ValueError(f"{where}: stop_token_ids must be non-negative ints")
    stop = req.sampling.stop
    if not isinstance(stop, (tuple, list)) or any(not isinstance(s, str) or not s for s in stop):
        raise ValueError(f"{where}: stop must be a tuple of non-empty strings, got {stop!r}")
