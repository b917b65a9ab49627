"""Address-validation tokens (NEW_TOKEN, RFC 9000 §8.1.3): what a token is good for, and the
listener issuing them and taking them back, over real sockets with aioquic clients."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet_builder import QuicDeliveryState
from prometheus_client import CollectorRegistry

from tests.helpers import settled, wait_until
from tests.transport.conftest import H3Factory
from tests.transport.h3client import client_config, fresh_ticket, h3_connect
from tests.transport.udp_holdback import UdpHoldback
from transport import address_tokens
from transport import aioquic_patches as patches
from transport.address_tokens import CLOCK_SKEW, LIFETIME, MARK, TOKEN_BYTES, AddressTokens
from transport.aioquic_private import mark_address_validated, retry_count
from transport.asgi import Receive, Scope, Send
from transport.early_data import EarlyDataPolicy, Mode
from transport.metrics import TransportMetrics

SECRET = b"a secret every worker shares"
HOST = "127.0.0.1"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_token_is_good_for_its_address_only() -> None:
    tokens = AddressTokens(SECRET)
    token = tokens.issue(HOST)
    assert len(token) == TOKEN_BYTES and token.startswith(MARK)
    assert tokens.valid(token, HOST)
    assert not tokens.valid(token, "127.0.0.2")
    assert not tokens.valid(token, "::1")
    assert tokens.accept(token, "127.0.0.2") == "invalid"


def test_a_token_is_accepted_once() -> None:
    """A copy sent again from the client's address (an on-path observer's) is refused."""
    tokens = AddressTokens(SECRET)
    token, other = tokens.issue(HOST), tokens.issue(HOST)
    assert tokens.accept(token, HOST) == "accepted"
    assert tokens.accept(token, HOST) == "replayed"
    assert tokens.valid(token, HOST)  # still genuine, only used
    assert tokens.accept(other, HOST) == "accepted"


def test_the_tokens_remembered_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(address_tokens, "MAX_REMEMBERED", 3)
    clock = Clock()
    tokens = AddressTokens(SECRET, clock=clock)
    issued = [tokens.issue(HOST) for _ in range(5)]
    assert [tokens.accept(t, HOST) for t in issued] == ["accepted"] * 5
    assert len(tokens._accepted) == 3  # the two oldest forgotten
    assert tokens.accept(issued[-1], HOST) == "replayed"
    # Those past their lifetime are forgotten with the next one remembered.
    clock.now += LIFETIME + 1
    fresh = tokens.issue(HOST)
    assert tokens.accept(fresh, HOST) == "accepted"
    assert len(tokens._accepted) == 1


def test_any_holder_of_the_secret_accepts_it_and_no_one_else() -> None:
    token = AddressTokens(SECRET).issue(HOST)
    assert AddressTokens(SECRET).valid(token, HOST)
    assert not AddressTokens(b"another secret of some length").valid(token, HOST)
    assert not AddressTokens().valid(token, HOST)  # a random key


def test_a_token_expires_and_does_not_come_from_the_future() -> None:
    clock = Clock()
    tokens = AddressTokens(SECRET, clock=clock)
    token = tokens.issue(HOST)
    clock.now += LIFETIME
    assert tokens.valid(token, HOST)
    clock.now += 1
    assert not tokens.valid(token, HOST)
    clock.now -= LIFETIME + 1 + CLOCK_SKEW + 1  # issued "later" than now by more than the skew
    assert not tokens.valid(token, HOST)


@pytest.mark.parametrize("where", [0, 1, 13, TOKEN_BYTES - 1])
def test_an_altered_token_is_refused(where: int) -> None:
    tokens = AddressTokens(SECRET)
    token = bytearray(tokens.issue(HOST))
    token[where] ^= 0x01
    assert not tokens.valid(bytes(token), HOST)


@pytest.mark.parametrize("token", [b"", MARK, b"\x00" * TOKEN_BYTES, MARK * (TOKEN_BYTES + 1)])
def test_what_is_not_a_token_is_refused(token: bytes) -> None:
    assert not AddressTokens(SECRET).valid(token, HOST)


def test_validating_a_connection_without_a_path_is_harmless(dev_certs: Any) -> None:
    quic = QuicConnection(configuration=client_config(dev_certs.ca_cert))
    mark_address_validated(quic)  # no datagram yet, so no path: nothing to mark
    assert quic._network_paths == []


def test_a_token_stays_to_be_sent_until_it_is_acknowledged(dev_certs: Any) -> None:
    quic = QuicConnection(configuration=client_config(dev_certs.ca_cert))
    patches.send_new_token(quic, b"token")
    patches._on_new_token_delivery(QuicDeliveryState.LOST, quic)
    assert patches.new_token_pending(quic)  # sent again with HANDSHAKE_DONE
    patches._on_new_token_delivery(QuicDeliveryState.ACKED, quic)
    assert not patches.new_token_pending(quic)


async def test_the_listener_gives_each_client_a_token_for_its_address(
    h3_server: H3Factory, dev_certs: Any
) -> None:
    async with h3_server() as server:
        tokens: list[bytes] = []
        async with h3_connect(server.port, dev_certs.ca_cert, tokens=tokens) as c:
            assert (await c.fetch("GET", "/echo")).status == 200
            await wait_until(lambda: bool(tokens))
        assert len(tokens) == 1
        assert server.address_tokens is not None
        assert server.address_tokens.valid(tokens[0], HOST)


async def test_no_tokens_when_turned_off(h3_server: H3Factory, dev_certs: Any) -> None:
    async with h3_server(address_tokens=False) as server:
        tokens: list[bytes] = []
        async with h3_connect(server.port, dev_certs.ca_cert, tokens=tokens) as c:
            assert (await c.fetch("GET", "/echo")).status == 200
            await asyncio.sleep(0.2)  # the flight a token would have come in has arrived
        assert tokens == []


BIG = 20_000


async def _big(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"x" * BIG})


async def _first_flight_answer(
    server: Any, ca: Any, ticket: Any, token: bytes
) -> tuple[int, int, int]:
    """A 0-RTT GET /big through a relay that holds the client's datagrams after the server's
    first reply, so the handshake cannot complete: (bytes received, bytes sent, body bytes
    the client got) once the server stops sending."""
    relay = UdpHoldback(server.port, hold_after_reply=True)
    port = await relay.start()
    try:
        async with h3_connect(port, ca, ticket=ticket, token=token, wait_connected=False) as client:
            sid = client.request("GET", "/big")
            client.send_now()
            await asyncio.wait_for(client.responses[sid].first_data.wait(), 10)
            await settled(lambda: relay.bytes_down)
            seen = relay.bytes_up, relay.bytes_down, len(client.responses[sid].body)
            relay.release()
            r = await client.wait(sid)
            assert r.status == 200 and len(r.body) == BIG
            return seen
    finally:
        relay.close()


async def test_a_returning_client_with_a_token_gets_its_early_answer_at_once(
    h3_server: H3Factory, dev_certs: Any
) -> None:
    """Without a token, the server sends at most 3x what it received until the handshake
    completes (RFC 9000 §8.1); with one, the whole early answer leaves in the first flight."""
    metrics = TransportMetrics(CollectorRegistry())
    policy = EarlyDataPolicy({"/big": Mode.ACCEPT})
    async with h3_server(app=_big, policy=policy, metrics=metrics) as server:
        tokens: list[bytes] = []
        tickets: list[Any] = []
        async with h3_connect(server.port, dev_certs.ca_cert, tokens=tokens, tickets=tickets) as c:
            assert (await c.fetch("GET", "/warm")).status == 200
            await wait_until(lambda: bool(tokens) and bool(tickets))
        up, down, got = await _first_flight_answer(server, dev_certs.ca_cert, tickets[-1], b"")
        assert down <= 3 * up and got < BIG
        ticket = await fresh_ticket(server.port, dev_certs.ca_cert)
        up, down, got = await _first_flight_answer(server, dev_certs.ca_cert, ticket, tokens[0])
        assert got == BIG and down > 3 * up
    assert metrics.address_tokens.labels("accepted")._value.get() == 1


async def test_a_token_spares_the_retry_and_a_stale_one_gets_a_retry(
    h3_server: H3Factory, dev_certs: Any
) -> None:
    metrics = TransportMetrics(CollectorRegistry())
    async with h3_server(retry_secret=SECRET, token_secret=SECRET, metrics=metrics) as server:
        tokens: list[bytes] = []
        async with h3_connect(server.port, dev_certs.ca_cert, tokens=tokens) as c:
            assert (await c.fetch("GET", "/echo")).status == 200
            assert retry_count(c.quic) == 1
            await wait_until(lambda: bool(tokens))
        async with h3_connect(server.port, dev_certs.ca_cert, token=tokens[0]) as c:
            assert (await c.fetch("GET", "/echo")).status == 200
            assert retry_count(c.quic) == 0  # the token proved the address
        stale = AddressTokens(b"the key of another deployment").issue(HOST)
        for token in (stale, tokens[0]):  # a token of another key, and one used already
            async with h3_connect(server.port, dev_certs.ca_cert, token=token) as c:
                assert (await c.fetch("GET", "/echo")).status == 200
                assert retry_count(c.quic) == 1  # as if it had no token (RFC 9000 §8.1.3)
    assert metrics.address_tokens.labels("accepted")._value.get() == 1
    assert metrics.address_tokens.labels("invalid")._value.get() == 1
    assert metrics.address_tokens.labels("replayed")._value.get() == 1


async def test_a_token_kept_from_before_tokens_were_turned_off_gets_a_retry(
    h3_server: H3Factory, dev_certs: Any
) -> None:
    """A client keeps its token for a day; a listener with tokens turned off and Retry on
    answers it with a Retry, as if it had no token (RFC 9000 §8.1.3), not with a close
    (INVALID_TOKEN), which is for a bad Retry token (§8.1.2), and which ended its connection."""
    token = AddressTokens(SECRET).issue(HOST)
    async with h3_server(retry_secret=SECRET, token_secret=SECRET, address_tokens=False) as s:
        async with h3_connect(s.port, dev_certs.ca_cert, token=token) as c:
            assert (await c.fetch("GET", "/echo", timeout=5)).status == 200
            assert retry_count(c.quic) == 1


async def test_a_token_of_another_server_gets_a_retry(h3_server: H3Factory, dev_certs: Any) -> None:
    """Clients keep NEW_TOKEN tokens per server name: one from the QUIC server that had the name
    before (or a deployment whose secret changed) is sealed under no key of ours. That is no
    Retry token of ours either, so it gets a Retry as no token would (RFC 9000 §8.1.3), not the
    INVALID_TOKEN close meant for a Retry token that fails its checks (§8.1.2)."""
    foreign = bytes(range(60))  # a plausible size for another server's token
    async with h3_server(retry_secret=SECRET, token_secret=SECRET) as s:
        async with h3_connect(s.port, dev_certs.ca_cert, token=foreign) as c:
            assert (await c.fetch("GET", "/echo", timeout=5)).status == 200
            assert retry_count(c.quic) == 1
