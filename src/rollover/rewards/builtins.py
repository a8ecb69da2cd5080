"""Built-in reward functions: `(completion, answer, **fields) -> float | None`.

`None` means the function does not apply to this sample (see `rollover.rewards.runner`).
None of these has a timeout of its own; `RewardRunner` enforces one around every call.

`math` is marked `isolate = True`: sympy can spend unbounded time inside C code on an answer
such as `\\boxed{9^{9^{9}}}`, so the runner calls it in a worker process it kills at the
timeout. The others do work bounded by the completion's length and run in threads:
`numeric`, `exact` and `format` are regex searches (the default `format` pattern is the
slowest, quadratic in the worst case: 0.15 s on 56,000 characters of `\\boxed{`), and
`countdown` evaluates at most 200 characters of integers and + - * / (no powers), each
literal one of the given numbers. A `format` pattern of your own that can backtrack
catastrophically wants `isolate: true`.

`numeric` and `exact` look for the final answer with `rollover.rewards.extract.final_answer`:
the last `\\boxed{...}`, else the last `<answer>...</answer>`, else the whole completion.
"""

from __future__ import annotations

import math
import numbers
import re
import sys
from decimal import Decimal
from fractions import Fraction
from functools import lru_cache

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from rollover.rewards.code import code_reward  # a sandboxed program run against tests
from rollover.rewards.countdown import countdown_reward
from rollover.rewards.extract import final_answer, gold
from rollover.rewards.judge import judge  # an LLM behind an OpenAI-compatible endpoint grades
from rollover.rewards.model import reward_model  # a learned sequence classifier's score


# --- math ---------------------------------------------------------------------------------------


_COMPLETION_EXTRACTION = [
    LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False),
    ExprExtractionConfig(),
]


def math_reward(completion: str, answer, **_) -> float | None:
    """1.0 if math-verify finds the completion equal to the gold answer, else 0.0.

    Follows TRL's `accuracy_reward`: the completion is parsed with `\\boxed{}` taking priority
    and no anchor-less LaTeX, then plain expressions. A bare gold answer ("8", "x^2+1", "\\$1.17")
    is wrapped in `\\boxed{}` before parsing, as verl does, so it is read as LaTeX; one already
    boxed or in math mode (an unescaped `$`) is parsed as it is. A gold answer that does not
    parse gives None (the sample is not scored by this function), not 0.

    A number as the gold answer is written out in plain decimals (a JSON 0.00001 is "0.00001",
    not str()'s "1e-05", which math-verify reads as -5 + e). A list or tuple is a set of
    acceptable answers: 1.0 if the completion equals any of them, None if none parses. Any other
    type raises.

    math-verify's own timeouts use `signal.alarm`, which fails off the main thread; they are
    turned off here. The runner's worker processes stand in for them; called directly, this
    function has no timeout. A GSM8K solution as the gold answer ("... #### 72") counts by its
    final answer, the text after its last `####`.
    """
    answers = gold(answer, "math")
    if isinstance(answers, (list, tuple)):
        if not answers:
            raise ValueError("math: the answer is an empty list of acceptable answers")
    else:
        answers = [answers]
    targets = [parse(_gold_text(a), parsing_timeout=None) for a in answers]
    targets = [t for t in targets if t]
    if not targets:
        return None
    pred = parse(completion, extraction_config=_COMPLETION_EXTRACTION, parsing_timeout=None)
    return 1.0 if pred and any(verify(t, pred, timeout_seconds=None) for t in targets) else 0.0


def numpy_bool(value) -> bool:
    """np.bool_ (what np.isclose returns) is no numbers.Real, unlike numpy's ints and floats."""
    np = sys.modules.get("numpy")  # not imported: the value cannot be one of its bools
    return np is not None and isinstance(value, np.bool_)


_MATH_MODE = re.compile(r"(?<!\\)\$")  # a `$` that opens or closes math mode; `\$` is a dollar sign


def _gold_text(answer) -> str:
    """One gold answer as LaTeX for math-verify."""
    if isinstance(answer, bool) or not isinstance(answer, (str, numbers.Real, Decimal)) or numpy_bool(answer):
        raise TypeError(f"math: the answer must be a string, a number or a list of acceptable answers, got "
                        f"{type(answer).__name__}: {answer!r:.80}")
    if isinstance(answer, (str, numbers.Integral, Fraction)):  # (numpy's ints too; a fraction as p/q)
        text = str(int(answer)) if isinstance(answer, numbers.Integral) else str(answer)
    else:  # a float (numpy's too) or a Decimal
        if not math.isfinite(answer):
            raise ValueError(f"math: the answer is {answer}")
        # str: the shortest digits that round-trip in the number's own precision (float32's too)
        text = format(answer if isinstance(answer, Decimal) else Decimal(str(answer)), "f")  # no exponent
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip().replace(",", "")
    if "\\boxed" not in text and not _MATH_MODE.search(text):
        text = f"\\boxed{{{text}}}"
    return text


math_reward.isolate = True


# --- numeric ------------------------------------------------------------------------------------

