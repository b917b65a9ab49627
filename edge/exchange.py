"""The state of one inference request as it moves through the stages, and its headers."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from backends.registry import Backend
from edge.routing.base import Decision, RequestView
from edge.sse import Usage
from edge.telemetry import RequestTrace
from transport.asgi import BodyWriter, OnDisconnect


@dataclass(slots=True)
class RequestHeaders:
    """The request headers the app reads, found in one pass."""

    content_type: bytes | None = None
    content_length: bytes | None = None
    request_id: bytes | None = None
    session: bytes | None = None
    tenant: bytes | None = None
    traceparent: bytes | None = None
    tracestate: bytes | None = None


_WANTED = {
    b"content-type": "content_type",
    b"content-length": "content_length",
    b"x-request-id": "request_id",
    b"x-session-id": "session",
    b"x-tenant-id": "tenant",
    b"traceparent": "traceparent",
    b"tracestate": "tracestate",
}


def read_headers(raw: Iterable[tuple[bytes, bytes]]) -> RequestHeaders:
    found = RequestHeaders()
    for name, value in raw:
        attr = _WANTED.get(name.lower())
        if attr is not None:
            setattr(found, attr, value)
    return found


@dataclass(slots=True)
class Exchange:
    """State of one inference request while it runs (small: one per request)."""

    route: str
    t0: float
    transport: str
    early_data: bool
    handshake_wait: float
    request_id: str
    headers: RequestHeaders
    trace: RequestTrace | None
    view: RequestView | None = None
    stream: bool = False
    payload: bytes = b""
    abort_rid: str | None = None
    upstream_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    started: bool = False
    """The response start was sent: no retry, no error page, only an error event."""
    responded: bool = False
    """The response's last message was handed to the server: an `http.disconnect` from here on
    is its end, not a client going away."""
    disconnected: bool = False
    status: int = 0
    model: str = "none"
    """The `model` metric label (`edge.app`): a served model, `default`, `other` or `none`."""
    backend: Backend | None = None
    decision: Decision | None = None
    retries: int = 0
    usage: Usage | None = None
    ttft: float | None = None
    """Seconds from arrival to the first content chunk handed to the client (streams)."""
    body_writer: BodyWriter | None = None
    """The listener's `quicedge.body_writer`, when it offers one: the relay writes through it."""
    on_disconnect: OnDisconnect | None = None
    """The listener's `quicedge.on_disconnect`, when it offers one: no watcher task needed."""

    def mark_responded(self) -> None:
        self.responded = True
