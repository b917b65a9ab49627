"""The admin ASGI app: liveness, readiness, Prometheus metrics and the state of every backend.

Served on its own (plain HTTP) listener, never on the client-facing ones. With `[proxy]
admin_token_file`, every action (a POST) needs `Authorization: Bearer TOKEN` (`guard_actions`);
with or without it, what a web page makes a browser send is refused (`from_a_web_page`).
- `GET /health`: 200 while the process runs (liveness).
- `GET /ready`: 200 when at least one backend is healthy and not drained, else 503 (readiness).
- `GET /metrics`: `generate_latest(registry)` of the process's one registry.
- `GET /backends`: JSON of `registry.snapshot()`, the routing policy, the pool's statistics,
  every isolation domain's circuit breaker (`breakers`) and, with pre-warming, the shared view
  or the KV-cache events on, their state too.
- `POST /prewarm` `{"text": "...", "backends": ["name", ...]}` (backends optional: all): warm
  that prefix now (`edge.routing.prewarm`); answers with what each backend did.
- `GET /tenants`: every tenant's tier, quotas and requests in flight here, and the admission
  queue; `GET /tenants/{name}`: one, with where its buckets stand now (shared ones from Redis).
- `GET /rollouts`: model pools, aliases and each rollout's state, tests and transitions.
- `POST /rollouts/{model}/promote|pause|rollback|restart`: move a rollout by hand
  (docs/models.md); with several workers every worker takes it (`edge.worker_admin`,
  `x-quicedge-workers: K/N`).
- `POST /config/reload`: read the config again now, as SIGHUP does, and answer what it did
  (outcome, live parts changed, sections waiting for a restart; 400 when refused); every
  worker reloads.
- `POST /backends/{name}/drain|undrain`: hold a backend out of routing for maintenance (its
  requests in flight finish) and let it back; every worker takes it, as above.
"""

from __future__ import annotations

import dataclasses
import hmac
import inspect
import json
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from backends.backend import Backend
from backends.pool import UpstreamPool
from backends.registry import BackendRegistry
from edge.access_log import METHOD_MAX
from edge.admission import Admission
from edge.asgi import ASGIApp, Receive, Scope, Send, lifespan, render_error
from edge.audit import AuditLog
from edge.backend_holds import SharedHolds
from edge.errors import (
    AdminUnauthorized,
    EdgeError,
    InvalidJSON,
    InvalidRequest,
    MethodNotAllowed,
    OriginNotAllowed,
    PayloadTooLarge,
    RouteNotFound,
)
from edge.models import Models
from edge.routing.base import RoutingPolicy
from edge.routing.breakers import Breakers
from edge.routing.fleet import FleetServices
from edge.tracing import cut

MAX_PREWARM_BODY = 8 * 1024 * 1024

REFUSED_RECORD_GAP_S = 0.1
"""The least time between two audit lines of refused admin actions."""

Answer = tuple[int, bytes, bytes]
"""An admin route's status, content type and body."""

_ROLLOUT_ACTIONS = ("promote", "pause", "rollback", "restart")


PATH_MAX = 512
"""Characters of a refused call's path kept in its audit event."""

PROBES = frozenset({"/health", "/ready"})
"""Reads that never need the admin token: the orchestrator's probes."""


