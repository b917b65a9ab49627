"""Wiring: proxy flags and config, and the objects one edge process runs (used by `edge.serve`).

`add_arguments` adds the proxy flags to a parser; `config_from` reads the `[proxy]` section
through `edge.settings` (flags, then `QUICEDGE_*` variables, then TOML, then the `ProxyConfig`
defaults); `build` makes the pool, the backend registry, the routing policy, telemetry and the
two ASGI apps.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, cast

from prometheus_client import CollectorRegistry, Counter

from backends.credentials import BackendCredentials
from backends.discovery import (
    Discovery,
    DiscoveryConfig,
    DiscoveryMetrics,
    apply_membership,
    make_source,
    wanted_urls,
)
from backends.pool import KeyedPool, UpstreamPool
from backends.registry import Backend, BackendClient, BackendRegistry, HealthConfig
from edge import settings
from edge.access_log import AccessLog, AccessLogConfig
from edge.admin import AdminApp
from edge.admission import Admission
from edge.app import ProxyApp, allowed_methods
from edge.asgi import ASGIApp
from edge.audit import AuditConfig, AuditLog
from edge.backend_holds import HoldsCollector, SharedHolds
from edge.config import SECTIONS, ProxyConfig
from edge.cors import CorsConfig
from edge.cors import wrap as wrap_cors
from edge.models import ModelCatalog, Models, ModelsConfig
from edge.models.rollout_sync import RolloutSync
from edge.policy.config import PolicyConfig
from edge.policy.gateway import PolicyGateway
from edge.redis_pubsub import SubscriptionCollector
from edge.routing.base import RoutingPolicy, make_policy
from edge.routing.breakers import BreakerConfig, Breakers
from edge.routing.fleet import FleetServices, build_fleet
from edge.routing.fleet_view import FleetViewConfig
from edge.routing.kv_events import KvEventsConfig
from edge.routing.prewarm import PrewarmConfig
from edge.routing.ttft import TTFTPolicy
from edge.state.stage import StateStage
from edge.telemetry import (
    AccessLogCollector,
    AuditCollector,
    FleetCollector,
    Metrics,
    TracingCollector,
)
from edge.tracing import Tracer, TracingSetup, tracer_from_env

log = logging.getLogger(__name__)

_PROXY = next(s for s in SECTIONS if s.name == "proxy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The proxy flags (from `ProxyConfig`'s fields). `--backend` repeats."""
    settings.add_flags(parser, [_PROXY])


