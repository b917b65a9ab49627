"""A deterministic, offline tokenizer with a GPT-2-like pre-tokenizer.

Real tokenizers matter to the stand-in only through two properties: the same text always gives
the same ids, and text that shares a prefix gives ids that share a prefix (so radix-cache hits
behave as with a real model). Pieces are split with a GPT-2 style regular expression and each
piece maps to a stable id (CRC-32, not Python's salted `hash`), so ids agree across processes.
Special tokens such as `<|eot_id|>` are single tokens with fixed ids, as in Llama 3.
"""

from __future__ import annotations

import re
import zlib
from array import array

VOCAB_SIZE = 128_256  # Llama 3's vocabulary size
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|eot_id|>"

# Llama 3 ids for the special tokens the chat template uses.
SPECIAL_TOKENS: dict[str, int] = {
    BOS_TOKEN: 128000,
    "<|end_of_text|>": 128001,
    "<|start_header_id|>": 128006,
    "<|end_header_id|>": 128007,
    EOS_TOKEN: 128009,
}
EOS_ID = SPECIAL_TOKENS[EOS_TOKEN]
_SPECIAL_BY_ID = {v: k for k, v in SPECIAL_TOKENS.items()}
_ORDINARY_IDS = 128_000  # ordinary pieces map into [0, 128000)

# Special tokens first, then words with an optional leading space, digits, single punctuation,
# and whitespace that does not swallow the space in front of the next word (GPT-2's `\s+(?!\S)`).
_PIECE_RE = re.compile(
    r"<\|[a-z_]+\|>| ?[^\W\d]+| ?\d{1,3}| ?[^\w\s]|\s+(?!\S)|\s+",
)


class Tokenizer:
    """Text <-> token ids. Thread-unsafe by design (one per server); caches piece ids."""

    __slots__ = ("_id_of", "_piece_of")

    def __init__(self) -> None:
        self._id_of: dict[str, int] = dict(SPECIAL_TOKENS)
        self._piece_of: dict[int, str] = dict(_SPECIAL_BY_ID)

    def piece_id(self, piece: str) -> int:
        token_id = self._id_of.get(piece)
        if token_id is None:
            token_id = zlib.crc32(piece.encode("utf-8")) % _ORDINARY_IDS
            self._id_of[piece] = token_id
            # First writer wins for decoding; collisions only affect decoding of input ids.
            self._piece_of.setdefault(token_id, piece)
        return token_id

    def encode(self, text: str) -> list[int]:
        piece_id = self.piece_id
        return [piece_id(piece) for piece in _PIECE_RE.findall(text)]

    def decode(self, ids: list[int]) -> str:
        """Best effort: ids never produced by this tokenizer decode to a placeholder piece."""
        piece_of = self._piece_of
        return "".join(piece_of.get(i, f" <{i}>") for i in ids)


def fingerprint(ids: list[int]) -> int:
    """A stable 32-bit digest of a token sequence (seeds the deterministic output)."""
    return zlib.crc32(array("q", ids).tobytes())
