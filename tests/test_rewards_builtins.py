"""Built-in reward functions, with hand-picked completions."""

import re
import threading
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest

from rollover.rewards import (
    countdown_reward,
    exact_reward,
    extract_boxed,
    format_reward,
    math_reward,
    numeric_reward,
)


def test_extract_boxed_balances_braces_and_takes_the_last():
    assert extract_boxed(r"first \boxed{1}, then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{7} and an unclosed \boxed{8") == "7"
    assert extract_boxed("no box") is None


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        (r"3 + 5 = 8, so \boxed{8}", "8", 1.0),
        (r"I think \boxed{8.0}", "8", 1.0),
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"so \boxed{x^2 + 1}", "1 + x^2", 1.0),
        (r"7 is tempting, but \boxed{9}", "8", 0.0),
        (r"guess 8 then \boxed{9}", "8", 0.0),  # the boxed answer wins over a bare number
        ("The answer is 8", "8", 1.0),  # no box: plain expressions are still read
        ("no idea", "8", 0.0),
        # a GSM8K solution as gold: its final answer after ####, thousands separators dropped
        (r"so \boxed{1200}", "She pays 3 * 400 = <<3*400=1200>>1200 dollars.\n#### 1,200", 1.0),
        (r"so \boxed{400}", "She pays 3 * 400 = <<3*400=1200>>1200 dollars.\n#### 1200", 0.0),
    ],
)
def test_math_reward(completion, answer, expected):
    assert math_reward(completion, answer) == expected


def test_math_reward_abstains_when_gold_does_not_parse():
    assert math_reward(r"\boxed{8}", r"\boxed{") is None


@pytest.mark.parametrize("completion, answer, expected", [
    (r"\boxed{0.00001}", 0.00001, 1.0),  # str() gives "1e-05", which math-verify reads as -5 + e
    (r"\boxed{10000000000000000}", 1e16, 1.0),  # str(): "1e+16"
    (r"\boxed{0.5}", 0.5, 1.0),
    (r"\boxed{12}", 12, 1.0),
    (r"\boxed{\$1.17}", r"\$1.17", 1.0),  # MATH's escaped dollar is not math mode: the gold is boxed
    (r"\boxed{\$1.18}", r"\$1.17", 0.0),
    (r"\boxed{3}", "$3$", 1.0),  # in math mode already: parsed as it is
    (r"\boxed{four}", ["4", "four"], 1.0),  # a list: any acceptable answer
    (r"\boxed{4}", ("4", "four"), 1.0),
    (r"\boxed{5}", ["4", "four"], 0.0),
    (r"\boxed{0.1}", np.float32(0.1), 1.0),  # in its own precision, not float64's 0.10000000149...
    (r"\boxed{7}", np.int64(7), 1.0),
    (r"\boxed{\frac{1}{2}}", Fraction(1, 2), 1.0),
    (r"\boxed{0.00001}", Decimal("1E-5"), 1.0),
])
def test_math_reward_gold_numbers_escaped_dollars_and_lists(completion, answer, expected):
    assert math_reward(completion, answer) == expected


@pytest.mark.parametrize("answer, error, message", [
    ({"value": 4}, TypeError, "math: the answer must be a string, a number or a list of acceptable answers, got dict"),
    (True, TypeError, "got bool"),
    (np.bool_(True), TypeError, "got bool"),
    (["4", None], TypeError, "got NoneType"),
    ([], ValueError, "empty list"),
    (float("nan"), ValueError, "the answer is nan"),
])
def test_math_reward_refuses_a_gold_answer_of_another_type(answer, error, message):
    with pytest.raises(error, match=re.escape(message)):
        math_reward(r"\boxed{4}", answer)


