"""Admission settings: the `[admission]` table (with its nested tables) and `[[tenants]]`.

Plain dataclasses read by `from_mapping`, which rejects unknown keys and wrong types by name;
`validate()` checks values. Everything is harmless by default: an anonymous tenant with no limits,
memory buckets, no throttle.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from redis.connection import parse_url

from transport.redacted import without_password

Tier = Literal["gold", "silver", "bronze"]
TIERS: tuple[str, ...] = ("gold", "silver", "bronze")
"""Tiers in the order the admission queue serves them."""

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(slots=True)
class TenantSettings:
    """One `[[tenants]]` entry: who it is, how its keys are recognised, what it may use."""

    name: str = ""
    """Tenant name as it appears in metrics, logs and spans; required, unique."""
    tier: Tier = "bronze"
    """SLA tier: gold | silver | bronze; the admission queue serves gold first."""
    api_key_sha256: list[str] = field(default_factory=list)
    """Hex SHA-256 digests of the tenant's API keys (the keys themselves are never stored)."""
    requests_per_second: float | None = None
    """Sustained request rate, requests/s; None: unlimited."""
    burst: int | None = None
    """Requests allowed at once above the sustained rate; default: requests_per_second rounded
    up, at least 1."""
    tokens_per_minute: int | None = None
    """Prompt + completion tokens per minute (also the token bucket's size); None: unlimited."""
    max_concurrent: int | None = None
    """Requests in flight at once in this edge process; None: unlimited."""

    def validate(self, where: str = "tenants") -> None:
        if not self.name or not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", self.name):
            raise ValueError(
                f"{where}.name: 1-64 characters of A-Z a-z 0-9 . _ -, got {self.name!r}"
            )
        if self.tier not in TIERS:
            raise ValueError(f"{where}.tier: gold, silver or bronze, got {self.tier!r}")
        for digest in self.api_key_sha256:
            if not _SHA256_HEX.fullmatch(digest):
                raise ValueError(f"{where}.api_key_sha256: 64 lowercase hex digits, got {digest!r}")
        _check_limits(where, self.requests_per_second, self.burst, self.tokens_per_minute,
                      self.max_concurrent)  # fmt: skip


@dataclass(slots=True)
class AnonymousSettings:
    """`[admission.anonymous]`: requests that carry no API key."""

    enabled: bool = True
    """Admit requests without `Authorization` as the tenant `anonymous`; false: they get 401."""
    tier: Tier = "bronze"
    """The anonymous tenant's tier (bronze)."""
    requests_per_second: float | None = None
    """As for a tenant; None: unlimited."""
    burst: int | None = None
    """As for a tenant; default requests_per_second rounded up, at least 1."""
    tokens_per_minute: int | None = None
    """As for a tenant; None: unlimited."""
    max_concurrent: int | None = None
    """As for a tenant; None: unlimited."""

    def validate(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"admission.anonymous.tier: gold, silver or bronze, got {self.tier!r}")
        _check_limits("admission.anonymous", self.requests_per_second, self.burst,
                      self.tokens_per_minute, self.max_concurrent)  # fmt: skip


