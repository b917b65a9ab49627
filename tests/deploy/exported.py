"""What the edge exports on `/metrics`, read from the registry a real `build()` fills."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest

from edge.fleet_metrics import merge_expositions
from edge.wiring import build
from tests.edge.conftest import fast_config
from transport.metrics import TransportMetrics

SUFFIXES = {"histogram": ("_bucket", "_count", "_sum"), "summary": ("_count", "_sum")}


def edge_families(registry: CollectorRegistry | None = None) -> dict[str, tuple[str, str]]:
    """Family name as exposed (counters with `_total`) → (type, help), for one worker's
    registry as `quicedge serve` fills it, plus what the multi-worker `/metrics` adds."""
    registry = registry or CollectorRegistry()

    async def fill() -> None:
        TransportMetrics(registry)
        wiring = await build(fast_config(["http://127.0.0.1:9"]), registry=registry)
        await wiring.aclose()

    asyncio.run(fill())
    text = merge_expositions({0: generate_latest(registry)}).decode()
    helps = {}
    families: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            _, _, name, doc = line.split(" ", 3)
            helps[name] = doc
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            if not name.endswith("_created"):  # prometheus-client's timestamps, not metrics
                families[name] = (kind, helps[name])
    return families


def edge_metric_names(registry: CollectorRegistry | None = None) -> set[str]:
    """Every series name a query may use: families and their histogram suffixes."""
    names: set[str] = set()
    for name, (kind, _) in edge_families(registry).items():
        names.add(name)
        names.update(name + suffix for suffix in SUFFIXES.get(kind, ()))
    return names
