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

import re
import time
from collections.abc import AsyncIterable, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from backends.errors import UpstreamError
from backends.pool import UpstreamResponse
from edge.errors import EdgeError, from_upstream, stream_error_event
from transport.asgi import BodyWriter

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class Guard(Protocol):
    """A watch over the stream (`edge.policy.stream.StreamGuard`): it sees each upstream chunk
    before the client and says what to send instead (b"" holds it back); `cut` names the rule
    that ended the stream, after which `feed` has returned the stream's last events."""

    cut: str | None

    def feed(self, chunk: bytes) -> bytes: ...

    def finish(self) -> bytes: ...


# The JSON string member `"content": "..."` (chat deltas) or `"text": "..."` (completions,
# /generate); group 1 is the string literal's body, still escaped. The literal prefix lets the
# regex engine skip to candidates with a fast substring search instead of trying every `"`.
_FIELDS = {
    # the string body "unrolled" (runs of plain characters, then one escape): one step per run,
    # where an alternation per character costs a step each (findall over 64 chat events:
    # 73 -> 51 us)
    field: re.compile(rb'"' + field + rb'":\s*"([^"\\]*(?:\\.[^"\\]*)*)"', re.DOTALL)
    for field in (b"content", b"text")
}
_MAX_PIECES = 256 * 1024
_BATCH = 64 * 1024
"""Bytes of events gathered before their delta texts are extracted, in one regex pass."""
"""Bytes of OpenAI stream deltas kept for routing feedback; a longer answer is not learned."""
_DONE = b"[DONE]"
_DONE_LINE = b"data: [DONE]"
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

    Events end at a blank line (`\\n\\n`; SGLang writes LF line ends, one `data:` line per event).
    A chunk is scanned as a whole, not event by event: the complete events in it are one region,
    searched with a few C-level calls (counts, one regex `findall`), whatever their number; a
    busy edge reads many tokens at once, and a loop per event was most of its relay cost. Bytes
    of an incomplete event wait in `_tail`, searched again only from where the last search
    stopped. Error events, rare, are parsed one by one.

    `field` is the JSON member that carries generated text (`content` for chat, `text` for the
    others); `deltas` says whether it is a delta (OpenAI) or /generate's cumulative text.
    """

    __slots__ = (
        "_content",
        "_deltas",
        "_last_region",
        "_compact",
        "_compact_empty",
        "_key",
        "_pending",
        "_pending_size",
        "_pieces",
        "_pieces_size",
        "_tail",
        "content_events",
        "done",
        "error",
        "events",
    )

    def __init__(self, field: bytes = b"content", *, deltas: bool = True) -> None:
        self._content = _FIELDS[field]
        self._deltas = deltas
        self._tail = b""
        self._last_region = b""
        """The last region that held a data event other than `[DONE]`."""
        self.events = 0
        """Complete data events seen (not counting `[DONE]`)."""
        self.content_events = 0
        """Events that carried generated text."""
        self.error: dict[str, Any] | None = None
        """The `error` object of an error event, if the backend sent one."""
        self.done = False
        """`data: [DONE]` was seen."""
        self._pieces: list[bytes] | None = []
        """Escaped text of each OpenAI delta, decoded once at the end (None: gave up)."""
        self._pieces_size = 0
        self._pending: list[bytes] = []
        """Regions with content whose text is not extracted yet."""
        self._pending_size = 0
        self._key = b'"' + field + b'":'
        self._compact = self._key + b'"'
        self._compact_empty = self._compact + b'"'

    @classmethod
    def for_route(cls, route: str) -> SSEScanner:
        if route == "/generate":
            return cls(b"text", deltas=False)
        return cls(b"content" if route == "/v1/chat/completions" else b"text")

    def feed(self, chunk: bytes) -> int:
        """Scan `chunk`; return how many content events it completed."""
        tail = self._tail
        if tail:
            if len(tail) > _MAX_TAIL:
                return 0
            data = tail + chunk
            # the tail held no separator; one may straddle the old end, so start a byte before
            end = data.find(b"\n\n", len(tail) - 1)
            if end >= 0:
                end = data.rfind(b"\n\n", end)
        else:
            data = chunk
            end = data.rfind(b"\n\n")
        if end < 0:
            self._tail = data
            return 0
        self._tail = data[end + 2 :]
        return self._scan(data[:end])

    def _scan(self, region: bytes) -> int:
        """Account for `region`, one or more complete events (separators between them)."""
        events = region.count(b"\n\ndata:") + region.startswith(b"data:")
        if not events:
            return 0  # comments or other fields only: relayed, not counted
        if region.endswith(_DONE_LINE) and (
            len(region) == len(_DONE_LINE) or region.endswith(b"\n\n" + _DONE_LINE)
        ):  # anchored: JSON text may say "data: [DONE]" too
            self.done = True
            events -= 1
        if not events:
            return 0
        self.events += events
        self._last_region = region
        if b'"error"' in region:
            self._scan_errors(region)
        # Non-empty text fields, counted in compact JSON (SGLang's) by two substring counts;
        # other spacing takes the regex. The text itself is extracted in batches (`_collect`).
        content = region.count(self._compact)
        if content:
            content -= region.count(self._compact_empty)
        elif self._key in region:
            content = sum(1 for m in self._content.findall(region) if m)
        if content:
            self.content_events += content
            if self._deltas and self._pieces is not None:
                self._pending.append(region)
                self._pending_size += len(region)
                if self._pending_size >= _BATCH:
                    self._collect()
        return content

    def _collect(self) -> None:
        """Extract the escaped delta texts of the regions kept so far, in one regex pass."""
        pending, self._pending, self._pending_size = self._pending, [], 0
        if self._pieces is None or not pending:
            return
        found = [m for m in self._content.findall(b"\n\n".join(pending)) if m]
        self._pieces_size += sum(map(len, found))
        if self._pieces_size <= _MAX_PIECES:
            self._pieces += found
        else:
            self._pieces = None

    def _scan_errors(self, region: bytes) -> None:
        for event in region.split(b"\n\n"):
            payload = _data_of(event)
            if payload is not None and payload[:16].find(b'"error"') >= 0:
                self._record_error(payload)

    def _record_error(self, payload: bytes) -> None:
        try:
            obj = orjson.loads(payload)
        except ValueError:
            self.error = {"message": "unparseable error event"}
            return
        err = obj.get("error") if isinstance(obj, dict) else None
        self.error = err if isinstance(err, dict) else {"message": str(err)}

    @property
    def last_data(self) -> bytes | None:
        """Payload of the last data event before `[DONE]` (usage/meta_info live there)."""
        for event in reversed(self._last_region.split(b"\n\n")):
            payload = _data_of(event)
            if payload is not None and payload != _DONE:
                return payload
        return None

    def final(self) -> tuple[Usage, str | None]:
        """Decode the last data event once, at the end of the stream: usage, and the whole
        generated text when the stream is /generate's (its text is cumulative)."""
        last = self.last_data
        if last is None:
            return Usage(), None
        try:
            obj = orjson.loads(last)
        except ValueError:
            return Usage(), None
        text = obj.get("text") if isinstance(obj, dict) and "meta_info" in obj else None
        if not isinstance(text, str):
            text = self._joined_pieces()
        return usage_from(obj), text

    def _joined_pieces(self) -> str | None:
        """The OpenAI stream's generated text: the deltas' escaped bodies joined into one JSON
        string and decoded once (escapes never span two deltas, so the join stays valid)."""
        if not self._deltas:
            return None
        self._collect()
        if not self._pieces:
            return None
        try:
            text = orjson.loads(b'"' + b"".join(self._pieces) + b'"')
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
    delays: list[float] = field(default_factory=list)
    """Per content chunk: from the socket read that brought it to its hand-over to the client."""
    usage: Usage = field(default_factory=Usage)
    text: str | None = None
    """The generated text, when it came for free (/generate streams)."""
    error: EdgeError | None = None
    """A failure after the response started (the client got an error event)."""
    upstream_error: UpstreamError | None = None
    backend_error: dict[str, Any] | None = None
    """An error event the backend itself sent mid-stream."""
    bytes_out: int = 0
    filtered: str | None = None
    """The stream policy rule that ended the stream (`finish_reason: "content_filter"`)."""


