"""The state of one inference request as it moves through the stages, and its headers."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from backends.registry import Backend
from edge.routing.base import Decision, RequestView
from edge.sse import Usage
from edge.tracing import RequestTrace
from transport.asgi import BodyWriter, OnDisconnect

if TYPE_CHECKING:
    from edge.models.pools import Route
    from edge.models.tap import ShadowTap
    from edge.relay import Guard
    from edge.state.stage import StateRequest


@dataclass(slots=True)
class RequestHeaders:
    """The request headers the app reads, found in one pass."""

    content_type: bytes | None = None
    content_encoding: bytes | None = None
    content_length: bytes | None = None
    request_id: bytes | None = None
    session: bytes | None = None
    authorization: bytes | None = None
    canary: bytes | None = None
    traceparent: bytes | None = None
    tracestate: bytes | None = None
    conversation: bytes | None = None
    cache: bytes | None = None
    via: bytes | None = None


_WANTED = {
    b"content-type": "content_type",
    b"content-encoding": "content_encoding",
    b"content-length": "content_length",
    b"x-request-id": "request_id",
    b"x-session-id": "session",
    b"authorization": "authorization",
    b"x-canary": "canary",
    b"traceparent": "traceparent",
    b"tracestate": "tracestate",
    b"x-quicedge-conversation": "conversation",
    b"x-quicedge-cache": "cache",
    b"via": "via",
}


def read_headers(raw: Iterable[tuple[bytes, bytes]]) -> RequestHeaders:
    """The headers the app reads; of a repeated one, the last, except `Authorization`, whose
    lines are joined with commas (RFC 9110 §5.3), so that the tenant check sees them all and
    refuses them (a singleton field repeated is ambiguous, `TenantDirectory.identify`) rather
    than take whichever line came last."""
    found = RequestHeaders()
    for name, value in raw:
        attr = _WANTED.get(name.lower())
        if attr is None:
            continue
        if attr == "authorization" and found.authorization is not None:
            value = found.authorization + b", " + value
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
    strip_usage: bool = False
    """The payload asks for a stream's usage chunk the client did not (`forward.ask_usage`)."""
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
    model_route: Route | None = None
    """The model pool and version (`edge.models`); None: any backend."""
    shadow_tap: ShadowTap | None = None
    """Reads the stable reply of a request sampled for shadowing (`edge.models.tap`)."""
    usage: Usage | None = None
    body_writer: BodyWriter | None = None
    """The listener's `quicedge.body_writer`, when it offers one: the relay writes through it."""
    on_disconnect: OnDisconnect | None = None
    """The listener's `quicedge.on_disconnect`, when it offers one: no watcher task needed."""
    tenant: str = "anonymous"
    """The admitted tenant (from the API key, never from a header the client names); state
    (conversations, cache entries) and limits are kept per tenant."""
    state: StateRequest | None = None
    """The stored-conversation / response-cache side of this request (`edge.state`), if any."""
    error: str | None = None
    """How the last backend attempt failed (None: it succeeded, or none was made)."""
    tier: str = "bronze"
    """The tenant's tier: gold | silver | bronze."""
    tier_rank: int = 2
    """The tier's place in the admission queue (0 = gold, served first)."""
    holds_slot: bool = False
    """Admission counted this request against its tenant's `max_concurrent`."""
    ratelimit: list[tuple[bytes, bytes]] | None = None
    """The tenant's `x-ratelimit-*` headers as admission left its buckets (None: no quota)."""
    content_chunks: int = 0
    """Content chunks relayed to the client (about one token each): the completion tokens
    charged to the tenant when the backend reported no usage."""
    policy_decision: str | None = None
    """The policy gateway's decision (`allow`, `redact`, `deny`, `filtered`...); None: off."""
    policy_rules: tuple[str, ...] = ()
    """Ids of the policy rules and modules that matched."""
    stream_guard: Guard | None = None
    """The stream policy's watch over this answer, when stream rules are configured (or a
    shadow's tap in front of it, `edge.models.tap`)."""
    judge_refused: bool = False
    """The guard model refused this request while it ran (`race` mode): its cancellation is
    a refusal, not a client going away."""
    ttft: float | None = None
    """TTFT as the edge saw it, seconds (streamed answers)."""

    def mark_responded(self) -> None:
        self.responded = True
