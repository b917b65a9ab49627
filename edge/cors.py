"""CORS for browsers calling the edge from another origin (the Fetch standard's CORS protocol).

Off by default (no `origins`). When on, `CorsApp` wraps the proxy's ASGI app:

- a preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`) on a proxied route
  from an allowed origin is answered by the edge itself: 204 with `Access-Control-Allow-Origin`,
  `-Allow-Methods` (the route's), `-Allow-Headers`, `-Max-Age`, `Vary` and `x-request-id` (the
  client's when well-formed, else a new one); it never reaches a backend. A preflight from
  another origin gets 403 in OpenAI's error shape (with the same `x-request-id`), one for a path
  the edge does not serve goes on to the app (404).
- every other response to an allowed origin gets `Access-Control-Allow-Origin`,
  `-Expose-Headers` (so a page can read `x-request-id`), `Vary: Origin` and, when enabled,
  `Timing-Allow-Origin` (so the page's Resource Timing shows the real TTFT, not zeros).

A request without `Origin` (any non-browser client) costs one scan of its headers; with CORS off
the app is not wrapped at all. The head is rewritten where it is sent: the ASGI `send` and, on
our own listeners, the body writer that sends the head from the upstream read callback.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from edge import settings
from edge.asgi import ASGIApp, Message, Receive, Scope, Send, render_error
from edge.errors import InvalidRequest, OriginNotAllowed
from edge.stages.forward import new_request_id, request_id_from

DEFAULT_HEADERS = [
    "authorization", "content-type", "user-agent", "x-request-id", "x-session-id", "traceparent",
    "tracestate", "openai-organization", "openai-project",
]  # fmt: skip
"""What the OpenAI SDKs and tracing send from a browser (the `x-stainless-*` ones are matched
by prefix). openai-node sets `User-Agent` too, which Firefox and Safari send and ask for in the
preflight (Chromium drops it); without it, the preflight's answer refused the SDK's calls."""
DEFAULT_EXPOSE = [
    "x-request-id", "x-quicedge-backend", "retry-after", "retry-after-ms", "x-should-retry",
    *(f"x-ratelimit-{what}-{bucket}" for bucket in ("requests", "tokens")
      for what in ("limit", "remaining", "reset")),
]  # fmt: skip
"""What a page may read: the request id, the backend, when and whether to retry (the OpenAI
SDKs read `x-should-retry`, `edge.errors.NOT_RETRYABLE`), and the rate-limit headers
(`edge.admission.headers`)."""


@dataclass(slots=True)
class CorsConfig:
    """Cross-origin requests from browsers (`[cors]`)."""

    origins: list[str] = field(default_factory=list)
    """Origins allowed to call the edge, exactly as a browser sends them
    (`https://app.example.com`), or `*` for any; empty (the default): CORS off."""
    headers: list[str] = field(default_factory=lambda: list(DEFAULT_HEADERS))
    """Request headers a page may send (case-insensitive); `*` allows whatever the preflight
    asks for (the Fetch standard's `*` would not cover `Authorization`)."""
    expose_headers: list[str] = field(default_factory=lambda: list(DEFAULT_EXPOSE))
    """Response headers a page may read besides the CORS-safelisted ones."""
    max_age: int = 600
    """How long a browser may cache a preflight's answer, s (Chromium caps it at 7200)."""
    allow_credentials: bool = False
    """Allow cookies and HTTP authentication from the page (`credentials: "include"`); needs
    named origins, not `*`."""
    timing_allow_origin: bool = True
    """Send `Timing-Allow-Origin` to allowed origins, so Resource Timing shows the page the
    edge's real timings (TTFT included)."""

    def validate(self) -> None:
        for origin in self.origins:
            if origin != "*" and (
                not origin.startswith(("http://", "https://")) or origin.endswith("/")
            ):
                raise ValueError(
                    f"cors.origins: {origin!r} must be scheme://host[:port] without a path, or *"
                )
        if self.allow_credentials and "*" in self.origins:
            raise ValueError("cors.allow_credentials: needs named origins, not *")
        if self.max_age < 0:
            raise ValueError(f"cors.max_age: must be >= 0, got {self.max_age}")

    @property
    def enabled(self) -> bool:
        return bool(self.origins)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> CorsConfig:
        return settings.from_mapping(cls, values, "cors")


class CorsApp:
    """`app` with CORS answered and added per `config` (which must be enabled)."""

    def __init__(
        self,
        app: ASGIApp,
        config: CorsConfig,
        methods_for: Callable[[str], tuple[str, ...] | None],
    ) -> None:
        self.app = app
        self.methods_for = methods_for
        self.configure(config)

    def configure(self, config: CorsConfig) -> None:
        """Take `config` (enabled) for the requests that come next: a reload's new origins,
        headers and lifetimes."""
        self.any_origin = "*" in config.origins
        self.origins = frozenset(o.encode("latin-1") for o in config.origins if o != "*")
        self.any_header = "*" in config.headers
        self.allowed_headers = frozenset(h.lower() for h in config.headers if h != "*")
        self.allow_headers_value = ", ".join(sorted(self.allowed_headers)).encode()
        self.credentials = config.allow_credentials
        self.max_age = str(config.max_age).encode()
        common: list[tuple[bytes, bytes]] = [(b"vary", b"Origin")]
        if config.allow_credentials:
            common.append((b"access-control-allow-credentials", b"true"))
        self._common = common
        self._response_extra = list(common)
        if config.expose_headers:
            value = ", ".join(h.lower() for h in config.expose_headers).encode()
            self._response_extra.append((b"access-control-expose-headers", value))
        self._timing = config.timing_allow_origin

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        origin = request_method = request_headers = None
        for name, value in scope["headers"]:
            if name == b"origin":
                origin = value
            elif name == b"access-control-request-method":
                request_method = value
            elif name == b"access-control-request-headers":
                request_headers = value
        if origin is None:
            await self.app(scope, receive, send)
            return
        allowed = self._allowed(origin)
        if scope["method"] == "OPTIONS" and request_method is not None:
            methods = self.methods_for(scope["path"])
            if methods is not None:
                rid = next((v for n, v in scope["headers"] if n == b"x-request-id"), None)
                await self._preflight(send, allowed, methods, request_headers, rid)
                return
        if allowed is None:
            await self.app(scope, receive, send)
            return
        extra = self._for_response(allowed)
        ext = scope.get("extensions")
        writer = ext.get("quicedge.body_writer") if ext else None
        if ext is not None and writer is not None:
            scope = {**scope, "extensions": {**ext, "quicedge.body_writer": _Writer(writer, extra)}}
        await self.app(scope, receive, _with_headers(send, extra))

    def _allowed(self, origin: bytes) -> bytes | None:
        """The `Access-Control-Allow-Origin` value for `origin`, or None if not allowed."""
        if origin in self.origins:
            return origin
        if self.any_origin:
            return origin if self.credentials else b"*"
        return None

    def _for_response(self, allowed: bytes) -> list[tuple[bytes, bytes]]:
        extra = [(b"access-control-allow-origin", allowed), *self._response_extra]
        if self._timing:
            extra.append((b"timing-allow-origin", allowed))
        return extra

    async def _preflight(
        self,
        send: Send,
        allowed: bytes | None,
        methods: tuple[str, ...],
        request_headers: bytes | None,
        request_id: bytes | None,
    ) -> None:
        # The client's `x-request-id` when well-formed, else a new one, as the app's answers.
        try:
            rid = request_id_from(request_id).encode()
        except InvalidRequest:
            rid = new_request_id().encode()
        if allowed is None:
            err = OriginNotAllowed("this origin may not call the edge")
            err.extra_headers = (*err.extra_headers, (b"x-request-id", rid))
            await render_error(send, err)
            return
        headers = [
            (b"x-request-id", rid),
            (b"access-control-allow-origin", allowed),
            (b"access-control-allow-methods", ", ".join(methods).encode()),
            (b"access-control-max-age", self.max_age),
            *self._common,
        ]  # no content-length: a 204 must not carry one (RFC 9110 §8.6)
        asked = self._allow_headers(request_headers)
        if asked:
            headers.append((b"access-control-allow-headers", asked))
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _allow_headers(self, requested: bytes | None) -> bytes:
        """What to allow of the preflight's `Access-Control-Request-Headers`: all of it with
        `*`, else the configured list (the browser then refuses whatever is not in it)."""
        if requested is None:
            return self.allow_headers_value
        if self.any_header:
            return requested.lower()
        names = [n.strip().lower() for n in requested.split(b",") if n.strip()]
        if all(n.decode("latin-1") in self.allowed_headers or n.startswith(b"x-stainless-")
               for n in names):  # fmt: skip
            return b", ".join(names)
        return self.allow_headers_value


def _with_headers(send: Send, extra: list[tuple[bytes, bytes]]) -> Send:
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *extra]}
        await send(message)

    return sending


class _Writer:
    """A body writer that adds the CORS headers to the head; the body goes straight through."""

    def __init__(self, inner: Any, extra: list[tuple[bytes, bytes]]) -> None:
        self._inner = inner
        self._extra = extra
        self.write_body = inner.write_body
        self.drained = inner.drained

    def write_head(self, start: Message, body: bytes = b"", more: bool = True) -> bool:
        start = {**start, "headers": [*start.get("headers", ()), *self._extra]}
        return bool(self._inner.write_head(start, body, more))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def wrap(
    app: ASGIApp, config: CorsConfig, methods_for: Callable[[str], tuple[str, ...] | None]
) -> ASGIApp:
    """`app` itself when CORS is off (no cost), else `CorsApp`."""
    return CorsApp(app, config, methods_for) if config.enabled else app


__all__ = ["CorsApp", "CorsConfig", "wrap"]