def test_math_reward_works_off_the_main_thread():
    # math-verify's default timeouts use signal.alarm, which raises in a worker thread.
    results = []
    worker = threading.Thread(target=lambda: results.append(math_reward(r"\boxed{12}", "12")))
    worker.start()
    worker.join(timeout=30)
    assert results == [1.0]


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("3 + 5 = 8", "8", 1.0),
        ("It is 8.0.", "8", 1.0),
        ("total: 1,234", "1234", 1.0),
        ("total: 1234.5", "1,234.50", 1.0),
        ("5 - 3 gives 2", "2", 1.0),
        ("temperature is -4 today", "-4", 1.0),
        ("5-4", "4", 1.0),  # "5-4" reads as 5 and 4, not 5 and -4
        (r"\boxed{8}, checked with 3 + 5", "8", 1.0),  # the box is the final answer
        ("8 or maybe 9", "8", 0.0),
        ("no numbers", "8", 0.0),
        (r"\boxed{1{,}000}", "1000", 1.0),  # LaTeX's thousands separator
        (r"\boxed{.5}", "0.5", 1.0),
        ("version 1.2.3", "3", 1.0),  # not .3
        ("so \u22123", "-3", 1.0),  # a Unicode minus
        ("so 3", "\u22123", 0.0),
    ],
)
def test_numeric_reward(completion, answer, expected):
    assert numeric_reward(completion, answer) == expected


def test_numeric_reward_refuses_a_non_numeric_gold():
    with pytest.raises(ValueError, match=r"numeric: the answer 'eight' is not a number"):
        numeric_reward("8", "eight")
    with pytest.raises(ValueError, match=r"numeric: the answer \{'value': 6\} is not a number"):
        numeric_reward("6", {"value": 6})  # a structured answer column: named, not float()'s complaint
    for odd in ("nan", "inf", "-Infinity", float("nan")):  # float() reads them; no completion's number equals one
        with pytest.raises(ValueError, match="is not a number"):
            numeric_reward("8", odd)
    assert numeric_reward("The answer is " + "9" * 400, "8") == 0.0  # a completion's huge number: a wrong answer


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        (r"\boxed{Paris}", "paris", 1.0),
        ("<answer>  New   York. </answer>", "new york", 1.0),
        ("Paris", "Paris.", 1.0),
        ("It is Paris", "Paris", 0.0),
    ],
)
def test_exact_reward(completion, answer, expected):
    assert exact_reward(completion, answer) == expected


@pytest.mark.parametrize("completion, answer, expected", [
    ("<think>search it</think><answer>The Beatles!</answer>", ["beatles", "the fab four"], 1.0),
    ("<answer>Frank Herbert</answer>", "frank  herbert", 1.0),
    ("<answer>Herbert</answer>", ["Frank Herbert"], 0.0),
    ("<answer>an apple</answer>", ("Apple",), 1.0),
    ("<answer>Paris</answer>", {"target": ["paris", "Paris, France"]}, 1.0),  # Search-R1's parquet rows
])
def test_em_reward_matches_any_gold_answer_after_squad_normalisation(completion, answer, expected):
    from rollover.rewards.builtins import em_reward

    assert em_reward(completion, answer) == expected


def test_format_reward_default_and_custom_pattern():
    assert format_reward(r"so \boxed{3}", "3") == 1.0
    assert format_reward("so 3", "3") == 0.0
    think = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
    assert format_reward("<think>a\nb</think>\n<answer>3</answer>", None, pattern=think) == 1.0
    assert format_reward("text <think>a</think><answer>3</answer>", None, pattern=think) == 0.0


@pytest.mark.parametrize(
    "completion, expected",
    [
        (r"\boxed{(3 + 7) * 2}", 1.0),
        (r"\boxed{2 \times (7 + 3)}", 1.0),
        ("<answer>7*2+3*2</answer>", 0.0),  # uses 2 twice and 3... numbers must match exactly
        ("Let me try.\n(7 + 3) * 2 = 20", 1.0),  # last line, left of '='
        (r"\boxed{7 * 3 - 2}", 0.0),  # 19
        (r"\boxed{(3 + 7) * 2 * 1}", 0.0),  # 1 is not given
        (r"\boxed{(3 + 7) ** 2}", 0.0),  # power is not allowed
        (r"\boxed{__import__('os').system('true')}", 0.0),  # never evaluated
        (r"\boxed{3 / (7 - 7) * 2}", 0.0),  # uses 7 twice; also divides by zero
        ("", 0.0),
    ],
)
def test_countdown_reward(completion, expected):
    assert countdown_reward(completion, "20", numbers=[3, 7, 2]) == expected


def test_countdown_reward_divides_exactly_and_handles_zero_division():
    assert countdown_reward(r"\boxed{(6 - 2) / 8}", "0.5", numbers=[2, 6, 8]) == 1.0
    assert countdown_reward(r"\boxed{8 / (2 - 2)}", "1", numbers=[2, 2, 8]) == 0.0
