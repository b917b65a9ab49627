"""A request's trip in two legs, timed with the client's and the stand-in's own stamps.

The edge's own clock starts at its socket read. A request that waits in the kernel while the
edge's event loop is busy (at 32 streams, behind the other requests of a burst) is invisible
to it, and the client's TTFT mixes that wait with the client's own wake-ups on a shared core.
The stand-in (`backends.sim --record-timings N`) records, per rid, the `perf_counter()` of the
read that completed the request and of the write of its first token; the client knows when it
sent the request and when it read the first token. On one Linux host both clocks are
CLOCK_MONOTONIC, so per request:

- the *request leg*: client send → the stand-in's read of the request;
- the *response leg*: the stand-in's first-token write → the client's read of it;
- *both legs*, their sum per request: the client's TTFT less the stand-in's own time from its
  read to its first token. An edge can shorten one leg by lengthening the other (serving first
  tokens before new requests does), so the sum is what the percentiles of the two cannot tell.

Direct to the stand-in, the legs hold the loopback hops and the stand-in's own wait before its
read; through the edge, also everything the edge does and waits for on the way, including the
kernel queue in front of it. The difference of the two (edge minus direct, per percentile) is
what the edge adds to each leg.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterable, Mapping
from typing import Any

from bench.summary import rank_index

LEGS = ("request_leg_ms", "response_leg_ms", "both_legs_ms")
Stamps = dict[str, tuple[float, float | None]]
"""rid → (the stand-in's read, its first-token write or None)."""


def fetch(sim_url: str, timeout: float = 10.0) -> Stamps:
    """The stand-in's records (`GET /debug/timings`)."""
    with urllib.request.urlopen(sim_url.rstrip("/") + "/debug/timings", timeout=timeout) as r:
        data = json.load(r)
    if data.get("clock") != "perf_counter":
        raise ValueError(f"the stand-in's timings use clock {data.get('clock')!r}")
    return {t["rid"]: (float(t["read_at"]), t["first_token_at"]) for t in data["timings"]}


def _pcts(values: list[float]) -> dict[str, float] | None:
    """Nearest-rank percentiles, None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return {f"p{q}": ordered[rank_index(len(ordered), q)] for q in (50, 90, 99)}


def legs(sent: Iterable[tuple[str, float, float]], stamps: Mapping[str, Any]) -> dict[str, Any]:
    """Per-leg percentiles in ms for requests given as (rid, client send, client first token);
    `joined` counts those the stand-in recorded."""
    request: list[float] = []
    response: list[float] = []
    both: list[float] = []
    for rid, t_send, t_first in sent:
        stamp = stamps.get(rid)
        if stamp is None:
            continue
        read_at, first_at = stamp
        request.append((read_at - t_send) * 1e3)
        if first_at is not None:
            response.append((t_first - first_at) * 1e3)
            both.append(request[-1] + response[-1])
    return {
        "joined": len(request),
        "request_leg_ms": _pcts(request),
        "response_leg_ms": _pcts(response),
        "both_legs_ms": _pcts(both),
    }


def added(row: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, float | None]:
    """What `row` adds over `base` on each leg and on both, at p50 and p99 (ms)."""
    out: dict[str, float | None] = {}
    for leg in LEGS:
        for q in ("p50", "p99"):
            a, b = row.get(leg), base.get(leg)
            out[f"{leg.split('_')[0]}_{q}"] = None if a is None or b is None else a[q] - b[q]
    return out
