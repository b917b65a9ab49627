"""Wiring: proxy flags and config, and the objects one edge process runs (used by `edge.serve`).

`add_arguments` adds the proxy flags to the serve parser; `config_from` merges them over the TOML
`[proxy]` table (command line wins, then TOML, then the `ProxyConfig` defaults); `build` makes the
pool, the backend registry, the routing policy, telemetry and the two ASGI apps.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from prometheus_client import CollectorRegistry

from backends.pool import UpstreamPool
from backends.registry import Backend, BackendRegistry, HealthConfig
from edge.admin import AdminApp
from edge.admission import Admission, AdmissionSettings
from edge.app import ProxyApp
from edge.asgi import ASGIApp
from edge.config import ProxyConfig
from edge.models import ModelCatalog
from edge.routing.base import RoutingPolicy, make_policy
from edge.telemetry import FleetCollector, Metrics, Tracer, TracingSetup, tracer_from_env

log = logging.getLogger(__name__)

# flag → (ProxyConfig field, type, help). Defaults are None so that TOML values show through.
_FLAGS: tuple[tuple[str, str, Any, str], ...] = (
    ("--policy", "policy", str, "routing policy: round_robin random least_load power_of_two "
     "cache_aware ttft (default ttft)"),
    ("--connect-timeout", "connect_timeout", float, "backend TCP connect timeout, s (2)"),
    ("--first-byte-timeout", "first_byte_timeout", float,
     "request sent to response headers, s (120)"),
    ("--chunk-timeout", "chunk_timeout", float, "longest gap between streamed chunks, s (60)"),
    ("--max-body", "max_body_bytes", int, "largest request body, bytes (8 MiB); 413 above"),
    ("--retries", "max_retries", int, "extra attempts on other backends before any byte was "
     "sent to the client (2)"),
    ("--health-interval", "health_interval", float, "active /health check period, s (2)"),
    ("--health-timeout", "health_timeout", float, "one /health check's timeout, s (1)"),
    ("--health-failures", "health_failure_threshold", int,
     "failed checks that mark a backend unhealthy (3)"),
    ("--health-successes", "health_success_threshold", int,
     "passed checks that mark it healthy again (2)"),
    ("--loads-interval", "loads_interval", float, "/v1/loads polling period, s (1)"),
    ("--eject-after", "eject_after_failures", int,
     "consecutive connect failures/5xx that eject a backend (5)"),
    ("--eject-base", "eject_base", float, "first ejection, s; doubles on repeats (1)"),
    ("--eject-max", "eject_max", float, "longest ejection, s (30)"),
    ("--pool-size", "pool_max_connections", int, "keep-alive connections per backend (128)"),
    ("--pool-warm", "pool_warm_connections", int, "connections opened per backend at start (8)"),
    ("--pool-idle-timeout", "pool_idle_timeout", float, "idle upstream connection lifetime, s"),
    ("--max-concurrency", "max_concurrency_per_backend", int,
     "requests in flight per backend (no cap)"),
    ("--degraded-ttft-p99", "degraded_ttft_p99", float, "TTFT p99 (s) that marks a backend "
     "degraded (off)"),
    ("--degraded-token-usage", "degraded_token_usage", float,
     "KV usage 0..1 that marks a backend degraded (0.95)"),
    ("--degraded-queue", "degraded_queue", int, "waiting requests that mark a backend degraded"),
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The proxy flags. `--backend` repeats; every flag also has a `[proxy]` TOML key."""
    group = parser.add_argument_group("proxy")
    group.add_argument(
        "--backend",
        dest="backends",
        action="append",
        metavar="URL",
        default=None,
        help="SGLang server base URL, e.g. http://127.0.0.1:30000 (repeat for several)",
    )
    for flag, dest, kind, text in _FLAGS:
        group.add_argument(flag, dest=dest, type=kind, default=None, help=text)
    group.add_argument(
        "--tracing",
        dest="tracing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="OpenTelemetry spans per request stage (also on when OTEL_TRACES_EXPORTER is set)",
    )


def config_from(args: argparse.Namespace, toml: Mapping[str, Any]) -> ProxyConfig:
    """The proxy settings: `[proxy]` table of the parsed TOML document, overridden by flags.

    Raises ValueError with the setting's name for unknown keys and bad values.
    """
    section = toml.get("proxy", {})
    if not isinstance(section, Mapping):
        raise ValueError("config: [proxy] must be a table")
    values = dict(section)
    for f in fields(ProxyConfig):
        flag_value = getattr(args, f.name, None)
        if flag_value is not None:
            values[f.name] = flag_value
    config = ProxyConfig.from_mapping(values).validate()
    config.admission = AdmissionSettings.from_toml(toml)
    return config


