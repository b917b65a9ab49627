"""What the edge exports on `/metrics`, read from the registry a real `build()` fills."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest

from edge.fleet_metrics import merge_expositions
from edge.wiring import build
from tests.edge.conftest import fast_config
from transport.metrics import TransportMetrics

SUFFIXES = {"histogram": ("_bucket", "_count", "_sum"), "summary": ("_count", "_sum")}


def _filled(registry: CollectorRegistry | None) -> CollectorRegistry:
    registry = registry or CollectorRegistry()

    async def fill() -> None:
        TransportMetrics(registry)
        wiring = await build(fast_config(["http://127.0.0.1:9"]), registry=registry)
        await wiring.aclose()

    asyncio.run(fill())
    return registry


def edge_families(registry: CollectorRegistry | None = None) -> dict[str, tuple[str, str]]:
    """Family name as exposed (counters with `_total`) → (type, help), for one worker's
    registry as `quicedge serve` fills it (`registry`, when given, is one `_filled` already),
    plus what the multi-worker `/metrics` adds."""
    registry = registry or _filled(None)
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


def edge_metric_names() -> set[str]:
    """Every series name a query may use: families and their histogram suffixes."""
    names: set[str] = set()
    for name, (kind, _) in edge_families().items():
        names.add(name)
        names.update(name + suffix for suffix in SUFFIXES.get(kind, ()))
    return names


def _label_names(registry: CollectorRegistry) -> dict[str, tuple[str, ...]]:
    """Label names by family (as exposed), from the collectors themselves: a labelled family
    has no samples until its first child, so the samples cannot tell."""
    labels: dict[str, tuple[str, ...]] = {}
    for collector in list(registry._collector_to_names):  # a test helper may read it
        for family in collector.collect():
            names = getattr(collector, "labelnames", None) or getattr(
                collector, "_labelnames", None
            )
            if names is None:
                names = getattr(family, "_labelnames", ())
            exposed = family.name + ("_total" if family.type == "counter" else "")
            labels[exposed] = tuple(names)
    return labels


def reference_table() -> str:
    """The metrics reference of docs/operations.md, as the code's registry has it."""
    registry = _filled(None)
    labels = _label_names(registry)
    labels["quicedge_metrics_worker_up"] = ("worker",)
    rows = ["| metric | type | labels | what it counts |", "| --- | --- | --- | --- |"]
    for name, (kind, doc) in sorted(edge_families(registry).items()):
        names = ", ".join(f"`{n}`" for n in labels.get(name, ())) or "none"
        rows.append(f"| `{name}` | {kind} | {names} | {doc.replace('|', '/')} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # python -m tests.deploy.exported: print the table
    print(reference_table(), end="")
