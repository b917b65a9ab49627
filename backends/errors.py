"""Errors raised by the upstream side. The app maps them to 502/503/504 in one place
(`edge.errors.from_upstream`).

Each class carries a `kind` string that the backend registry uses to count passive failures
(`record_failure(backend, kind)`) and that metrics use as a label.
"""

from __future__ import annotations


class UpstreamError(Exception):
    """Base of every failure talking to a backend."""

    kind = "upstream"

    def __init__(self, message: str, *, base_url: str = "") -> None:
        super().__init__(message)
        self.base_url = base_url


class UpstreamConnectError(UpstreamError):
    """The TCP connection could not be opened: refused, unreachable or connect timeout.

    Nothing was sent, so the request may be retried on another backend.
    """

    kind = "connect"


class UpstreamPoolBusy(UpstreamError):
    """No connection to the backend came free: too many requests wait for one already, or none
    did within `acquire_timeout`. Nothing was sent; the edge is short of connections, not the
    backend out of order, so it is not a failure of the backend."""

    kind = "pool_busy"


class UpstreamResponseTooLarge(UpstreamError):
    """A non-streaming answer larger than the edge is willing to hold."""

    kind = "protocol"


class UpstreamTimeout(UpstreamError):
    """No first byte within `first_byte_timeout`, or no body chunk within `chunk_timeout`."""

    kind = "timeout"


class UpstreamProtocolError(UpstreamError):
    """The connection died, or the backend sent something that is not valid HTTP/1.1."""

    kind = "protocol"


__all__ = [
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamPoolBusy",
    "UpstreamProtocolError",
    "UpstreamResponseTooLarge",
    "UpstreamTimeout",
]
