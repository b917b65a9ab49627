"""Text folding for policy matching: what a pattern is matched against.

A prompt is folded before matching, so that a rule written in plain ASCII also catches the same
word spelt with look-alike characters:

1. Unicode NFKC: full-width forms (`ｐａｓｓ`), mathematical letters (`𝐩𝐚𝐬𝐬`), ligatures (`ﬁ`),
   superscripts and circled letters become their plain letters.
2. Invisible characters are removed: zero-width space/joiners (U+200B-U+200D), word joiner
   (U+2060), byte-order mark (U+FEFF), soft hyphen (U+00AD), and the variation selectors.
3. A small confusables table maps Cyrillic and Greek letters that look like Latin ones to
   those (`раѕѕ` → `pass`); the full list is `CONFUSABLES` and docs/policy.md.

Case is handled by the patterns (compiled case-insensitive), not here, so folding keeps the
text's length when it is ASCII; ASCII text (the common case) skips folding entirely.
"""

from __future__ import annotations

import unicodedata

CONFUSABLES: dict[str, str] = {
    # Cyrillic lower case
    "а": "a", "в": "b", "с": "c", "ԁ": "d", "е": "e", "һ": "h", "і": "i", "ј": "j",
    "к": "k", "м": "m", "н": "h", "о": "o", "р": "p", "ԛ": "q", "ѕ": "s", "т": "t",
    "у": "y", "ԝ": "w", "х": "x", "ү": "y", "ӏ": "l",
    # Cyrillic upper case
    "А": "A", "В": "B", "С": "C", "Е": "E", "Н": "H", "І": "I", "Ј": "J", "К": "K",
    "М": "M", "О": "O", "Р": "P", "Ѕ": "S", "Т": "T", "Х": "X", "У": "Y", "Ԝ": "W",
    # Greek lower case
    "α": "a", "β": "b", "ε": "e", "η": "n", "ι": "i", "κ": "k", "ν": "v", "ο": "o",
    "ρ": "p", "τ": "t", "υ": "u", "χ": "x", "ω": "w",
    # Greek upper case
    "Α": "A", "Β": "B", "Ε": "E", "Η": "H", "Ι": "I", "Κ": "K", "Μ": "M", "Ν": "N",
    "Ο": "O", "Ρ": "P", "Τ": "T", "Υ": "Y", "Χ": "X", "Ζ": "Z",
    # Latin look-alikes outside ASCII that NFKC keeps
    "ı": "i", "ɡ": "g", "ɑ": "a", "ʏ": "y", "ᴀ": "a",
}  # fmt: skip

INVISIBLE = "\u00ad\u200b\u200c\u200d\u2060\ufeff" + "".join(chr(c) for c in range(0xFE00, 0xFE10))

_TABLE: dict[int, str | None] = {ord(k): v for k, v in CONFUSABLES.items()}
_TABLE.update({ord(c): None for c in INVISIBLE})


def fold(text: str) -> str:
    """The text a pattern is matched against (see the module docstring)."""
    if text.isascii():
        return text
    return unicodedata.normalize("NFKC", text).translate(_TABLE)


__all__ = ["CONFUSABLES", "INVISIBLE", "fold"]
