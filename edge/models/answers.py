"""One answer's parts a shadow comparison reads, from any of SGLang's shapes, and the comparison.

`answer_of` reads a whole (non-streamed) answer; `edge.models.tap.ShadowTap` assembles the same
`Answer` from a stream's events, with the `*_positions` helpers. A position is the alternatives
SGLang returned for one token (token, logprob), the chosen one among them.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from edge.models.drift import Sample
from edge.stages.validate import CHAT, GENERATE

TOP_K = 5
"""Alternatives asked per token; the entropy is that of the top-k, renormalised."""
MAX_COMPARED_WORDS = 2000
"""Words of each text the edit similarity looks at (it is quadratic in the worst case)."""

Position = Sequence[tuple[str, float]]


@dataclass(slots=True)
class Answer:
    """The parts of one answer a comparison reads."""

    text: str
    finish: str | None
    tokens: int
    top1: list[str] = field(default_factory=list)
    """The most likely token at each position (where logprobs came back)."""
    top1_prob: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)

    def sample(self) -> Sample:
        return Sample(
            length=float(self.tokens),
            stopped=self.finish == "stop",
            top1=sum(self.top1_prob) / len(self.top1_prob) if self.top1_prob else None,
            entropy=sum(self.entropy) / len(self.entropy) if self.entropy else None,
        )


def _position(alternatives: Position) -> tuple[str, float, float]:
    """(top-1 token, its probability, entropy of the renormalised top-k) of one position."""
    best = max(alternatives, key=lambda a: a[1])
    probs = [math.exp(lp) for _, lp in alternatives]
    total = sum(probs)
    entropy = -sum(p / total * math.log(p / total) for p in probs if p > 0)
    return best[0], math.exp(best[1]), entropy


def build_answer(text: str, finish: str | None, tokens: int, positions: list[Position]) -> Answer:
    answer = Answer(text=text, finish=finish, tokens=tokens)
    for alternatives in positions:
        if alternatives:
            token, prob, entropy = _position(alternatives)
            answer.top1.append(token)
            answer.top1_prob.append(prob)
            answer.entropy.append(entropy)
    return answer


def chat_positions(logprobs: Any) -> list[Position]:
    """Positions of a chat choice's `logprobs` (`content`: one entry per token)."""
    if not isinstance(logprobs, dict):
        return []
    out: list[Position] = []
    for entry in logprobs.get("content") or []:
        tops = entry.get("top_logprobs") or [entry]
        out.append([(t["token"], float(t["logprob"])) for t in tops])
    return out


def completion_positions(logprobs: Any) -> list[Position]:
    """Positions of a legacy completion's `logprobs` (`top_logprobs`: a dict per token)."""
    if not isinstance(logprobs, dict):
        return []
    return [[(k, float(v)) for k, v in (top or {}).items()]
            for top in logprobs.get("top_logprobs") or []]  # fmt: skip


def generate_positions(meta: dict[str, Any]) -> list[Position]:
    """Positions of `/generate`'s `meta_info.output_top_logprobs` ([logprob, id, text] each)."""
    return [[(str(alt[1]), float(alt[0])) for alt in top or []]
            for top in meta.get("output_top_logprobs") or []]  # fmt: skip


def with_tool_calls(text: str, calls: Sequence[tuple[str, str]]) -> str:
    """An answer's text with its tool calls (name, arguments) after it, one a line: a call is
    what the model said as much as its text is, so two answers calling a tool with other
    arguments are no match."""
    return text + "".join(f"\n{name}({arguments})" for name, arguments in calls)


def message_tool_calls(message: Any) -> list[tuple[str, str]]:
    """(name, arguments) of each tool call of a chat answer's `message`."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    out: list[tuple[str, str]] = []
    for call in calls if isinstance(calls, list) else ():
        function = (call.get("function") if isinstance(call, dict) else None) or {}
        out.append((str(function.get("name") or ""), str(function.get("arguments") or "")))
    return out


def answer_of(route: str, obj: Any) -> Answer:
    """The answer in a decoded non-streamed response of `route`; ValueError if odd."""
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    if route == GENERATE:
        meta = obj.get("meta_info") or {}
        finish = (meta.get("finish_reason") or {}).get("type")
        text, tokens = obj.get("text", ""), int(meta.get("completion_tokens") or 0)
        positions = generate_positions(meta)
    else:
        choice = (obj.get("choices") or [{}])[0]
        finish = choice.get("finish_reason")
        if route == CHAT:
            message = choice.get("message") or {}
            text = with_tool_calls(message.get("content") or "", message_tool_calls(message))
        else:
            text = choice.get("text")
        tokens = int((obj.get("usage") or {}).get("completion_tokens") or 0)
        logprobs = choice.get("logprobs")
        positions = chat_positions(logprobs) if route == CHAT else completion_positions(logprobs)
    return build_answer(text or "", finish, tokens, positions)


def parse_answer(route: str, body: bytes) -> Answer:
    """`answer_of` the JSON body of a non-streamed response; ValueError if odd."""
    return answer_of(route, orjson.loads(body))


@dataclass(frozen=True, slots=True)
class Comparison:
    exact: bool | None
    """Texts equal (greedy requests only; None otherwise)."""
    token_overlap: float
    edit_similarity: float
    length_ratio: float | None
    """Canary / stable tokens; None when only the stable answer is empty (no ratio)."""
    finish_agree: bool
    top1_agreement: float | None
    stable_top1: float | None
    canary_top1: float | None


def compare(stable: Answer, canary: Answer, *, greedy: bool) -> Comparison:
    a, b = stable.text.split(), canary.text.split()
    union = set(a) | set(b)
    overlap = len(set(a) & set(b)) / len(union) if union else 1.0
    edit = difflib.SequenceMatcher(
        None, a[:MAX_COMPARED_WORDS], b[:MAX_COMPARED_WORDS], autojunk=False
    ).ratio()
    ratio = canary.tokens / stable.tokens if stable.tokens else (1.0 if not canary.tokens else None)
    agreement = None
    n = min(len(stable.top1), len(canary.top1))
    if n:
        agreement = sum(x == y for x, y in zip(stable.top1, canary.top1, strict=False)) / n
    s, c = stable.sample(), canary.sample()
    return Comparison(
        exact=(stable.text == canary.text) if greedy else None,
        token_overlap=overlap, edit_similarity=edit, length_ratio=ratio,
        finish_agree=stable.finish == canary.finish, top1_agreement=agreement,
        stable_top1=s.top1, canary_top1=c.top1,
    )  # fmt: skip


__all__ = [
    "TOP_K", "Answer", "Comparison", "answer_of", "build_answer", "chat_positions", "compare",
    "completion_positions", "generate_positions", "message_tool_calls", "parse_answer",
    "with_tool_calls",
]  # fmt: skip
