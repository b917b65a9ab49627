"""How fast a new QUIC connection lets a token stream out: the pacer (`aioquic_patches.BytePacer`)
and the initial congestion window (`H3Limits.initial_congestion_window`).

The pacer is tested on real aioquic connections linked in memory with injected time: a 40 ms
round trip, and writes made within one millisecond, as uvloop's clock (whole milliseconds)
shows a burst of tokens to aioquic. The window is tested on the listener, through a relay that
holds everything the server sends, so nothing is acknowledged.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from aioquic.quic import recovery
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from tests.helpers import wait_until
from tests.transport.conftest import H3Factory
from tests.transport.h3client import client_config, h3_connect
from tests.transport.udp_holdback import UdpHoldback
from transport import aioquic_patches as patches
from transport import aioquic_private as private
from transport.asgi import Receive, Scope, Send
from transport.h3_session import H3Limits
from transport.tls import TlsMaterial

CLIENT = ("127.0.0.1", 50000)
SERVER = ("127.0.0.1", 4433)
ONE_WAY = 0.020  # seconds: a 40 ms round trip
TOKEN = b"x" * 200  # about an SSE chunk of one token


class Pair:
    """A client and a server connection, handshake done, the server's RTT sample 40 ms."""

    def __init__(self, tls: TlsMaterial, ca: Any) -> None:
        self.client = QuicConnection(configuration=client_config(ca, None))
        self.client.connect(SERVER, now=0.0)
        self.server = QuicConnection(
            configuration=tls.quic_configuration(idle_timeout=60),
            original_destination_connection_id=self.client.original_destination_connection_id,
        )
        private.set_initial_congestion_window(self.server, 32)
        self.now = 0.0
        for _ in range(4):
            self._client_to_server()
            self._server_to_client()
        assert self.server._handshake_complete and self.client._handshake_complete
        self.stream = self.client.get_next_available_stream_id()
        self.client.send_stream_data(self.stream, b"request", end_stream=True)
        self._client_to_server()

    def _client_to_server(self) -> None:
        datagrams = self.client.datagrams_to_send(now=self.now)
        self.now += ONE_WAY
        for data, _ in datagrams:
            self.server.receive_datagram(data, CLIENT, now=self.now)

    def _server_to_client(self) -> None:
        datagrams = self.server.datagrams_to_send(now=self.now)
        self.now += ONE_WAY
        for data, _ in datagrams:
            self.client.receive_datagram(data, SERVER, now=self.now)

    def tokens_sent_at_once(self, count: int) -> int:
        """Write `count` tokens, each followed by a transmit, all at one instant; how many
        transmits sent a datagram."""
        sent = 0
        for _ in range(count):
            self.server.send_stream_data(self.stream, TOKEN)
            if self.server.datagrams_to_send(now=self.now):
                sent += 1
        return sent


@pytest.fixture
def aioquic_pacer(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Connections made meanwhile pace as aioquic's own pacer does."""
    monkeypatch.setattr(recovery, "QuicPacketPacer", patches.ORIGINAL_PACER)
    monkeypatch.setattr(QuicConnection, "_write_application", patches.ORIGINAL_WRITE_APPLICATION)
    yield


def test_the_transport_paces_by_bytes() -> None:
    assert patches.APPLIED["pacing_by_bytes"]
    assert recovery.QuicPacketPacer is patches.BytePacer


def test_a_burst_of_small_packets_leaves_at_once(tls: TlsMaterial, dev_certs: Any) -> None:
    pair = Pair(tls, dev_certs.ca_cert)
    assert isinstance(pair.server._loss._pacer, patches.BytePacer)
    # 40 tokens of ~250 bytes on the wire: within the burst of 10 full datagrams' bytes.
    assert pair.tokens_sent_at_once(40) == 40


def test_aioquics_pacer_held_the_same_burst(
    aioquic_pacer: None, tls: TlsMaterial, dev_certs: Any
) -> None:
    """Why the patch: each small packet was charged a full datagram, and the bucket held two."""
    pair = Pair(tls, dev_certs.ca_cert)
    assert type(pair.server._loss._pacer) is patches.ORIGINAL_PACER
    assert pair.tokens_sent_at_once(40) < 10


def test_pacing_still_holds_past_the_burst(tls: TlsMaterial, dev_certs: Any) -> None:
    pair = Pair(tls, dev_certs.ca_cert)
    sent = pair.tokens_sent_at_once(200)  # ~50 KB at one instant
    # A burst of 12,000 bytes is ~48 such packets; the window (32 datagrams) would allow ~150.
    assert 40 <= sent <= 60
    assert pair.server._pacing_at is not None and pair.server._pacing_at > pair.now


def test_the_pacer_charges_a_full_datagram_without_a_builder() -> None:
    pacer = patches.BytePacer(max_datagram_size=1200)
    pacer.update_rate(congestion_window=12_000, smoothed_rtt=0.040)
    assert pacer.packet_time == pytest.approx(1200 / (1.25 * 12_000 / 0.040))
    assert pacer.bucket_max == pytest.approx(10 * pacer.packet_time)
    pacer.update_bucket(now=1.0)  # a first look fills the bucket
    pacer.update_after_send(now=1.0)
    assert pacer.bucket_time == pytest.approx(9 * pacer.packet_time)


@pytest.mark.parametrize("value", [1, 65])
def test_initial_window_out_of_range_is_refused(value: int) -> None:
    with pytest.raises(ValueError, match="initial_congestion_window must be from 2 to 64"):
        H3Limits(initial_congestion_window=value)


def test_the_window_is_set_in_datagrams_of_the_connection() -> None:
    quic = QuicConnection(configuration=QuicConfiguration(is_client=True))
    private.set_initial_congestion_window(quic, 20)
    assert quic._loss.congestion_window == 20 * quic.configuration.max_datagram_size


ANSWER = 250  # chunks of TOKEN: 50 KB, more than either window lets out
FIRST_FLIGHT = 30 * 1200  # bytes: within a window of 32 datagrams, far past one of 10


async def _answer(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    if scope["path"] == "/answer":
        for _ in range(ANSWER):
            await send({"type": "http.response.body", "body": TOKEN, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


@pytest.mark.parametrize(("window", "reaches"), [(32, True), (10, False)])
async def test_an_answer_written_at_once_leaves_in_the_first_round_trip(
    h3_server: H3Factory, dev_certs: Any, window: int, reaches: bool
) -> None:
    """Nothing reaches the client, so nothing is acknowledged: what the server sends is what its
    initial window lets out, with what the handshake's acknowledgements added and a few probes
    (a window of 10 sends ~12,000 bytes and, in 1.5 s, at most ~10,000 more)."""
    limits = H3Limits(initial_congestion_window=window)
    async with h3_server(app=_answer, limits=limits) as server:
        relay = UdpHoldback(server.port)
        port = await relay.start()
        try:
            async with h3_connect(port, dev_certs.ca_cert) as c:
                relay.hold_down = True
                sid = c.request("GET", "/answer")
                c.send_now()
                held = lambda: sum(map(len, relay.held_down))  # noqa: E731
                if reaches:
                    await wait_until(lambda: held() >= FIRST_FLIGHT, timeout=10)
                else:
                    with pytest.raises(AssertionError):
                        await wait_until(lambda: held() >= FIRST_FLIGHT, timeout=1.5)
                relay.release_down()
                r = await c.wait(sid, timeout=30)
        finally:
            relay.close()
    assert r.status == 200 and r.body == TOKEN * ANSWER
