"""`ProxyConfig`: every setting of the proxy core, typed, with units and documented defaults;
`SECTIONS`: every settings section `quicedge serve` reads.

`edge.settings` reads each section from its TOML table, `QUICEDGE_*` variables and flags (flags
win, then the environment, then TOML). Field names are the TOML keys; the docstring under each
field is its `--help` text; `validate()` gives a clear error for each bad value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from backends.credentials import BackendCredentials, read_key
from backends.discovery import DiscoveryConfig
from backends.labels import check_url, parse_labels
from edge import settings
from edge.access_log import AccessLogConfig
from edge.admission.settings import TIERS, AdmissionSettings, TenantSettings
from edge.audit import AUDIT_FLAGS, AuditConfig
from edge.cors import CorsConfig
from edge.models.config import ModelsConfig
from edge.policy.config import POLICY_FLAGS, PolicyConfig
from edge.routing.base import POLICY_NAMES
from edge.routing.breakers import BreakerConfig
from edge.routing.fleet_view import FLEET_VIEW_FLAGS, FleetViewConfig
from edge.routing.kv_events import KV_EVENTS_FLAGS, KvEventsConfig
from edge.routing.prewarm import PREWARM_FLAGS, PrewarmConfig
from edge.settings import Section
from edge.state.config import StateConfig
from transport.config import EarlyDataSettings, TransportConfig

SECONDS = 1.0
KiB = 1024
MiB = 1024 * KiB


@dataclass(slots=True)
class ProxyConfig:
    """Proxy-core settings. Times are in seconds, sizes in bytes."""

    backends: list[str] = field(default_factory=list)
    """Base URLs of the SGLang servers, e.g. `http://10.0.0.5:30000`, each optionally with its
    isolation-domain labels: `http://10.0.0.5:30000#model=llama3-v2&hardware=h100&tiers=gold+silver`
    (see docs/routing.md, "Isolation and breakers")."""
    policy: str = "ttft"
    """Routing policy: round_robin, random, least_load, power_of_two, cache_aware or ttft."""

    connect_timeout: float = 2 * SECONDS
    """TCP connect to a backend, s; past it the attempt is retried on another backend."""
    first_byte_timeout: float = 120 * SECONDS
    """Request sent → response headers, s. Generous: a long prompt queued behind others is slow."""
    chunk_timeout: float = 60 * SECONDS
    """Longest silence between two chunks of a streaming answer before it is cut (504), s."""
    max_body_bytes: int = 8 * MiB
    """Largest request body accepted, bytes (413 above it); counted as it streams in."""
    max_pending_body_bytes: int = 256 * MiB
    """Request-body bytes this process holds for bodies still arriving, over all requests: a
    body that would pass it is refused with 503 `overloaded`, so that many slow or stalled
    uploads cannot take the edge's memory. A body that comes whole in one read is not
    counted. At least `max_body_bytes`; 0: no cap."""
    max_pending_answer_bytes: int = 512 * MiB
    """Bytes of non-streamed backend answers this process holds while they arrive and are
    passed on, over all requests (each is also capped at 64 MiB): an answer that would pass it
    is refused with 503 `overloaded` and its backend request aborted, so that many large
    answers at once cannot take the edge's memory. 0: no cap."""
    max_retries: int = 2
    """Extra attempts on other backends, only while nothing has reached the client."""
    retry_budget: float = 0.2
    """Share of this process's requests in flight that may be on a retry at once, 0..1: past
    it a failed attempt is answered as it failed, so an overloaded fleet's 429s and 503s are
    not multiplied by the retries (1: no budget)."""
    retry_budget_min: int = 3
    """Requests that may be on a retry at once whatever the share says (a quiet edge retries)."""

    health_interval: float = 2 * SECONDS
    """Period of the active `/health` checks and `/v1/loads` polls, s."""
    health_timeout: float = 5 * SECONDS
    """Deadline of one active check, s. SGLang's `/health` sleeps 1 s before it looks whether
    its scheduler answered a one-token probe: a deadline of 1 s failed every check."""
    health_failure_threshold: int = 3
    """Consecutive failed checks that mark a backend unhealthy."""
    health_success_threshold: int = 2
    """Consecutive passed checks that mark it healthy again."""
    loads_interval: float | None = 1 * SECONDS
    """Period of `/v1/loads` polling (queue and KV usage feed routing), s; none turns it off."""
    eject_after_failures: int = 5
    """Consecutive connect failures / 5xx on real traffic that eject a backend (passive check)."""
    eject_base: float = 1 * SECONDS
    """First ejection's length, s; it doubles on each repeat, up to `eject_max`."""
    eject_max: float = 30 * SECONDS
    """Longest ejection, s."""

    pool_max_connections: int = 128
    """Upstream keep-alive connections per backend (requests wait for a slot at the cap)."""
    pool_warm_connections: int = 8
    """Idle connections opened per backend at start, so early requests pay no TCP connect."""
    pool_idle_timeout: float = 4 * SECONDS
    """An idle upstream connection is closed after this long, s: below SGLang's keep-alive
    (uvicorn's 5 s), so the edge, not the backend, closes it; less where a backend's
    `Keep-Alive: timeout=N` says so (a second below N)."""
    pool_max_waiters: int = 256
    """Requests that may wait for a free upstream connection to one backend when all
    `pool_max_connections` are in use; one more is refused at once with 503 and Retry-After
    (or tried on another backend). 0: none waits."""
    pool_acquire_timeout: float = 5 * SECONDS
    """Longest wait for a free upstream connection to one backend before 503 and Retry-After
    (or another backend). Default 5 s."""
    max_concurrency_per_backend: int | None = None
    """Requests the edge keeps in flight on one backend; none means no cap."""

    degraded_ttft_p99: float | None = None
    """p99 TTFT above which a backend is degraded (gets work only when no other can), s; none:
    off."""
    degraded_token_usage: float | None = 0.95
    """KV-cache usage (`token_usage`, 0..1) above which a backend is degraded."""
    degraded_queue: int | None = None
    """Waiting requests (`num_waiting_reqs`) above which a backend is degraded."""

    backend_api_key_file: str | None = None
    """File holding the API key sent to every backend as `Authorization: Bearer` (SGLang's
    `--api-key`); none: no key. Read once at start; the client's own key is never forwarded."""
    backend_api_key_files: dict[str, str] = field(default_factory=dict)
    """Per backend URL, a file holding that backend's key (overrides `backend_api_key_file`);
    TOML only: `[proxy.backend_api_key_files]` `"http://10.0.0.5:30000" = "/run/secrets/b1"`."""

    tracing: bool = False
    """Create OpenTelemetry spans. Also turned on by OTEL_TRACES_EXPORTER=console|otlp."""
    trust_client_sampling: bool = False
    """Let a client's `traceparent` decide whether its request is traced (its sampled flag,
    and its trace id for `traceidratio`). Off: the edge's own sampler decides every request,
    continuing the client's trace id."""
    models_ttl: float = 5 * SECONDS
    """How long the merged `/v1/models` list is reused before it is fetched again, s."""
    max_pending_aborts: int = 256
    """`/abort_request` calls in flight at once (sent when a client leaves mid-generation); one
    more is dropped and counted (`quicedge_abort_requests_total{outcome="dropped"}`): closing
    the upstream connection aborts the request anyway."""
    expose_backend_names: bool = False
    """Name the backend (its host:port) to clients: the `x-quicedge-backend` response header and
    the upstream detail in error messages. Off: internal addresses never leave the edge."""
    admin_token_file: str | None = None
    """File holding the token the admin listener's actions (every POST: drains, rollouts,
    pre-warming) require as `Authorization: Bearer TOKEN`; reads (health, metrics, state) stay
    open for probes and scrapers. None: actions are open too. Read once at start."""
    admin_token_reads: bool = False
    """Reads need the token too (`/metrics`, `/backends`, `/tenants`, `/rollouts`), all but the
    probes (`/health`, `/ready`): for an admin port other workloads can reach. Needs
    `admin_token_file`; scrapers then send the token."""
    share_drains: bool = False
    """Share backend drains (`POST /backends/NAME/drain`) through the `[serve] redis`: one call
    holds a backend on every edge, and an edge that starts later holds it too."""
    drains_key: str = "quicedge:drains"
    """The Redis hash of the shared drains (backend name → when and where)."""
    drains_interval: float = 2.0
    """Seconds between reads of the shared drains. A change is also announced on pub/sub, which
    every edge hears at once; the read finds what an edge missed (Redis away, a lost message)."""
    config_poll_interval: float | None = None
    """Seconds between checks of the `--config` file: when it changed, it is reloaded as on
    SIGHUP (docs/configuration.md, "Reloading the config"); none: on SIGHUP only."""
    state: StateConfig = field(default_factory=StateConfig, metadata={"load": False})
    """Stored conversations and the response cache: the top-level `[state]` table (`edge.state`),
    carried here for the proxy's stages; not a `[proxy]` key."""
    admission: AdmissionSettings = field(
        default_factory=AdmissionSettings, metadata={"load": False}
    )
    """Tenants, quotas and throttling: the top-level `[admission]` table and `[[tenants]]` array
    (`edge.admission`), carried here for the proxy's stages; not `[proxy]` keys."""

    def validate(self, *, need_backends: bool = True) -> ProxyConfig:
        """Raise ValueError naming the first bad setting; return self for chaining.

        `need_backends` is False when discovery finds the backends (`backends.discovery`)."""
        for f in fields(self):
            value = getattr(self, f.name)
            # NaN passes every comparison below (`nan <= 0` is False) and then breaks the
            # timers that take it; an infinite time or share means nothing a large one does not.
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"proxy: {f.name} must be a finite number, got {value!r}")
        if not self.backends and need_backends:
            raise ValueError("proxy: at least one backend is required (--backend URL)")
        addresses = []
        for url in self.backends:
            try:
                addresses.append(check_url(parse_labels(url)[0])[1])
            except ValueError as exc:
                raise ValueError(f"proxy.backends: {exc}") from None
        if len(set(addresses)) != len(addresses):
            raise ValueError("proxy: a backend URL is listed twice (the same host and port)")
        if self.policy not in POLICY_NAMES:
            raise ValueError(
                f"proxy.policy: unknown routing policy {self.policy!r}; choose one of "
                + ", ".join(POLICY_NAMES)
            )
        positive = (
            "connect_timeout",
            "first_byte_timeout",
            "chunk_timeout",
            "health_interval",
            "health_timeout",
            "eject_base",
            "eject_max",
            "pool_idle_timeout",
            "pool_acquire_timeout",
            "max_body_bytes",
            "pool_max_connections",
            "health_failure_threshold",
            "health_success_threshold",
            "eject_after_failures",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"proxy: {name} must be > 0, got {getattr(self, name)!r}")
        if self.eject_max < self.eject_base:
            raise ValueError(
                f"proxy.eject_max: must be >= eject_base ({self.eject_base}), got {self.eject_max}"
            )
        if self.max_retries < 0:
            raise ValueError(f"proxy: max_retries must be >= 0, got {self.max_retries}")
        if 0 < self.max_pending_body_bytes < self.max_body_bytes or self.max_pending_body_bytes < 0:
            raise ValueError(
                "proxy: max_pending_body_bytes must be 0 (no cap) or at least max_body_bytes "
                f"({self.max_body_bytes}), got {self.max_pending_body_bytes}"
            )
        if self.max_pending_answer_bytes < 0:
            raise ValueError(
                "proxy: max_pending_answer_bytes must be >= 0 (0: no cap), "
                f"got {self.max_pending_answer_bytes}"
            )
        if not 0 <= self.retry_budget <= 1:
            raise ValueError(f"proxy: retry_budget must be in 0..1, got {self.retry_budget}")
        if self.retry_budget_min < 0:
            raise ValueError(f"proxy: retry_budget_min must be >= 0, got {self.retry_budget_min}")
        if self.pool_max_waiters < 0:
            raise ValueError(f"proxy: pool_max_waiters must be >= 0, got {self.pool_max_waiters}")
        if self.max_pending_aborts < 0:
            raise ValueError(
                f"proxy: max_pending_aborts must be >= 0, got {self.max_pending_aborts}"
            )
        if not self.models_ttl >= 0:
            raise ValueError(f"proxy: models_ttl must be >= 0, got {self.models_ttl}")
        if not 0 <= self.pool_warm_connections <= self.pool_max_connections:
            raise ValueError("proxy: pool_warm_connections must be in 0..pool_max_connections")
        if self.max_concurrency_per_backend is not None and self.max_concurrency_per_backend < 1:
            raise ValueError("proxy: max_concurrency_per_backend must be >= 1")
        if self.degraded_token_usage is not None and not 0 < self.degraded_token_usage <= 1:
            raise ValueError("proxy: degraded_token_usage must be in (0, 1]")
        # a missing or empty key file fails at start, with its setting's name
        BackendCredentials.from_files(self.backend_api_key_file, self.backend_api_key_files)
        self.admin_token()
        if self.admin_token_reads and self.admin_token_file is None:
            raise ValueError("proxy: admin_token_reads needs admin_token_file (the token to ask)")
        for name in ("degraded_ttft_p99", "degraded_queue", "loads_interval",
                     "config_poll_interval", "drains_interval"):  # fmt: skip
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"proxy: {name} must be > 0, got {value!r}")
        self.state.validate()
        return self

    def admin_token(self) -> bytes | None:
        """The admin actions' token from `admin_token_file` (ValueError naming the setting)."""
        if self.admin_token_file is None:
            return None
        return read_key(self.admin_token_file, "proxy.admin_token_file")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ProxyConfig:
        """From a `[proxy]`-style table, refusing unknown keys and wrong types by name (not
        validated: call `validate()`)."""
        own = {k: v for k, v in values.items() if k not in _CARRIED}
        config = settings.from_mapping(cls, own, "proxy")
        for name in _CARRIED.intersection(values):  # in-process callers pass these as objects
            setattr(config, name, values[name])
        return config

    def with_features(self, loaded: settings.Settings) -> ProxyConfig:
        """This `[proxy]` with the feature sections it carries, from `loaded`: `[state]`,
        `[admission]` with the `[[tenants]]` array. Checks what spans sections."""
        self.state = loaded.get("state", StateConfig)
        admission = loaded.get("admission", AdmissionSettings)
        admission.tenants = list(loaded.get("tenants", list))
        admission.validate()  # tenant names and keys unique across the array
        _check_tenant_names(loaded, admission)
        self.admission = admission
        if self.share_drains and getattr(loaded["serve"], "redis", None) is None:
            raise ValueError("proxy.share_drains: sharing drains needs a Redis (--redis)")
        return self


