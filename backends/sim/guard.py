"""Guard mode: the stand-in answers chat completions as a Llama-Guard-style safety classifier.

A guard model reads a conversation and answers `safe`, or `unsafe` and the violated category on
the next line (`unsafe\\nS2`), as Llama Guard 3 does. Here a conversation is unsafe when the text
of its messages matches one of the configured patterns (`S<n>=REGEX`, or `REGEX` for S1; Python
regular expressions, case-insensitive; the first that matches names the category). The verdict
is generated token by token through the scheduler like any answer, so the guard's latency is the
timing model's: queueing, the prompt's prefill (prefix cache included) and a few decode steps.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from backends.sim.chat_template import message_text
from backends.sim.tokenizer import EOS_ID, Tokenizer

_CATEGORY = re.compile(r"S(\d{1,2})=(.*)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class GuardRule:
    category: int
    """The `n` of `S<n>` the verdict names."""
    pattern: re.Pattern[str]


def parse_rules(specs: Sequence[str]) -> list[GuardRule]:
    """`S<n>=REGEX` or `REGEX` (category 1) each; a ValueError names a pattern that does not
    compile."""
    rules = []
    for spec in specs:
        match = _CATEGORY.fullmatch(spec)
        category, source = (int(match[1]), match[2]) if match else (1, spec)
        if category < 1:
            raise ValueError(f"guard_unsafe: category S{category} must be S1 or above")
        try:
            pattern = re.compile(source, re.IGNORECASE)
        except re.error as exc:
            raise ValueError(f"guard_unsafe: {spec!r} is not a regular expression: {exc}") from None
        rules.append(GuardRule(category, pattern))
    return rules


class Guard:
    """The verdicts of one stand-in in guard mode."""

    def __init__(self, specs: Sequence[str]) -> None:
        self.rules = parse_rules(specs)

    def verdict(self, messages: Sequence[Any]) -> str:
        """`safe`, or `unsafe\\nS<n>` for the first rule whose pattern the messages' text
        matches (the messages were validated by the chat template already)."""
        text = "\n".join(message_text(m.get("content")) for m in messages)
        for rule in self.rules:
            if rule.pattern.search(text):
                return f"unsafe\nS{rule.category}"
        return "safe"

    def plan(self, messages: Sequence[Any], tokenizer: Tokenizer) -> GuardPlan:
        return GuardPlan(tokenizer, self.verdict(messages))


class GuardPlan:
    """The answer of a guard: the verdict's tokens, then end-of-turn (`safe` is one token,
    `unsafe\\nS2` four, as with Llama 3's tokenizer)."""

    __slots__ = ("_tokens",)

    def __init__(self, tokenizer: Tokenizer, verdict: str) -> None:
        head, _, category = verdict.partition("\nS")
        pieces = [head] + (["\n", "S", category] if category else [])
        self._tokens = [(tokenizer.piece_id(p), p) for p in pieces]

    def next_token(self, index: int, *, ignore_eos: bool) -> tuple[int, str]:
        if index < len(self._tokens):
            return self._tokens[index]
        return EOS_ID, ""  # past the verdict (ignore_eos keeps asking): end-of-turn only


__all__ = ["Guard", "GuardPlan", "GuardRule", "parse_rules"]
