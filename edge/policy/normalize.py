"""Text folding for policy matching: what a pattern is matched against.

A prompt is folded before matching, so that a rule written in plain ASCII also catches the same
word spelt with look-alike characters:

1. Unicode NFKC: full-width forms (`ｐａｓｓ`), mathematical letters (`𝐩𝐚𝐬𝐬`), ligatures (`ﬁ`),
   superscripts and circled letters become their plain letters.
2. Invisible characters are removed: every Unicode Default_Ignorable_Code_Point (zero-width
   space and joiners, word joiner and the invisible operators U+2061-U+2064, soft hyphen,
   combining grapheme joiner, bidi marks, the Mongolian vowel separator, all 256 variation
   selectors, the tag characters U+E0000-U+E0FFF, ...): characters a renderer shows as nothing,
   so they can sit inside a word unseen. The list is `DEFAULT_IGNORABLE`.
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

DEFAULT_IGNORABLE: tuple[tuple[int, int], ...] = (
    # Default_Ignorable_Code_Point, as inclusive ranges, from the Unicode Character Database's
    # DerivedCoreProperties.txt (Unicode 16.0.0: 4,174 code points; the set is unchanged since
    # 14.0 added U+180F). Python's unicodedata has no such property; a test checks this table
    # against the `regex` package's \p{Default_Ignorable_Code_Point}.
    (0x00AD, 0x00AD),  # SOFT HYPHEN
    (0x034F, 0x034F),  # COMBINING GRAPHEME JOINER
    (0x061C, 0x061C),  # ARABIC LETTER MARK
    (0x115F, 0x1160),  # HANGUL CHOSEONG FILLER, HANGUL JUNGSEONG FILLER
    (0x17B4, 0x17B5),  # KHMER VOWEL INHERENT AQ, AA
    (0x180B, 0x180F),  # MONGOLIAN FREE VARIATION SELECTORS ONE-FOUR, VOWEL SEPARATOR
    (0x200B, 0x200F),  # ZERO WIDTH SPACE, NON-JOINER, JOINER, LEFT-TO-RIGHT / RIGHT-TO-LEFT MARK
    (0x202A, 0x202E),  # bidi embeddings and overrides
    (0x2060, 0x206F),  # WORD JOINER, invisible operators, bidi isolates, deprecated formats
    (0x3164, 0x3164),  # HANGUL FILLER
    (0xFE00, 0xFE0F),  # VARIATION SELECTOR-1..16
    (0xFEFF, 0xFEFF),  # ZERO WIDTH NO-BREAK SPACE (byte-order mark)
    (0xFFA0, 0xFFA0),  # HALFWIDTH HANGUL FILLER
    (0xFFF0, 0xFFF8),  # reserved
    (0x1BCA0, 0x1BCA3),  # SHORTHAND FORMAT LETTER OVERLAP..UP STEP
    (0x1D173, 0x1D17A),  # MUSICAL SYMBOL BEGIN BEAM..END PHRASE
    (0xE0000, 0xE0FFF),  # tags, VARIATION SELECTOR-17..256, reserved
)

INVISIBLE = "".join(chr(c) for start, end in DEFAULT_IGNORABLE for c in range(start, end + 1))
"""Every character `fold` removes."""

# One table, one str.translate pass, does both: look-alikes mapped, invisibles dropped. Its size
# does not change the cost per character (one dict lookup each).
_TABLE: dict[int, str | None] = {ord(k): v for k, v in CONFUSABLES.items()}
_TABLE.update(dict.fromkeys(map(ord, INVISIBLE)))


def fold(text: str) -> str:
    """The text a pattern is matched against (see the module docstring)."""
    if text.isascii():
        return text
    return unicodedata.normalize("NFKC", text).translate(_TABLE)


__all__ = ["CONFUSABLES", "DEFAULT_IGNORABLE", "INVISIBLE", "fold"]
