"""Finding the final answer inside a completion.

The final answer is the content of the last `\\boxed{...}`, else of the last
`<answer>...</answer>`, else a fallback that each reward picks (the whole completion, or its
last line).
"""

from __future__ import annotations

import re

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth = 0
        for i in range(start + len("\\boxed"), len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start + len("\\boxed{") : i]
        start = text.rfind("\\boxed{", 0, start)  # unclosed: try an earlier one
    return None


def extract_tagged(text: str) -> str | None:
    """Content of the last `<answer>...</answer>`, or None."""
    tagged = _ANSWER_TAG.findall(text)
    return tagged[-1] if tagged else None


def final_answer(completion: str) -> str:
    """Boxed content, else tagged content, else the whole completion."""
    for found in (extract_boxed(completion), extract_tagged(completion)):
        if found is not None:
            return found
    return completion


def gold(answer, reward: str):
    """`answer`, for a reward that compares a completion with it; a sample without one (its row had
    none: data.require_answer false) raises, so it is counted as the reward's error, not scored 0."""
    if answer is None:
        raise ValueError(f"{reward}: the sample has no answer to compare with (its row has none)")
    return answer