@dataclass(eq=False)
class Wiring:
    """Everything one edge process runs; `edge.serve` serves `app` and `admin_app`."""

    app: ASGIApp
    admin_app: ASGIApp
    config: ProxyConfig
    pool: UpstreamPool
    registry: BackendRegistry
    policy: RoutingPolicy
    metrics: Metrics
    catalog: ModelCatalog
    tracing: TracingSetup
    admission: Admission
    _aborts: set[asyncio.Task[Any]] = field(default_factory=set)
    _clients: dict[str, Any] = field(default_factory=dict)

    async def start(self) -> None:
        """Pre-warm pools, start health checks and load polling, learn the fleet's models."""
        await self.registry.start()
        await self.catalog.refresh()

    async def aclose(self) -> None:
        """Stop checks, let in-progress aborts finish briefly, close pools, flush spans."""
        await self.registry.aclose()
        if self._aborts:
            await asyncio.wait(set(self._aborts), timeout=1.0)
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            with contextlib.suppress(Exception):
                await client.aclose()
        await self.pool.aclose()
        await self.admission.aclose()
        self.tracing.shutdown()

    def abort(self, backend: Backend, rid: str) -> None:
        """Fire `/abort_request {rid}` at the backend without waiting for it (never raises)."""
        task = asyncio.ensure_future(self._abort(backend, rid))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, backend: Backend, rid: str) -> None:
        try:
            client = self._clients.get(backend.url)
            if client is None:
                from backends.sglang import SGLangClient

                client = self._clients[backend.url] = SGLangClient(
                    backend.url, timeout=self.config.health_timeout
                )
            await client.abort(rid)
        except Exception as exc:  # best effort: the closed upstream connection aborts it too
            log.info("abort of %s on %s failed: %s", rid, backend.name, exc)


async def build(
    config: ProxyConfig,
    *,
    registry: CollectorRegistry,
    tracer: Tracer | None = None,
) -> Wiring:
    """Make the proxy's objects (nothing is started: call `Wiring.start`).

    `tracer` overrides the one from the OTEL_* environment (tests pass an in-memory one).
    """
    config.validate()
    pool = UpstreamPool(
        max_connections_per_backend=config.pool_max_connections,
        idle_timeout=config.pool_idle_timeout,
        connect_timeout=config.connect_timeout,
    )
    health = HealthConfig(
        interval=config.health_interval,
        timeout=config.health_timeout,
        failure_threshold=config.health_failure_threshold,
        success_threshold=config.health_success_threshold,
        loads_interval=config.loads_interval,
        eject_after=config.eject_after_failures,
        eject_base_s=config.eject_base,
        eject_max_s=config.eject_max,
        degraded_ttft_p99_s=config.degraded_ttft_p99,
        degraded_token_usage=config.degraded_token_usage,
        degraded_queue=config.degraded_queue,
    )
    backends = BackendRegistry(
        config.backends,
        pool=pool,
        health=health,
        max_concurrency=config.max_concurrency_per_backend,
        warm_connections=config.pool_warm_connections,
    )
    policy = make_policy(config.policy)
    metrics = Metrics(registry)
    admission = Admission(config.admission, metrics=metrics)
    registry.register(FleetCollector(backends.backends, pool.stats))
    tracing = TracingSetup(tracer) if tracer is not None else tracer_from_env(force=config.tracing)
    catalog = ModelCatalog(
        backends=backends.backends, pool=pool, ttl=config.models_ttl, timeout=config.health_timeout
    )
    wiring = Wiring(
        app=_unset_app,
        admin_app=_unset_app,
        config=config,
        pool=pool,
        registry=backends,
        policy=policy,
        metrics=metrics,
        catalog=catalog,
        tracing=tracing,
        admission=admission,
    )
    wiring.app = ProxyApp(
        config=config,
        pool=pool,
        registry=backends,
        policy=policy,
        metrics=metrics,
        catalog=catalog,
        abort=wiring.abort,
        tracer=tracing.tracer,
        admission=admission,
    )
    wiring.admin_app = AdminApp(registry=registry, backends=backends, pool=pool, policy=policy)
    return wiring


async def _unset_app(scope: Any, receive: Any, send: Any) -> None:  # replaced in build()
    raise RuntimeError("wiring not built")


__all__ = ["Wiring", "add_arguments", "build", "config_from"]
