"""An LLM as the judge (`judge`, a built-in reward): a chat model behind an OpenAI-compatible
endpoint (a vLLM or SGLang server, OpenAI, any `/v1/chat/completions`) grades each completion.

    reward:
      timeout_s: 120                      # the whole batch is one call
      functions:
        - fn: judge
          kwargs: {url: "http://localhost:8000/v1", model: Qwen2.5-7B-Instruct,
                   rubric: "Is the answer correct and its reasoning sound?"}

For each sample the judge is sent one user message: the question (the prompt's text, or its
messages as `role: content` lines), the reference answer when the sample has one, the completion
and the rubric, asking for a last line `Score: N` with N from `scale` (0 to 10 by default); the
score is N mapped onto [0, 1]. `template` replaces that message: a string with `{prompt}`,
`{answer}`, `{completion}`, `{rubric}`, `{low}` and `{high}`.

A request that fails (no answer within `request_timeout_s`, an HTTP error, a reply whose last
line is not a score in the scale) fails its sample only, with the reason (`reward.on_error`
decides what that sample gets); the other samples of the batch keep their scores, and so do those
graded when the batch's time (`reward.timeout_s`, which the runner hands over) runs out: the rest
fail with a timeout each. Requests go out `concurrency` at a time. The API key, if the endpoint wants one, is read from the environment variable
`api_key_env` (OPENAI_API_KEY by default; none set: no key sent). Each sample's reply is not
kept; its raw score is the extra `judge/raw`.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
import time
from concurrent.futures import ThreadPoolExecutor, wait

KWARGS = ("url", "model", "rubric", "template", "scale", "max_tokens", "temperature", "request_timeout_s",
          "concurrency", "api_key_env")
DEFAULT_RUBRIC = "Judge whether the answer is correct and complete."
TEMPLATE = """You are grading an answer to a question.

Question:
{prompt}
{answer}
Answer to grade (between the lines of dashes):
-----
{completion}
-----

{rubric}
Think briefly if you need to, then end with a last line of the form `Score: N`, where N is a number from {low} (worst) to {high} (best)."""
# the reply's last non-empty line, and only it: "Score: 7", "**Score:** 7/10"; a score quoted earlier
# (from the graded answer, or a "confidence score" beside it) is not read
_SCORE = re.compile(r"^\W*score\W*[:=]\W*(-?\d+(?:\.\d+)?)(?:\s*/\s*\d+(?:\.\d+)?)?\W*$", re.IGNORECASE)


def judge(prompts: list, completions: list[str], answer: list, *, url: str, model: str, rubric: str = DEFAULT_RUBRIC,
          template: str | None = None, scale: tuple[float, float] = (0, 10), max_tokens: int = 512,
          temperature: float = 0.0, request_timeout_s: float = 60.0, concurrency: int = 8,
          api_key_env: str = "OPENAI_API_KEY", reward_timeout_s: float | None = None) -> list:
    """One dict (`score` in [0, 1], `raw` the judge's N) per sample, or the exception that failed it.
    `reward_timeout_s` (the runner's `reward.timeout_s`, which bounds the whole batch): the samples
    not graded a little before it fail with a timeout of their own; the graded ones keep their
    scores."""
    low, high = scale
    started = time.monotonic()
    key = os.environ.get(api_key_env)
    endpoint = url.rstrip("/") + "/chat/completions"

    def grade(i: int):
        fields = dict(prompt=_text(prompts[i]), completion=completions[i], rubric=rubric, low=low, high=high)
        if template is None:
            message = TEMPLATE.format(answer="" if answer[i] is None else f"\nReference answer:\n{answer[i]}\n", **fields)
        else:
            message = template.format(answer="" if answer[i] is None else answer[i], **fields)
        try:
            reply = _chat(endpoint, key, {"model": model, "messages": [{"role": "user", "content": message}],
                                          "max_tokens": max_tokens, "temperature": temperature}, request_timeout_s)
            lines = [line for line in reply.splitlines() if line.strip()]
            found = _SCORE.match(lines[-1]) if lines else None
            if found is None:
                raise ValueError(f"the judge's reply does not end with a `Score: N` line: {_cut(reply)!r}")
            raw = float(found.group(1))
            if not low <= raw <= high:
                raise ValueError(f"the judge's score {raw:g} is outside its scale [{low:g}, {high:g}]: {_cut(reply)!r}")
            return {"score": (raw - low) / (high - low), "raw": raw}
        except Exception as e:  # this sample fails, with what went wrong; the batch goes on
            return e

    pool = ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(completions))))
    futures = [pool.submit(grade, i) for i in range(len(completions))]
    budget = None if reward_timeout_s is None else reward_timeout_s - min(2.0, 0.1 * reward_timeout_s)
    done, _ = wait(futures, timeout=None if budget is None else max(0.0, budget - (time.monotonic() - started)))
    pool.shutdown(wait=False, cancel_futures=True)  # requests still out end at their request_timeout_s, unread
    late = TimeoutError(f"not graded within the batch's time (reward.timeout_s={reward_timeout_s:g} s for "
                        f"{len(completions)} samples at concurrency {concurrency}): raise reward.timeout_s or "
                        "concurrency") if budget is not None else None
    return [f.result() if f in done else late for f in futures]


def _prepare(load: bool = True, **kwargs) -> dict:
    """The bound arguments checked when the reward is built (`rollover.rewards.registry.prepare`)."""
    unknown = sorted(set(kwargs) - set(KWARGS))
    if unknown:
        raise ValueError(f"unknown kwargs {unknown} (known: {', '.join(KWARGS)})")
    missing = [k for k in ("url", "model") if not kwargs.get(k)]
    if missing:
        raise ValueError(f"kwargs {missing} required: the endpoint's base URL (http://host:port/v1) and the "
                         "judge model's name")
    if not str(kwargs["url"]).startswith(("http://", "https://")):
        raise ValueError(f"url={kwargs['url']!r}: expected http://... or https://...")
    scale = kwargs.get("scale", (0, 10))
    if not (isinstance(scale, (list, tuple)) and len(scale) == 2 and all(isinstance(x, (int, float)) for x in scale)
            and scale[0] < scale[1]):
        raise ValueError(f"scale={scale!r}: expected [low, high] with low < high")
    concurrency = kwargs.get("concurrency", 8)
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency={concurrency!r}: must be an integer >= 1")
    template = kwargs.get("template")
    if template is not None:
        try:
            template.format(prompt="", answer="", completion="", rubric="", low=0, high=1)
        except (KeyError, IndexError, ValueError, AttributeError) as e:
            raise ValueError(f"template: {e!r} (it may use {{prompt}}, {{answer}}, {{completion}}, {{rubric}}, "
                             "{{low}}, {{high}}; write literal braces twice)") from None
    return {**kwargs, "scale": tuple(scale)} if "scale" in kwargs else kwargs


judge._rollover_prepare = _prepare


def _chat(endpoint: str, key: str | None, body: dict, timeout: float) -> str:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(endpoint, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            reply = json.loads(response.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{endpoint}: HTTP {e.code}: {_cut(e.read().decode(errors='replace'))}") from None
    except (urllib.error.URLError, TimeoutError) as e:
        raise RuntimeError(f"{endpoint}: {getattr(e, 'reason', e)}") from None
    try:
        return reply["choices"][0]["message"]["content"] or ""
    except (KeyError, IndexError, TypeError):
        raise RuntimeError(f"{endpoint}: not a chat completion: {_cut(json.dumps(reply))}") from None


def _text(prompt) -> str:
    if isinstance(prompt, list):
        return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in prompt)
    return str(prompt)


def _cut(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
