"""A backend that misbehaves in the middle of a request, byte by byte on a real socket: what the
client gets, whether the request is retried (only while nothing reached the client), what the
registry and the metrics count, and that nothing is left held (in-flight counts, connections).

`RawUpstream` answers the registry's polls as a healthy SGLang would and hands every inference
request's socket to the test's scenario, which writes whatever bytes it likes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

from tests.edge.conftest import LISTENERS, Edge, Recorded, client, fast_config, health_ok, run_edge
from tests.helpers import wait_until

Scenario = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[None]]
"""Writes the answer to one inference request (given its body); returning closes the socket."""

COMPLETION = {"model": "tiny-model", "prompt": "Hello there", "stream": True}
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def event(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}).encode() + b"\n\n"


def rst(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a crashing pod's kernel or a middlebox does."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class RawUpstream:
    """A backend healthy to the registry whose inference answers are raw bytes from `scenario`."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.inference = 0
        self.paths: list[str] = []
        self.open = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> RawUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.open += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                path = lines[0].split(" ")[1]
                headers = dict(
                    (k.strip().lower(), v.strip())
                    for k, _, v in (line.partition(":") for line in lines[1:] if line)
                )
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.paths.append(path)
                reply = health_ok(Recorded("POST", path, headers, body))
                if reply is not None:
                    data = b"".join(reply.chunks)
                    writer.write(
                        b"HTTP/1.1 %d OK\r\ncontent-length: %d\r\n\r\n%b"
                        % (reply.status, len(data), data)
                    )
                    await writer.drain()
                    continue
                self.inference += 1
                await self.scenario(reader, writer, body)
                return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            return
        finally:
            self.open -= 1
            self._tasks.discard(task)
            writer.close()


@contextlib.asynccontextmanager
async def edge_before(
    *scenarios: Scenario, listener: str = "h1", **overrides: Any
) -> AsyncIterator[tuple[Edge, list[RawUpstream], httpx.AsyncClient]]:
    async with contextlib.AsyncExitStack() as stack:
        ups = [await stack.enter_async_context(RawUpstream(s)) for s in scenarios]
        overrides.setdefault("pool_warm_connections", 0)
        config = fast_config([u.url for u in ups], **overrides)
        edge = await stack.enter_async_context(run_edge(config, listener=listener))
        http = await stack.enter_async_context(client(edge, timeout=10.0))
        yield edge, ups, http


def in_flight(edge: Edge) -> list[int]:
    return [b.in_flight for b in edge.wiring.registry.backends]


def events_of(body: bytes) -> list[bytes]:
    return [e for e in body.split(b"\n\n") if e]


async def _trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> None:
    """One whole event, then the next one a byte at a time, forever: never silent, never done."""
    writer.write(SSE_HEAD + chunk(event("a")))
    await writer.drain()
    while True:
        await asyncio.sleep(0.05)
        writer.write(chunk(b"d"))
        await writer.drain()


@LISTENERS
async def test_a_stream_that_trickles_bytes_but_never_ends_an_event_is_cut(listener: str) -> None:
    """Bytes that never complete an event are not progress: the chunk timeout counts from the
    last event passed on. Each byte used to restart it, so the request was held for good and
    the client waited with nothing to read."""
    async with edge_before(_trickle, listener=listener, chunk_timeout=0.5) as (edge, ups, http):
        response = await http.post("/v1/completions", json=COMPLETION)
        assert response.status_code == 200
        events = events_of(response.content)
        assert json.loads(events[0][6:])["choices"][0]["text"] == "a"
        assert json.loads(events[-2][6:])["error"]["code"] == "upstream_timeout"
        assert events[-1] == b"data: [DONE]"
        assert in_flight(edge) == [0]
        assert edge.wiring.registry.backends[0].failures == {"timeout": 1}
        await wait_until(lambda: "/abort_request" in ups[0].paths)


async def _stalls_mid_answer(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes
) -> None:
    """A non-streamed answer's head and half its body, then nothing."""
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 40\r\n\r\n")
    writer.write(b"{")
    await writer.drain()
    await asyncio.sleep(30)


