"""Redact rules whose matches overlap: each rule's matches are found in the text as sent, and
a stretch any of them covers is replaced once. Applied one rule after the other, a rule's
replacement cut another's match short (the rest of it forwarded in the clear) or took away
the context another's pattern needs (`password: VALUE`, after `password` was replaced, no
longer matched, and VALUE went out)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.edge.conftest import TinyUpstream, client
from tests.edge.policy.test_policy_e2e import edge_with, inference, script

RULES: list[dict[str, Any]] = [
    {"id": "aws-key-id", "action": "redact", "patterns": ["AKIA[0-9A-Z]{16}"]},
    {"id": "long-token", "action": "redact", "patterns": ["[A-Za-z0-9]{24,}"]},
    {"id": "password-word", "action": "redact", "patterns": ["password"]},
    {"id": "password-value", "action": "redact", "patterns": [r"password\s*[:=]\s*\S+"]},
]
SECRETS = {
    "key": ("key AKIAABCDEFGHIJKLMNOPQRSTUVWX end", "QRSTUVWX"),
    "value": ("my password: hunter2xyz end", "hunter2xyz"),
}


async def forwarded(body: dict[str, Any], path: str) -> bytes:
    async with TinyUpstream(script(["ok"])) as up:
        async with edge_with(up.url, {"rules": RULES}) as edge, client(edge) as http:
            response = await http.post(path, json=body)
    assert response.status_code == 200, response.text
    (sent,) = inference(up)
    return sent.body


@pytest.mark.parametrize("case", list(SECRETS))
async def test_overlapping_redactions_leave_nothing_of_either_match(case: str) -> None:
    text, rest = SECRETS[case]
    sent = await forwarded({"model": "tiny-model", "prompt": text, "stream": False},
                           "/v1/completions")  # fmt: skip
    assert rest.encode() not in sent, sent
    prompt = json.loads(sent)["prompt"]
    assert prompt.startswith(text.split()[0] + " ") and prompt.endswith(" end"), prompt
    assert "[REDACTED]" in prompt


@pytest.mark.parametrize("case", list(SECRETS))
async def test_overlapping_redactions_in_text_parts(case: str) -> None:
    text, rest = SECRETS[case]
    cut = len(text) // 2  # the secret split over two parts of one message
    parts = [{"type": "text", "text": text[:cut]}, {"type": "text", "text": text[cut:]}]
    body = {"model": "tiny-model", "messages": [{"role": "user", "content": parts}]}
    sent = await forwarded(body, "/v1/chat/completions")
    content = json.loads(sent)["messages"][0]["content"]
    assert rest not in "".join(p["text"] for p in content), content
    assert rest not in " ".join(p["text"] for p in content), content


async def test_overlapping_patterns_of_one_rule_leave_nothing_of_either_match() -> None:
    # one rule's patterns are one alternation, which takes the first pattern that matches at a
    # place, not the longest: `password` there, and VALUE was left
    rule = {"id": "pw", "action": "redact", "patterns": ["password", r"password\s*[:=]\s*\S+"]}
    body = {"model": "tiny-model", "prompt": "my password: hunter2xyz end", "stream": False}
    async with TinyUpstream(script(["ok"])) as up:
        async with edge_with(up.url, {"rules": [rule]}) as edge, client(edge) as http:
            response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    (sent,) = inference(up)
    assert json.loads(sent.body)["prompt"] == "my [REDACTED] end"
