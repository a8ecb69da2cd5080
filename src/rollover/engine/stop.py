"""Stop strings (`rollout.stop`; vLLM's `stop`, TRL's `generation_kwargs={"stop": ...}`).

A response ends, with finish reason `stop`, at the token whose text completes one of its
request's stop strings (`SamplingParams.stop`). Engines generate tokens, not text: after each
token the engine decodes the response's last few tokens and looks for the strings there, with
special tokens left out as vLLM does. The window is one token per byte of the longest string,
plus two: a token other than a special one holds at least one byte, and a window's first token
may decode to less than its bytes (a part of a character, a SentencePiece word's leading space).
Only the response is searched, not the prompt (as vLLM). The token that completes a string
writes its last character, so a token whose own text holds none of the strings' last characters
(nor a part of one: a byte token) is passed without decoding the window, which is the check's
cost.

The token that completes a string is kept whole, so a string that ends inside a token keeps the
rest of that token's text; the trained tokens are always the sampled ones.
"""

from __future__ import annotations

from typing import Callable, Sequence


class StopStrings:
    """Finds stop strings at the end of responses; `decode` turns token ids into text."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self._windows: dict[tuple[str, ...], tuple[int, str | None]] = {}
        self._pieces: dict[int, str] = {}  # each token's text alone, as met

    def ends(self, stops: tuple[str, ...], response_ids: Sequence[int]) -> bool:
        """Whether `response_ids` hold one of `stops` in their last tokens' text (the token just
        sampled completes it: a response is checked after every token)."""
        if not stops or not response_ids:
            return False
        stops = tuple(stops)
        known = self._windows.get(stops)
        if known is None:
            # the strings' last characters: the token that completes one writes it. Not for strings
            # that end in whitespace, which a SentencePiece token alone may decode without
            finals = None if any(s[-1].isspace() for s in stops) else "".join({s[-1] for s in stops})
            known = self._windows[stops] = (max(len(s.encode()) for s in stops) + 2, finals)
        window, finals = known
        if finals is not None:  # most tokens write none of them: no window to decode
            last = response_ids[-1]
            piece = self._pieces.get(last)
            if piece is None:
                piece = self._pieces[last] = self.decode([last])
            # (a piece that decodes to nothing may be part of a character a decoder drops alone)
            if piece and "\ufffd" not in piece and not any(c in piece for c in finals):
                return False
        tail = self.decode(list(response_ids[-window:]))
        # a window that starts inside a character: byte-fallback decoders (Llama 2's, Mistral's) make
        # every byte of a run replacement characters when one is, which may hide the string's own
        for more in range(1, 4):
            if not tail.startswith("\ufffd") or len(response_ids) < window + more:
                break
            tail = self.decode(list(response_ids[-window - more:]))
        return any(s in tail for s in stops)

    @classmethod
    def of(cls, tokenizer) -> "StopStrings":
        """One that decodes with `tokenizer`, special tokens left out (as vLLM)."""
        return cls(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


def stop_strings_of(model: str) -> StopStrings:
    """A `StopStrings` that decodes with the tokenizer of `model`."""
    from rollover.models import load_tokenizer

    return StopStrings.of(load_tokenizer(model))
