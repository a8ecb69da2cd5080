"""Procedural generators: determinism, correct answers, option parsing."""

import itertools
import operator
import re
from fractions import Fraction

import pytest

from rollover.data import DataError, arithmetic, countdown, generate, load_prompts
from rollover.data.generators import generate_from_spec


def test_arithmetic_first_items_by_hand():
    # Pinned so a change to the generator (which would silently change every toy run) shows.
    ps = arithmetic(3, seed=0)
    assert [(p.id, p.text, p.answer) for p in ps] == [
        ("arithmetic-0-0", "What is 4 + 1?", "5"),
        ("arithmetic-0-1", "What is 6 + 2?", "8"),
        ("arithmetic-0-2", "What is 2 + 6?", "8"),
    ]


@pytest.mark.parametrize("digits, ops", [(1, "+"), (2, "+-*"), (3, "-")])
def test_arithmetic_answers_are_right(digits, ops):
    ops_fn = {"+": operator.add, "-": operator.sub, "*": operator.mul}
    for p in arithmetic(200, seed=3, digits=digits, ops=ops):
        a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", p.text).groups()
        assert len(a) <= digits and len(b) <= digits and op in ops
        assert p.answer == str(ops_fn[op](int(a), int(b)))
        assert int(p.answer) >= 0


def test_generators_are_deterministic_and_prefix_stable():
    assert generate("arithmetic", n=50, seed=7) == generate("arithmetic", n=50, seed=7)
    assert generate("countdown", n=20, seed=7)[:5] == generate("countdown", n=5, seed=7)
    assert [p.text for p in arithmetic(50, seed=1)] != [p.text for p in arithmetic(50, seed=2)]


def _left_fold_targets(numbers):
    """Every value reachable by folding a permutation of numbers left to right with + - * /."""
    ops = [operator.add, operator.sub, operator.mul, operator.truediv]
    reached = set()
    for perm in itertools.permutations(numbers):
        for chosen in itertools.product(ops, repeat=len(numbers) - 1):
            value = Fraction(perm[0])
            for op, x in zip(chosen, perm[1:]):
                value = op(value, Fraction(x))
            reached.add(value)
    return reached


def test_countdown_instances_are_solvable():
    for p in countdown(40, seed=0, count=3, max_number=9):
        numbers = p.fields["numbers"]
        assert len(numbers) == 3 and all(1 <= x <= 9 for x in numbers)
        assert str(numbers) in p.text and p.answer in p.text
        assert Fraction(p.answer) in _left_fold_targets(numbers)


def test_spec_string_options_and_errors():
    ps = generate_from_spec("gen:arithmetic?n=4&digits=2&ops=*&seed=5")
    assert ps == arithmetic(4, seed=5, digits=2, ops="*")  # '+' and '*' are not URL-decoded
    assert len(generate_from_spec("gen:countdown?n=2&count=4")[0].fields["numbers"]) == 4
    with pytest.raises(DataError, match=r"unknown generator 'algebra'"):
        load_prompts("gen:algebra?n=3")
    with pytest.raises(DataError, match="option n .* is required"):
        load_prompts("gen:arithmetic?digits=2")
    with pytest.raises(DataError, match=r"unknown option 'digit' \(known:"):
        load_prompts("gen:arithmetic?n=3&digit=2")
    with pytest.raises(DataError, match=r"option digits='two' is not a int"):
        load_prompts("gen:arithmetic?n=3&digits=two")
    with pytest.raises(ValueError, match="ops must be"):
        generate("arithmetic", n=3, ops="/")
