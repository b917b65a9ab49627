"""The edge's one error family, rendered once, at the ASGI boundary, as OpenAI's error JSON.

Every failure the client may see is an `EdgeError` subclass that carries its HTTP status and
OpenAI error `type`/`code`. Stages raise them; `edge.app` catches the family in exactly one place
and renders `{"error": {"message", "type", "param", "code"}}`. Upstream exceptions
(`backends.errors`) are mapped into the family where they enter the app (`from_upstream`).
"""

from __future__ import annotations

import json
from typing import ClassVar

from backends.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamPoolBusy,
    UpstreamProtocolError,
    UpstreamResponseTooLarge,
    UpstreamTimeout,
)

JSON_HEADERS: tuple[tuple[bytes, bytes], ...] = ((b"content-type", b"application/json"),)

NOT_RETRYABLE = frozenset({"loop_detected", "tier_not_served"})
"""Codes of 5xx answers that a retry cannot change (the edges' or the fleet's configuration
causes them): they carry `x-should-retry: false`, which the OpenAI SDKs obey, where they
would retry any other 5xx (twice, by default)."""
_NO_RETRY = (b"x-should-retry", b"false")


class EdgeError(Exception):
    """Base: a failure with a wire status. Subclasses set the class attributes."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    code: ClassVar[str | None] = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.instance_code = code if code is not None else self.code
        self.extra_headers = headers

    def payload(self) -> dict[str, object]:
        """The OpenAI error object: `{"error": {...}}`."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.instance_code,
            }
        }

    def body(self) -> bytes:
        return json.dumps(self.payload(), separators=(",", ":")).encode()

    def headers(
        self, *extra: tuple[bytes, bytes], length: int | None = None
    ) -> list[tuple[bytes, bytes]]:
        """The response headers; `length` is the body's, when the caller has encoded it."""
        body_len = b"%d" % (len(self.body()) if length is None else length)
        headers = [*JSON_HEADERS, (b"content-length", body_len), *self.extra_headers, *extra]
        if self.instance_code in NOT_RETRYABLE:
            headers.append(_NO_RETRY)
        return headers


class InvalidRequest(EdgeError):
    """400: the request is malformed or misses a required field."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class InvalidJSON(InvalidRequest):
    """400: the body is not valid JSON (or not a JSON object)."""

    code = "invalid_json"


class OriginNotAllowed(EdgeError):
    """403: a CORS preflight from an origin that `[cors] origins` does not list."""

    status = 403
    type = "invalid_request_error"
    code = "origin_not_allowed"


class RouteNotFound(EdgeError):
    """404: no such route on this proxy."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(EdgeError):
    """405: the route exists but not for this method (headers carry `allow`)."""

    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLarge(EdgeError):
    """413: the request body exceeds `max_body_bytes`."""

    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class UnsupportedMediaType(EdgeError):
    """415: inference routes accept `application/json` only."""

    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class ModelNotFound(EdgeError):
    """404 `model_not_found`, as SGLang and OpenAI answer for an unknown model id."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class TooEarly(EdgeError):
    """425 (RFC 8470): the transport refuses this route in 0-RTT; kept here for one family."""

    status = 425
    type = "invalid_request_error"
    code = "too_early"


class TooManyRequests(EdgeError):
    """429: a rate limit or admission bound refused the request."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class Unauthorized(EdgeError):
    """401 `invalid_api_key`: no API key where one is required, or a key that is not known."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers=((b"www-authenticate", b"Bearer"),))


class Overloaded(EdgeError):
    """503 `overloaded`: admission could not place the request within its deadline
    (headers carry `retry-after`)."""

    status = 503
    type = "server_error"
    code = "overloaded"


class BadGateway(EdgeError):
    """502: the backend failed (connection died, garbage, or refused after all retries)."""

    status = 502
    type = "server_error"
    code = "bad_gateway"


class NoHealthyBackend(EdgeError):
    """503: no backend can take the request (all unhealthy, ejected or at their cap)."""

    status = 503
    type = "server_error"
    code = "no_healthy_backend"


class CircuitOpen(NoHealthyBackend):
    """503: backends are up, but every one that serves the request's tier is in an isolation
    domain whose circuit breaker is open (`edge.routing.breakers`); carries Retry-After."""

    code = "circuit_open"


class GatewayTimeout(EdgeError):
    """504: the backend did not answer within the first-byte or between-chunk timeout."""

    status = 504
    type = "server_error"
    code = "upstream_timeout"


class LoopDetected(EdgeError):
    """508 (RFC 5842): the request came back to an edge it had passed (its `Via` names the
    edge), or has passed too many: a backend of some edge is that edge, or leads back to it."""

    status = 508
    type = "server_error"
    code = "loop_detected"


class InternalError(EdgeError):
    """500: a fault in the edge itself; logged with its traceback, and the client gets the
    request id to quote instead of an empty answer."""

    status = 500
    type = "server_error"
    code = "internal_error"


POOL_BUSY_RETRY_AFTER = b"1"
"""Seconds a client is asked to wait after a 503 `pool_busy` (RFC 9110 §10.2.3): connections
come free as streams end, so a short wait is enough."""


class AdminUnauthorized(Unauthorized):
    """401 `invalid_admin_token`: an admin action without the admin token."""

    code = "invalid_admin_token"


class ConversationNotFound(EdgeError):
    """404: a stored conversation (or response) that does not exist, expired, or is another
    tenant's; the three look the same, so an id leaks nothing."""

    status = 404
    type = "invalid_request_error"
    code = "conversation_not_found"