def _check_tenant_names(loaded: settings.Settings, admission: AdmissionSettings) -> None:
    """The tiers and tenants `[policy]` and `[[models.rollouts]]` name are those admission gives
    requests: a tier or a tenant it never gives (`tier = "free"`, a tenant's name mistyped) was
    accepted, and its limits, model allow-list, rule or canary then held no request, without a
    word."""
    policy = loaded.get("policy", PolicyConfig)
    tenants = [t.name for t in admission.tenants]
    known = ", ".join(["anonymous", *tenants])

    def check_tenant(where: str, name: str) -> None:
        if name != "anonymous" and name not in tenants:
            raise ValueError(f"{where}: {name!r} is not a tenant: [[tenants]] names {known}")

    for limits in policy.tiers:
        if limits.tier not in TIERS:
            raise ValueError(
                f"policy.tiers.tier: {limits.tier!r} is not a tier: {', '.join(TIERS)}"
            )
    for models in policy.tenant_models:
        check_tenant("policy.tenant_models.tenant", models.tenant)
    for rule in policy.rules:
        for name in rule.tenants:
            check_tenant(f"policy.rules.tenants ({rule.id})", name)
    for i, rollout in enumerate(loaded.get("models", ModelsConfig).rollouts):
        for name in rollout.tenants:
            check_tenant(f"models.rollouts[{i}].tenants", name)


