"""OpenAI's rate-limit headers, from a tenant's buckets as a take left them.

Every answer to a tenant with a quota carries, per bucket it has (`requests`, `tokens`),
`x-ratelimit-limit-*` (the bucket's size: the burst of requests, a minute's tokens),
`x-ratelimit-remaining-*` (what it holds now, whole units, never below 0) and
`x-ratelimit-reset-*` (how long until it is full again, as OpenAI writes it: `12ms`, `1.5s`,
`6m0s`). Clients and SDK helpers pace themselves on them. A 429 also carries `retry-after-ms`,
which the OpenAI SDKs read before `retry-after`: they retry after the exact wait, not a second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from edge.admission.tenants import Bucket


@dataclass(frozen=True, slots=True)
class Standing:
    """One bucket after a take (before it, when the take was refused)."""

    name: str
    """`requests` or `tokens`."""
    bucket: Bucket
    """Its shape as it applied (scaled to this process's share while Redis is out)."""
    level: float


def duration(seconds: float) -> str:
    """`seconds` as OpenAI's headers write a wait: `0s`, `12ms`, `1.5s`, `6m0s`, `1h2m3s`."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    whole = round(seconds, 3)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{int(hours)}h{int(minutes)}m{text}"
    if minutes:
        return f"{int(minutes)}m{text}"
    return text


def ratelimit_headers(standings: tuple[Standing, ...]) -> list[tuple[bytes, bytes]]:
    out: list[tuple[bytes, bytes]] = []
    for s in standings:
        bucket, name = s.bucket, s.name.encode()
        reset = max(0.0, bucket.capacity - s.level) / bucket.rate
        out += [
            (b"x-ratelimit-limit-" + name, b"%d" % math.floor(bucket.capacity)),
            (b"x-ratelimit-remaining-" + name, b"%d" % max(0, math.floor(s.level))),
            (b"x-ratelimit-reset-" + name, duration(reset).encode()),
        ]
    return out


def retry_after(wait: float) -> tuple[tuple[bytes, bytes], ...]:
    """`retry-after` (whole seconds, at least 1, as HTTP has it) and `retry-after-ms`."""
    return (
        (b"retry-after", b"%d" % max(1, math.ceil(wait))),
        (b"retry-after-ms", b"%d" % max(1, math.ceil(wait * 1000))),
    )


__all__ = ["Standing", "duration", "ratelimit_headers", "retry_after"]
