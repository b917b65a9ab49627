"""Deterministic output text: the same prompt and seed always produce the same answer.

Answers are pseudo-words with a leading space, with an occasional comma or full stop after a
word. Each output piece is one token of `Tokenizer`, and re-tokenizing the answer gives back the
same ids, so a follow-up turn that quotes the answer hits the radix cache on it.
"""

from __future__ import annotations

import random
from typing import Protocol

from backends.sim.tokenizer import EOS_ID, EOS_TOKEN, Tokenizer, fingerprint

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "st")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")


def _build_words(count: int = 1024) -> tuple[str, ...]:
    rng = random.Random(20240611)
    words: set[str] = set()
    while len(words) < count:
        syllables = rng.randint(1, 3)
        words.add(
            " " + "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables))
        )
    return tuple(sorted(words))


WORDS = _build_words()
_PUNCT = (",", ".")


class TokenPlan(Protocol):
    """What the scheduler asks of an answer: its token at each position."""

    def next_token(self, index: int, *, ignore_eos: bool) -> tuple[int, str]: ...


class OutputPlan:
    """The answer to one prompt, token by token.

    `natural_len` is where the model would emit its end-of-turn token when `ignore_eos` is off.
    """

    __slots__ = ("_rng", "_after_word", "natural_len", "_tokenizer")

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        *,
        seed: int,
        natural_len: tuple[int, int],
    ) -> None:
        self._rng = random.Random((seed << 32) ^ fingerprint(prompt_ids))
        self._tokenizer = tokenizer
        self._after_word = False
        lo, hi = natural_len
        self.natural_len = self._rng.randint(lo, hi)

    def next_token(self, index: int, *, ignore_eos: bool) -> tuple[int, str]:
        """The token at position `index` (0-based) of the answer: (id, text piece)."""
        if index + 1 >= self.natural_len and not ignore_eos:
            return EOS_ID, ""  # skip_special_tokens: the end-of-turn token has no text
        rng = self._rng
        if self._after_word and rng.random() < 0.12:
            piece = _PUNCT[rng.random() < 0.6]
            self._after_word = False
        else:
            piece = WORDS[int(rng.random() * len(WORDS))]
            self._after_word = True
        return self._tokenizer.piece_id(piece), piece


__all__ = ["EOS_ID", "EOS_TOKEN", "WORDS", "OutputPlan", "TokenPlan"]