async def test_a_non_streamed_answer_that_stalls_is_504_and_aborted_on_the_backend() -> None:
    """A timeout leaves the backend working on the request, so the edge aborts it there
    (`/abort_request`, docs/errors.md); an answer that stalled after its head was not."""
    async with edge_before(_stalls_mid_answer, chunk_timeout=0.3) as (edge, ups, http):
        response = await http.post("/v1/completions", json=dict(COMPLETION, stream=False))
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "upstream_timeout"
        assert in_flight(edge) == [0]
        assert edge.wiring.registry.backends[0].failures == {"timeout": 1}
        await wait_until(lambda: "/abort_request" in ups[0].paths, timeout=3.0)


async def _head_only(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes
) -> None:
    writer.write(SSE_HEAD)
    await writer.drain()


async def _cut_mid_event(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes
) -> None:
    writer.write(SSE_HEAD + chunk(event("a")) + chunk(b'data: {"choi'))
    await writer.drain()


async def _cut_between_events(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes
) -> None:
    writer.write(SSE_HEAD + chunk(event("a")))
    await writer.drain()


async def _bad_chunk_size(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes
) -> None:
    writer.write(SSE_HEAD + chunk(event("a")) + b"zz\r\nnot a chunk\r\n")
    await writer.drain()
    await asyncio.sleep(5)


async def _reset_mid_stream(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes
) -> None:
    writer.write(SSE_HEAD + chunk(event("a")))
    await writer.drain()
    await asyncio.sleep(0.05)
    rst(writer)


@LISTENERS
async def test_a_stream_broken_off_after_its_head_ends_with_an_error_event_and_no_retry(
    listener: str,
) -> None:
    """Whatever way the backend breaks off after the head (closed, cut inside an event or
    between two, bad chunk framing, a TCP reset), the client's 200 stream ends with whole events,
    a `bad_gateway` error event and `[DONE]`; nothing is retried, one `protocol` failure is
    counted, and no connection, in-flight count or pool slot is left held."""
    for scenario in (_head_only, _cut_mid_event, _cut_between_events, _bad_chunk_size,
                     _reset_mid_stream):  # fmt: skip
        async with edge_before(scenario, scenario, listener=listener) as (edge, ups, http):
            response = await http.post("/v1/completions", json=COMPLETION)
            assert response.status_code == 200, scenario.__name__
            events = events_of(response.content)
            assert events[-1] == b"data: [DONE]"
            error = json.loads(events[-2][6:])["error"]
            assert error["code"] == "bad_gateway", scenario.__name__
            texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-2]]
            assert texts == ([] if scenario is _head_only else ["a"]), scenario.__name__
            assert sum(u.inference for u in ups) == 1, scenario.__name__
            assert sorted(b.failures.get("protocol", 0) for b in edge.wiring.registry.backends) == [
                0,
                1,
            ]
            await wait_until(lambda: in_flight(edge) == [0, 0])
            pool = edge.wiring.pool.stats().backends
            assert all(b.active == 0 for b in pool.values()), scenario.__name__


async def _closes_unanswered(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes
) -> None:
    pass


async def _resets_unanswered(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes
) -> None:
    rst(writer)


async def _huge_head(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes
) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * 100_000)  # and no end of line
    await writer.drain()
    await asyncio.sleep(5)