def config_from(
    args: argparse.Namespace, toml: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> ProxyConfig:
    """The proxy settings: flags over `QUICEDGE_*` variables over the TOML `[proxy]` table.

    Raises `SettingsError` (a ValueError) naming the setting for unknown keys and bad values.
    """
    loaded = settings.load(
        [_PROXY], toml={"proxy": toml.get("proxy", {})}, environ=environ or {}, flags=vars(args)
    )
    return loaded.validate().get("proxy", ProxyConfig)


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
    models: Models
    credentials: BackendCredentials = field(default_factory=BackendCredentials)
    discovery: Discovery | None = None
    state: StateStage | None = None
    gateway: PolicyGateway | None = None
    audit: AuditLog | None = None
    breakers: Breakers | None = None
    abort_outcomes: Counter | None = None
    """`quicedge_abort_requests_total{outcome}`: sent, failed, dropped (over the cap)."""
    fleet: FleetServices | None = None
    access_log: AccessLog | None = None
    rollout_sync: RolloutSync | None = None
    holds: SharedHolds | None = None
    """Drains shared through Redis (`share_drains`); None: each process keeps its own."""
    proxy: ProxyApp | None = None
    """The proxy app inside `app` (which may be it wrapped for CORS)."""
    _aborts: set[asyncio.Task[Any]] = field(default_factory=set)
    _drains: set[asyncio.Task[None]] = field(default_factory=set)
    """Backends a reload took out, draining."""
    _clients: dict[str, Any] = field(default_factory=dict)

    async def start(self) -> None:
        """Pre-warm pools, start health checks and load polling, learn the fleet's models."""
        if self.access_log is not None:
            self.access_log.start()
        await self.registry.start()
        if self.holds is not None:
            await self.holds.start()
        if self.breakers is not None:
            self.breakers.start()
        await self.catalog.refresh()
        if self.discovery is not None:
            self.discovery.start(self.registry)
        if self.gateway is not None:
            self.gateway.start()
        if self.audit is not None:
            await self.audit.start()
        if self.fleet is not None:
            await self.fleet.start()
        if self.rollout_sync is not None:
            await self.rollout_sync.start()

    def reload(self) -> None:
        """SIGHUP: compile the policy modules again (requests in progress keep the old ones)."""
        if self.gateway is not None:
            self.gateway.reload_soon()

    async def set_backends(self, urls: list[str], drain_timeout: float) -> None:
        """A reloaded `--backend` list: new backends join now, gone ones drain (up to
        `drain_timeout` s) and leave. With discovery it is the list kept beside what is found.

        The catalog's list, which still names the models of the backends it last asked, is
        marked stale: the first request that finds no backend for its model fetches it again
        (else a model only a removed backend had taught it got 404 until someone fetched
        `/v1/models`). It is not fetched here: the gone backends still hold their pools while
        they drain, and a new backend's model learned meanwhile would be a second pool, making
        a request that names no model ambiguous (400 `model_required`) until they leave."""
        if self.discovery is not None:
            self.discovery.set_static(urls)
            await self.discovery.refresh(self.registry)
        else:
            apply_membership(self.registry, wanted_urls(urls), drain_timeout, self._drains)
        self.catalog.expire()

    async def swap_gateway(self, gateway: PolicyGateway | None) -> None:
        """Serve the requests that start from now on with `gateway` (a reloaded `[policy]`),
        then stop the old one's module watchers. Requests in progress keep what they hold."""
        old, self.gateway = self.gateway, gateway
        if self.proxy is not None:
            self.proxy.set_gateway(gateway)
        if gateway is not None:
            gateway.start()
        if old is not None:
            await old.aclose()

    async def settle(self, timeout: float) -> None:
        """While the listeners drain: let background answers finish for up to `timeout` s."""
        if self.proxy is not None:
            await self.proxy.settle_background(timeout)

    async def aclose(self) -> None:
        """Stop background answers and checks, let in-progress aborts finish briefly, close
        pools, flush spans."""
        if self.proxy is not None:  # first: they still need the pool and the state store
            await self.proxy.stop_background()
        if self.discovery is not None:
            await self.discovery.aclose()
        for task in self._drains:
            task.cancel()
        await asyncio.gather(*self._drains, return_exceptions=True)
        if self.breakers is not None:
            await self.breakers.aclose()
        if self.fleet is not None:
            await self.fleet.aclose()
        if self.holds is not None:
            await self.holds.aclose()
        await self.registry.aclose()
        if self.rollout_sync is not None:
            await self.rollout_sync.aclose()
        await self.models.aclose()
        if self._aborts:
            await asyncio.wait(set(self._aborts), timeout=1.0)
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            with contextlib.suppress(Exception):
                await client.aclose()
        await self.pool.aclose()
        if self.state is not None:
            await self.state.aclose()
        await self.admission.aclose()
        if self.gateway is not None:
            await self.gateway.aclose()
        if self.audit is not None:
            await self.audit.aclose()  # after the requests: their records are written too
        self.tracing.shutdown()
        if self.access_log is not None:
            self.access_log.stop()

    def set_attempts(self, values: dict[str, Any]) -> None:
        """A reload's retries, retry budget and upstream timeouts (`[proxy]` fields only
        `Attempts` reads), for the attempts that start next."""
        if self.proxy is not None:
            attempts = self.proxy.attempts
            attempts.config = replace(attempts.config, **values)

    async def set_access_log(self, config: AccessLogConfig) -> None:
        """A reloaded `[access_log]`, for the requests that end from now on: a new log with its
        writer started (or none, turned off); the old one writes what it holds, then stops."""
        old = self.access_log
        new = AccessLog(config) if config.enabled else None
        if new is not None:
            new.start()
            new.dropped = old.dropped if old is not None else 0  # one counter for the process
        self.access_log = new
        if self.proxy is not None:
            self.proxy.access_log = new
        if old is not None:
            await asyncio.to_thread(old.stop)

    def abort(self, backend: Backend, rid: str) -> None:
        """Fire `/abort_request {rid}` at the backend without waiting for it (never raises).

        At most `max_pending_aborts` are in flight: past that one is dropped and counted (a
        flood of departing clients must not become a flood of tasks)."""
        if len(self._aborts) >= self.config.max_pending_aborts:
            self._count_abort("dropped")
            return
        task = asyncio.ensure_future(self._abort(backend, rid))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _forget_clients(self) -> None:
        """Close the abort clients of backends that left the registry: each holds a connection,
        and a fleet whose pods come and go would keep one for every address it ever had."""
        live = {b.url for b in self.registry.backends}
        for url in [u for u in self._clients if u not in live]:
            with contextlib.suppress(Exception):
                await self._clients.pop(url).aclose()

    async def set_credentials(self, keys: BackendCredentials) -> bool:
        """The backends' keys a reload read (`edge.reload`): every upstream request, check, load
        poll, model fetch and abort from now on carries them; requests in flight keep theirs.
        True when a key changed."""
        if not self.credentials.replace_with(keys):
            return False
        await self.registry.renew_clients()  # the health and load clients hold their key
        old, self._clients = list(self._clients.values()), {}  # so do the abort clients
        for client in old:
            with contextlib.suppress(Exception):
                await client.aclose()
        return True

    async def _abort(self, backend: Backend, rid: str) -> None:
        try:
            client = self._clients.get(backend.url)
            if client is None:
                from backends.sglang import SGLangClient

                await self._forget_clients()
                client = self._clients[backend.url] = SGLangClient(
                    backend.url,
                    timeout=self.config.health_timeout,
                    api_key=self.credentials.api_key(backend.url),
                )
            await client.abort(rid)
        except Exception as exc:  # best effort: the closed upstream connection aborts it too
            self._count_abort("failed")
            log.info("abort of %s on %s failed: %s", rid, backend.name, exc)
        else:
            self._count_abort("sent")

    def _count_abort(self, outcome: str) -> None:
        if self.abort_outcomes is not None:
            self.abort_outcomes.labels(outcome).inc()


async def build(
    config: ProxyConfig,
    *,
    registry: CollectorRegistry,
    tracer: Tracer | None = None,
    discovery: DiscoveryConfig | None = None,
    policies: PolicyConfig | None = None,
    audit: AuditConfig | None = None,
    breakers: BreakerConfig | None = None,
    prewarm: PrewarmConfig | None = None,
    fleet_view: FleetViewConfig | None = None,
    kv_events: KvEventsConfig | None = None,
    redis_url: str | None = None,
    cors: CorsConfig | None = None,
    access_log: AccessLogConfig | None = None,
    models: ModelsConfig | None = None,
) -> Wiring:
    """Make the proxy's objects (nothing is started: call `Wiring.start`).

    `tracer` overrides the one from the OTEL_* environment (tests pass an in-memory one).
    With `discovery` other than static, the first lookup's backends join the `--backend` list.
    `policies` (`[policy]`) and `audit` (`[audit]`) turn on the policy gateway and the audit log.
    `prewarm`, `fleet_view` and `kv_events` are those sections (off when None), `redis_url` the
    `[serve]` Redis the fleet view uses unless it names its own.
    """
    source = make_source(discovery) if discovery is not None else None
    config.validate(need_backends=source is None)
    credentials = BackendCredentials.from_files(
        config.backend_api_key_file, config.backend_api_key_files
    )
    pool = UpstreamPool(
        max_connections_per_backend=config.pool_max_connections,
        idle_timeout=config.pool_idle_timeout,
        max_waiters_per_backend=config.pool_max_waiters,
        acquire_timeout=config.pool_acquire_timeout,
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
    # Registered with or without a mode that uses them: the metrics reference lists them.
    found = DiscoveryMetrics(registry)
    finder = Discovery(discovery, source, found) if discovery and source else None
    urls = await finder.initial(config.backends) if finder else config.backends
    backends = BackendRegistry(
        urls,
        allow_empty=finder is not None,
        pool=pool,
        health=health,
        max_concurrency=config.max_concurrency_per_backend,
        warm_connections=config.pool_warm_connections,
        client_factory=partial(_sglang_client, credentials),
    )
    policy = make_policy(config.policy)
    if isinstance(policy, TTFTPolicy):
        # A backend healthy again after failing its checks most likely restarted: an empty cache.
        forget = policy.forget
        backends.on_healthy.append(lambda backend: forget(backend.url))
    metrics = Metrics(registry)
    metrics.bound_backends(backends.backends)
    admission = Admission(config.admission, metrics=metrics)
    breaker_set = Breakers(
        (breakers or BreakerConfig()).validate(), backends.backends, registry=registry,
        model_info=partial(_model_info, config.health_timeout, credentials),
    )  # fmt: skip
    registry.register(FleetCollector(backends.backends, pool.stats))
    tracing = (
        TracingSetup(tracer)
        if tracer is not None
        else tracer_from_env(
            force=config.tracing, trust_client_sampling=config.trust_client_sampling
        )
    )
    registry.register(TracingCollector(tracing))
    catalog = ModelCatalog(
        backends=backends.backends,
        pool=pool,
        ttl=config.models_ttl,
        timeout=config.health_timeout,
        credentials=credentials,
    )
    pools = Models(
        models or ModelsConfig(), backends=backends, catalog=catalog, pool=pool,
        registry=registry, credentials=credentials, breakers=breaker_set,
    )  # fmt: skip
    catalog.on_relabel = breaker_set.relabel  # a learned model moves its backend's domain
    # A backend healthy again (one a reload added while it was down, one restarted with another
    # model) may serve what the catalog does not know yet: the next look fetches the list.
    backends.on_healthy.append(lambda _backend: catalog.expire())
    sync = None
    # Without rollouts too: one a reload adds is shared as the others are.
    if models is not None and (models.share_stops or models.share_advances):
        if redis_url is None:
            which = "share_stops" if models.share_stops else "share_advances"
            raise ValueError(f"models.{which}: sharing rollouts needs a Redis (--redis)")
        sync = RolloutSync(pools, url=redis_url, key=models.share_key,
                           stops=models.share_stops, advances=models.share_advances)  # fmt: skip
    gateway = make_gateway(policies or PolicyConfig(), metrics=metrics, pool=pool)
    holds = None
    if config.share_drains:
        if redis_url is None:
            raise ValueError("proxy.share_drains: sharing drains needs a Redis (--redis)")
        holds = SharedHolds(backends, url=redis_url, key=config.drains_key,
                            interval=config.drains_interval)  # fmt: skip
    access = AccessLog(access_log) if access_log and access_log.enabled else None
    audit_log = AuditLog(audit) if audit is not None and audit.path else None
    if audit_log is not None:
        registry.register(AuditCollector(audit_log))
        if audit_log.export is not None:
            registry.register(audit_log.export.collector())
    # Pre-warming sends its own requests to the backends: with their keys, those a reload
    # reads too (it calls only `request`).
    keyed = cast(UpstreamPool, KeyedPool(pool, credentials))
    fleet = build_fleet(
        prewarm, fleet_view, redis_url=redis_url, registry=backends, pool=keyed, policy=policy,
        kv_events=kv_events,
    )  # fmt: skip
    if fleet is not None:
        registry.register(fleet.collector())
        policy = fleet.policy
    wiring = Wiring(
        fleet=fleet,
        app=_unset_app,
        admin_app=_unset_app,
        config=config,
        pool=pool,
        registry=backends,
        policy=policy,
        metrics=metrics,
        catalog=catalog,
        tracing=tracing,
        credentials=credentials,
        models=pools,
        discovery=finder,
        state=StateStage(config.state, registry=registry, on_redis_state=metrics.redis_breaker),
        admission=admission,
        gateway=gateway,
        audit=audit_log,
        breakers=breaker_set,
        abort_outcomes=Counter(
            "quicedge_abort_requests",
            "Fire-and-forget /abort_request calls for requests whose client left, by outcome:"
            " sent, failed, or dropped (over max_pending_aborts)",
            ["outcome"], registry=registry,
        ),
        access_log=access,
        rollout_sync=sync,
        holds=holds,
    )  # fmt: skip
    pools.set_aborter(wiring.abort)
    if wiring.state is not None and wiring.state.cache is not None:  # keyed by what they serve
        wiring.state.cache.fleet = lambda: backends.backends
    registry.register(AccessLogCollector(lambda: wiring.access_log))  # the one a reload made too
    view = fleet.view if fleet is not None else None
    registry.register(SubscriptionCollector(
        lambda: (part.subscription for part in (holds, sync, view) if part is not None)
    ))  # fmt: skip
    registry.register(HoldsCollector(lambda: holds))
    proxy = ProxyApp(
        config=config,
        pool=pool,
        registry=backends,
        policy=policy,
        metrics=metrics,
        catalog=catalog,
        abort=wiring.abort,
        tracer=tracing.tracer,
        state=wiring.state,
        admission=admission,
        gateway=gateway,
        audit=audit_log,
        breakers=breaker_set,
        credentials=credentials,
        access_log=wiring.access_log,
        models=pools,
    )
    wiring.proxy = proxy
    wiring.app = wrap_cors(proxy, cors, allowed_methods) if cors is not None else proxy
    wiring.admin_app = AdminApp(
        registry=registry,
        backends=backends,
        pool=pool,
        policy=policy,
        breakers=breaker_set,
        fleet=fleet,
        models=pools,
        audit=audit_log,
        holds=holds,
        admission=admission,
    )
    return wiring


def make_gateway(
    policies: PolicyConfig, *, metrics: Metrics, pool: UpstreamPool
) -> PolicyGateway | None:
    """The policy gateway of `policies` reporting into `metrics` (None when it configures
    nothing). Compiles the WebAssembly modules: no event loop needed, so it may run in a thread."""
    return PolicyGateway.from_config(
        policies,
        on_decision=lambda rule, outcome: metrics.policy_decisions.labels(rule, outcome).inc(),
        on_module_failure=lambda module, kind: metrics.policy_failures.labels(module, kind).inc(),
        pool=pool,
        on_judge=lambda verdict, seconds: metrics.policy_judge.labels(verdict).observe(seconds),
    )


def _sglang_client(credentials: BackendCredentials, url: str, timeout: float) -> BackendClient:
    """The registry's health and load client for `url`, with that backend's key."""
    from backends.sglang import SGLangClient

    return SGLangClient(url, timeout=timeout, api_key=credentials.api_key(url))


async def _model_info(
    timeout: float, credentials: BackendCredentials, backend: Backend
) -> Mapping[str, Any]:
    from backends.sglang import SGLangClient

    key = credentials.api_key(backend.url)
    async with SGLangClient(backend.url, timeout=timeout, api_key=key) as client:
        return await client.model_info()


async def _unset_app(scope: Any, receive: Any, send: Any) -> None:  # replaced in build()
    raise RuntimeError("wiring not built")


__all__ = ["Wiring", "add_arguments", "build", "config_from", "make_gateway"]
