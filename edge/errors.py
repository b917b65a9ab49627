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
    UpstreamTimeout,
)

JSON_HEADERS: tuple[tuple[bytes, bytes], ...] = ((b"content-type", b"application/json"),)


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

    def headers(self, *extra: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
        body_len = str(len(self.body())).encode()
        return [*JSON_HEADERS, (b"content-length", body_len), *self.extra_headers, *extra]


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


class GatewayTimeout(EdgeError):
    """504: the backend did not answer within the first-byte or between-chunk timeout."""

    status = 504
    type = "server_error"
    code = "upstream_timeout"


POOL_BUSY_RETRY_AFTER = b"1"
"""Seconds a client is asked to wait after a 503 `pool_busy` (RFC 9110 §10.2.3): connections
come free as streams end, so a short wait is enough."""


def from_upstream(exc: UpstreamError) -> EdgeError:
    """Map a `backends.errors` exception to the client-facing error (the one mapping point)."""
    if isinstance(exc, UpstreamPoolBusy):
        return NoHealthyBackend(
            f"no upstream connection is free: {exc}",
            code="pool_busy",
            headers=((b"retry-after", POOL_BUSY_RETRY_AFTER),),
        )
    if isinstance(exc, UpstreamTimeout):
        return GatewayTimeout(f"upstream timed out: {exc}")
    if isinstance(exc, UpstreamConnectError):
        return BadGateway(f"could not connect to a backend: {exc}")
    if isinstance(exc, UpstreamProtocolError):
        return BadGateway(f"backend connection failed: {exc}")
    return BadGateway(f"backend error: {exc}")


def stream_error_event(err: EdgeError) -> bytes:
    """An SSE error event then `[DONE]`: how SGLang ends a stream that fails after the 200."""
    return b"data: " + err.body() + b"\n\ndata: [DONE]\n\n"


__all__ = [
    "BadGateway",
    "EdgeError",
    "GatewayTimeout",
    "InvalidJSON",
    "OriginNotAllowed",
    "InvalidRequest",
    "MethodNotAllowed",
    "ModelNotFound",
    "NoHealthyBackend",
    "PayloadTooLarge",
    "RouteNotFound",
    "TooEarly",
    "TooManyRequests",
    "UnsupportedMediaType",
    "from_upstream",
    "stream_error_event",
]