async def _answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> None:
    writer.write(SSE_HEAD + chunk(event("ok")) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    await writer.drain()
    await asyncio.sleep(1)


async def test_a_backend_that_fails_before_its_head_is_retried_on_another() -> None:
    """Closed or reset unanswered, or a head that never ends: nothing reached the client, so the
    request goes to the other backend, and the failure is counted as `protocol`."""
    for scenario in (_closes_unanswered, _resets_unanswered, _huge_head):
        async with edge_before(scenario, _answers) as (edge, ups, http):
            for _ in range(2):  # round robin: one of the two goes to the failing backend first
                response = await http.post("/v1/completions", json=COMPLETION)
                assert response.status_code == 200, scenario.__name__
                assert events_of(response.content)[-1] == b"data: [DONE]"
            assert ups[0].inference >= 1 and ups[1].inference == 2, scenario.__name__
            failures = edge.wiring.registry.backends[0].failures
            assert list(failures) == ["protocol"], (scenario.__name__, failures)
            await wait_until(lambda: in_flight(edge) == [0, 0])


def _refuses(status: bytes, wait: bytes) -> Scenario:
    async def refuse(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes
    ) -> None:
        answer = b'{"error": "busy"}'
        writer.write(
            b"HTTP/1.1 %b\r\nretry-after: %b\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (status, wait, len(answer), answer)
        )
        await writer.drain()
        await asyncio.sleep(1)

    return refuse


async def test_a_refusal_the_edge_answers_itself_keeps_the_backends_retry_after() -> None:
    """A 429 or 503 the retry budget does not let the edge retry is answered as it failed
    (docs/errors.md): with the backend's own `Retry-After` too, which clients pace themselves on;
    the last backend's refusal, relayed, keeps it as well."""
    for status, wait in ((b"429 Too Many Requests", b"7"), (b"503 Service Unavailable", b"9")):
        refuse = _refuses(status, wait)
        async with edge_before(refuse, refuse, retry_budget=0.0, retry_budget_min=0) as (
            edge,
            ups,
            http,
        ):
            response = await http.post("/v1/completions", json=COMPLETION)
            assert response.status_code == int(status[:3])
            assert sum(u.inference for u in ups) == 1  # not retried: no budget
            assert response.headers.get("retry-after") == wait.decode(), response.headers
            await wait_until(lambda: in_flight(edge) == [0, 0])


def upstream_errors(edge: Edge, kind: str) -> float:
    return sum(
        edge.registry.get_sample_value(
            "quicedge_upstream_errors_total", {"backend": b.name, "kind": kind}
        )
        or 0.0
        for b in edge.wiring.registry.backends
    )


async def test_every_429_a_backend_answers_is_counted_whether_retried_or_relayed() -> None:
    """The first 429 is retried on the other backend, the second (no backend left) relayed to
    the client: both are failed attempts of kind `429`, in the metric and the registry. The
    relayed one was counted in neither, so a fleet of one refusing every request showed none."""
    refuse = _refuses(b"429 Too Many Requests", b"1")
    async with edge_before(refuse, refuse) as (edge, ups, http):
        response = await http.post("/v1/completions", json=COMPLETION)
        assert response.status_code == 429
        assert [u.inference for u in ups] == [1, 1]
        assert upstream_errors(edge, "429") == 2
        assert [b.failures for b in edge.wiring.registry.backends] == [{"429": 1}, {"429": 1}]
        await wait_until(lambda: in_flight(edge) == [0, 0])


async def _reset_until_close_body(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes
) -> None:
    """A stream framed by the connection's close (no length, not chunked: an HTTP/1.0 proxy's),
    reset after its first event: a reset is not the close that ends such a body."""
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
    writer.write(event("a"))
    await writer.drain()
    await asyncio.sleep(0.05)
    rst(writer)


@LISTENERS
async def test_a_body_framed_by_the_close_that_is_reset_is_broken_off_not_ended(
    listener: str,
) -> None:
    """RFC 9112 §8: a response the connection's premature close cut short is incomplete. The
    reset used to end the body as a close does: the client got a cut stream as if whole, and the
    backend a success."""
    async with edge_before(_reset_until_close_body, listener=listener) as (edge, ups, http):
        response = await http.post("/v1/completions", json=COMPLETION)
        assert response.status_code == 200
        events = events_of(response.content)
        assert json.loads(events[0][6:])["choices"][0]["text"] == "a"
        assert json.loads(events[-2][6:])["error"]["code"] == "bad_gateway"
        assert events[-1] == b"data: [DONE]"
        assert edge.wiring.registry.backends[0].failures == {"protocol": 1}
        await wait_until(lambda: in_flight(edge) == [0])
