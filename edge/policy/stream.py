"""Stream policies: patterns watched for in the generated text, across SSE chunk boundaries.

A `StreamGuard` sits in the relay, one per streamed answer, and sees every upstream chunk before
the client does. It decodes the text of each complete SSE event (in a chat stream, a tool call's
arguments and a reasoning model's `reasoning_content` too: the client gets them as it gets
text), folds it (`normalize.fold`) into
a window of the last `lookbehind` characters, and searches the rules there with the `regex`
module's partial matching:

- no match: the events are passed on at once, unchanged;
- a match: the chunk that completed it (and anything held) is dropped, the stream ends with a
  well-formed final chunk with `finish_reason: "content_filter"` and `data: [DONE]`, and the
  relay aborts the upstream request;
- with `stream_hold` on, also: the tail could be the start of a match (`BEGIN PRIV` of
  `BEGIN PRIVATE KEY`): the events from there on are held back until the match completes or
  fails, so no part of a match reaches the client (those tokens wait for the deciding ones).

By default nothing is held but the bytes of an incomplete event (the client could not parse
them yet either). A match longer than `lookbehind` characters is not caught.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import orjson
import regex

from edge.policy.config import PolicyConfig
from edge.policy.normalize import fold
from edge.sse import ARGUMENTS, ARGUMENTS_KEY, REASONING, REASONING_KEY, has_string

_FIELDS = {
    field: re.compile(rb'"' + field + rb'":\s*"([^"\\]*(?:\\.[^"\\]*)*)"', re.DOTALL)
    for field in (b"content", b"text")
}
_ID = re.compile(rb'"id":\s*"([^"\\]{1,200})"')
_MODEL = re.compile(rb'"model":\s*"([^"\\]{1,200})"')


def combined_pattern(rules: list[tuple[str, list[str], bool]], flags: int) -> tuple[str, list[str]]:
    """One alternation for many rules: group `r<i>` is rule i (ids in the returned list)."""
    parts, ids = [], []
    for i, (rule_id, patterns, literal) in enumerate(rules):
        body = "|".join(f"(?:{regex.escape(p) if literal else p})" for p in patterns)
        parts.append(f"(?P<r{i}>{body})")
        ids.append(rule_id)
    return "|".join(parts), ids


@dataclass(slots=True)
class StreamRules:
    """The compiled stream rules; `guard(route)` makes the per-stream state."""

    pattern: regex.Pattern[str]
    ids: list[str]
    lookbehind: int
    hold: bool = False
    span: int = 0
    """The longest match any rule can make, capped at `lookbehind`: only the window's last
    `span - 1` characters can hold the start of a match that ends in new text."""

    @classmethod
    def from_config(cls, config: PolicyConfig) -> StreamRules | None:
        if not config.stream_rules:
            return None
        source, ids = combined_pattern(
            [(r.id, r.patterns, r.literal) for r in config.stream_rules], regex.IGNORECASE
        )
        pattern = regex.compile(source, regex.IGNORECASE)
        span = max(_longest(p, r.literal) for r in config.stream_rules for p in r.patterns)
        lookbehind = config.stream_lookbehind
        return cls(pattern, ids, lookbehind, config.stream_hold, min(span, lookbehind))

    def guard(self, route: str) -> StreamGuard:
        return StreamGuard(self, route)

    def rule_of(self, match: regex.Match[str]) -> str:
        name = match.lastgroup
        return self.ids[int(name[1:])] if name else self.ids[0]


class StreamGuard:
    """One stream's watch: `feed` each upstream chunk, send what it returns; `finish` at the end.

    After a match, `cut` names the rule and `feed` returned the stream's final events; the relay
    then stops and aborts the upstream request."""

    __slots__ = (
        "_chat",
        "_cumulative",
        "_field",
        "_held",
        "_id",
        "_model",
        "_released_text",
        "_route",
        "_rules",
        "_seen",
        "_tail",
        "_window",
        "cut",
    )

    def __init__(self, rules: StreamRules, route: str) -> None:
        self._rules = rules
        self._route = route
        self._cumulative = route == "/generate"
        self._field = _FIELDS[b"content" if route == "/v1/chat/completions" else b"text"]
        self._chat = route == "/v1/chat/completions"
        self._tail = b""
        self._held: list[bytes] = []
        self._window = ""
        self._seen = 0
        """/generate: characters of its cumulative text already looked at."""
        self._released_text = ""
        """/generate: the cumulative text of the last event passed on."""
        self._id: str | None = None
        self._model: str | None = None
        self.cut: str | None = None

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to send now for `chunk` (b"" while they are held back)."""
        if self.cut is not None:
            return b""
        data = self._tail + chunk if self._tail else chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._tail = data
            return b""
        region, self._tail = data[: end + 2], data[end + 2 :]
        if self._id is None:
            self._learn_ids(region)
        text = self._text_of(region)
        if not text:
            if self._held:  # no new text: a possible match is neither done nor disproved
                self._held.append(region)
                return b""
            return self._pass(region)
        new = fold(text)
        window = self._window + new
        rules = self._rules
        # a match that ends in the new text starts at most `span - 1` characters before it
        start = max(0, len(window) - len(new) - rules.span + 1)
        match = rules.pattern.search(window, start, partial=rules.hold)
        self._window = window[-rules.span :]
        if match is None or (match.partial and match.start() == match.end()):
            return self._pass(region)  # (the empty string at the end is a "partial" of anything)
        if match.partial:
            self._held.append(region)
            return b""
        self.cut = self._rules.rule_of(match)
        self._held.clear()
        return self._final()

    def finish(self) -> bytes:
        """The stream ended without a match: whatever is still held goes out."""
        if self.cut is not None:
            return b""
        out = b"".join(self._held) + self._tail
        self._held.clear()
        self._tail = b""
        return out

    def _pass(self, region: bytes) -> bytes:
        if self._held:
            self._held.append(region)
            region = b"".join(self._held)
            self._held.clear()
        if self._cumulative:
            self._remember_released(region)
        return region

    def _text_of(self, region: bytes) -> str:
        found = self._field.findall(region)
        if self._chat:  # (SGLang sends `"reasoning_content":null` in every text chunk)
            if has_string(region, ARGUMENTS_KEY):
                found += ARGUMENTS.findall(region)
            if has_string(region, REASONING_KEY):
                found += REASONING.findall(region)
        if not found:
            return ""
        if self._cumulative:
            whole = _decode(found[-1])
            new = whole[self._seen :]
            self._seen = max(self._seen, len(whole))
            return new
        return "".join(_decode(m) for m in found if m)

    def _remember_released(self, region: bytes) -> None:
        found = self._field.findall(region)
        if found:
            self._released_text = _decode(found[-1])

    def _learn_ids(self, region: bytes) -> None:
        found = _ID.search(region)
        if found is not None:
            self._id = found.group(1).decode("utf-8", "replace")
        model = _MODEL.search(region)
        if model is not None:
            self._model = model.group(1).decode("utf-8", "replace")

    def _final(self) -> bytes:
        return final_events(self._route, self._id, self._model, self._released_text)


