"""Relay and account: pass upstream body chunks to the client as they arrive, never re-encoded.

Only what accounting needs is parsed: which chunk carries the first content token (TTFT), the gaps
between content chunks (ITL), and — once, at the end — the usage the backend reports
(`prompt_tokens`, `cached_tokens`). `SSEScanner` finds event boundaries incrementally and never
rescans bytes it has seen; a cheap regex tells content events from the chat role chunk and the
usage/finish chunks, and JSON is decoded only for the last event and for error events.

Backpressure: the next upstream chunk is read only after the client's `send` returned, so a slow
client slows the upstream read instead of growing a buffer in the edge.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterable, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from backends.errors import UpstreamError
from edge.errors import EdgeError, from_upstream, stream_error_event

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

# A JSON string member `"content": "<first char>` or `"text": "<first char>`: the first char is
# `"` when the string is empty (the chat role chunk, `"content":""`), anything else is content.
# The first "content" (chat delta) or "text" (completions, /generate) string of an event: group 1
# is the JSON string literal's body, still escaped.
_CONTENT = re.compile(rb'"(?:content|text)"\s*:\s*"((?:[^"\\]|\\.)*)"', re.DOTALL)
_MAX_PIECES = 256 * 1024
"""Bytes of OpenAI stream deltas kept for routing feedback; a longer answer is not learned."""
_DONE = b"[DONE]"
_MAX_TAIL = 1 << 20
"""An SSE event larger than this (1 MiB) is relayed but not scanned: accounting gives up on it."""


@dataclass(slots=True)
class Usage:
    """Token counts the backend reported, when it did."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None


def usage_from(obj: Any) -> Usage:
    """Counts from one response object: SGLang `meta_info` or OpenAI `usage`."""
    if not isinstance(obj, dict):
        return Usage()
    meta = obj.get("meta_info")
    if isinstance(meta, dict):  # /generate: every chunk carries the counts so far
        return Usage(
            _int(meta.get("prompt_tokens")),
            _int(meta.get("cached_tokens")),
            _int(meta.get("completion_tokens")),
        )
    usage = obj.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        # SGLang fills prompt_tokens_details only with --enable-cache-report and a count > 0;
        # null is ambiguous (off, or zero), so it is reported as unknown rather than as a miss.
        cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
        return Usage(_int(usage.get("prompt_tokens")), cached, _int(usage.get("completion_tokens")))
    return Usage()


def text_from(obj: Any) -> str | None:
    """The generated text of a whole answer (or of /generate's cumulative last chunk)."""
    if not isinstance(obj, dict):
        return None
    text = obj.get("text")
    if isinstance(text, str):  # /generate
        return text
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        choice = choices[0]
        message = choice.get("message")
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            return str(message["content"])  # chat
        if isinstance(choice.get("text"), str):
            return str(choice["text"])  # completions
    return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _data_of(event: bytes) -> bytes | None:
    """The payload of an event's `data:` field (SGLang sends one data line per event)."""
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]  # the usual shape, found without splitting
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            return line[5:].strip()
    return None