class StreamRelay:
    """Relaying one SSE stream: its scanner, its timings, whether the client's stream ended.

    `begin` starts it from inside the pool's read callback, as the response head arrives
    (`UpstreamPool.request(on_head=...)`); `run` is the request task's part, which does all of
    it when nothing began it."""

    __slots__ = (
        "began",
        "began_at",
        "ended",
        "guard",
        "last",
        "on_complete",
        "on_first_token",
        "result",
        "scanner",
        "writer",
        "_blocked",
        "_chunks",
        "_failure",
    )

    def __init__(
        self,
        result: RelayResult,
        *,
        route: str = "/v1/chat/completions",
        writer: BodyWriter | None = None,
        on_first_token: Callable[[], None] | None = None,
        on_complete: Callable[[], None] | None = None,
        guard: Guard | None = None,
    ) -> None:
        self.scanner = SSEScanner.for_route(route)
        self.guard = guard
        self.result = result
        self.writer = writer
        self.on_first_token = on_first_token
        self.on_complete = on_complete
        self.began = False
        self.began_at: float | None = None
        self.ended = False
        self.last = 0.0
        self._blocked = False  # the client's buffer was full after `begin`'s write
        self._chunks: UpstreamResponse | None = None
        self._failure: Exception | None = None  # raised in a callback, for the task to raise

    def begin(self, chunks: UpstreamResponse, start: MutableMapping[str, Any]) -> None:
        """Send the head `start` with the body bytes that came with it, and pass later chunks on
        from the read callback (`set_sink`), without waiting for the request task's turn. Needs
        a `writer`. Called from a transport callback: a failure is kept for `run` to raise."""
        assert self.writer is not None
        self.began, self.began_at, self._chunks = True, time.perf_counter(), chunks
        try:
            more = _pass_on(chunks, self.writer, self, chunks.take_ready(), start)
        except Exception as exc:
            self._failure = exc
            chunks.abort()
            return
        if not more:
            self._blocked = True  # the task waits for the drain, then sets the sink
        elif not self.ended:
            chunks.set_sink(self._take)

    async def run(
        self, chunks: UpstreamResponse, send: Send, start: MutableMapping[str, Any] | None
    ) -> None:
        """Relay the rest of the stream after `start` (None: the caller sent it; ignored once
        `begin` sent it). With a `writer`, the head goes out with whatever body bytes arrived
        with it, each later chunk is passed on from inside the upstream connection's read
        callback without waking this task, and the stream's end goes with the last chunk;
        otherwise this task sends the head, then reads each chunk and sends it as an ASGI
        message. A backend failure mid-stream ends the client's stream with an error event in
        the API's format then `data: [DONE]` (as SGLang does), never a hang. Client-side send
        errors propagate."""
        result = self.result
        try:
            if self._failure is not None:
                raise self._failure
            if self.writer is None:
                if start is not None:
                    await send(start)
                await self._pull(chunks, send)
            else:
                await self._splice(chunks, self.writer, None if self.began else start)
        except UpstreamError as exc:
            result.upstream_error = exc
            result.error = from_upstream(exc)
            if not self.scanner.done:
                await send(
                    {
                        "type": "http.response.body",
                        "body": stream_error_event(result.error),
                        "more_body": True,
                    }
                )
        if not self.ended:
            self.complete()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        result.end = time.perf_counter()
        result.backend_error = self.scanner.error
        result.usage, result.text = self.scanner.final()

    def complete(self) -> None:
        """The stream's last message is about to be handed over."""
        self.ended = True
        if self.on_complete is not None:
            self.on_complete()

    def passed(self, chunks: UpstreamResponse, chunk: bytes, content: int, arrived: float) -> None:
        """`chunk`, read at `arrived` with `content` tokens in it, was handed to the client."""
        result = self.result
        result.bytes_out += len(chunk)
        if content:
            now = time.perf_counter()
            result.delays.append(now - arrived)
            if result.first_client is None:
                result.first_upstream = arrived
                result.first_client = now
                chunks.first_token_passed()
                if self.on_first_token is not None:
                    self.on_first_token()
            else:
                result.gaps.append(now - self.last)
            self.last = now

    async def _pull(self, chunks: UpstreamResponse, send: Send) -> None:
        scanner = self.scanner
        guard = self.guard
        async for chunk in chunks:
            arrived = chunks.arrived_at  # the socket read, not when this task got to it
            if guard is not None:
                chunk = guard.feed(chunk)
                if guard.cut is not None:
                    self.result.filtered = guard.cut
                    chunks.abort()
                if not chunk:
                    continue
            content = scanner.feed(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            self.passed(chunks, chunk, content, arrived)
            if guard is not None and guard.cut is not None:
                return
        if guard is not None and guard.cut is None:
            rest = guard.finish()
            if rest:
                content = scanner.feed(rest)
                await send({"type": "http.response.body", "body": rest, "more_body": True})
                self.passed(chunks, rest, content, chunks.arrived_at)

    def _take(self) -> bool:
        """The sink: pass on what the read callback parsed (`UpstreamResponse.set_sink`)."""
        chunks = self._chunks
        assert chunks is not None and self.writer is not None
        try:
            if not _pass_on(chunks, self.writer, self, chunks.take_ready()):
                chunks.set_sink(None)  # the client's buffer is full: the task waits for it
            return not chunks.settled
        except Exception as exc:  # raised in a transport callback: hand it to the task
            self._failure = exc
            chunks.abort()
            return False

    async def _splice(
        self,
        chunks: UpstreamResponse,
        writer: BodyWriter,
        start: MutableMapping[str, Any] | None,
    ) -> None:
        """The head goes out with the body bytes that came with it, later chunks from the
        pool's read callback (`_take`), and the stream's end with the last chunk, so that the
        client has its whole answer before this task wakes to account for it. This task only
        waits: for the end, an error, a timeout, or a client too slow for the callback to write
        to, in which case it writes what is left itself, waits for the drain, and hands back."""
        self._chunks = chunks
        if start is not None:
            self._blocked = not _pass_on(chunks, writer, self, chunks.take_ready(), start)
        if self._blocked:
            await writer.drained()
        if self.ended:
            return
        chunks.set_sink(self._take)
        try:
            async for chunk in chunks:  # only what the callback did not take
                if not _pass_on(chunks, writer, self, chunk):
                    await writer.drained()
                chunks.set_sink(self._take)
        except UpstreamError:
            if self._failure is not None:
                raise self._failure from None
            if self.result.filtered is not None:
                return  # the guard ended the stream and closed the upstream connection
            raise
        finally:
            chunks.set_sink(None)
        if self._failure is not None:
            raise self._failure


async def relay_stream(
    chunks: UpstreamResponse,
    send: Send,
    result: RelayResult,
    on_first_token: Callable[[], None] | None = None,
    *,
    route: str = "/v1/chat/completions",
    writer: BodyWriter | None = None,
    on_complete: Callable[[], None] | None = None,
    start: MutableMapping[str, Any] | None = None,
) -> None:
    """Relay an SSE body chunk by chunk, after the `http.response.start` message `start` (None:
    the caller sent it); `on_complete` is called as the stream's last message is sent. See
    `StreamRelay.run`."""
    relay = StreamRelay(
        result, route=route, writer=writer, on_first_token=on_first_token,
        on_complete=on_complete,
    )  # fmt: skip
    await relay.run(chunks, send, start)


def _pass_on(
    chunks: UpstreamResponse,
    writer: BodyWriter,
    relay: StreamRelay,
    chunk: bytes,
    start: MutableMapping[str, Any] | None = None,
) -> bool:
    """Write `chunk` (after the head `start`, if given) and, when the backend's body is
    complete, the stream's end, all in one write; False when the client's buffer is full."""
    guard = relay.guard
    cut = False
    if guard is not None:
        chunk, cut = _guarded(chunks, relay, guard, chunk)
    content = relay.scanner.feed(chunk) if chunk else 0
    chunks.take_end()  # all of the body was taken: the response ends here
    end = chunks.complete
    if guard is not None and (end or cut):
        if not cut:
            rest = guard.finish()
            content += relay.scanner.feed(rest) if rest else 0
            chunk += rest
        end = True
    if end:
        relay.complete()
    if start is not None:
        more = writer.write_head(start, chunk, more=not end)
    elif chunk or end:
        more = writer.write_body(chunk, more=not end)
    else:
        more = True
    if chunk:
        relay.passed(chunks, chunk, content, chunks.arrived_at)
    return more


def _guarded(
    chunks: UpstreamResponse, relay: StreamRelay, guard: Guard, chunk: bytes
) -> tuple[bytes, bool]:
    """`chunk` as the guard lets it through; True when the guard ended the stream (the upstream
    request is then aborted by closing its connection)."""
    if relay.ended:
        return b"", False
    if chunk:
        chunk = guard.feed(chunk)
    if guard.cut is None:
        return chunk, False
    relay.result.filtered = guard.cut
    chunks.abort()
    return chunk, True


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
        obj = orjson.loads(body)
    except ValueError:
        return Usage(), None
    return usage_from(obj), text_from(obj)
