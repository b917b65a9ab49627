"""The HTTP/3 listener: aioquic's QUIC endpoint, one thin asyncio protocol per connection.

The connection's protocol, with its per-stream channels, flushes, back-pressure and early-data
deadline, is ``h3_protocol.H3Protocol``; here are aioquic's endpoint (`_Endpoint`, which stops
admitting connections while draining, refuses those past the connection caps, checks and
issues address tokens, answers a datagram of a connection it does not know with a stateless
reset, and swaps its configuration on a certificate reload) and ``H3Server``:
the socket, session tickets, metrics hooks, drain and close.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
from functools import partial
from typing import Any, cast

from aioquic.asyncio.server import QuicServer
from aioquic.buffer import Buffer
from aioquic.h3.connection import ErrorCode
from aioquic.quic.configuration import SMALLEST_MAX_DATAGRAM_SIZE, QuicConfiguration
from aioquic.quic.connection import NetworkAddress
from aioquic.quic.events import HandshakeCompleted
from aioquic.quic.packet import QuicHeader, QuicPacketType, encode_quic_retry, pull_quic_header
from aioquic.tls import SessionTicket

from transport import aioquic_patches  # (before any connection: see the module)
from transport.address_tokens import MARK, TOKEN_BYTES, AddressTokens
from transport.aioquic_private import (
    answering,
    connection_for,
    has_connection,
    mark_address_validated,
    retry_handler,
    server_configuration,
    server_protocols,
    set_retry_handler,
    set_server_configuration,
)
from transport.asgi import ASGIApp
from transport.caps import ConnectionGate
from transport.early_data import EarlyDataPolicy
from transport.h3_caps import may_open, refusal
from transport.h3_protocol import SEND_HIGH_WATER, SEND_LOW_WATER, H3Protocol
from transport.h3_session import EarlyRequest, H3Limits, RequestRefused
from transport.metrics import TransportMetrics
from transport.qlog import QlogWriter
from transport.retry import SharedRetryTokenHandler
from transport.sockets import bind_naming
from transport.stateless_reset import StatelessResets
from transport.steering import WorkerConnectionIds
from transport.tickets import TicketStore, TicketStoreError
from transport.tls import TlsMaterial

__all__ = ["SEND_HIGH_WATER", "SEND_LOW_WATER", "H3Protocol", "H3Server"]

log = logging.getLogger("quicedge.transport.h3")

DRAIN_POLL_S = 0.02
"""How often a drain looks whether its clients acknowledged the answers their apps finished,
and whether the requests held for a handshake started."""

TICKET_WARN_EVERY_S = 10.0
"""Seconds between warnings of ticket store failures (the other Redis users' pace)."""


class _Endpoint(QuicServer):
    """aioquic's QuicServer that can stop admitting new connections, caps them through a
    `ConnectionGate`, validates a returning client's address by its token
    (`transport.address_tokens`), answers a short-header datagram of a connection ID it does
    not know with a stateless reset (`transport.stateless_reset`), and swaps its config.

    Each new connection gets the configuration with only its Initial's QUIC version: aioquic
    derives Initial keys for every supported version when a connection starts (for compatible
    version negotiation, RFC 9368), which is 2 of the 8 packet-key setups a first datagram pays
    for, ~4 % of a connection's instructions (docs/transport.md, "Handshake CPU: where it goes,
    what was cut"). A client that starts in v2 still gets v2; one that starts in v1 stays in
    v1, which aioquic's server chooses anyway unless the client prefers another version first."""

    draining = False

    def __init__(
        self,
        *,
        gate: ConnectionGate,
        retry: bool,
        tokens: AddressTokens | None,
        resets: StatelessResets | None,
        metrics: TransportMetrics | None,
        **kwargs: Any,
    ) -> None:
        super().__init__(retry=retry, **kwargs)
        self.gate = gate
        self.retry = retry
        self.tokens = tokens
        """Address tokens issued and accepted (None: none, as aioquic's own server)."""
        self.resets = resets
        """Stateless resets for unknown connections (None: none, as aioquic's own server)."""
        self._metrics = metrics
        self._socket: asyncio.DatagramTransport | None = None
        self._versioned: dict[int, tuple[QuicConfiguration, QuicConfiguration]] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._socket = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes | str, addr: NetworkAddress) -> None:
        raw = data if isinstance(data, bytes) else data.encode()
        if raw and not raw[0] & 0x80:  # a short header: only ever a known connection's
            # Straight to the connection, which parses the packet anyway: aioquic's endpoint
            # would parse its header once more only to look up the same connection ID.
            cid_length = server_configuration(self).connection_id_length
            protocol = connection_for(self, raw[1 : 1 + cid_length])
            if protocol is None:
                self._reset(raw, addr, cid_length)
            else:
                protocol.datagram_received(raw, addr)
            return
        if len(raw) < SMALLEST_MAX_DATAGRAM_SIZE and not self._supported(raw):
            # Too small to open a connection, so no Version Negotiation: aioquic answered any
            # size, more bytes than came, to an address no one checked (RFC 9000 §5.2.2: MUST
            # drop). Nor does one answer a Version Negotiation packet (version 0).
            return
        if self.draining:
            header = self._header(raw)
            if header is None or not has_connection(self, header.destination_cid):
                return  # no new connections while draining
        elif may_open(raw):
            header = self._header(raw)
            if header is None:
                return
            if self._opens(header):
                self._open(raw, addr, header)
                return
        super().datagram_received(data, addr)

    def _reset(self, data: bytes, addr: NetworkAddress, cid_length: int) -> None:
        """A stateless reset for a datagram of a connection this listener does not have (one it
        closed, or one of a process before it), within the reset rate; counted either way."""
        if self.resets is None or self._socket is None:
            return
        reply = self.resets.reply(data, cid_length)
        if reply is not None:
            self._socket.sendto(reply, addr)
        if self._metrics is not None:
            outcome = "sent" if reply is not None else "not_sent"
            self._metrics.stateless_resets.labels(outcome).inc()

    def _supported(self, data: bytes) -> bool:
        """Whether a long-header datagram names a version this listener speaks."""
        version = int.from_bytes(data[1:5])
        return len(data) >= 5 and version in server_configuration(self).supported_versions

    def _header(self, data: bytes) -> QuicHeader | None:
        try:
            return pull_quic_header(
                Buffer(data=data), host_cid_length=server_configuration(self).connection_id_length
            )
        except ValueError:
            return None

    def _opens(self, header: QuicHeader) -> bool:
        """Whether aioquic would make a connection for this datagram (rather than answer with a
        Retry or a version negotiation, or drop it)."""
        return (
            header.packet_type == QuicPacketType.INITIAL
            and header.version in server_configuration(self).supported_versions
            and not has_connection(self, header.destination_cid)
            and (not self.retry or bool(header.token))
        )

    def _open(self, data: bytes, addr: NetworkAddress, header: QuicHeader) -> None:
        """A new connection, on its version's configuration; counted by the gate until it ends
        when a cap is set, and past a cap refused without any state."""
        host = str(addr[0])
        counted = self.gate.active
        if counted and self.gate.admit(host) is not None:
            assert self._socket is not None
            self._socket.sendto(refusal(header), addr)
            return
        validated = self._token_outcome(header, host)
        if validated is None:  # an address token that is not good where Retry is on
            self._send_retry(header, addr)
            if counted:
                self.gate.release(host)
            return
        base, version = server_configuration(self), header.version
        assert version is not None  # `_opens` found it among the supported versions
        set_server_configuration(self, self._version_only(base, version))
        # The token proves the address as a Retry would: no Retry for this connection.
        handler = retry_handler(self) if validated else None
        if handler is not None:
            set_retry_handler(self, None)
        try:
            super().datagram_received(data, addr)
        finally:
            set_server_configuration(self, base)
            if handler is not None:
                set_retry_handler(self, handler)
        protocol = connection_for(self, header.destination_cid)
        if isinstance(protocol, H3Protocol):
            if validated:  # before the reply, which `_reply_soon` sends at the turn's end
                mark_address_validated(protocol.quic)
            if self.tokens is not None:
                aioquic_patches.send_new_token(protocol.quic, self.tokens.issue(host))
        if not counted:
            return
        if isinstance(protocol, H3Protocol):
            protocol.on_closed = partial(self.gate.release, host)
        else:
            self.gate.release(host)  # none was made: a Retry token that did not validate

    def _token_outcome(self, header: QuicHeader, host: str) -> bool | None:
        """True: the Initial carries a good address token, now used up. False: no token to
        consider (none, or, where Retry is on, one aioquic checks as a Retry token). None: an
        address token that is not good (used, expired, another address or key, tokens turned off),
        or a token sealed under no key of ours (another server's), where Retry is on, so the
        client is sent a Retry, as if it had no token (RFC 9000 §8.1.3)."""
        token = header.token
        if not token:
            return False
        shaped = len(token) == TOKEN_BYTES and token.startswith(MARK)
        if self.retry and not shaped and not self._retry_token(token):
            return None  # neither kind of ours: another server's, as if there were none
        if self.tokens is None:
            # Turned off, but a client keeps a token for a day: one of ours is still no Retry
            # token, which aioquic would answer with a close (INVALID_TOKEN), ending it.
            return None if shaped and self.retry else False
        outcome = self.tokens.accept(token, host)
        if outcome == "accepted":
            self._count_token(outcome)
            return True
        if shaped or not self.retry:
            self._count_token(outcome)
        return None if shaped and self.retry else False

    def _retry_token(self, token: bytes) -> bool:
        """Whether `token` may be a Retry token of this listener's (for aioquic to check)."""
        handler = retry_handler(self)
        return not isinstance(handler, SharedRetryTokenHandler) or handler.sealed_here(token)

    def _count_token(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.address_tokens.labels(outcome).inc()

    def _send_retry(self, header: QuicHeader, addr: NetworkAddress) -> None:
        """A Retry for this Initial, as aioquic's server sends one to an Initial without a
        token."""
        handler = retry_handler(self)
        assert handler is not None and self._socket is not None and header.version is not None
        source_cid = os.urandom(8)
        token = handler.create_token(
            address=addr,
            original_destination_connection_id=header.destination_cid,
            retry_source_connection_id=source_cid,
            now=asyncio.get_running_loop().time(),
        )
        packet = encode_quic_retry(
            version=header.version,
            source_cid=source_cid,
            destination_cid=header.source_cid,
            original_destination_cid=header.destination_cid,
            retry_token=token,
        )
        self._socket.sendto(packet, addr)

    def _version_only(self, base: QuicConfiguration, version: int) -> QuicConfiguration:
        """`base` with `version` as its only supported version (made once per base)."""
        cached = self._versioned.get(version)
        if cached is None or cached[0] is not base:
            cached = self._versioned[version] = (
                base,
                dataclasses.replace(base, supported_versions=[version]),
            )
        return cached[1]

    def protocols(self) -> list[H3Protocol]:
        unique = {id(p): p for p in server_protocols(self) if isinstance(p, H3Protocol)}
        return list(unique.values())


class H3Server:
    """An HTTP/3 listener serving one ASGI app."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        tls: TlsMaterial,
        tickets: TicketStore | None,
        policy: EarlyDataPolicy | None = None,
        limits: H3Limits | None = None,
        retry_secret: bytes | None = None,
        token_secret: bytes | None = None,
        address_tokens: bool = True,
        stateless_resets: StatelessResets | None = None,
        qlog: QlogWriter | None = None,
        connection_ids: WorkerConnectionIds | None = None,
        metrics: TransportMetrics | None = None,
        max_connections: int = 0,
        max_connections_per_client: int = 0,
        new_connections_per_client: float = 0.0,
        new_connection_burst: int = 1,
    ) -> None:
        self.app = app
        self.tls = tls
        self.tickets = tickets
        self._ticket_failures = 0  # since the last warning
        self._ticket_warned_at = -1e18
        self.policy = policy or EarlyDataPolicy()
        self.limits = limits or H3Limits()
        self.retry_secret = retry_secret
        self.address_tokens = AddressTokens(token_secret) if address_tokens else None
        """Tokens for returning clients (NEW_TOKEN): keyed from `token_secret`, which every
        worker and machine should share, else a random key of this process's."""
        self.stateless_resets = stateless_resets
        """Tokens of this listener's connection IDs and the resets it sends (None: neither)."""
        self.qlog = qlog
        """Where each connection's qlog trace goes (None: no traces)."""
        self.connection_ids = connection_ids
        """Makes connection IDs that name this worker (`transport.steering`; None: aioquic's)."""
        self.metrics = metrics
        self.gate = ConnectionGate(
            max_connections, max_connections_per_client,
            rate=new_connections_per_client, burst=new_connection_burst,
        )  # fmt: skip
        """Connection caps and rate (0: none), asked before any TLS work; its `on_refused` is
        called for each connection refused."""
        self.address: tuple[str, int] | None = None
        self._endpoint: _Endpoint | None = None
        self._transport: asyncio.DatagramTransport | None = None

    def __repr__(self) -> str:
        conns = len(self._endpoint.protocols()) if self._endpoint else 0
        return f"<H3Server {self.address} connections={conns}>"

    @property
    def port(self) -> int:
        assert self.address is not None, "not started"
        return self.address[1]

    async def start(
        self,
        host: str,
        port: int,
        *,
        reuse_port: bool = False,
        sock: socket.socket | None = None,
    ) -> None:
        """Listen on `host:port`, or on `sock`, a UDP socket already bound (a worker's socket
        of the group its parent bound, `transport.steering`)."""
        loop = asyncio.get_running_loop()
        if sock is None:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_DGRAM)
            if reuse_port:
                # Workers share the port; the kernel spreads clients by 4-tuple hash.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            bind_naming(sock, host, port, "UDP")
        configuration = self._configuration()
        fetcher = self._take_ticket if self.tickets is not None else None
        handler = self._keep_ticket if self.tickets is not None else None
        transport, endpoint = await loop.create_datagram_endpoint(
            lambda: _Endpoint(
                gate=self.gate,
                configuration=configuration,
                create_protocol=partial(H3Protocol, server=self),
                session_ticket_fetcher=fetcher,
                session_ticket_handler=handler,
                retry=self.retry_secret is not None,
                tokens=self.address_tokens,
                resets=self.stateless_resets,
                metrics=self.metrics,
            ),
            sock=sock,
        )
        if self.retry_secret is not None:
            set_retry_handler(endpoint, SharedRetryTokenHandler(self.retry_secret))
        self._transport = transport
        self._endpoint = endpoint
        name = sock.getsockname()
        self.address = (str(name[0]), int(name[1]))
        self.tls.on_reload(self._reload)

    def _configuration(self) -> QuicConfiguration:
        """The configuration new connections get, from the current certificate."""
        configuration = self.tls.quic_configuration(idle_timeout=self.limits.idle_timeout)
        configuration.quic_logger = self.qlog
        return configuration

    def _reload(self) -> None:
        if self._endpoint is not None:
            # New connections take the new certificate; live ones keep theirs.
            set_server_configuration(self._endpoint, self._configuration())

    # session tickets: called synchronously by aioquic's TLS engine

    def _ticket_trouble(self, what: str, exc: TicketStoreError) -> None:
        """Log a ticket store failure, at most once per `TICKET_WARN_EVERY_S`: there can be two
        a handshake (250 lines in 5 s with Redis gone); the metric counts every one."""
        self._ticket_failures += 1
        now = time.monotonic()
        if now - self._ticket_warned_at >= TICKET_WARN_EVERY_S:
            log.warning(
                "%s: %s (%d ticket store failures since the last such warning)",
                what, exc, self._ticket_failures,
            )  # fmt: skip
            self._ticket_warned_at = now
            self._ticket_failures = 0

    def _take_ticket(self, ticket_id: bytes) -> SessionTicket | None:
        assert self.tickets is not None
        try:
            ticket = self.tickets.take(ticket_id)
        except TicketStoreError as exc:
            # Fail closed: no ticket, no resumption, no early data without replay protection.
            self._ticket_trouble("resumption refused", exc)
            if self.metrics is not None:
                self.metrics.ticket_store_errors.labels("take").inc()
                self.metrics.zero_rtt.labels("rejected").inc()
            return None
        if ticket is None and self.metrics is not None:
            self.metrics.zero_rtt.labels("replay_refused").inc()
        return ticket

    def _keep_ticket(self, ticket: SessionTicket) -> None:
        assert self.tickets is not None
        try:
            self.tickets.put(ticket)
        except TicketStoreError as exc:
            self._ticket_trouble("session ticket not kept", exc)
            if self.metrics is not None:
                self.metrics.ticket_store_errors.labels("put").inc()

    # metrics hooks

    def handshake_completed(self, event: HandshakeCompleted, seconds: float) -> None:
        if self.metrics is None:
            return
        self.metrics.handshake_seconds.observe(seconds)
        self.metrics.handshakes.labels("true" if event.session_resumed else "false").inc()
        if event.early_data_accepted:
            self.metrics.zero_rtt.labels("accepted").inc()

    def request_refused(self, action: RequestRefused) -> None:
        if self.metrics is not None:
            self.metrics.stream_errors.labels(str(action.status or "reset")).inc()
        log.debug("stream %d refused: %s", action.stream_id, action.reason)

    def sent_away(self, reason: str) -> None:
        """A connection closed for how its client behaved (`caps.RAPID_RESET`)."""
        log.info("connection closed: %s", reason)
        if self.metrics is not None:
            self.metrics.connections_refused.labels("h3", reason).inc()

    def early_data_expired(self, requests: int) -> None:
        log.debug("%d early-data request(s) cancelled: handshake past its deadline", requests)
        if self.metrics is not None:
            self.metrics.early_data_expired.inc(requests)

    def early_request(self, action: EarlyRequest) -> None:
        if self.metrics is not None:
            self.metrics.early_requests.labels(action.action.value).inc()

    # shutdown

    def connections(self) -> list[H3Protocol]:
        return self._endpoint.protocols() if self._endpoint is not None else []

    async def drain(self, timeout: float) -> None:
        """Stop admitting connections, GOAWAY all, wait up to ``timeout`` for open requests:
        for their apps to end, then for the clients to acknowledge what they wrote (the close
        that follows would drop what is still buffered, cutting a finished answer short), and
        for the requests deferred for a handshake. An idle connection holds nothing up, even
        where its client acknowledges nothing (it went away)."""
        if self._endpoint is None:
            return
        self._endpoint.draining = True
        for protocol in self.connections():
            protocol.goaway()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            tasks = [t for p in self.connections() for t in p.app_tasks()]
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            if tasks:
                await asyncio.wait(tasks, timeout=remaining)
            elif any(answering(p.quic) for p in self.connections()):
                # An answer not yet acknowledged, or a request held for its handshake (its app
                # not started): no event says when either is done, so look again shortly.
                await asyncio.sleep(min(DRAIN_POLL_S, remaining))
            else:
                break
        for protocol in self.connections():
            protocol.cancel_all()

    async def aclose(self) -> None:
        if self._endpoint is None:
            return
        for protocol in self.connections():
            protocol.cancel_all()
            # RFC 9114 §5.2: H3_NO_ERROR, not aioquic's default application code 0, which
            # HTTP/3 does not define; the endpoint's close below sends it.
            protocol.quic.close(error_code=ErrorCode.H3_NO_ERROR)
        self._endpoint.close()  # CONNECTION_CLOSE to every client, then the socket
        self._endpoint = None
        await asyncio.sleep(0)