def _longest(pattern: str, literal: bool) -> int:
    """The most characters a match of `pattern` can span (a large number when unbounded)."""
    if literal:
        return len(pattern)
    try:
        import re._parser as parser  # Python 3.11+: the parser `re` itself uses

        width = parser.parse(pattern, re.IGNORECASE).getwidth()[1]
    except (ImportError, re.error, AttributeError):
        return 1 << 30  # unknown: the whole look-behind
    return int(min(width, 1 << 30))


def final_events(
    route: str, response_id: str | None, model: str | None, generated: str = ""
) -> bytes:
    """A stream's last chunk with `finish_reason: "content_filter"`, then `data: [DONE]`."""
    rid = response_id or "policy"
    if route == "/generate":
        obj: dict[str, object] = {
            "text": generated,
            "meta_info": {"id": rid, "finish_reason": {"type": "content_filter"}},
        }
    elif route == "/v1/chat/completions":
        obj = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model or "",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "content_filter"}],
        }
    else:
        obj = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model or "",
            "choices": [{"index": 0, "text": "", "finish_reason": "content_filter"}],
        }
    return b"data: " + orjson.dumps(obj) + b"\n\ndata: [DONE]\n\n"


def _decode(escaped: bytes) -> str:
    try:
        text = orjson.loads(b'"' + escaped + b'"')
    except orjson.JSONDecodeError:
        return escaped.decode("utf-8", "replace")
    return text if isinstance(text, str) else ""


__all__ = ["StreamGuard", "StreamRules", "combined_pattern", "final_events"]