def from_a_web_page(method: str, headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a script or form of some web page made this request, rather than curl, a
    scraper, an orchestrator or an operator typing the URL.

    A page on any origin can make a browser POST a form to `127.0.0.1:9901` without a CORS
    preflight (a "simple" request: the answer is opaque to the page, but the drain or reload is
    done), and a DNS-rebinding page can read the admin answers as its own origin. Browsers mark
    what a page sends: `Origin` on every POST, and `Sec-Fetch-Site` on every request (`none`
    only for what the user typed or bookmarked). No tool that is meant to call the admin port
    sends either, so an action that carries them, and a read that a page fetched (not a
    navigation, which leaves the answer to the user), are refused. So is a navigation from the
    port's own origin (`same-origin`): the port serves no page, so only a DNS-rebinding page is
    that origin, and it can read what it loads in a frame or a window it opened."""
    site = mode = None
    origin = False
    for key, value in headers:
        key = key.lower()
        if key == b"sec-fetch-site":
            site = value.strip().lower()
        elif key == b"sec-fetch-mode":
            mode = value.strip().lower()
        elif key == b"origin":
            origin = True
    if method not in ("GET", "HEAD"):
        return origin or (site is not None and site != b"none")
    return site == b"same-origin" or (site not in (None, b"none") and mode != b"navigate")


def guard_actions(
    app: ASGIApp, token: bytes | None, audit: AuditLog | None = None, *, reads: bool = False
) -> ASGIApp:
    """`app` whose actions (POST) need `Authorization: Bearer TOKEN` (401 otherwise, recorded in
    `audit` as `event: admin_refused`); reads pass, or with `reads` all but the probes need it
    too. With or without a token, what a web page sent (`from_a_web_page`) is refused with 403
    `browser_request`: without a token, any page a browser on the admin network opens could
    otherwise drain every backend. Wraps the outermost admin app, so that an action is refused
    before any worker is asked to take it (their private sockets are not the listener's)."""
    if token is None:
        return _refuse_pages(app)
    expected = token
    last_recorded = [-1.0]

    def guarded_request(scope: Scope) -> bool:
        if scope["method"] not in ("GET", "HEAD"):
            return True
        return reads and scope["path"] not in PROBES

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and guarded_request(scope):
            given = [v for k, v in scope["headers"] if k.lower() == b"authorization"]
            # one header or none: with two, which counts would be the listener's choice
            scheme, _, token = (given[0].strip() if len(given) == 1 else b"").partition(b" ")
            # the scheme is case-insensitive (RFC 9110, 11.1), the token is compared in full
            if not hmac.compare_digest(token, expected) or scheme.lower() != b"bearer":
                # At most ten a second: a flood of refused calls must not fill the audit queue
                # that requests need (with `when_full = "refuse"` they would be turned away).
                now = time.monotonic()
                if audit is not None and now - last_recorded[0] >= REFUSED_RECORD_GAP_S:
                    last_recorded[0] = now
                    client = scope.get("client") or ("-", 0)
                    # the client's own words, as long as its request head allows: cut
                    method, path = cut(scope["method"], METHOD_MAX), cut(scope["path"], PATH_MAX)
                    audit.record_event("admin_refused", method=method, path=path,
                                       client=client[0])  # fmt: skip
                what = "admin actions" if scope["method"] not in ("GET", "HEAD") else "admin reads"
                await render_error(send, AdminUnauthorized(
                    f"{what} need `Authorization: Bearer <token>` (proxy.admin_token_file)"
                ))  # fmt: skip
                return
        await app(scope, receive, send)

    return _refuse_pages(guarded)


def _refuse_pages(app: ASGIApp) -> ASGIApp:
    """`app` behind the refusal of `from_a_web_page` (outermost: before the token is asked)."""

    async def no_pages(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and from_a_web_page(scope["method"], scope["headers"]):
            await render_error(send, OriginNotAllowed(
                "the admin port does not answer requests made by web pages (Origin or "
                "Sec-Fetch-Site); call it with curl or another HTTP client",
                code="browser_request",
            ))  # fmt: skip
            return
        await app(scope, receive, send)

    return no_pages


class AdminApp:
    def __init__(
        self,
        *,
        registry: CollectorRegistry,
        backends: BackendRegistry,
        pool: UpstreamPool,
        policy: RoutingPolicy,
        breakers: Breakers | None = None,
        fleet: FleetServices | None = None,
        models: Models | None = None,
        audit: AuditLog | None = None,
        holds: SharedHolds | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.admission = admission
        """Tenants, their quotas and requests in flight (`GET /tenants`)."""
        self.reload_config: Callable[[], Awaitable[dict[str, Any]]] | None = None
        """Reload the config and say what it did (`POST /config/reload`); `edge.serve` sets
        it once the process's reloader exists."""
        self.audit = audit
        """Where each action taken is recorded (`event: admin`; a `/prewarm` too, its target
        the backends named, `*` for all), when the audit log is on."""
        self.holds = holds
        """Where drains are shared with every edge (`share_drains`), when they are."""
        self.breakers = breakers
        self.fleet = fleet
        self.models = models
        self.registry = registry
        self.backends = backends
        self.pool = pool
        self.policy = policy
        self._routes: dict[str, Callable[[], tuple[int, bytes, bytes]]] = {
            "/health": self._health,
            "/ready": self._ready,
            "/metrics": self._metrics,
            "/backends": self._backends,
            "/rollouts": self._rollouts,
            "/tenants": self._tenants,
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["path"] == "/prewarm":
            await self._prewarm(scope, receive, send)
            return
        try:
            path: str = scope["path"]
            handler: Callable[[], Answer | Awaitable[Answer]] | None = self._routes.get(path)
            if path == "/config/reload":
                if scope["method"] != "POST":
                    raise MethodNotAllowed(
                        "/config/reload is POST only", headers=((b"allow", b"POST"),)
                    )
                handler = self._config_reload()
            elif handler is None and path.startswith("/tenants/"):
                if scope["method"] not in ("GET", "HEAD"):
                    raise MethodNotAllowed(
                        "admin routes are GET only", headers=((b"allow", b"GET"),)
                    )
                handler = partial(self._tenant, path[len("/tenants/") :])
            elif handler is None and path.startswith(("/rollouts/", "/backends/")):
                if scope["method"] != "POST":
                    raise MethodNotAllowed(
                        "admin actions are POST only", headers=((b"allow", b"POST"),)
                    )
                if path.startswith("/rollouts/"):
                    handler = self._rollout_action(path)
                else:
                    handler = self._backend_action(path)
            elif handler is None:
                raise RouteNotFound(f"no admin route {scope['path']}")
            elif scope["method"] not in ("GET", "HEAD"):
                raise MethodNotAllowed("admin routes are GET only", headers=((b"allow", b"GET"),))
            result = handler()
            if inspect.isawaitable(result):  # an action that waits (a shared drain)
                result = await result
            assert not inspect.isawaitable(result)
            status, content_type, body = result
            extra: tuple[tuple[bytes, bytes], ...] = ()
        except EdgeError as err:
            status, content_type, body = err.status, b"application/json", err.body()
            extra = err.extra_headers  # `allow` of a 405
        headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body)),
                   *extra]  # fmt: skip
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send(
            {"type": "http.response.body", "body": body if scope["method"] != "HEAD" else b""}
        )

    def _audited(self, action: str, target: str) -> None:
        if self.audit is not None:
            self.audit.record_event("admin", action=action, target=target)

    def _health(self) -> tuple[int, bytes, bytes]:
        return 200, b"application/json", b'{"status":"ok"}'

    def _ready(self) -> tuple[int, bytes, bytes]:
        healthy = sum(1 for b in self.backends.backends if b.healthy and not b.held)
        body = {"ready": healthy > 0, "healthy_backends": healthy,
                "backends": len(self.backends.backends)}  # fmt: skip
        return (200 if healthy else 503), b"application/json", _json(body)

    def _metrics(self) -> tuple[int, bytes, bytes]:
        return 200, CONTENT_TYPE_LATEST.encode(), generate_latest(self.registry)

    def _backends(self) -> tuple[int, bytes, bytes]:
        stats = self.pool.stats()
        pool = dataclasses.asdict(stats)
        pool["reuse_ratio"] = round(stats.reuse_ratio, 4)
        body = {"policy": self.policy.name, "backends": self.backends.snapshot(), "pool": pool}
        if self.breakers is not None:
            body["breakers"] = self.breakers.snapshot()
        if self.fleet is not None:
            body |= self.fleet.snapshot()
        return 200, b"application/json", _json(body)

    def _config_reload(self) -> Callable[[], Awaitable[Answer]]:
        """`POST /config/reload`: read the config again now, as SIGHUP does, and answer what
        the reload did (400 when the file was refused)."""
        reload = self.reload_config
        if reload is None:
            raise RouteNotFound("reloads need the settings' source (quicedge serve)")

        async def act() -> Answer:
            report = await reload()
            self._audited("config.reload", str(report["outcome"]))
            status = 400 if report["outcome"] == "refused" else 200
            return status, b"application/json", _json(report)

        return act

    def _tenants(self) -> Answer:
        if self.admission is None:
            raise RouteNotFound("no admission stage in this process")
        return 200, b"application/json", _json(self.admission.tenants())

    async def _tenant(self, name: str) -> Answer:
        found = await self.admission.tenant(name) if self.admission is not None else None
        if found is None:
            raise RouteNotFound(f"no tenant {name!r}; GET /tenants lists them")
        return 200, b"application/json", _json(found)

    def _rollouts(self) -> tuple[int, bytes, bytes]:
        body = self.models.snapshot() if self.models is not None else {"rollouts": []}
        return 200, b"application/json", _json(body)

    def _backend_action(self, path: str) -> Callable[[], Awaitable[Answer]]:
        """`/backends/{name}/drain` and `/undrain`: hold a backend out of routing (its
        requests in flight finish) and let it back, for maintenance."""
        name, _, action = path[len("/backends/") :].rpartition("/")
        backend = self.backends.get(name)
        if backend is None:
            raise RouteNotFound(f"no backend {name!r}; GET /backends lists them")
        if action not in ("drain", "undrain"):
            raise RouteNotFound(f"unknown backend action {action!r}; use drain or undrain")

        async def act() -> Answer:
            if self.holds is not None:
                await self.holds.set(name, action == "drain")  # 503 when Redis did not take it
            self.backends.hold(name, action == "drain")
            self._audited(f"backend.{action}", name)
            snapshot = next((b for b in self.backends.snapshot() if b["name"] == name), None)
            if snapshot is None:  # a reload or discovery took it out while Redis answered
                raise RouteNotFound(
                    f"backend {name!r} left the fleet while it was being {action}ed"
                )
            return 200, b"application/json", _json(snapshot)

        return act

    def _rollout_action(self, path: str) -> Callable[[], Awaitable[Answer]]:
        """`/rollouts/{model}/{action}`; the model may contain slashes (`org/name`)."""
        model, _, action = path[len("/rollouts/") :].rpartition("/")
        models = self.models
        if models is None or model not in models.ramps:
            raise RouteNotFound(f"no rollout for model {model!r}")
        if action not in _ROLLOUT_ACTIONS:
            raise RouteNotFound(
                f"unknown rollout action {action!r}; use promote, pause, rollback or restart"
            )

        async def act() -> Answer:
            if action == "restart":
                ramp = await models.restart(model)
            else:
                ramp = models.ramps[model]
                try:
                    getattr(ramp, action)("operator")
                except ValueError as exc:
                    raise InvalidRequest(str(exc), code="invalid_state") from None
            self._audited(f"rollout.{action}", model)
            return 200, b"application/json", _json(ramp.snapshot())

        return act

    async def _prewarm(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if scope["method"] != "POST":
                raise MethodNotAllowed("/prewarm is POST only", headers=((b"allow", b"POST"),))
            service = self.fleet.prewarm if self.fleet is not None else None
            if service is None:
                raise RouteNotFound("pre-warming is off (enable [prewarm])")
            raw = await _read_body(receive)
            try:  # orjson: nesting bounded (json's recursion was a 500), UTF-8 strict
                request = orjson.loads(raw)
            except orjson.JSONDecodeError:
                raise InvalidJSON("the body is not valid JSON") from None
            if not isinstance(request, dict):
                raise InvalidJSON("the body must be a JSON object")
            text = request.get("text")
            if not isinstance(text, str) or not text:
                raise InvalidRequest("'text' must be a non-empty string", param="text")
            names = request.get("backends")
            chosen = None
            if names is not None:
                if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                    raise InvalidRequest("'backends' must be a list of names", param="backends")
                by_name: dict[str, Backend] = {}  # each once: a name given again is no more work
                for name in names:
                    backend = self.backends.get(name)
                    if backend is None:
                        raise InvalidRequest(f"no backend named {name!r}", param="backends")
                    by_name[name] = backend
                chosen = list(by_name.values())
            results = await service.warm_text(text, chosen)
            self._audited("prewarm", "*" if chosen is None else " ".join(b.name for b in chosen))
            status, body = 200, _json({"chars": len(text), "backends": results})
            extra: tuple[tuple[bytes, bytes], ...] = ()
        except EdgeError as err:
            status, body = err.status, err.body()
            extra = err.extra_headers  # `allow` of a 405
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                   *extra]  # fmt: skip
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def _read_body(receive: Receive) -> bytes:
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise InvalidRequest("the client went away before its body arrived")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_PREWARM_BODY:
            raise PayloadTooLarge(f"a /prewarm body is at most {MAX_PREWARM_BODY} bytes")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
