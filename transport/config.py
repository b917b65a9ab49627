"""The transport's settings: listeners, TLS, ticket store, early data, Retry, workers, limits.

`TransportConfig` is the TOML ``[serve]`` table and `EarlyDataSettings` the ``[early_data]``
table; `edge.settings` reads both (with their flags and ``QUICEDGE_*`` variables) from the field
types, docstrings and metadata here. `validate()` checks what one field's type cannot say.
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from certs.dev import dev_certificates_refusal
from transport.early_data import DEFAULT_MODE, EarlyDataPolicy, Mode
from transport.h3_session import H3Limits
from transport.loop import resolve as resolve_loop
from transport.qlog import check_directory
from transport.redacted import without_password
from transport.tickets import DEFAULT_MAX_TTL
from transport.tls import CertificateFiles, check_files

Address = tuple[str, int]


def format_address(addr: Address | None) -> str:
    if addr is None:
        return "off"
    host, port = addr
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


def listen_address(value: str) -> Address:
    """A listener that cannot be turned off: ``HOST:PORT``."""
    if value == "off":
        raise ValueError("cannot be off")
    return _address(value)


def optional_listen_address(value: str) -> Address | None:
    """``HOST:PORT``, or ``off``."""
    return None if value in ("off", "") else _address(value)


def _address(value: str) -> Address:
    host, sep, port_text = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return host, int(port_text)


_LISTENER = {"parse": optional_listen_address, "format": format_address, "metavar": "HOST:PORT"}
_SECRET = {"format": lambda v: "none" if v is None else "(set)"}


@dataclass(frozen=True, slots=True)
class TransportConfig:
    """The ``[serve]`` table: listeners, TLS, tickets, Retry, processes and HTTP/3 limits."""

    h3: Address = field(
        default=("127.0.0.1", 4433),
        metadata={"parse": listen_address, "format": format_address, "metavar": "HOST:PORT"},
    )
    """QUIC/HTTP3 listener (UDP), HOST:PORT."""
    tcp: Address | None = field(default=("127.0.0.1", 8443), metadata=_LISTENER)
    """HTTP/2 + HTTP/1.1 over TLS (TCP) listener, HOST:PORT or off."""
    admin: Address | None = field(default=("127.0.0.1", 9901), metadata=_LISTENER)
    """Plain-HTTP admin listener (/health, /ready, /metrics), HOST:PORT or off."""
    http: Address | None = field(default=None, metadata=_LISTENER)
    """Plain-HTTP/1.1 proxy listener (behind a TLS-terminating balancer), HOST:PORT or off."""
    cert: str | None = field(default=None, metadata={"metavar": "FILE"})
    """PEM certificate chain file; with --key."""
    key: str | None = field(default=None, metadata={"metavar": "FILE"})
    """PEM private key file for --cert."""
    cert_poll_interval: float | None = None
    """Seconds between checks of the --cert and --key files: when either changed, the
    certificate is reloaded as on SIGHUP (a renewal lands without a signal); none: SIGHUP only."""
    dev_certs: bool = False
    """Without --cert/--key, serve the generated development certificates even on a listener
    that is not loopback (on loopback they are used without it)."""
    redis: str | None = field(default=None, metadata={"metavar": "URL"})
    """Redis URL of the ticket store shared by all workers and edge machines; none: this
    process's memory."""
    redis_timeout: float = 0.05
    """Socket timeout of one ticket-store call to Redis, s (it runs on the event loop)."""
    ticket_ttl: float = 86400.0
    """How long an issued session ticket is kept for its one resumption, s (at most its 24 h
    lifetime); in Redis each new connection's costs about 0.7 KB for this long."""
    ticket_secret: str | None = field(default=None, metadata=_SECRET)
    """Seals tickets stored in Redis (AES-GCM); at least 16 bytes, the same on every worker."""
    early_data: EarlyDataPolicy = field(default_factory=EarlyDataPolicy, metadata={"load": False})
    quic_retry: bool = False
    """Validate client addresses with a Retry round trip before the handshake (RFC 9000 8.1.2)."""
    quic_address_tokens: bool = True
    """Give each client an address token (NEW_TOKEN, RFC 9000 8.1.3) that proves its address on
    its next connection, which then sends its first flight and a 0-RTT answer at once; off: a
    client carries nothing from one connection to the next but its session ticket."""
    quic_stateless_reset: bool = True
    """Answer a datagram of a connection this listener does not have (one it closed, or one of
    the process before a restart with the same --quic-retry-secret) with a stateless reset
    (RFC 9000 10.3), so that its client knows at once rather than after its idle timeout."""
    quic_worker_steering: bool = True
    """With several workers, route each QUIC datagram to its connection's worker by the
    connection ID (a BPF program on the shared port), so that a client whose address changes
    mid-connection stays connected; off: the kernel spreads datagrams by client address."""
    tls_keylog: str | None = field(default=None, metadata={"metavar": "FILE"})
    """Append the TLS secrets of every QUIC and TLS-over-TCP connection to FILE (the key log
    format Wireshark reads), to decrypt packet captures while debugging; whoever can read it
    can decrypt the traffic. Created owner-only; none: no key log."""
    qlog_dir: str | None = field(default=None, metadata={"metavar": "DIR"})
    """Write a qlog trace of each QUIC connection into this directory when it ends (for
    debugging: docs/transport.md, "qlog traces"); none: no traces."""
    quic_retry_secret: str | None = field(default=None, metadata=_SECRET)
    """Secret the keys of Retry tokens, address tokens (NEW_TOKEN) and stateless reset tokens
    are derived from; at least 16 bytes, the same on every worker and machine."""
    workers: int = 1
    """Processes sharing the UDP and TCP ports (SO_REUSEPORT); above 1 needs --redis."""
    drain_timeout: float = 10.0
    """On SIGTERM, how long open requests get to finish, s."""
    loop: Literal["auto", "asyncio", "uvloop"] = "auto"
    """Event loop: asyncio, uvloop, or auto (uvloop when installed)."""
    max_connections: int = 10000
    """Open connections per listener (QUIC, TLS, plain HTTP, admin); one more is closed at once
    (QUIC: refused with CONNECTION_REFUSED) and counted (`quicedge_connections_refused_total`).
    0: no cap."""
    max_connections_per_client: int = 256
    """Open connections from one client IP address per listener; one more is closed at once
    and counted. Behind a load balancer that does not keep client addresses, raise it or set 0
    (no cap)."""
    new_connections_per_client: float = 0.0
    """New connections per second one client IP address may open on each listener (a token
    bucket of `new_connection_burst`); one more is closed at once (QUIC: refused before any TLS
    work) and counted (`client_rate`). A QUIC client's address is unproven until a handshake
    or a Retry: where spoofed floods are a risk, turn on --quic-retry. 0: no limit."""
    new_connection_burst: int = 20
    """New connections one client IP address may open at once under
    `new_connections_per_client`."""
    max_requests_per_connection: int = 0
    """Requests one HTTP/1.1 or HTTP/2 connection serves before it retires (HTTP/1.1:
    `connection: close` on the last answer; HTTP/2: GOAWAY once no answer is in flight), so
    that long-lived connections spread again over the workers and the machines behind a
    balancer. HTTP/3 connections have no such cap. 0: no cap."""
    limits: H3Limits = field(
        default_factory=H3Limits,
        metadata={
            "flatten": True,
            "flags": {"max_concurrent_streams": "--max-streams", "max_body_bytes": "--h3-max-body"},
        },
    )

    def validate(self) -> TransportConfig:
        """Raise ValueError naming the first bad setting; return self for chaining."""
        for name in ("cert_poll_interval", "redis_timeout", "drain_timeout"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):  # NaN passes every comparison
                raise ValueError(f"serve.{name} must be a finite number, got {value}")
        if self.workers < 1:
            raise ValueError(f"serve.workers must be >= 1, got {self.workers}")
        if self.workers > 1 and not self.redis:
            raise ValueError(
                f"--workers {self.workers} needs --redis URL: each worker's in-memory ticket "
                "store knows only the tickets that worker issued, so a returning client would "
                "resume (and send 0-RTT) only when the kernel hands its new connection to the "
                "same worker; Redis shares one store, in which each ticket is still single-use"
            )
        if self.redis is not None and not self.redis.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ValueError(
                f"serve.redis: expected a redis://, rediss:// or unix:// URL,"
                f" got {without_password(self.redis)!r}"
            )
        if (self.cert is None) != (self.key is None):
            raise ValueError("--cert and --key go together: give both or neither")
        if self.cert is not None and self.key is not None:
            # read here, not only at start: a reload took files a start cannot read as a change
            # for the next restart, which then did not start (TlsError names the file)
            check_files(CertificateFiles(Path(self.cert), Path(self.key)))
        if self.cert is None and not self.dev_certs:
            # Only the TLS listeners present a certificate; admin and http are plain.
            refusal = dev_certificates_refusal([a[0] for a in (self.h3, self.tcp) if a])
            if refusal:
                raise ValueError(refusal)
        resolve_loop(self.loop)  # unknown, or uvloop asked for and not installed
        if self.drain_timeout < 0:
            raise ValueError(f"serve.drain_timeout must be >= 0, got {self.drain_timeout}")
        caps = ("max_connections", "max_connections_per_client", "max_requests_per_connection")
        for name in caps:
            if getattr(self, name) < 0:
                raise ValueError(f"serve.{name} must be >= 0 (0: no cap)")
        rate = self.new_connections_per_client
        if not math.isfinite(rate) or rate < 0:
            raise ValueError(
                f"serve.new_connections_per_client must be >= 0 (0: no limit), got {rate}"
            )
        if self.new_connection_burst < 1:
            raise ValueError(
                f"serve.new_connection_burst must be >= 1, got {self.new_connection_burst}"
            )
        if self.qlog_dir is not None:
            check_directory(self.qlog_dir)
        if self.tls_keylog is not None and not Path(self.tls_keylog).parent.is_dir():
            raise ValueError(f"--tls-keylog {self.tls_keylog}: its directory does not exist")
        if self.cert_poll_interval is not None and self.cert_poll_interval <= 0:
            raise ValueError(f"serve.cert_poll_interval must be > 0, got {self.cert_poll_interval}")
        if self.redis_timeout <= 0:
            raise ValueError(f"serve.redis_timeout must be > 0, got {self.redis_timeout}")
        if not 0 < self.ticket_ttl <= DEFAULT_MAX_TTL:
            raise ValueError(
                f"serve.ticket_ttl must be > 0 and <= {DEFAULT_MAX_TTL:.0f} (a ticket's lifetime),"
                f" got {self.ticket_ttl}"
            )
        if self.quic_retry and self.workers > 1 and not self.quic_retry_secret:
            raise ValueError(
                "--quic-retry with several workers needs --quic-retry-secret, so that every "
                "worker validates the others' tokens"
            )
        if self.quic_retry_secret is not None and len(self.quic_retry_secret.encode()) < 16:
            raise ValueError("serve.quic_retry_secret must be at least 16 bytes")
        if self.ticket_secret is not None:
            if not self.redis:
                raise ValueError("--ticket-secret seals tickets stored in Redis: it needs --redis")
            if len(self.ticket_secret.encode()) < 16:
                raise ValueError("serve.ticket_secret must be at least 16 bytes")
        self._check_tcp_listeners()
        return self

    def _check_tcp_listeners(self) -> None:
        """Two TCP listeners on one address: a start stopped on `Address already in use`, which
        sends one looking for another process (ValueError naming the second flag). Only the sure
        cases: the same host, or the IPv4 wildcard and an IPv4 address. Here, not only at start,
        so that a reload refuses what a start would (it took it for the next restart, which then
        did not start)."""
        tcp = [("--tcp", self.tcp), ("--admin", self.admin), ("--http", self.http)]
        for i, (flag, address) in enumerate(tcp):
            for earlier, before in tcp[:i]:
                if address is None or before is None or address[1] != before[1] or not address[1]:
                    continue
                hosts = {address[0], before[0]}
                if len(hosts) == 1 or ("0.0.0.0" in hosts and all(map(_ipv4, hosts))):
                    raise ValueError(
                        f"{flag} {format_address(address)}: the address of {earlier}; each TCP "
                        "listener needs a port of its own"
                    )


@dataclass(frozen=True, slots=True)
class EarlyDataSettings:
    """The ``[early_data]`` table: what is done with a request received in 0-RTT."""

    default: Mode = DEFAULT_MODE
    """Mode of every path not in routes: accept, defer (until the handshake completes) or
    reject (425)."""
    routes: dict[str, Mode] = field(default_factory=dict)
    """Mode per path, merged over the built-in table (TOML only: routes = {PATH = MODE})."""
    every_route: Mode | None = field(default=None, metadata={"flag": "--early-data"})
    """One mode for every route and the default, overriding both."""

    def validate(self) -> None:
        for path in self.routes:
            if not path.startswith("/"):
                raise ValueError(
                    f"early_data.routes: a route is a path starting with /, got {path!r}"
                )

    def policy(self) -> EarlyDataPolicy:
        merged = EarlyDataPolicy()
        policy = EarlyDataPolicy({**merged.routes, **self.routes}, self.default)
        return policy if self.every_route is None else policy.overridden(self.every_route)

    def applied_to(self, transport: TransportConfig) -> TransportConfig:
        return replace(transport, early_data=self.policy())
