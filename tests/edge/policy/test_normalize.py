"""Folding drops every Unicode Default_Ignorable_Code_Point, so no invisible character hides a
word from the request rules or the stream rules."""

from __future__ import annotations

import json
import unicodedata

import pytest
import regex

from edge.errors import PolicyRefused
from edge.policy.config import PolicyConfig
from edge.policy.gateway import PolicyGateway
from edge.policy.normalize import DEFAULT_IGNORABLE, INVISIBLE, fold
from edge.policy.stream import StreamRules

# Characters a renderer shows as nothing, beyond the zero-width ones folding always removed.
HIDDEN = {
    "U+2064 INVISIBLE PLUS": "\u2064",
    "U+2062 INVISIBLE TIMES": "\u2062",
    "U+034F COMBINING GRAPHEME JOINER": "\u034f",
    "U+180E MONGOLIAN VOWEL SEPARATOR": "\u180e",
    "U+200E LEFT-TO-RIGHT MARK": "\u200e",
    "U+202E RIGHT-TO-LEFT OVERRIDE": "\u202e",
    "U+2066 LEFT-TO-RIGHT ISOLATE": "\u2066",
    "U+3164 HANGUL FILLER": "\u3164",
    "U+1D173 MUSICAL SYMBOL BEGIN BEAM": "\U0001d173",
    "U+E0100 VARIATION SELECTOR-17": "\U000e0100",
    "U+E0020 TAG SPACE": "\U000e0020",
    "U+E0FFF (reserved, ignorable)": "\U000e0fff",
}


def test_the_table_is_exactly_the_default_ignorable_code_points() -> None:
    """The generated table against an independent source: the `regex` package's property."""
    prop = regex.compile(r"\p{Default_Ignorable_Code_Point}")
    expected = {c for c in range(0x110000) if prop.match(chr(c))}
    assert {ord(c) for c in INVISIBLE} == expected
    assert all(a <= b for a, b in DEFAULT_IGNORABLE)
    assert len(INVISIBLE) == 4174


@pytest.mark.parametrize("char", list(HIDDEN.values()), ids=list(HIDDEN))
def test_fold_drops_the_character(char: str) -> None:
    assert fold(f"pass{char}word") == "password"
    assert fold(f"ｐａｓｓ{char}{char}ｗｏｒｄ") == "password"  # with NFKC in the same pass


def test_fold_keeps_visible_text() -> None:
    text = "naïve café — 東京 ١٢٣ Ωmega"
    assert fold(text) == unicodedata.normalize("NFKC", text)


@pytest.mark.parametrize("char", list(HIDDEN.values()), ids=list(HIDDEN))
def test_request_rules_refuse_the_word_with_the_character_inside(char: str) -> None:
    gw = PolicyGateway.from_config(
        PolicyConfig.from_mapping(
            {"rules": [{"id": "no-secrets", "action": "deny", "patterns": ["password"]}]}
        )
    )
    assert gw is not None
    body = {"model": "m", "messages": [{"role": "user", "content": f"my pass{char}word is x"}]}
    with pytest.raises(PolicyRefused) as info:
        gw.check("/v1/chat/completions", body, tenant="t", tier="pro", stream=False)
    assert info.value.rule == "no-secrets"


@pytest.mark.parametrize("char", list(HIDDEN.values()), ids=list(HIDDEN))
def test_stream_rules_cut_the_secret_with_the_character_inside(char: str) -> None:
    built = StreamRules.from_config(
        PolicyConfig.from_mapping(
            {"stream_rules": [{"id": "key-leak", "patterns": ["BEGIN PRIVATE KEY"]}]}
        )
    )
    assert built is not None
    guard = built.guard("/v1/chat/completions")
    choice = {"index": 0, "delta": {"content": f"-----BEGIN PRIV{char}ATE KEY-----"}}
    event = b"data: " + json.dumps({"id": "c", "choices": [choice]}).encode() + b"\n\n"
    out = guard.feed(event) + guard.finish()
    assert guard.cut == "key-leak"
    assert b"PRIV" not in out  # none of the match reached the client
