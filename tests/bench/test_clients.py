"""The streaming clients against real servers over each transport."""

from __future__ import annotations

import json
import socket
import time

import pytest

from bench.clients import ClientError, ClientOptions, Target, TicketStore, make_client
from bench.clients.h3 import H3Client
from bench.stub_app import WORDS
from certs import DevCertificates
from tests.bench.conftest import Servers
from tests.helpers import free_port, free_udp_port

BODY = json.dumps({"prompt_tokens": 11}).encode()
HEADERS = [("content-type", "application/json")]


def _url(scheme: str, port: int) -> Target:
    return Target.parse(f"{scheme}://localhost:{port}/v1/chat/completions")


@pytest.mark.parametrize(
    ("transport", "scheme", "reuse"),
    [
        ("h1", "http", False),
        ("h1", "https", True),
        ("h2", "https", False),
        ("h2", "https", True),
        ("h3", "https", False),
        ("h3", "https", True),
    ],
)
async def test_stream_timings_and_usage(
    servers: Servers, dev_certs: DevCertificates, transport: str, scheme: str, reuse: bool
) -> None:
    port = {"h3": servers.h3_port, "http": servers.plain_port}.get(
        transport if transport == "h3" else scheme, servers.tls_port
    )
    options = ClientOptions(cacert=str(dev_certs.ca_cert), new_connection_per_request=not reuse)
    client = make_client(transport, options)
    texts: list[str] = []
    try:
        first = await client.request(
            _url(scheme, port), method="POST", headers=HEADERS, body=BODY, on_text=texts.append
        )
        second = await client.request(_url(scheme, port), method="POST", headers=HEADERS, body=BODY)
    finally:
        await client.aclose()
    for result in (first, second):
        assert result.error is None
        assert result.status == 200
        assert result.transport == transport
        assert result.text == "".join(WORDS)
        assert result.backend == "stub"
        assert (result.prompt_tokens, result.completion_tokens, result.cached_tokens) == (11, 6, 3)
        assert result.ttft_s is not None and result.latency_s is not None
        assert 0 < result.ttft_s <= result.latency_s
        assert len(result.content_times) == len(WORDS)  # the role chunk is not content
        assert len(result.itl_s) == len(WORDS) - 1
        assert all(gap >= 0 for gap in result.itl_s)
        assert result.early_data is False
    assert texts == WORDS
    assert first.reused_connection is False and first.connect_s is not None
    assert second.reused_connection is reuse
    assert (second.connect_s is None) is reuse
    assert first.header("x-stub-transport") == transport  # what the listener says it served
    if transport != "h3":
        version = first.header("x-stub-http-version")
        assert version == ("2" if transport == "h2" else "1.1")


async def test_h3_zero_rtt_resumes_with_single_use_tickets(
    servers: Servers, dev_certs: DevCertificates
) -> None:
    tickets = TicketStore()
    options = ClientOptions(cacert=str(dev_certs.ca_cert), zero_rtt=True)
    client = make_client("h3", options, tickets=tickets)
    target = _url("https", servers.h3_port)
    try:
        results = [
            await client.request(target, method="POST", headers=HEADERS, body=BODY)
            for _ in range(3)
        ]
    finally:
        await client.aclose()
    cold, *resumed = results
    assert cold.error is None and cold.early_data is False and cold.early_data_accepted is None
    assert cold.header("x-stub-early-data") == "0"
    for result in resumed:
        assert result.error is None and result.status == 200
        assert result.early_data is True and result.early_data_accepted is True
        assert result.header("x-stub-early-data") == "1"  # the app saw it as early data
        assert result.connect_s is None  # sent before any handshake completed
    assert len(tickets) == 1  # each ticket used once; the last connection's is left
    # The listener's address token (NEW_TOKEN) is kept and presented on the next connection.
    assert isinstance(client, H3Client) and set(tickets.tokens) == {"localhost"}


async def test_h3_ticket_reused_twice_falls_back_to_full_handshake(
    servers: Servers, dev_certs: DevCertificates
) -> None:
    """The server takes each ticket once (RFC 8446 §8.1): replaying one gets no early data."""
    tickets = TicketStore()
    options = ClientOptions(cacert=str(dev_certs.ca_cert), zero_rtt=True)
    client = make_client("h3", options, tickets=tickets)
    target = _url("https", servers.h3_port)
    try:
        await client.request(target, method="POST", headers=HEADERS, body=BODY)
        ticket = tickets.take("localhost")
        assert ticket is not None
        tickets.add(ticket)
        first = await client.request(target, method="POST", headers=HEADERS, body=BODY)
        tickets.take("localhost")
        tickets.add(ticket)  # the same, already used ticket again
        replay = await client.request(target, method="POST", headers=HEADERS, body=BODY)
    finally:
        await client.aclose()
    assert first.early_data_accepted is True
    assert replay.error is None and replay.status == 200  # still served, after the handshake
    assert replay.early_data is True and replay.early_data_accepted is False
    assert replay.header("x-stub-early-data") == "0"


async def test_connection_refused_is_an_error_result(dev_certs: DevCertificates) -> None:
    client = make_client("h1", ClientOptions(timeout=5.0))
    target = Target.parse(f"http://127.0.0.1:{free_port()}/generate")
    result = await client.request(target, method="POST", headers=[], body=b"")
    assert result.status is None and result.ttft_s is None
    assert result.error is not None and "Connect" in result.error


async def test_h3_timeout_when_nothing_answers(dev_certs: DevCertificates) -> None:
    options = ClientOptions(cacert=str(dev_certs.ca_cert), timeout=0.5)
    client = make_client("h3", options)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:  # reads, never answers
        silent.bind(("127.0.0.1", 0))
        try:
            result = await client.request(
                _url("https", silent.getsockname()[1]), method="POST", headers=[], body=b"{}"
            )
        finally:
            await client.aclose()
    assert result.error == "timeout after 0.5s"


async def test_h3_is_refused_at_once_when_nothing_listens(dev_certs: DevCertificates) -> None:
    """The kernel's ICMP "port unreachable" fails the handshake at once, as TCP's connection
    refused does, rather than at the end of the timeout."""
    options = ClientOptions(cacert=str(dev_certs.ca_cert), timeout=30.0)
    client = make_client("h3", options)
    began = time.perf_counter()
    try:
        result = await client.request(
            _url("https", free_udp_port()), method="POST", headers=[], body=b"{}"
        )
    finally:
        await client.aclose()
    assert result.error is not None and "nothing listens on that UDP port" in result.error
    assert time.perf_counter() - began < 10.0  # not the 30 s timeout


def test_bad_configurations_are_refused() -> None:
    with pytest.raises(ClientError, match="0-RTT needs"):
        make_client("h2", ClientOptions(zero_rtt=True))
    with pytest.raises(ClientError, match="unknown transport"):
        make_client("h4", ClientOptions())
    with pytest.raises(ClientError, match="http:// or https://"):
        Target.parse("ftp://x/")
    with pytest.raises(ClientError, match="no host"):
        Target.parse("https:///v1")
    with pytest.raises(ClientError, match="bad port"):
        Target.parse("https://localhost:99999/")