@dataclass(slots=True)
class RedisSettings:
    """`[admission.redis]`: the shared bucket store and how Redis trouble is handled."""

    url: str | None = None
    """redis:// URL of the shared store; None keeps buckets in this process's memory."""
    prefix: str = "quicedge:admission:"
    """Key prefix of the bucket hashes."""
    timeout_ms: float = 5.0
    """Deadline of one Redis call, ms (5); past it the call counts as a failure."""
    slow_ms: float = 2.0
    """A call that answers but takes longer than this, ms (2), counts as slow."""
    failures_to_open: int = 3
    """Failed or slow calls in a row that open the breaker (3)."""
    backoff_s: float = 0.25
    """First wait before a probe while open, s (0.25); doubles per failed probe."""
    backoff_max_s: float = 5.0
    """Longest wait between probes, s (5)."""
    warn_interval_s: float = 10.0
    """At most one warning per this many seconds about Redis trouble (10)."""
    fallback_share: float = 1.0
    """Share of each quota one process enforces alone while Redis is unreachable, 0..1
    (1; set 1/expected_processes to keep the fleet's total near the quota)."""

    def validate(self) -> None:
        if self.url is not None and not self.url.startswith(("redis://", "rediss://", "unix://")):
            shown = without_password(self.url)
            raise ValueError(f"admission.redis.url: redis://HOST:PORT/DB, got {shown!r}")
        if self.url is not None:
            try:  # as the client reads it: a bad port ended each worker at its start
                parse_url(self.url)
            except ValueError as exc:
                raise ValueError(f"admission.redis.url: {exc}") from None
        for name in ("timeout_ms", "slow_ms", "backoff_s", "backoff_max_s", "warn_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"admission.redis.{name}: must be > 0")
        if self.backoff_max_s < self.backoff_s:
            raise ValueError("admission.redis.backoff_max_s: must be >= backoff_s")
        if self.failures_to_open < 1:
            raise ValueError("admission.redis.failures_to_open: must be >= 1")
        if not 0 < self.fallback_share <= 1:
            raise ValueError("admission.redis.fallback_share: must be in (0, 1]")


@dataclass(slots=True)
class ThrottleSettings:
    """`[admission.throttle]`: queue-depth throttling and the admission queue."""

    max_queue_depth: int | None = None
    """A backend's queue depth (requests waiting) at which it gets no new work; None: the
    throttle and the admission queue are off."""
    depth: Literal["waiting", "in_flight"] = "waiting"
    """What counts as a backend's queue: `waiting` is the larger of its reported waiting
    requests and this edge's requests on it without a first token; `in_flight` is every request
    this edge has on it (bounds the backend's running batch too, hence its KV use)."""
    start_fraction: float = 0.8
    """Depth (share of the maximum) where admission starts to fall linearly to zero (0.8)."""
    queue_size: int = 256
    """Requests that may wait for a backend at once; beyond it 503 at once (256)."""
    queue_timeout_s: float = 5.0
    """Longest wait in the admission queue, s (5); then 503 with Retry-After."""
    recheck_s: float = 0.05
    """How often the head of the queue looks again without being woken, s (0.05)."""

    def validate(self) -> None:
        if self.max_queue_depth is not None and self.max_queue_depth < 1:
            raise ValueError("admission.throttle.max_queue_depth: must be >= 1")
        if not 0 < self.start_fraction < 1:
            raise ValueError("admission.throttle.start_fraction: must be in (0, 1)")
        if self.queue_size < 0:
            raise ValueError("admission.throttle.queue_size: must be >= 0")
        for name in ("queue_timeout_s", "recheck_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"admission.throttle.{name}: must be > 0")


@dataclass(slots=True)
class AdmissionSettings:
    """`[admission]` plus the document's `[[tenants]]` array."""

    anonymous: AnonymousSettings = field(default_factory=AnonymousSettings)
    """Requests without an API key."""
    redis: RedisSettings = field(default_factory=RedisSettings)
    """Shared buckets (off: memory)."""
    throttle: ThrottleSettings = field(default_factory=ThrottleSettings)
    """Queue-depth throttle and admission queue (off)."""
    tenants: list[TenantSettings] = field(default_factory=list, metadata={"load": False})
    """Tenants with API keys (`[[tenants]]` at the top of the TOML document)."""

    def validate(self) -> None:
        self.anonymous.validate()
        self.redis.validate()
        self.throttle.validate()
        names: set[str] = set()
        digests: set[str] = set()
        for i, tenant in enumerate(self.tenants):
            tenant.validate(f"tenants[{i}]")
            if tenant.name in names or tenant.name == "anonymous":
                raise ValueError(f"tenants[{i}].name: {tenant.name!r} is taken")
            names.add(tenant.name)
            for digest in tenant.api_key_sha256:
                if digest in digests:
                    raise ValueError(f"tenants[{i}].api_key_sha256: a key is listed twice")
                digests.add(digest)

    @classmethod
    def from_toml(cls, document: Mapping[str, Any]) -> AdmissionSettings:
        """From a parsed TOML document: its `[admission]` table and `[[tenants]]` array."""
        section = document.get("admission", {})
        if not isinstance(section, Mapping):
            raise ValueError("admission: must be a table")
        values = dict(section)
        if "tenants" in values:
            raise ValueError("admission.tenants: write tenants as top-level [[tenants]]")
        if "tenants" in document:
            values["tenants"] = document["tenants"]
        settings = cls.from_mapping(values)
        settings.validate()
        return settings

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> AdmissionSettings:
        return from_mapping(cls, values, "admission")


def _check_limits(
    where: str, rps: float | None, burst: int | None, tpm: int | None, concurrent: int | None
) -> None:
    if rps is not None and not (math.isfinite(rps) and rps > 0):  # TOML reads inf and nan too
        raise ValueError(f"{where}.requests_per_second: must be a finite number > 0, got {rps}")
    if burst is not None and burst < 1:
        raise ValueError(f"{where}.burst: must be >= 1")
    if burst is not None and rps is None:
        raise ValueError(f"{where}.burst: needs requests_per_second")
    if tpm is not None and tpm < 1:
        raise ValueError(f"{where}.tokens_per_minute: must be >= 1")
    if concurrent is not None and concurrent < 1:
        raise ValueError(f"{where}.max_concurrent: must be >= 1")


T = TypeVar("T")


def from_mapping(cls: type[T], values: Mapping[str, Any], where: str) -> T:
    """Build dataclass `cls` from TOML-style values, by its field types; unknown keys and wrong
    types raise ValueError naming `where.key`."""
    if not isinstance(values, Mapping):
        raise ValueError(f"{where}: must be a table")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{where}: unknown setting(s) {', '.join(unknown)}")
    kwargs = {
        name: _coerce(hints[name], value, f"{where}.{name}") for name, value in values.items()
    }
    return cls(**kwargs)


def _coerce(kind: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(kind)
        if value is None and type(None) in options:
            return None
        (inner,) = [o for o in options if o is not type(None)]
        return _coerce(inner, value, where)
    if origin is Literal:
        if value not in typing.get_args(kind):
            choices = " | ".join(str(a) for a in typing.get_args(kind))
            raise ValueError(f"{where}: one of {choices}, got {value!r}")
        return value
    if origin is list:
        (item,) = typing.get_args(kind)
        if not isinstance(value, list):
            raise ValueError(f"{where}: must be a list")
        return [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(kind):
        return from_mapping(kind, value, where)  # type: ignore[arg-type]
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: must be true or false, got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: must be an integer, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where}: must be a number, got {value!r}")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: must be a string, got {value!r}")
        return value
    raise TypeError(f"{where}: unsupported setting type {kind!r}")


__all__ = [
    "TIERS",
    "AdmissionSettings",
    "AnonymousSettings",
    "RedisSettings",
    "TenantSettings",
    "ThrottleSettings",
    "Tier",
    "from_mapping",
]
