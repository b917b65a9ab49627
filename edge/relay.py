"""The SSE relay: pass upstream body chunks to the client as they arrive, never re-encoded.

Each chunk goes through the scanner (`edge.sse.SSEScanner`) for accounting, then on to the client
unchanged. On a listener with a body writer the chunks are written from inside the upstream
connection's read callback (`UpstreamResponse.set_sink`), so the request task wakes only at the
end; otherwise the task reads each chunk and sends it as an ASGI message. The whole path of a
chunk is in `docs/routing.md`, "Following a chunk".

Backpressure: the next upstream chunk is taken only after the client's transport accepted the
last one, so a slow client slows the upstream read instead of growing a buffer in the edge.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from backends.errors import UpstreamError, UpstreamResponseTooLarge, UpstreamTimeout
from backends.pool import UpstreamResponse
from edge.errors import EdgeError, from_upstream, stream_error_event
from edge.sse import SSEScanner, Usage
from transport.asgi import BodyWriter

if TYPE_CHECKING:
    from edge.stages.body import BodyBudget

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class Guard(Protocol):
    """A watch over the stream (`edge.policy.stream.StreamGuard`): it sees each upstream chunk
    before the client and says what to send instead (b"" holds it back); `cut` names the rule
    that ended the stream, after which `feed` has returned the stream's last events."""

    cut: str | None

    def feed(self, chunk: bytes) -> bytes: ...

    def finish(self) -> bytes: ...


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
        strip_usage: bool = False,
    ) -> None:
        self.scanner = SSEScanner.for_route(route, strip_usage=strip_usage)
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
        chunks.count_progress()
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
        chunks.count_progress()  # bytes of an event never finished are not progress
        try:
            if self._failure is not None:
                raise self._failed()
            if self.writer is None:
                if start is not None:
                    await send(start)
                await self._pull(chunks, send)
            else:
                await self._splice(chunks, self.writer, None if self.began else start)
        except UpstreamError as exc:
            # Kept past the block: without its traceback, which would hold this relay's frames
            # (and the response's buffers) in a reference cycle until the collector runs.
            result.upstream_error = exc.with_traceback(None)
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
        chunks.progressed()
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
            chunk, content = scanner.take(chunk)
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self.passed(chunks, chunk, content, arrived)
            if guard is not None and guard.cut is not None:
                return
        rest = b""
        if guard is not None and guard.cut is None:
            rest = guard.finish()
            if guard.cut is not None:  # the last event, without its blank line, matched
                self.result.filtered = guard.cut
        rest, content = scanner.take(rest) if rest else (b"", 0)
        rest += scanner.rest()
        if rest:
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
            chunks.progressed()  # the wait was the client's, not the backend's
        if self.ended:
            return
        chunks.set_sink(self._take)
        try:
            async for chunk in chunks:  # only what the callback did not take
                if not _pass_on(chunks, writer, self, chunk):
                    await writer.drained()
                    chunks.progressed()
                chunks.set_sink(self._take)
        except UpstreamError:
            if self._failure is not None:
                raise self._failed() from None
            if self.result.filtered is not None:
                return  # the guard ended the stream and closed the upstream connection
            raise
        finally:
            chunks.set_sink(None)
        if self._failure is not None:
            raise self._failed()

    def _failed(self) -> Exception:
        """The failure a callback kept, handed over once: kept on, it would hold the relay in
        a reference cycle through its traceback."""
        failure, self._failure = self._failure, None
        assert failure is not None
        return failure


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
    scanner = relay.scanner
    chunk, content = scanner.take(chunk) if chunk else (b"", 0)
    chunks.take_end()  # all of the body was taken: the response ends here
    end = chunks.complete
    if guard is not None and (end or cut):
        if not cut:
            rest, more_content = scanner.take(guard.finish())
            if guard.cut is not None:  # the last event, without its blank line, matched
                relay.result.filtered = guard.cut
            chunk += rest
            content += more_content
        end = True
    if end and not cut:
        chunk += scanner.rest()  # an event the backend ended without its blank line
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


async def read_whole(
    response: UpstreamResponse,
    limit: int,
    within: float | None = None,
    budget: BodyBudget | None = None,
) -> bytes:
    """Collect a non-streaming answer (one JSON document) before anything is sent to the client.

    A JSON answer is useless until complete, so holding it costs no TTFT, and it lets a backend
    failure become a clean 502/504 instead of a truncated 200. Bounded by `limit` bytes (at
    once when the head declares more) and, when given, by `within` seconds for a body that did
    not come whole with its head: each read's own bound (`chunk_timeout`) alone would let a
    backend that trickles its answer hold the request for as long as it liked.

    With a `budget`, each chunk is counted in it as it arrives (503 `overloaded` past its cap,
    what was counted given back); the whole answer's bytes stay counted until the caller gives
    them back, once it has passed them on.
    """
    declared = response.header(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise UpstreamResponseTooLarge(f"backend answer of {int(declared)} bytes is over {limit}")
    if within is None or response.complete:
        return await _collect(response, limit, budget)
    try:
        async with asyncio.timeout(within):
            return await _collect(response, limit, budget)
    except TimeoutError:
        raise UpstreamTimeout(
            f"backend answer not whole within {within:g}s of its head", base_url=""
        ) from None


async def _collect(chunks: AsyncIterable[bytes], limit: int, budget: BodyBudget | None) -> bytes:
    parts: list[bytes] = []
    size = 0
    try:
        async for chunk in chunks:
            size += len(chunk)
            if size > limit:
                raise UpstreamResponseTooLarge(f"backend answer is over {limit} bytes")
            if budget is not None:
                budget.take(len(chunk))
            parts.append(chunk)
    except BaseException:
        if budget is not None:
            budget.give(sum(map(len, parts)))
        raise
    return b"".join(parts)


__all__ = ["RelayResult", "Send", "StreamRelay", "read_whole", "relay_stream"]
