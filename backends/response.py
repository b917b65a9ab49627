"""`UpstreamResponse`: one backend response's status, headers and body, as the pool hands it out.

The body goes either to a task iterating the response (`__anext__`: everything parsed so far in
one piece, waiting only when nothing is) or, through `set_sink`, to a callback run inside the
connection's read that brought it (`take_ready`, `take_end`); see `docs/routing.md`, "Following
a chunk". Closing a response whose body is incomplete closes its connection, which is how an
upstream request is aborted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from backends.connection import Connection
from backends.errors import UpstreamError, UpstreamProtocolError

if TYPE_CHECKING:
    from backends.pool import BackendSlots

MAX_READ_BYTES = 16 * 1024 * 1024
"""The most `UpstreamResponse.read()` holds unless told otherwise: whole bodies read this way
(model lists, pre-warm answers) are small, and a backend that sends more is broken."""


class UpstreamResponse:
    """Status and headers of a backend response; the body is read by iterating."""

    __slots__ = (
        "_chunk_timeout",
        "_conn",
        "_done",
        "_host",
        "arrived_at",
        "headers",
        "reused",
        "status",
    )

    def __init__(
        self,
        *,
        host: BackendSlots,
        conn: Connection,
        status: int,
        headers: list[tuple[bytes, bytes]],
        reused: bool,
        chunk_timeout: float | None,
    ) -> None:
        self._host = host
        self._conn: Connection | None = conn
        self._chunk_timeout = chunk_timeout
        self._done = False
        self.status = status
        self.headers = headers
        self.reused = reused
        self.arrived_at = 0.0
        """`time.perf_counter()` of the socket read that brought the first byte of the body
        bytes last returned: the time they waited in the edge starts there."""

    @property
    def complete(self) -> bool:
        """True once the whole body was received."""
        return self._done

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        """All body bytes received so far (at least one), waiting only when there are none.

        Chunks that arrived together come back as one: a consumer that fell behind (a busy
        edge, a burst of tokens) catches up with one write to its client instead of one per
        chunk, and nothing that has arrived waits for anything that has not. Body bytes parsed
        before a framing error are returned first; the next call raises."""
        conn = self._conn
        if conn is None:
            raise StopAsyncIteration
        response = conn.response
        while True:
            if response.body:
                self.arrived_at = conn.unread_since
                out = conn.take_body()
            else:
                out = b""
            if response.done:
                self._done = True
                self._conn = None
                self._host.release(conn)
                if out:
                    return out
                raise StopAsyncIteration
            if out:
                return out
            if response.error is not None or conn.eof:
                self._abort()
                cause = response.error or "the connection closed before the end of the body"
                raise UpstreamProtocolError(
                    f"{self._host.base_url} broke off the response body: {cause}",
                    base_url=self._host.base_url,
                )
            try:
                what = "body chunk" if conn.progress_at is None else "whole event"
                await conn.wait(self._chunk_timeout, what)
            except UpstreamError:
                self._abort()
                raise
            if self._done:  # a sink took the end meanwhile (`take_end`)
                raise StopAsyncIteration

    def set_sink(self, sink: Callable[[], bool] | None) -> None:
        """Run `sink` from the connection's read callback each time a read parsed something,
        instead of waking the task iterating this response. The sink takes what it can with
        `take_ready` and returns True when the iterating task need not wake; returning False
        (the end of the body, an error, a sink that cannot take more now) wakes it, and
        iterating finishes the body as usual: whatever the sink left, then the end or the
        error. While the sink takes chunks, each one counts as progress for `chunk_timeout`."""
        if self._conn is not None:
            self._conn.sink = sink

    def count_progress(self) -> None:
        """From now on only `progressed()` is progress for `chunk_timeout`, not each read: a
        relay that holds the bytes of an unfinished event calls it as it passes something on,
        so a backend that trickles bytes but never completes an event is cut as a silent one
        is, instead of holding the request for good."""
        conn = self._conn
        if conn is not None and conn.progress_at is None:
            conn.progress_at = conn.loop.time()

    def progressed(self) -> None:
        """Something was passed on (or the client's buffer drained): see `count_progress`."""
        conn = self._conn
        if conn is not None:
            conn.progressed()

    def take_ready(self) -> bytes:
        """The body bytes parsed so far, without waiting (b"" when none); sets `arrived_at`."""
        conn = self._conn
        if conn is None or not conn.response.body:
            return b""
        self.arrived_at = conn.unread_since
        return conn.take_body()

    def take_end(self) -> bool:
        """True when the body is complete and all of it was taken: the response ends here,
        and its connection goes back to the pool, as iterating to the end would do."""
        conn = self._conn
        if conn is None or not conn.response.done or conn.response.body:
            return False
        self._done = True
        self._conn = None
        self._host.release(conn)
        return True

    def first_token_passed(self) -> None:
        """The first content token went on to the client: from now on this response's reads
        wait for the loop's turn like any other (`UrgentReads`)."""
        if self._conn is not None:
            self._conn.not_urgent()

    @property
    def settled(self) -> bool:
        """Nothing more will arrive: the body is complete, broken off, or the connection closed."""
        conn = self._conn
        return conn is None or conn.response.done or conn.response.error is not None or conn.eof

    async def read(self, limit: int = MAX_READ_BYTES) -> bytes:
        """The whole (remaining) body; past `limit` bytes the response is aborted (its
        connection closed) and UpstreamProtocolError raised, so a body that never ends does
        not grow the edge's memory without bound."""
        chunks: list[bytes] = []
        size = 0
        async for chunk in self:
            size += len(chunk)
            if size > limit:
                self._abort()
                raise UpstreamProtocolError(
                    f"{self._host.base_url} sent a body over {limit} bytes",
                    base_url=self._host.base_url,
                )
            chunks.append(chunk)
        return b"".join(chunks)

    def _abort(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def abort(self) -> None:
        """Close the connection now if the body is incomplete (aborts the upstream request)."""
        self._abort()

    async def aclose(self) -> None:
        """Body incomplete: close the connection (aborts the upstream request). Idempotent."""
        self._abort()

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._abort()

    def __repr__(self) -> str:
        state = "complete" if self._done else ("open" if self._conn else "closed")
        return f"<UpstreamResponse {self.status} {state} reused={self.reused}>"


def response_of(conn: Connection, reused: bool, chunk_timeout: float | None) -> UpstreamResponse:
    return UpstreamResponse(
        host=conn.host,
        conn=conn,
        status=conn.response.status,
        headers=conn.response.headers,
        reused=reused,
        chunk_timeout=chunk_timeout,
    )


__all__ = ["UpstreamResponse", "response_of"]
