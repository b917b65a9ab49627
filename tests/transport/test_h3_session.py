"""H3Session on its own: real aioquic client and server connections linked in memory (no
sockets, injected time), so the early-data actions and ``handshake_wait_s`` are exact."""

from __future__ import annotations

import time
from typing import Any

from aioquic.buffer import encode_uint_var
from aioquic.h3.connection import H3Connection
from aioquic.quic.connection import QuicConnection
from aioquic.tls import SessionTicket

from tests.transport.h3client import client_config
from transport.caps import CONTROL_FLOOD
from transport.early_data import EarlyDataPolicy, Mode
from transport.h3_session import (
    Action,
    EarlyRequest,
    H3Limits,
    H3Session,
    RequestBody,
    SentAway,
    StartRequest,
)
from transport.tickets import MemoryTicketStore
from transport.tls import TlsMaterial

CLIENT = ("127.0.0.1", 50000)
SERVER = ("127.0.0.1", 4433)


class Pair:
    def __init__(self, tls: TlsMaterial, ca: Any, store: MemoryTicketStore, **session: Any):
        self.tickets: list[SessionTicket] = []
        ticket = session.pop("ticket", None)
        self.client = QuicConnection(
            configuration=client_config(ca, ticket), session_ticket_handler=self.tickets.append
        )
        self.client.connect(SERVER, now=0.0)
        self.server = QuicConnection(
            configuration=tls.quic_configuration(idle_timeout=60),
            original_destination_connection_id=self.client.original_destination_connection_id,
            session_ticket_fetcher=store.take,
            session_ticket_handler=store.put,
        )
        self.session = H3Session(
            self.server,
            policy=session.pop("policy", EarlyDataPolicy()),
            limits=H3Limits(),
            server=SERVER,
        )
        self.h3 = H3Connection(self.client)

    def to_server(self, now: float) -> list[Action]:
        for data, _ in self.client.datagrams_to_send(now=now):
            self.server.receive_datagram(data, CLIENT, now=now)
        actions: list[Action] = []
        while (event := self.server.next_event()) is not None:
            actions.extend(self.session.handle(event, now))
        return actions

    def to_client(self, now: float) -> None:
        for data, _ in self.server.datagrams_to_send(now=now):
            self.client.receive_datagram(data, SERVER, now=now)
        while (event := self.client.next_event()) is not None:
            self.h3.handle_event(event)

    def post(self, path: str, body: bytes) -> int:
        sid = self.client.get_next_available_stream_id()
        self.h3.send_headers(
            sid,
            [(b":method", b"POST"), (b":scheme", b"https"),
             (b":authority", b"localhost"), (b":path", path.encode())],
        )  # fmt: skip
        self.h3.send_data(sid, body, end_stream=True)
        return sid


def _ticket(tls: TlsMaterial, ca: Any, store: MemoryTicketStore) -> SessionTicket:
    pair = Pair(tls, ca, store)
    for i in range(10):  # a loop cap catches livelock; time moves so the pacer lets data out
        pair.to_server(now=i * 0.01)
        pair.to_client(now=i * 0.01 + 0.005)
        if pair.tickets:
            return pair.tickets[-1]
    raise AssertionError("no ticket after 10 rounds")


def test_accepted_early_request_starts_at_once(tls: TlsMaterial, dev_certs) -> None:
    store = MemoryTicketStore()
    pair = Pair(tls, dev_certs.ca_cert, store, ticket=_ticket(tls, dev_certs.ca_cert, store))
    sid = pair.post("/generate", b"{}")
    actions = pair.to_server(now=1.0)  # the client's first flight only
    assert actions[0] == EarlyRequest(sid, Mode.ACCEPT)
    start = actions[1]
    assert isinstance(start, StartRequest) and start.stream_id == sid
    extensions = dict(start.scope["extensions"])
    assert 0 < extensions.pop("arrived_at") <= time.perf_counter()
    assert extensions == {"transport": "h3", "early_data": True, "handshake_wait_s": 0.0}
    assert start.scope["client"] == CLIENT and start.scope["server"] == SERVER
    assert actions[2:] == [RequestBody(sid, b"{}", False)]
    assert not pair.session.handshake_complete


def test_deferred_request_waits_for_the_handshake(tls: TlsMaterial, dev_certs) -> None:
    store = MemoryTicketStore()
    pair = Pair(
        tls,
        dev_certs.ca_cert,
        store,
        ticket=_ticket(tls, dev_certs.ca_cert, store),
        policy=EarlyDataPolicy({}, Mode.DEFER),
    )
    sid = pair.post("/generate", b"{}")
    assert pair.to_server(now=1.0) == [EarlyRequest(sid, Mode.DEFER)]
    pair.to_client(now=1.02)
    actions = pair.to_server(now=1.04)  # the client's Finished: handshake complete
    start = actions[0]
    assert isinstance(start, StartRequest)
    assert start.scope["extensions"]["early_data"] is False
    assert abs(start.scope["extensions"]["handshake_wait_s"] - 0.04) < 1e-9
    assert actions[1:] == [RequestBody(sid, b"{}", False)]


def test_request_after_handshake_is_not_early(tls: TlsMaterial, dev_certs) -> None:
    pair = Pair(tls, dev_certs.ca_cert, MemoryTicketStore())
    for i in range(3):
        pair.to_server(now=i * 0.01)
        pair.to_client(now=i * 0.01 + 0.005)
    assert pair.session.handshake_complete
    sid = pair.post("/v1/chat/completions", b"{}")
    actions = pair.to_server(now=0.5)
    assert isinstance(actions[0], StartRequest) and actions[0].stream_id == sid
    assert actions[0].scope["extensions"]["early_data"] is False


def test_a_control_flood_is_reported_with_the_flight_that_floods(
    tls: TlsMaterial, dev_certs
) -> None:
    """QUIC hands the listener its own close only three probe timeouts later; a listener that
    stops before then must still count the connection it sent away."""
    pair = Pair(tls, dev_certs.ca_cert, MemoryTicketStore())
    for i in range(3):
        pair.to_server(now=i * 0.01)
        pair.to_client(now=i * 0.01 + 0.005)
    control = pair.h3._local_control_stream_id
    assert control is not None
    unknown = encode_uint_var(0x21) + encode_uint_var(0)  # a reserved frame type, empty
    pair.client.send_stream_data(control, unknown * 3000)
    actions = pair.to_server(now=0.1)
    assert SentAway(CONTROL_FLOOD) in actions
    assert pair.session.terminated
    pair.to_client(now=0.11)
    assert pair.to_server(now=10.0) == []  # QUIC's own close later counts nothing more