# A number with optional thousands separators and decimals, or a bare decimal (".5", not the
# ".3" of "1.2.3"). A minus sign counts only when it does not follow a word character or ")", so
# "5-3" reads as 5 and 3, not 5 and -3.
_NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\d.])\.\d+)")


def _plain(text: str) -> str:
    """LaTeX's thousands separator `{,}` as a comma, a Unicode minus (U+2212) as '-'."""
    return text.replace("{,}", ",").replace("\u2212", "-")


def parse_number(text: str) -> float:
    """'1,234.50' -> 1234.5; raises ValueError if `text` is not one number."""
    cleaned = _plain(str(text)).strip().strip("$").replace(",", "")
    return float(cleaned)


def final_number(completion: str) -> float | None:
    """The last number in the completion's final answer, or None when it holds none."""
    numbers = _NUMBER.findall(_plain(final_answer(completion)))
    value = parse_number(numbers[-1]) if numbers else None
    return value if value is None or math.isfinite(value) else None  # (309 digits and more: no number it equals)


def numeric_reward(completion: str, answer, **_) -> float:
    """1.0 if the last number in the completion's final answer equals `answer` (8 == 8.0 ==
    "8"; commas are thousands separators), else 0.0. A non-numeric gold answer raises."""
    try:
        gold_number = parse_number(gold(answer, "numeric"))
        if not math.isfinite(gold_number):  # "nan" and "inf", which float() reads: no completion's number equals one
            raise ValueError
    except ValueError:
        if answer is None:
            raise
        raise ValueError(f"numeric: the answer {answer!r} is not a number (the row's answer column holds it; "
                         "score other answers with exact, em or a function of yours)") from None
    value = final_number(completion)
    if value is None:
        return 0.0
    return 1.0 if math.isclose(value, gold_number, rel_tol=1e-9, abs_tol=1e-9) else 0.0


# --- exact --------------------------------------------------------------------------------------


def normalize_text(text: str) -> str:
    """Casefolded, whitespace collapsed, surrounding `$` and a trailing period removed."""
    text = " ".join(str(text).split()).casefold()
    return text.strip("$ ").removesuffix(".").strip()


def exact_reward(completion: str, answer, **_) -> float:
    """1.0 if the completion's final answer equals `answer` after `normalize_text`, else 0.0."""
    return 1.0 if normalize_text(final_answer(completion)) == normalize_text(gold(answer, "exact")) else 0.0


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", __import__("string").punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation (and Search-R1's): lower case, punctuation and the articles a, an,
    the removed, whitespace collapsed."""
    text = _ARTICLES.sub(" ", str(text).lower().translate(_PUNCTUATION))
    return " ".join(text.split())


def em_reward(completion: str, answer, **_) -> float:
    """1.0 if the completion's final answer (the `<answer>`'s or `\\boxed{}`'s text, else the whole
    completion) equals one of the gold answers (`answer`: one, or a list, as QA datasets give
    several; Search-R1's rows give `{"target": [...]}`) after `normalize_answer`; SQuAD's and
    Search-R1's exact match."""
    if isinstance(gold(answer, "em"), dict) and "target" in answer:
        answer = answer["target"]
    golds = list(answer) if isinstance(answer, (list, tuple)) or type(answer).__name__ == "ndarray" else [answer]
    mine = normalize_answer(final_answer(completion))
    return 1.0 if any(mine == normalize_answer(g) for g in golds) else 0.0


# --- format -------------------------------------------------------------------------------------

DEFAULT_FORMAT_PATTERN = r"\\boxed\{.+\}"


@lru_cache(maxsize=64)
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(pattern, re.DOTALL)


def format_reward(
    completion: str, answer=None, *, pattern: str = DEFAULT_FORMAT_PATTERN, **_
) -> float:
    """1.0 if `pattern` is found in the completion (`re.search`, DOTALL), else 0.0.

    Anchor the pattern with ^...$ to require the whole completion to match, e.g.
    r"^<think>.*?</think>\\s*<answer>.*?</answer>$".
    """
    return 1.0 if _compiled(pattern).search(completion) else 0.0


def _format_prepare(load: bool, **kwargs) -> dict:
    """`format`'s options checked when the rewards are built: a pattern that does not compile
    failed on every sample, at the first scoring."""
    unknown = [k for k in kwargs if k != "pattern"]
    if unknown:
        raise ValueError(f"has no option {', '.join(map(repr, unknown))}; its options: pattern")
    if "pattern" in kwargs:
        pattern = kwargs["pattern"]
        if not isinstance(pattern, str):
            raise TypeError(f"pattern must be a regular expression as a string, got {type(pattern).__name__}")
        try:
            _compiled(pattern)
        except re.error as e:
            raise ValueError(f"pattern {pattern!r:.100} is not a regular expression: {e}") from None
    return kwargs


format_reward._rollover_prepare = _format_prepare

BUILTINS = {
    "math": math_reward,
    "numeric": numeric_reward,
    "exact": exact_reward,
    "em": em_reward,
    "format": format_reward,
    "countdown": countdown_reward,
    "code": code_reward,
    "reward_model": reward_model,
    "judge": judge,
}