class SSEScanner:
    """Incremental `text/event-stream` scanner: feed chunks, learn what accounting needs.

    Events end at a blank line (`\\n\\n`; SGLang writes LF line ends). Bytes of an incomplete
    event are kept in `_tail` and scanning resumes where it stopped, so feeding one byte at a
    time costs linear, not quadratic, time.
    """

    __slots__ = (
        "_pieces",
        "_pieces_size",
        "_scanned",
        "_tail",
        "content_events",
        "done",
        "error",
        "events",
        "last_data",
    )

    def __init__(self) -> None:
        self._tail = bytearray()
        self._scanned = 0
        self.events = 0
        """Complete data events seen (not counting `[DONE]`)."""
        self.content_events = 0
        """Events that carried generated text."""
        self.last_data: bytes | None = None
        """Payload of the last data event before `[DONE]` (usage/meta_info live there)."""
        self.error: dict[str, Any] | None = None
        """The `error` object of an error event, if the backend sent one."""
        self.done = False
        """`data: [DONE]` was seen."""
        self._pieces: list[bytes] | None = []
        """Escaped text of each OpenAI delta, decoded once at the end (None: gave up)."""
        self._pieces_size = 0

    def feed(self, chunk: bytes) -> int:
        """Scan `chunk`; return how many content events it completed."""
        if not self._tail:
            data: bytes | bytearray = chunk
            start_scan = 0
        else:
            if len(self._tail) > _MAX_TAIL:
                return 0
            self._tail += chunk
            data = self._tail
            start_scan = self._scanned
        content = 0
        start = 0
        while True:
            end = data.find(b"\n\n", start_scan)
            if end < 0:
                break
            content += self._event(bytes(data[start:end]))
            start = start_scan = end + 2
        if start == 0 and data is self._tail:
            pass  # nothing complete: keep the tail as it is
        elif start < len(data):
            self._tail = bytearray(data[start:])
        else:
            self._tail = bytearray()
        # a separator split across chunks: resume one byte before the end
        self._scanned = max(len(self._tail) - 1, 0)
        return content

    def _event(self, event: bytes) -> int:
        payload = _data_of(event)
        if payload is None:  # comment or non-data event: relayed, not counted
            return 0
        if payload == _DONE:
            self.done = True
            return 0
        self.events += 1
        self.last_data = payload
        if payload[:16].find(b'"error"') >= 0:
            self._record_error(payload)
            return 0
        match = _CONTENT.search(payload)
        if match is None or not match.group(1):
            return 0
        # /generate's text is cumulative and comes whole in the last event: keep OpenAI deltas only.
        if self._pieces is not None and not payload.startswith(b'{"text"'):
            piece = match.group(1)
            self._pieces_size += len(piece)
            if self._pieces_size <= _MAX_PIECES:
                self._pieces.append(piece)
            else:
                self._pieces = None
        return 1

    def _record_error(self, payload: bytes) -> None:
        try:
            obj = json.loads(payload)
        except ValueError:
            self.error = {"message": "unparseable error event"}
            return
        err = obj.get("error") if isinstance(obj, dict) else None
        self.error = err if isinstance(err, dict) else {"message": str(err)}

    def final(self) -> tuple[Usage, str | None]:
        """Decode the last data event once, at the end of the stream: usage, and the whole
        generated text when the stream is /generate's (its text is cumulative)."""
        if self.last_data is None:
            return Usage(), None
        try:
            obj = json.loads(self.last_data)
        except ValueError:
            return Usage(), None
        text = obj.get("text") if isinstance(obj, dict) and "meta_info" in obj else None
        if not isinstance(text, str):
            text = self._joined_pieces()
        return usage_from(obj), text

    def _joined_pieces(self) -> str | None:
        """The OpenAI stream's generated text: the deltas' escaped bodies joined into one JSON
        string and decoded once (escapes never span two deltas, so the join stays valid)."""
        if not self._pieces:
            return None
        try:
            text = json.loads(b'"' + b"".join(self._pieces) + b'"')
        except ValueError:
            return None
        return text if isinstance(text, str) else None

    def usage(self) -> Usage:
        return self.final()[0]


@dataclass(slots=True)
class RelayResult:
    """What the relay observed, in `time.perf_counter()` seconds."""

    first_upstream: float | None = None
    """When the chunk with the first content token arrived from the backend."""
    first_client: float | None = None
    """When that chunk had been handed to the client's transport."""
    end: float = 0.0
    gaps: list[float] = field(default_factory=list)
    """Inter-token latencies as the client sees them (between content chunks)."""
    usage: Usage = field(default_factory=Usage)
    text: str | None = None
    """The generated text, when it came for free (/generate streams)."""
    error: EdgeError | None = None
    """A failure after the response started (the client got an error event)."""
    upstream_error: UpstreamError | None = None
    backend_error: dict[str, Any] | None = None
    """An error event the backend itself sent mid-stream."""
    bytes_out: int = 0


async def relay_stream(
    chunks: AsyncIterable[bytes],
    send: Send,
    result: RelayResult,
    on_first_token: Callable[[], None] | None = None,
) -> None:
    """Relay an SSE body chunk by chunk. The response start was already sent.

    A backend failure mid-stream ends the client's stream with an error event in the API's format
    then `data: [DONE]` (as SGLang does), never a hang. Client-side send errors propagate.
    """
    scanner = SSEScanner()
    perf = time.perf_counter
    last = 0.0
    try:
        async for chunk in chunks:
            arrived = perf()
            content = scanner.feed(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            result.bytes_out += len(chunk)
            if content:
                now = perf()
                if result.first_client is None:
                    result.first_upstream = arrived
                    result.first_client = now
                    if on_first_token is not None:
                        on_first_token()
                else:
                    result.gaps.append(now - last)
                last = now
    except UpstreamError as exc:
        result.upstream_error = exc
        result.error = from_upstream(exc)
        if not scanner.done:
            await send(
                {
                    "type": "http.response.body",
                    "body": stream_error_event(result.error),
                    "more_body": True,
                }
            )
    result.backend_error = scanner.error
    result.usage, result.text = scanner.final()
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    result.end = perf()


async def read_whole(chunks: AsyncIterable[bytes], limit: int) -> bytes:
    """Collect a non-streaming answer (one JSON document) before anything is sent to the client.

    A JSON answer is useless until complete, so holding it costs no TTFT, and it lets a backend
    failure become a clean 502/504 instead of a truncated 200. Bounded by `limit`.
    """
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise UpstreamResponseTooLarge(f"backend answer exceeds {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


class UpstreamResponseTooLarge(UpstreamError):
    """A non-streaming answer larger than the edge is willing to hold."""

    kind = "protocol"


def answer_of_body(body: bytes) -> tuple[Usage, str | None]:
    """Counts and generated text of a non-streaming JSON answer (decoded once, for accounting)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return Usage(), None
    return usage_from(obj), text_from(obj)
