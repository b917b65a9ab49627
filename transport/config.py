"""The transport's settings: listeners, TLS, ticket store, early data, Retry, workers, limits.

``TransportConfig.from_mapping`` reads the TOML ``[serve]`` table (and ``[early_data]``);
``edge.serve`` lays command-line flags over it. Every value is checked with an error that names
the setting.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from transport.early_data import EarlyDataPolicy, parse_mode
from transport.h3_session import H3Limits
from transport.loop import resolve as resolve_loop

Address = tuple[str, int]


def parse_address(value: str, *, setting: str) -> Address:
    """``HOST:PORT`` (``[::1]:443`` for IPv6) → (host, port)."""
    host, sep, port_text = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"{setting}: expected HOST:PORT, got {value!r}")
    return host, int(port_text)


def format_address(addr: Address) -> str:
    host, port = addr
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class TransportConfig:
    h3: Address = ("127.0.0.1", 4433)
    """QUIC/HTTP3 listener (UDP)."""
    tcp: Address | None = ("127.0.0.1", 8443)
    """TLS over TCP listener, HTTP/2 and HTTP/1.1; None: off."""
    admin: Address | None = ("127.0.0.1", 9901)
    """Plain-HTTP admin listener (health, readiness, metrics); None: off."""
    http: Address | None = None
    """Plain-HTTP/1.1 proxy listener (behind a TLS-terminating balancer; benchmarks)."""
    cert: str | None = None
    """PEM certificate chain; with ``key``. Default: the development certificates."""
    key: str | None = None
    redis: str | None = None
    """Redis URL for the fleet-wide ticket store; None: in-process memory store."""
    redis_timeout: float = 0.05
    """Socket timeout of the ticket store's Redis calls, s (they run on the event loop)."""
    ticket_secret: str | None = None
    """Secret that seals tickets stored in Redis (AES-GCM); the same on every worker."""
    early_data: EarlyDataPolicy = field(default_factory=EarlyDataPolicy)
    quic_retry: bool = False
    """Validate client addresses with a Retry round trip before the handshake (RFC 9000 §8.1.2)."""
    quic_retry_secret: str | None = None
    """Secret the Retry token key is derived from; the same on every worker and machine."""
    workers: int = 1
    """Processes sharing the UDP and TCP ports (SO_REUSEPORT); > 1 needs ``redis``."""
    drain_timeout: float = 10.0
    """On SIGTERM, seconds open requests get to finish."""
    loop: str = "auto"
    """Event loop: ``asyncio``, ``uvloop``, or ``auto`` (uvloop when installed)."""
    limits: H3Limits = field(default_factory=H3Limits)

    def validate(self) -> TransportConfig:
        if self.workers < 1:
            raise ValueError("workers must be >= 1")
        if self.workers > 1 and not self.redis:
            raise ValueError(
                f"--workers {self.workers} needs --redis URL: session tickets must be shared "
                "by all workers, or a ticket issued by one worker could open a second 0-RTT "
                "window on another (replay)"
            )
        if (self.cert is None) != (self.key is None):
            raise ValueError("--cert and --key go together: give both or neither")
        resolve_loop(self.loop)  # unknown, or uvloop asked for and not installed
        if self.drain_timeout < 0:
            raise ValueError("drain_timeout must be >= 0")
        if self.redis_timeout <= 0:
            raise ValueError("redis_timeout must be > 0")
        if self.quic_retry and self.workers > 1 and not self.quic_retry_secret:
            raise ValueError(
                "--quic-retry with several workers needs --quic-retry-secret, so that every "
                "worker validates the others' tokens"
            )
        if self.quic_retry_secret is not None and len(self.quic_retry_secret.encode()) < 16:
            raise ValueError("quic_retry_secret must be at least 16 bytes")
        if self.ticket_secret is not None:
            if not self.redis:
                raise ValueError("--ticket-secret seals tickets stored in Redis: it needs --redis")
            if len(self.ticket_secret.encode()) < 16:
                raise ValueError("ticket_secret must be at least 16 bytes")
        return self

    @classmethod
    def from_mapping(cls, serve: Mapping[str, Any], early: Mapping[str, Any]) -> TransportConfig:
        """From the TOML ``[serve]`` and ``[early_data]`` tables."""
        known = {f.name for f in fields(cls)} - {"limits", "early_data"}
        limit_keys = {f.name for f in fields(H3Limits)}
        unknown = set(serve) - known - limit_keys
        if unknown:
            raise ValueError(f"config [serve]: unknown settings: {', '.join(sorted(unknown))}")
        values: dict[str, Any] = {}
        for name, value in serve.items():
            if name in ("h3", "tcp", "admin", "http"):
                if value in (False, "", "off"):
                    if name == "h3":
                        raise ValueError("config [serve].h3 cannot be off")
                    values[name] = None
                else:
                    values[name] = parse_address(str(value), setting=f"[serve].{name}")
            elif name in limit_keys:
                continue
            else:
                values[name] = value
        limits = {k: v for k, v in serve.items() if k in limit_keys}
        config = cls(**values)
        return replace(
            config,
            limits=H3Limits(**limits),
            early_data=EarlyDataPolicy.from_mapping(early),
        )

    def with_early_data_override(self, mode: str | None) -> TransportConfig:
        if mode is None:
            return self
        return replace(self, early_data=self.early_data.overridden(parse_mode(mode)))
