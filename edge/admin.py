"""The admin ASGI app: liveness, readiness, Prometheus metrics and the state of every backend.

Served on its own (plain HTTP) listener, never on the client-facing ones.
- `GET /health`: 200 while the process runs (liveness).
- `GET /ready`: 200 when at least one backend is healthy, else 503 (readiness).
- `GET /metrics`: `generate_latest(registry)` of the process's one registry.
- `GET /backends`: JSON of `registry.snapshot()`, the routing policy, the pool's statistics and
  every isolation domain's circuit breaker (`breakers`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from backends.pool import UpstreamPool
from backends.registry import BackendRegistry
from edge.asgi import Receive, Scope, Send, lifespan
from edge.errors import EdgeError, MethodNotAllowed, RouteNotFound
from edge.routing.base import RoutingPolicy
from edge.routing.breakers import Breakers


class AdminApp:
    def __init__(
        self,
        *,
        registry: CollectorRegistry,
        backends: BackendRegistry,
        pool: UpstreamPool,
        policy: RoutingPolicy,
        breakers: Breakers | None = None,
    ) -> None:
        self.breakers = breakers
        self.registry = registry
        self.backends = backends
        self.pool = pool
        self.policy = policy
        self._routes: dict[str, Callable[[], tuple[int, bytes, bytes]]] = {
            "/health": self._health,
            "/ready": self._ready,
            "/metrics": self._metrics,
            "/backends": self._backends,
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        try:
            handler = self._routes.get(scope["path"])
            if handler is None:
                raise RouteNotFound(f"no admin route {scope['path']}")
            if scope["method"] not in ("GET", "HEAD"):
                raise MethodNotAllowed("admin routes are GET only", headers=((b"allow", b"GET"),))
            status, content_type, body = handler()
        except EdgeError as err:
            status, content_type, body = err.status, b"application/json", err.body()
        headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send(
            {"type": "http.response.body", "body": body if scope["method"] != "HEAD" else b""}
        )

    def _health(self) -> tuple[int, bytes, bytes]:
        return 200, b"application/json", b'{"status":"ok"}'

    def _ready(self) -> tuple[int, bytes, bytes]:
        healthy = sum(1 for b in self.backends.backends if b.healthy)
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
        return 200, b"application/json", _json(body)


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
