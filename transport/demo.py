"""A built-in ASGI app for ``quicedge serve --demo``: no backends, answers what it was handed.

Used to exercise the listeners on their own (interop checks, handshake benchmarks). It is served
only when asked for: a proxy that cannot be built is an error, never this app in its place.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from transport.asgi import ASGIApp, Receive, Scope, Send
from transport.workers import ServedApps


async def demo_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Any path: JSON with the method, path, body size, pid and the transport extensions."""
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    ext = scope.get("extensions") or {}
    body = json.dumps(
        {
            "method": scope["method"],
            "path": scope["path"],
            "body_bytes": size,
            "pid": os.getpid(),
            "transport": ext.get("transport"),
            "early_data": ext.get("early_data"),
            "handshake_wait_s": ext.get("handshake_wait_s"),
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def demo_admin_app(registry: CollectorRegistry) -> ASGIApp:
    """``/health`` and ``/ready`` (200), ``/metrics`` (the process registry)."""

    async def admin(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/metrics":
            body, kind = generate_latest(registry), CONTENT_TYPE_LATEST
            status = 200
        elif scope["path"] in ("/health", "/ready"):
            body, kind, status = b"ok\n", "text/plain", 200
        else:
            body, kind, status = b"not found\n", "text/plain", 404
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", kind.encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return admin


@dataclass(frozen=True)
class DemoApps:
    """`transport.workers.AppFactory` of the echo app and its admin app."""

    async def open(self, registry: CollectorRegistry) -> ServedApps:
        return ServedApps(demo_app, demo_admin_app(registry), _nothing)

    def for_worker(self, index: int) -> DemoApps:
        return self

    def describe(self) -> str:
        return "built-in echo app (--demo)"


async def _nothing() -> None:
    return None