# Feature sections read from their own top-level tables and carried on `ProxyConfig` for the
# proxy's stages (`metadata={"load": False}`: not `[proxy]` keys).
_CARRIED = frozenset({"state", "admission"})


# Flags whose names are not `--field-name`; every other field's flag is.
PROXY_FLAGS: dict[str, str | bool] = {
    "backends": "--backend",
    "max_body_bytes": "--max-body",
    "max_retries": "--retries",
    "health_failure_threshold": "--health-failures",
    "health_success_threshold": "--health-successes",
    "eject_after_failures": "--eject-after",
    "pool_max_connections": "--pool-size",
    "pool_warm_connections": "--pool-warm",
    "max_concurrency_per_backend": "--max-concurrency",
}


def _prefixed(kind: type, prefix: str) -> dict[str, str | bool]:
    """Every field of `kind` as `PREFIX-field-name`: a feature's flags say whose they are."""
    return {f.name: f"{prefix}-{f.name.replace('_', '-')}" for f in fields(kind)}


def _toml_only(kind: type) -> dict[str, str | bool]:
    """No flag for any of `kind`'s fields: a feature's table is written in the TOML file."""
    return {f.name: False for f in fields(kind)}


# Every settings section of `quicedge serve`: TOML table, dataclass, flag renames. A feature adds
# its own with one line here (see docs/architecture.md, "Settings").
SECTIONS: tuple[Section, ...] = (
    Section("serve", TransportConfig, title="listeners, TLS, tickets, processes ([serve])"),
    Section(
        "early_data",
        EarlyDataSettings,
        flags={"default": "--early-data-default"},
        title="0-RTT early data ([early_data])",
    ),
    Section("proxy", ProxyConfig, flags=PROXY_FLAGS, title="proxy ([proxy])"),
    Section(
        "breakers",
        BreakerConfig,
        flags=_prefixed(BreakerConfig, "--breaker"),
        title="circuit breakers per isolation domain ([breakers])",
    ),
    Section(
        "cors",
        CorsConfig,
        flags=_prefixed(CorsConfig, "--cors"),
        title="CORS for browsers ([cors])",
    ),
    Section(
        "access_log",
        AccessLogConfig,
        flags=_prefixed(AccessLogConfig, "--access-log") | {"enabled": "--access-log"},
        title="access log ([access_log])",
    ),
    Section(
        "discovery",
        DiscoveryConfig,
        flags=_prefixed(DiscoveryConfig, "--discovery"),
        title="backend discovery ([discovery])",
    ),
    Section(
        "models",
        ModelsConfig,
        flags={"default": "--default-model", "discover": "--discover-models"},
        title="model pools and gray release ([models], docs/models.md)",
    ),
    Section("state", StateConfig, flags={f.name: False for f in fields(StateConfig)}),
    Section(
        "admission", AdmissionSettings, flags={f.name: False for f in fields(AdmissionSettings)}
    ),
    Section("tenants", list[TenantSettings]),
    Section("policy", PolicyConfig, flags=POLICY_FLAGS, title="policy gateway ([policy])"),
    Section("audit", AuditConfig, flags=AUDIT_FLAGS, title="audit log ([audit])"),
    Section("prewarm", PrewarmConfig, flags=PREWARM_FLAGS, title="pre-warming ([prewarm])"),
    Section(
        "fleet_view", FleetViewConfig, flags=FLEET_VIEW_FLAGS, title="fleet view ([fleet_view])"
    ),
    Section(
        "kv_events",
        KvEventsConfig,
        flags=KV_EVENTS_FLAGS,
        title="KV-cache events from the backends ([kv_events])",
    ),  # fmt: skip
)


__all__ = ["PROXY_FLAGS", "SECTIONS", "KiB", "MiB", "SECONDS", "ProxyConfig"]
