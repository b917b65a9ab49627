"""What every transport client shares: options, the target URL, TLS contexts and the interface."""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from bench.stream import RequestResult, TextCallback

TRANSPORTS: tuple[str, ...] = ("h3", "h2", "h1")


class ClientError(Exception):
    """A bad client configuration (not a failed request: those are recorded in the result)."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where requests go: the parsed URL, plus the TLS name to present (SNI and verification)."""

    scheme: str  # "https" | "http"
    host: str
    port: int
    path: str  # path + query of the URL, "/" when empty
    server_name: str

    @classmethod
    def parse(cls, url: str, *, server_name: str | None = None) -> Target:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise ClientError(f"URL must start with http:// or https://, got {url!r}")
        if not parts.hostname:
            raise ClientError(f"URL has no host: {url!r}")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as exc:
            raise ClientError(f"bad port in URL {url!r}") from exc
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        return cls(parts.scheme, parts.hostname, port, path, server_name or parts.hostname)

    @property
    def authority(self) -> str:
        default = 443 if self.scheme == "https" else 80
        return self.server_name if self.port == default else f"{self.server_name}:{self.port}"

    def with_path(self, path: str) -> Target:
        return Target(self.scheme, self.host, self.port, path, self.server_name)


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How to connect. The same options apply to every transport where they make sense."""

    cacert: str | None = None  # CA bundle to verify the server against (None: system store)
    insecure: bool = False  # skip certificate verification
    server_name: str | None = None  # TLS name when it differs from the URL host (e.g. via relay)
    new_connection_per_request: bool = True  # bench_serving's default: TTFT includes setup
    zero_rtt: bool = False  # h3 only: resume with a saved ticket and send in early data
    timeout: float = 60.0  # whole request, seconds


class Client(Protocol):
    transport: str

    async def request(
        self,
        target: Target,
        *,
        method: str,
        headers: list[tuple[str, str]],
        body: bytes,
        on_text: TextCallback | None = None,
    ) -> RequestResult:
        """Send one request and read the whole streamed answer, calling `on_text` with each
        piece of generated text as it arrives. Never raises for a failed request: the error is
        in `RequestResult.error`."""
        ...

    async def aclose(self) -> None: ...


class StreamingClient:
    """The `Client.request` every transport shares: time the exchange, bound it, and turn every
    failure into `RequestResult.error`. Subclasses implement `_exchange`."""

    transport: str
    _options: ClientOptions

    async def request(
        self,
        target: Target,
        *,
        method: str,
        headers: list[tuple[str, str]],
        body: bytes,
        on_text: TextCallback | None = None,
    ) -> RequestResult:
        result = RequestResult(transport=self.transport, start=time.perf_counter())
        try:
            exchange = self._exchange(result, target, method, headers, body, on_text)
            await asyncio.wait_for(exchange, self._options.timeout)
        except TimeoutError:
            result.error = f"timeout after {self._options.timeout}s"
        except Exception as exc:  # every failure is a result, not a crash of the benchmark
            result.error = describe(exc)
        return result

    async def _exchange(
        self,
        result: RequestResult,
        target: Target,
        method: str,
        headers: list[tuple[str, str]],
        body: bytes,
        on_text: TextCallback | None,
    ) -> None:
        raise NotImplementedError


def tcp_ssl_context(options: ClientOptions, alpn: list[str]) -> ssl.SSLContext:
    """A TLS 1.3 client context (TLS 1.3 so TCP and QUIC compare at the same handshake cost)."""
    context = ssl.create_default_context(cafile=options.cacert)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    if options.insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(alpn)
    return context


def describe(exc: BaseException) -> str:
    """A one-line error for the result: the exception's class and message."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
