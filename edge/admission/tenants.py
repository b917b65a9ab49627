"""Tenants: who sent a request, found from its `Authorization: Bearer <key>` header.

Keys are known only by their SHA-256 digest. A presented key is hashed once and looked up in a
dict keyed by the hex digest: the lookup's timing depends on the digest, which an attacker cannot
steer toward a stored one, so no constant-time compare is needed. No key means the anonymous
tenant, unless it is turned off (then 401); a key that is presented and unknown is always 401,
and so is more than one `Authorization` line or credential (a comma: no Bearer token has one).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from edge.admission.settings import TIERS, AdmissionSettings
from edge.errors import Unauthorized

ANONYMOUS = "anonymous"


@dataclass(frozen=True, slots=True)
class Bucket:
    """One token bucket's shape: refill `rate` per second up to `capacity`."""

    rate: float
    capacity: float

    def scaled(self, share: float) -> Bucket:
        """The same bucket at `share` of its rate and size (never below one unit of size)."""
        return Bucket(self.rate * share, max(1.0, self.capacity * share))


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    tier: str
    rank: int
    """Position of the tier in `TIERS` (0 = gold): the admission queue's priority."""
    requests: Bucket | None
    """Requests bucket (requests/s, burst); None: unlimited."""
    tokens: Bucket | None
    """Tokens bucket (tokens_per_minute / 60 per s, a minute's worth deep); None: unlimited."""
    max_concurrent: int | None

    @property
    def limited(self) -> bool:
        return self.requests is not None or self.tokens is not None


def _tenant(
    name: str, tier: str, rps: float | None, burst: int | None, tpm: int | None, cap: int | None
) -> Tenant:
    requests = None
    if rps is not None:
        requests = Bucket(rps, float(burst if burst is not None else max(1, math.ceil(rps))))
    tokens = Bucket(tpm / 60.0, float(tpm)) if tpm is not None else None
    return Tenant(name, tier, TIERS.index(tier), requests, tokens, cap)


class TenantDirectory:
    """API key digest → tenant, plus the anonymous tenant."""

    def __init__(self, settings: AdmissionSettings) -> None:
        a = settings.anonymous
        self.anonymous: Tenant | None = (
            _tenant(ANONYMOUS, a.tier, a.requests_per_second, a.burst, a.tokens_per_minute,
                    a.max_concurrent)
            if a.enabled
            else None
        )  # fmt: skip
        self.tenants: list[Tenant] = []
        self._by_digest: dict[str, Tenant] = {}
        for t in settings.tenants:
            tenant = _tenant(t.name, t.tier, t.requests_per_second, t.burst, t.tokens_per_minute,
                             t.max_concurrent)  # fmt: skip
            self.tenants.append(tenant)
            for digest in t.api_key_sha256:
                self._by_digest[digest] = tenant

    def identify(self, authorization: bytes | None) -> Tenant:
        """The tenant of a request from its Authorization header; 401 `invalid_api_key` else."""
        if authorization is None:
            if self.anonymous is None:
                raise Unauthorized(
                    "You didn't provide an API key. Send it as `Authorization: Bearer <key>`."
                )
            return self.anonymous
        if b"," in authorization:  # several lines (`read_headers` joins them) or a list
            raise Unauthorized(
                "Send one API key, in one `Authorization: Bearer <key>` header; this request"
                " carried several credentials."
            )
        scheme, _, key = authorization.strip().partition(b" ")
        key = key.strip()
        if scheme.lower() != b"bearer" or not key:
            raise Unauthorized("The Authorization header must be `Bearer <API key>`.")
        tenant = self._by_digest.get(hashlib.sha256(key).hexdigest())
        if tenant is None:
            raise Unauthorized("Incorrect API key provided.")
        return tenant


def key_digest(key: str) -> str:
    """The hex SHA-256 of an API key, as `api_key_sha256` lists it."""
    return hashlib.sha256(key.encode()).hexdigest()


__all__ = ["ANONYMOUS", "Bucket", "Tenant", "TenantDirectory", "key_digest"]
