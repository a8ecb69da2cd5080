"""The countdown reward: an arithmetic expression over given numbers that hits a target.

The expression is read from the completion's final answer (last `\\boxed{}`, else last
`<answer>` tag, else the last non-empty line); if it contains "=", the left side is used.
It must use each given number exactly once (as a multiset, TinyZero's rule) with + - * / and
parentheses only, and evaluate exactly (with fractions) to the target.

The expression is never passed to `eval`: it is parsed with `ast` and only integer literals,
the four binary operators and parentheses are accepted, so a completion cannot run code.
"""

from __future__ import annotations

import ast
import operator
from collections import Counter
from fractions import Fraction

from rollover.rewards.extract import extract_boxed, extract_tagged, gold

MAX_EXPRESSION_CHARS = 200

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def countdown_reward(completion: str, answer, numbers, **_) -> float:
    """1.0 if the completion's expression uses exactly `numbers` and equals `answer`, else 0.0."""
    gold(answer, "countdown")
    expression = countdown_expression(completion)
    if expression is None:
        return 0.0
    tree = _parse(expression)
    if tree is None:
        return 0.0
    used = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)]
    if Counter(used) != Counter(int(n) for n in numbers):
        return 0.0
    try:
        value = _evaluate(tree.body)
    except ZeroDivisionError:
        return 0.0
    return 1.0 if value == Fraction(str(answer)) else 0.0


def countdown_expression(completion: str) -> str | None:
    """The expression text a completion proposes, or None if there is none."""
    candidate = extract_boxed(completion)
    if candidate is None:
        candidate = extract_tagged(completion)
    if candidate is None:
        lines = [line for line in completion.splitlines() if line.strip()]
        if not lines:
            return None
        candidate = lines[-1]
    candidate = candidate.split("=")[0].replace("\\times", "*").replace("\\div", "/")
    candidate = candidate.replace("×", "*").replace("÷", "/").strip()
    return candidate or None


def _parse(expression: str) -> ast.Expression | None:
    """The syntax tree if `expression` is only integers, + - * / and parentheses, else None."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return None
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        allowed = isinstance(node, (ast.Expression, ast.BinOp, *_OPS)) or (
            isinstance(node, ast.Constant) and type(node.value) is int
        )
        if not allowed:
            return None
    return tree


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
