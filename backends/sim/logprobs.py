"""Deterministic logprobs for the stand-in's answers, in SGLang's three wire shapes.

The answer's token at each position is its top-1 candidate (the stand-in decodes greedily from
its plan). Its probability is the answer's confidence `c` plus a small per-token wobble, clamped
to [0.05, 0.99]; `c` is drawn per answer, uniform in [0.45, 0.95] (mean 0.70), or in
[0.37, 0.87] (mean 0.62, 0.08 lower) for the `flat` variant. The rest of the mass goes to the
alternatives, each half the one before, with a tenth left outside the top-k. Everything derives
from the seed, the variant and the prompt, so the same request gets the same logprobs.
"""

from __future__ import annotations

import math
import random
from typing import Any

from backends.sim.textgen import WORDS
from backends.sim.tokenizer import EOS_TOKEN, Tokenizer, fingerprint

CONFIDENCE = {"flat": (0.37, 0.87)}
"""Range of the per-answer confidence by variant; every other variant: (0.45, 0.95)."""
DEFAULT_CONFIDENCE = (0.45, 0.95)


def _base(seed: int, variant: str, prompt_ids: list[int]) -> int:
    return (seed << 40) ^ (fingerprint(prompt_ids) << 2) ^ (variant == "flat")


def confidence(seed: int, variant: str, prompt_ids: list[int]) -> float:
    lo, hi = CONFIDENCE.get(variant, DEFAULT_CONFIDENCE)
    return lo + (hi - lo) * random.Random(_base(seed, variant, prompt_ids)).random()


def position(
    base: int, c: float, index: int, piece: str, k: int
) -> tuple[float, list[tuple[str, float]]]:
    """(logprob of the answer's token, top-k [(token, logprob)], the answer's token first)."""
    rng = random.Random(base + 7919 * (index + 1))
    p1 = min(0.99, max(0.05, c + 0.2 * (rng.random() - 0.5)))
    top = [(piece, math.log(p1))]
    rest = (1 - p1) * 0.9
    weights = [0.5**i for i in range(max(0, k - 1))]
    total = sum(weights) or 1.0
    for w in weights:
        alternative = WORDS[int(rng.random() * len(WORDS))]
        top.append((alternative, math.log(max(1e-9, rest * w / total))))
    return top[0][1], top[: max(k, 1)] if k else []


class LogprobSource:
    """The logprobs of one request's answer, position by position."""

    def __init__(self, seed: int, variant: str, prompt_ids: list[int], k: int) -> None:
        self.base = _base(seed, variant, prompt_ids)
        self.c = confidence(seed, variant, prompt_ids)
        self.k = k

    def at(self, index: int, piece: str) -> tuple[float, list[tuple[str, float]]]:
        return position(self.base, self.c, index, piece or EOS_TOKEN, self.k)

    # -- SGLang's shapes --------------------------------------------------------------------
    def chat_content(self, pieces: list[str], start: int = 0) -> list[dict[str, Any]]:
        """`choices[].logprobs.content` entries for pieces[start:]."""
        out = []
        for i in range(start, len(pieces)):
            piece = pieces[i] or EOS_TOKEN
            lp, top = self.at(i, piece)
            out.append({
                "token": piece, "logprob": lp, "bytes": list(piece.encode()),
                "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                 for t, v in top],
            })  # fmt: skip
        return out

    def completion(self, pieces: list[str], start: int = 0) -> dict[str, Any]:
        """Legacy completions' `logprobs` object for pieces[start:] (a stream's chunk has its
        new tokens'). `text_offset` is -1 for every token, as SGLang writes it
        (`to_openai_style_logprobs`: "Not supported yet")."""
        tokens, lps, tops = [], [], []
        for i in range(start, len(pieces)):
            piece = pieces[i] or EOS_TOKEN
            lp, top = self.at(i, piece)
            tokens.append(piece)
            lps.append(lp)
            tops.append(dict(top))
        return {"text_offset": [-1] * len(tokens), "token_logprobs": lps, "tokens": tokens,
                "top_logprobs": tops}  # fmt: skip

    def native(self, tokenizer: Tokenizer, pieces: list[str], ids: list[int]) -> dict[str, Any]:
        """`meta_info` fields of `/generate` with `return_logprob` (text included, as with
        `return_text_in_logprobs`)."""
        tokens, tops = [], []
        for i, (raw, token_id) in enumerate(zip(pieces, ids, strict=False)):
            piece = raw or EOS_TOKEN
            lp, top = self.at(i, piece)
            tokens.append([lp, token_id, piece])
            tops.append([[v, tokenizer.piece_id(t), t] for t, v in top])
        return {"input_token_logprobs": [], "output_token_logprobs": tokens,
                "input_top_logprobs": [], "output_top_logprobs": tops}  # fmt: skip


__all__ = ["CONFIDENCE", "LogprobSource", "confidence", "position"]
