"""Errors raised by the upstream side. The app maps them to 502/504 in one place.

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


class UpstreamTimeout(UpstreamError):
    """No first byte within `first_byte_timeout`, or no body chunk within `chunk_timeout`."""

    kind = "timeout"


class UpstreamProtocolError(UpstreamError):
    """The connection died, or the backend sent something that is not valid HTTP/1.1."""

    kind = "protocol"


__all__ = ["UpstreamConnectError", "UpstreamError", "UpstreamProtocolError", "UpstreamTimeout"]
