"""What carries nothing costs the HTTP/3 listener too (2 to 25 µs a frame or stream, 40 times
what its bytes would cost in a request body): past 1,000 such frames, when they are more than
ten a request, the connection ends with H3_EXCESSIVE_LOAD and is counted as `control_flood`.
Real aioquic clients against the real listener."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from aioquic.buffer import encode_uint_var
from aioquic.h3.connection import ErrorCode, FrameType
from prometheus_client import CollectorRegistry

from tests.transport.conftest import H3Factory
from tests.transport.h3client import H3Client, h3_connect
from transport.metrics import TransportMetrics

PRIORITY_UPDATE = 0xF0700  # RFC 9218 §7.2, for a request stream
UNKNOWN = 0x21  # a reserved type (RFC 9114 §7.2.8): ignored, as unknown ones are


def frame(kind: int, payload: bytes = b"") -> bytes:
    return encode_uint_var(kind) + encode_uint_var(len(payload)) + payload


def on_control(client: H3Client, data: bytes) -> None:
    control = client.h3._local_control_stream_id
    assert control is not None
    client.quic.send_stream_data(control, data)


def in_a_request(client: H3Client, data: bytes) -> None:
    stream_id = client.request("POST", "/echo", end=False)
    client.quic.send_stream_data(stream_id, data, end_stream=True)


Flood = Callable[[H3Client, int], None]


def unknown_frames_on_the_control_stream(client: H3Client, n: int) -> None:
    on_control(client, frame(UNKNOWN) * n)


def priority_updates(client: H3Client, n: int) -> None:
    on_control(client, frame(PRIORITY_UPDATE, encode_uint_var(0) + b"u=1") * n)


def tiny_data_frames(client: H3Client, n: int) -> None:
    in_a_request(client, frame(FrameType.DATA, b"x") * n)


def unknown_unidirectional_streams(client: H3Client, n: int) -> None:
    for _ in range(n):
        stream_id = client.quic.get_next_available_stream_id(is_unidirectional=True)
        client.quic.send_stream_data(stream_id, encode_uint_var(UNKNOWN), end_stream=True)


async def _sent_away(client: H3Client) -> int:
    async with asyncio.timeout(10):
        while client.terminated is None:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    return client.terminated.error_code


@pytest.mark.parametrize(
    "flood",
    [unknown_frames_on_the_control_stream, priority_updates, tiny_data_frames],
)
async def test_frames_that_carry_nothing_past_their_share_end_the_connection(
    h3_server: H3Factory, dev_certs: Any, flood: Flood
) -> None:
    registry = CollectorRegistry()
    async with h3_server(metrics=TransportMetrics(registry)) as server:
        async with h3_connect(server.port, dev_certs.ca_cert) as c:
            assert (await c.fetch("GET", "/echo")).status == 200
            flood(c, 3000)
            c.send_now()
            assert await _sent_away(c) == ErrorCode.H3_EXCESSIVE_LOAD
        # Counted by the time the client hears of it, not only when QUIC's closing period
        # ends (three probe timeouts on): a listener that stops first still counts it.
        sample = {"listener": "h3", "reason": "control_flood"}
        assert registry.get_sample_value("quicedge_connections_refused_total", sample) == 1


async def test_streams_that_carry_nothing_count_too(h3_server: H3Factory, dev_certs: Any) -> None:
    """Unidirectional streams of an unknown type, and request streams ended before their
    HEADERS, each cost the listener a stream (20 to 25 µs) for a few bytes."""
    async with h3_server() as server, h3_connect(server.port, dev_certs.ca_cert) as c:
        for _ in range(12):  # as fast as the stream credit comes back
            unknown_unidirectional_streams(c, 50)
            for _ in range(50):
                c.quic.send_stream_data(c.quic.get_next_available_stream_id(), b"", True)
            c.send_now()
            try:
                await asyncio.wait_for(c.ping(), 5)
            except ConnectionError:
                break
        assert await _sent_away(c) == ErrorCode.H3_EXCESSIVE_LOAD


async def test_a_client_sending_a_few_with_each_request_is_served(
    h3_server: H3Factory, dev_certs: Any
) -> None:
    """Reprioritizing each request, a grease frame here and there, and ending each body with
    an empty DATA frame, for 150 requests: far from the bound."""
    async with h3_server() as server, h3_connect(server.port, dev_certs.ca_cert) as c:
        for _ in range(15):
            streams = []
            for _ in range(10):
                on_control(c, frame(PRIORITY_UPDATE, encode_uint_var(0) + b"u=1") * 4)
                stream_id = c.request("POST", "/echo", body=b"{}", end=False)
                c.quic.send_stream_data(stream_id, frame(UNKNOWN) + frame(FrameType.DATA), True)
                streams.append(stream_id)
            c.send_now()
            for stream_id in streams:
                assert (await c.wait(stream_id)).status == 200
        assert c.terminated is None
