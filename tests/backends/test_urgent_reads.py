"""Reading the sockets whose first token is due out of the loop's turn, and `on_head`.

The backend here answers from its own thread, so that a test can hold the event loop (as a
burst of request starts does) while a response arrives in the kernel, then see who reads it.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from backends import pool as pool_module
from backends.errors import UpstreamProtocolError
from backends.pool import UpstreamPool, UpstreamResponse
from backends.urgent_reads import UrgentReads

pytestmark = pytest.mark.skipif(not UrgentReads.available, reason="epoll is Linux only")

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class ThreadedBackend:
    """Answers a request with the head and a first chunk once the test sets `respond`; the
    rest of the body waits for `finish`."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.respond = threading.Event()
        self.finish = threading.Event()
        self.answered = threading.Semaphore(0)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            self.respond.wait(10)
            conn.sendall(HEAD + chunk(b"first\n\n"))
            self.answered.release()
            self.finish.wait(10)
            conn.sendall(chunk(b"second\n\n") + b"0\r\n\r\n")
            time.sleep(0.5)  # keep the connection open while the pool reads the end

    def close(self) -> None:
        self.respond.set()
        self.finish.set()
        self.listener.close()


def hold_the_loop(seconds: float = 0.05) -> None:
    """Block the event loop, as a burst of request starts does, while bytes arrive."""
    time.sleep(seconds)


async def answered_while_held(
    pool: UpstreamPool,
    backend: ThreadedBackend,
    on_head: Callable[[UpstreamResponse], None] | None = None,
) -> asyncio.Future[UpstreamResponse]:
    """Send a request and let it wait for its head, then hold the loop while the backend
    answers: the answer waits in the kernel. Returns the pending request."""
    request = asyncio.ensure_future(
        pool.request(backend.url, "POST", "/generate", headers=[], body=b"{}", on_head=on_head)
    )
    await asyncio.sleep(0)  # sent; it waits for its head
    backend.respond.set()
    assert backend.answered.acquire(timeout=5)
    hold_the_loop()
    return request


@pytest.fixture
def backend() -> Iterator[ThreadedBackend]:
    b = ThreadedBackend()
    yield b
    b.close()


def test_the_set_reads_only_ready_sockets_and_forgets_discarded_ones() -> None:
    urgent = UrgentReads()
    a, a_peer = socket.socketpair()
    b, b_peer = socket.socketpair()
    calls: list[str] = []
    try:
        urgent.add(a.fileno(), lambda: calls.append("a"))
        urgent.add(b.fileno(), lambda: calls.append("b"))
        urgent.poll()
        assert calls == []  # nothing to read yet
        b_peer.send(b"x")
        urgent.poll()
        assert calls == ["b"]
        urgent.discard(b.fileno())
        a_peer.send(b"y")
        urgent.poll()
        assert calls == ["b", "a"] and len(urgent) == 1
        urgent.add(a.fileno(), lambda: calls.append("a again"))  # re-added: the new reader
        urgent.poll()
        assert calls[-1] == "a again"
    finally:
        urgent.close()
        for s in (a, a_peer, b, b_peer):
            s.close()


def test_a_closed_socket_is_not_added() -> None:
    urgent = UrgentReads()
    s = socket.socket()
    fd = s.fileno()
    s.close()
    urgent.add(fd, lambda: None)
    assert len(urgent) == 0
    urgent.close()


async def test_a_due_head_is_read_between_request_starts(backend: ThreadedBackend) -> None:
    """While the loop is held (a burst of request starts), the response arrives in the kernel;
    `read_urgent` (which the pool runs after each request it sends) reads it at once, inside
    the running task, and `on_head` gets it there, not at the loop's next poll."""
    await _due_head_scenario(backend)


def test_a_due_head_is_read_between_request_starts_on_uvloop(backend: ThreadedBackend) -> None:
    """The same with uvloop's transports (`quicedge serve`'s default loop), which read the
    socket themselves: they find it empty, and the rest of the body still arrives in order."""
    uvloop = pytest.importorskip("uvloop")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_due_head_scenario(backend))


async def _due_head_scenario(backend: ThreadedBackend) -> None:
    pool = UpstreamPool()
    await pool.warm(backend.url, 1)
    heads: list[tuple[int, asyncio.Task[object] | None]] = []
    first: list[bytes] = []

    def on_head(response: UpstreamResponse) -> None:
        heads.append((response.status, asyncio.current_task()))
        first.append(response.take_ready())

    try:
        request = await answered_while_held(pool, backend, on_head)
        assert heads == []
        pool.read_urgent()
        assert heads == [(200, asyncio.current_task())]  # read in this task's turn
        assert pool.stats().urgent_reads == 1
        assert first == [b"first\n\n"]
        response = await asyncio.wait_for(request, 5)
        # Once its first token went on, the socket waits for the loop's turn like any other.
        response.first_token_passed()
        assert pool.urgent is not None and len(pool.urgent) == 0
        backend.finish.set()
        hold_the_loop()
        pool.read_urgent()
        assert response.take_ready() == b""
        assert await asyncio.wait_for(response.read(), 5) == b"second\n\n"
        assert response.complete
    finally:
        await pool.aclose()


