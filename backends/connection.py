"""One keep-alive TCP connection to a backend: the asyncio protocol, its timers, its urgent reads.

`Connection` feeds every socket read to its `ResponseParser` (`backends.http1`) and then does one
of three things, in this order: hands a just-completed head to `on_head`, hands the body parsed so
far to the `sink`, or wakes the task waiting in `wait`. Those two callbacks are how a streamed
answer reaches the client from inside the read that brought it (see `docs/routing.md`, "Following
a chunk"). More than `READ_HIGH_WATER` unread body bytes pause reading, so a slow consumer does
not grow a buffer without bound.

The first-byte and chunk timeouts share one timer per connection, re-armed lazily; a response
whose first token is due is read out of the loop's turn by `UrgentReads` (`_read_now`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

from backends.errors import UpstreamProtocolError, UpstreamTimeout
from backends.http1 import ResponseParser
from backends.urgent_reads import UrgentReads

if TYPE_CHECKING:
    from backends.pool import BackendSlots

log = logging.getLogger(__name__)

READ_HIGH_WATER = 256 * 1024  # buffered unread body bytes above which the socket is paused
_URGENT_READ_SIZE = 64 * 1024  # a head and first tokens; under malloc's mmap threshold


class Connection(asyncio.Protocol):
    """One TCP connection to a backend: its transport, its parser and the consumer's waiter."""

    def __init__(self, slots: BackendSlots) -> None:
        self.host = slots
        self.response = ResponseParser()
        self.transport: asyncio.Transport | None = None
        # Kept: asyncio.get_running_loop() costs a getpid() system call each time on 3.11.
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self.in_flight = False  # a request was sent and its response is not complete
        self.received_any = False  # any byte of the current response arrived
        self.unread_since = 0.0  # perf_counter() of the read that brought the oldest unread body
        self.progress_at: float | None = None
        """`loop.time()` of the consumer's last progress (`progressed`), once it counts its own:
        the chunk timeout then runs from there, not from the last read. None: each read counts."""
        self.sink: Callable[[], bool] | None = None
        """Called after each read that parsed something; True: it took care of it, the waiting
        consumer need not wake (see `UpstreamResponse.set_sink`)."""
        self.on_head: Callable[[], None] | None = None
        """Called from the read that completed the response head, before the consumer wakes."""
        self.fd = -1
        self.urgent: UrgentReads | None = None  # the set this socket is in while it is urgent
        self._wait_timeout: float | None = None
        self.eof = False
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self.idle_handle: asyncio.TimerHandle | None = None
        # One timer per connection for the first-byte and chunk timeouts, re-armed lazily:
        # a wait only moves the deadline, where a timer per wait (one per streamed chunk)
        # would cost a heap insert and a cancel each time.
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport, though not always an asyncio.Transport subclass: uvloop's
        # TCPTransport is not one, and an isinstance assert here would leave us without it.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.fd = sock.fileno()

    def data_received(self, data: bytes) -> None:
        if not self.in_flight:
            # RFC 9112 §9.3: a server must not send a response nobody asked for; the
            # connection can no longer be trusted to frame the next response.
            self.close()
            return
        self.received_any = True
        response = self.response
        now = self.host.pool.last_read = time.perf_counter()
        if not response.body:
            self.unread_since = now
        response.feed(data)
        if response.body_bytes > READ_HIGH_WATER and not self._paused:
            assert self.transport is not None
            self._paused = True
            self.transport.pause_reading()
        # 1. the head just completed: the relay may start the client's response from here
        if self.on_head is not None and response.head_done:
            on_head, self.on_head = self.on_head, None
            on_head()
            self._wake()
            return
        # 2. a relay took the body from here: the request task sleeps on
        sink = self.sink
        if sink is not None and sink():
            if (
                self._deadline is not None
                and self._wait_timeout is not None
                and self.progress_at is None
            ):
                self._deadline = self.loop.time() + self._wait_timeout  # progress: a new chunk
            return
        # 3. otherwise the task waiting in `wait` takes it
        self._wake()

    def eof_received(self) -> bool | None:
        self.eof = True
        self.response.feed_eof()
        self._wake()
        return None  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.not_urgent()
        if not self.eof:
            self.eof = True
            if exc is None:
                # A reset (`exc`) is no end of a body the close frames: it is cut short
                # (RFC 9112 §8), and the consumer sees the connection closed before its end.
                self.response.feed_eof()
        if not self.closed:
            self.closed = True
            self.host.on_connection_lost(self)
        self._wake()

    # -- used by the pool ------------------------------------------------------------------
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def usable(self) -> bool:
        return not self.closed and not self.eof and not self.in_flight

    def send(self, data: bytes, *, is_urgent: bool = False) -> None:
        """Write a request; `is_urgent`: its first token may be read out of turn (`UrgentReads`)."""
        assert self.transport is not None
        self.response.reset()
        self.sink = None
        self.in_flight = True
        self.received_any = False
        self.progress_at = None
        self.transport.write(data)
        urgent = self.host.pool.urgent
        if urgent is not None and self.fd >= 0 and is_urgent:
            self.urgent = urgent
            urgent.add(self.fd, self._read_now)

    def _read_now(self) -> None:
        """Read out of the loop's turn (`UrgentReads`); EOF and errors are left to the
        transport's own read, which sees them too."""
        if self.closed or self.eof or self._paused:
            self.not_urgent()
            return
        try:
            data = os.read(self.fd, _URGENT_READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.not_urgent()
            return
        if not data:
            self.not_urgent()
            return
        self.host.pool.urgent_reads += 1
        try:
            self.data_received(data)
        except Exception:
            # This runs inside another request's task: fail this connection as the transport
            # would have (the loop reports an error raised in data_received and closes it),
            # not the request that happened to read it.
            log.exception("reading %s out of turn", self.host.base_url)
            self.close()

    def not_urgent(self) -> None:
        """Leave the urgent set: the first token went on, or the response or connection ended."""
        if self.urgent is not None:
            self.urgent.discard(self.fd)
            self.urgent = None

    def take_body(self) -> bytes:
        """The body bytes parsed and not yet consumed; reading resumes if it was paused."""
        data = self.response.take_body()
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def wait_head(self, timeout: float | None, began: Sequence[object]) -> None:
        """Wait for the status line and headers of the response to the request just sent,
        `timeout` s at most in all (a head, or `100 Continue`s, sent a byte at a time would
        otherwise hold the request as long as the backend liked). Once `began` holds
        something, the head was handled in the read callback (`on_head`); the whole response
        may have ended there too, and the connection gone to another request."""
        response = self.response
        deadline: float | None = None
        while not began and not response.head_done:
            if response.error is not None:
                raise UpstreamProtocolError(
                    f"{self.host.base_url} sent an invalid response: {response.error}",
                    base_url=self.host.base_url,
                )
            if self.eof:
                raise UpstreamProtocolError(
                    f"{self.host.base_url} closed the connection before the response head",
                    base_url=self.host.base_url,
                )
            if timeout is None:
                await self.wait(None, "response")
                continue
            if deadline is None:  # the usual case: the whole head in the first read
                deadline = self.loop.time() + timeout
                left = timeout
            else:
                left = deadline - self.loop.time()
            if left <= 0:
                raise UpstreamTimeout(
                    f"no whole response head from {self.host.base_url} within {timeout:g}s",
                    base_url=self.host.base_url,
                )
            await self.wait(left, "response", of=timeout)

    async def wait(self, timeout: float | None, what: str, of: float | None = None) -> None:
        """Wait for the next read (or EOF); UpstreamTimeout after `timeout` s without one (the
        rest of a limit of `of` s, which the error names, when given), or, once the consumer
        counts its own progress (`progressed`), `timeout` s after its last."""
        loop = self.loop
        waiter = loop.create_future()
        self._waiter = waiter
        self._wait_timeout = timeout
        if timeout is not None:
            since = self.progress_at
            deadline = self._deadline = (loop.time() if since is None else since) + timeout
            if self._timer is None or self._timer_at > deadline:
                self._arm(loop, deadline)
        try:
            await waiter
        except TimeoutError:
            raise UpstreamTimeout(
                f"no {what} from {self.host.base_url} within {of or timeout:g}s",
                base_url=self.host.base_url,
            ) from None
        finally:
            # Unless the next request's wait began first: a sink can end the response and
            # release the connection while this task still has to resume (`take_end`).
            if self._waiter is waiter:
                self._waiter = None
                self._deadline = None  # the timer, if it fires now, finds nothing to expire

    def progressed(self) -> None:
        """The consumer made progress (passed something on): the chunk timeout starts again
        from now, for the wait in progress and the next ones; from the first call on, reads
        alone no longer count (`UpstreamResponse.count_progress`)."""
        now = self.progress_at = self.loop.time()
        if self._deadline is not None and self._wait_timeout is not None:
            self._deadline = now + self._wait_timeout

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(when, self._on_timer)
        self._timer_at = when

    def _on_timer(self) -> None:
        self._timer = None
        deadline, waiter = self._deadline, self._waiter
        if deadline is None or waiter is None or waiter.done():
            return  # no wait in progress: the next one arms the timer again
        loop = self.loop
        # Timers may fire a little early (the loop's clock resolution, libuv's milliseconds).
        if deadline - loop.time() <= 0.001:
            waiter.set_exception(TimeoutError())
        else:
            self._arm(loop, deadline)  # the deadline moved on since the timer was set

    def close(self) -> None:
        self.not_urgent()
        self.sink = None
        self.on_head = None
        if self.idle_handle is not None:
            self.idle_handle.cancel()
            self.idle_handle = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport is not None:
            self.transport.abort()
        if not self.closed:
            self.closed = True
            self.host.on_connection_lost(self)
        self.eof = True
        self._wake()


__all__ = ["READ_HIGH_WATER", "Connection"]
