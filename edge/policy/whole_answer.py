"""Stream rules over an answer read whole: what `stream: false` would otherwise let through.

The stream guard watches streamed answers as they pass. A client that asks for the same answer
whole (`stream: false`, or no `stream`) gets it in one body, which the relay holds entire before
it sends a byte; so the rules are searched over each of its texts whole, folded as the guard
folds them (the texts the guard reads: a chat choice's `content`, `reasoning_content` and each
tool call's `arguments`; a completion's `text`; `/generate`'s `text`). A choice with a match is
emptied and finished with `finish_reason: "content_filter"` (`/generate`: `{"type":
"content_filter"}`), as the stream's last chunk would say, and its usage is kept: the tokens were
generated; its logprobs, which hold each token's text, are dropped, and so are `/generate`'s
`output_ids`, the text's token ids, which a client decodes back to it. No part of a matched text
reaches the client, since none was sent before the check.
"""

from __future__ import annotations

from typing import Any

import orjson

from edge.policy.normalize import fold
from edge.policy.stream import StreamRules

ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/generate"})
"""Routes whose answers carry generated text (a `/v1/responses` request is forwarded as a chat
completion, and its answer checked as one)."""


def filter_whole(rules: StreamRules, route: str, body: bytes) -> tuple[bytes, str] | None:
    """None when no rule matches `body` (a 200 answer of `route`); else the answer with each
    matching choice emptied and finished as filtered, and the first matching rule's id."""
    if route not in ROUTES:
        return None
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None  # not an answer a client could read either
    first: str | None = None
    for item in answer if isinstance(answer, list) else [answer]:  # /generate: one per `n`
        if not isinstance(item, dict):
            continue
        if route == "/generate":
            rule = _first_match(rules, [item.get("text")])
            if rule is not None:
                item["text"] = ""
                item.pop("output_ids", None)  # the text's tokens: a client decodes them back
                meta = item.get("meta_info")
                if isinstance(meta, dict):
                    meta["finish_reason"] = {"type": "content_filter"}
                    for key in [k for k in meta if "logprobs" in k]:  # their tokens' text
                        del meta[key]
                first = first or rule
            continue
        choices = item.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if isinstance(choice, dict):
                rule = _filter_choice(rules, choice)
                first = first or rule
    if first is None:
        return None
    return orjson.dumps(answer), first


def _filter_choice(rules: StreamRules, choice: dict[str, Any]) -> str | None:
    message = choice.get("message")
    if isinstance(message, dict):  # a chat completion
        texts: list[object] = [message.get("content"), message.get("reasoning_content")]
        calls = message.get("tool_calls")
        for call in calls if isinstance(calls, list) else []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                texts.append(function.get("arguments"))
        rule = _first_match(rules, texts)
        if rule is not None:
            choice["message"] = {"role": message.get("role") or "assistant", "content": ""}
            _finish(choice)
        return rule
    rule = _first_match(rules, [choice.get("text")])
    if rule is not None:
        choice["text"] = ""
        _finish(choice)
    return rule


def _finish(choice: dict[str, Any]) -> None:
    choice["finish_reason"] = "content_filter"
    if choice.get("logprobs") is not None:
        choice["logprobs"] = None  # each token's text is in it


def _first_match(rules: StreamRules, texts: list[object]) -> str | None:
    for text in texts:
        for part in _strings(text):
            rule = rules.match(fold(part).encode(), 0)
            if rule is not None:
                return rule
    return None


def _strings(text: object) -> list[str]:
    """A text as strings: itself, or the `text` of each part of a content list."""
    if isinstance(text, str):
        return [text]
    if isinstance(text, list):
        return [p["text"] for p in text if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []


__all__ = ["ROUTES", "filter_whole"]