class ConversationBusy(EdgeError):
    """409: another turn of the same conversation is in progress."""

    status = 409
    type = "invalid_request_error"
    code = "conversation_busy"


class StateUnavailable(EdgeError):
    """503: the state store (Redis) did not answer in time; stateless requests go on."""

    status = 503
    type = "server_error"
    code = "state_unavailable"


class PolicyRefused(EdgeError):
    """403 `policy_violation`: a policy rule or module refused the request. The message and the
    `x-quicedge-policy-rule` header name the rule, never the text that matched."""

    status = 403
    type = "invalid_request_error"
    code = "policy_violation"

    def __init__(
        self, rule: str, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(
            message, param=param, code=code, headers=((b"x-quicedge-policy-rule", rule.encode()),)
        )
        self.rule = rule


class PolicyLimit(PolicyRefused):
    """400 `policy_limit`: the request asks for more than its tier allows."""

    status = 400
    code = "policy_limit"


class ModelNotAllowed(PolicyRefused):
    """403 `model_not_allowed`: the tenant may not use this model."""

    code = "model_not_allowed"


class PolicyUnavailable(PolicyRefused):
    """503 `policy_unavailable`: a policy module failed and is configured to fail closed."""

    status = 503
    type = "server_error"
    code = "policy_unavailable"


class StreamRefusal(PolicyRefused):
    """A refused streaming request answered as a well-formed stream: status 200, one chunk with
    `finish_reason: "content_filter"`, then `data: [DONE]` (`[policy] stream_refusal = "sse"`)."""

    status = 200

    def __init__(self, rule: str, message: str, events: bytes) -> None:
        super().__init__(rule, message)
        self.events = events

    def body(self) -> bytes:
        return self.events

    def headers(
        self, *extra: tuple[bytes, bytes], length: int | None = None
    ) -> list[tuple[bytes, bytes]]:
        return [
            (b"content-type", b"text/event-stream"),
            (b"cache-control", b"no-cache"),
            (b"content-length", b"%d" % len(self.events)),
            *self.extra_headers,
            *extra,
        ]


class AuditBacklog(EdgeError):
    """503 `audit_backlog`: the audit log's queue is full and is configured to refuse."""

    status = 503
    type = "server_error"
    code = "audit_backlog"


def from_upstream(exc: UpstreamError, *, expose: bool = False) -> EdgeError:
    """Map a `backends.errors` exception to the client-facing error (the one mapping point).

    The exception's text names the backend's address; it is in the message only with `expose`
    (`[proxy] expose_backend_names`). Otherwise the pool's and the timeouts' own texts keep
    their detail with the address read as "the backend", and the rest (which may quote an OS
    error, address and all) say only what failed."""
    if expose:
        detail = f": {exc}"
    elif isinstance(exc, UpstreamPoolBusy | UpstreamTimeout) and exc.base_url:
        detail = ": " + str(exc).replace(exc.base_url, "the backend")
    else:
        detail = ""
    if isinstance(exc, UpstreamPoolBusy):
        return NoHealthyBackend(
            f"no upstream connection is free{detail}",
            code="pool_busy",
            headers=((b"retry-after", POOL_BUSY_RETRY_AFTER),),
        )
    if isinstance(exc, UpstreamTimeout):
        return GatewayTimeout(f"upstream timed out{detail}")
    if isinstance(exc, UpstreamResponseTooLarge):  # its text names no backend
        # The same request makes as large an answer again (an embeddings batch exactly so): a
        # retry would only have a backend compute it once more.
        return BadGateway(
            f"{exc}: the edge holds no larger non-streamed answer", headers=(_NO_RETRY,)
        )
    if isinstance(exc, UpstreamConnectError):
        return BadGateway(f"could not connect to a backend{detail}")
    if isinstance(exc, UpstreamProtocolError):
        return BadGateway(f"backend connection failed{detail}")
    return BadGateway(f"backend error{detail}")


def stream_error_event(err: EdgeError) -> bytes:
    """An SSE error event then `[DONE]`: how SGLang ends a stream that fails after the 200."""
    return b"data: " + err.body() + b"\n\ndata: [DONE]\n\n"


__all__ = [
    "AdminUnauthorized",
    "AuditBacklog",
    "BadGateway",
    "ConversationBusy",
    "ConversationNotFound",
    "CircuitOpen",
    "EdgeError",
    "GatewayTimeout",
    "InvalidJSON",
    "OriginNotAllowed",
    "InvalidRequest",
    "MethodNotAllowed",
    "ModelNotAllowed",
    "ModelNotFound",
    "NoHealthyBackend",
    "Overloaded",
    "PayloadTooLarge",
    "PolicyLimit",
    "PolicyRefused",
    "PolicyUnavailable",
    "RouteNotFound",
    "StateUnavailable",
    "StreamRefusal",
    "TooEarly",
    "TooManyRequests",
    "Unauthorized",
    "UnsupportedMediaType",
    "from_upstream",
    "stream_error_event",
]