async def test_without_urgent_reads_the_head_waits_for_the_loop(backend: ThreadedBackend) -> None:
    pool = UpstreamPool(urgent_reads=False)
    await pool.warm(backend.url, 1)
    heads: list[asyncio.Task[object] | None] = []
    try:
        request = await answered_while_held(
            pool, backend, lambda r: heads.append(asyncio.current_task())
        )
        pool.read_urgent()
        assert heads == []
        response = await asyncio.wait_for(request, 5)
        assert heads == [None]  # from the transport's read callback
        assert pool.stats().urgent_reads == 0
        backend.finish.set()
        assert await asyncio.wait_for(response.read(), 5) == b"first\n\nsecond\n\n"
    finally:
        await pool.aclose()


async def test_a_request_without_a_head_callback_is_not_urgent(backend: ThreadedBackend) -> None:
    """Its task has to wake for the head anyway: an early read would gain nothing."""
    pool = UpstreamPool()
    await pool.warm(backend.url, 1)
    try:
        request = await answered_while_held(pool, backend)
        assert pool.urgent is not None and len(pool.urgent) == 0
        pool.read_urgent()
        assert pool.stats().urgent_reads == 0
        response = await asyncio.wait_for(request, 5)
        backend.finish.set()
        assert await asyncio.wait_for(response.read(), 5) == b"first\n\nsecond\n\n"
    finally:
        await pool.aclose()


async def test_a_loop_that_just_read_upstream_is_left_to_its_own_order(
    backend: ThreadedBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pool_module, "URGENT_AFTER", 10.0)  # no machine is that slow
    pool = UpstreamPool()
    await pool.warm(backend.url, 1)
    heads: list[asyncio.Task[object] | None] = []
    try:
        request = await answered_while_held(
            pool, backend, lambda r: heads.append(asyncio.current_task())
        )
        pool.last_read = time.perf_counter()  # an upstream socket was read just now
        pool.read_urgent()
        assert heads == []
        pool.last_read = 0.0
        pool.read_urgent()
        assert heads == [asyncio.current_task()]
        backend.finish.set()
        response = await asyncio.wait_for(request, 5)
        assert await asyncio.wait_for(response.read(), 5) == b"first\n\nsecond\n\n"
    finally:
        await pool.aclose()


async def test_a_failure_read_out_of_turn_fails_its_own_request_only(
    backend: ThreadedBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """Bytes read out of turn are parsed inside whichever task read them; an error there closes
    the connection they came from (as the loop does for a transport callback) and reaches that
    connection's request, not the task that happened to read."""
    pool = UpstreamPool()
    await pool.warm(backend.url, 1)

    def on_head(response: UpstreamResponse) -> None:
        raise RuntimeError("a broken head callback")

    try:
        request = await answered_while_held(pool, backend, on_head)
        pool.read_urgent()  # does not raise here
        assert "reading http://127.0.0.1" in caplog.text and "out of turn" in caplog.text
        response = await asyncio.wait_for(request, 5)
        with pytest.raises(UpstreamProtocolError):
            await asyncio.wait_for(response.read(), 5)
        assert pool.stats().backends[backend.url].active == 0
    finally:
        await pool.aclose()


async def test_a_response_that_ended_in_on_head_returns_though_its_connection_moved_on() -> None:
    """`on_head` took the whole answer and ended it, so the connection went back to the pool and
    the next request took it and began waiting on it before the first request's task resumed.
    The first request returns its response; it must not wait on the connection again (it
    would take the next request's place, and that request would hang)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.readuntil(b"\r\n\r\n"):
            await reader.readexactly(2)  # the body, b"{}"
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")  # one write

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    pool = UpstreamPool(max_connections_per_backend=1)
    taken: list[bytes] = []

    def on_head(response: UpstreamResponse) -> None:
        taken.append(response.take_ready())
        assert response.take_end()  # the connection goes back to the pool here

    try:
        await pool.warm(url, 1)
        first = asyncio.ensure_future(
            pool.request(url, "POST", "/generate", headers=[], body=b"{}", on_head=on_head)
        )
        await asyncio.sleep(0)  # sent; the next request waits for the only connection
        second = asyncio.ensure_future(
            pool.request(url, "POST", "/generate", headers=[], body=b"{}")
        )
        one, two = await asyncio.wait_for(asyncio.gather(first, second), 5)
        assert taken == [b"ok"] and one.complete
        assert await asyncio.wait_for(two.read(), 5) == b"ok"
        assert pool.stats().reuse_ratio == 1.0
    finally:
        await pool.aclose()
        server.close()
        await server.wait_closed()
