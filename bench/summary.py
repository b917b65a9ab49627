"""Summaries of recorded requests: TTFT, ITL and latency percentiles, throughput, hit rate,
early data and errors, per configuration; as a table and as JSON."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def nearest_rank(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100): the smallest value with at least q % of the values
    at or below it, always a measured value (the p99 of 10 values is the slowest, of 100 the
    99th); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[rank_index(len(ordered), q)]


def rank_index(n: int, q: float) -> int:
    """Where `nearest_rank` finds the q-th percentile (q in 0..100) in n > 0 sorted values."""
    rank = math.ceil(n * q / 100.0 - 1e-9)  # 1e-9: 0.99 * 100 is 99.00000000000001
    return min(n, max(1, rank)) - 1


def _dist(values: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {"mean": statistics.fmean(values) if values else None}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q)
    return out


def summarize(records: Iterable[dict[str, Any]], *, duration_s: float) -> dict[str, Any]:
    """One entry per configuration, in first-seen order."""
    by_config: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        by_config.setdefault(rec["config"], []).append(rec)
    return {name: _summary(recs, duration_s) for name, recs in by_config.items()}


def _summary(records: list[dict[str, Any]], duration_s: float) -> dict[str, Any]:
    ok: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    for r in records:
        completed = r["error"] is None and r["status"] == 200 and r["ttft_ms"]
        (ok if completed else failed).append(r)
    ttft = [r["ttft_ms"] for r in ok]
    itl = [gap for r in ok for gap in r["itl_ms"]]
    latency = [r["latency_ms"] for r in ok]
    prompt = sum(r["prompt_tokens"] or 0 for r in ok)
    cached = sum(r["cached_tokens"] or 0 for r in ok)
    output = sum(r["completion_tokens"] or 0 for r in ok)
    errors: dict[str, int] = {}
    for r in failed:
        key = r["error"] or f"status {r['status']}"
        errors[key] = errors.get(key, 0) + 1
    backends: dict[str, int] = {}
    for r in ok:
        backends[r["backend"] or "-"] = backends.get(r["backend"] or "-", 0) + 1
    return {
        "transport": records[0]["transport"],
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": errors,
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else None,
        "output_throughput": output / duration_s if duration_s > 0 else None,
        "ttft_ms": _dist(ttft),
        "itl_ms": _dist(itl),
        "latency_ms": _dist(latency),
        "total_prompt_tokens": prompt,
        "total_cached_tokens": cached,
        "total_output_tokens": output,
        "cache_hit_rate": cached / prompt if prompt else None,
        "early_data_accepted": sum(1 for r in records if r["early_data"]),
        "early_data_attempted": sum(1 for r in records if r["early_data_attempted"]),
        "backends": backends,
    }


def format_table(summary: dict[str, Any]) -> str:
    """Metrics down, configurations across."""
    names = list(summary)
    rows: list[tuple[str, list[str]]] = []

    def num(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    def add(label: str, fn: Any) -> None:
        rows.append((label, [fn(summary[n]) for n in names]))

    add("transport", lambda s: s["transport"])
    add("completed / requests", lambda s: f"{s['completed']}/{s['requests']}")
    for metric, title in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("latency_ms", "E2E latency")):
        add(f"mean {title} (ms)", lambda s, m=metric: num(s[m]["mean"], 2))
        for q in PERCENTILES:
            add(f"p{q} {title} (ms)", lambda s, m=metric, q=q: num(s[m][f"p{q}"], 2))
    add("request throughput (req/s)", lambda s: num(s["request_throughput"], 2))
    add("output throughput (tok/s)", lambda s: num(s["output_throughput"], 1))
    add(
        "cache hit rate",
        lambda s: "-" if s["cache_hit_rate"] is None else f"{s['cache_hit_rate']:.1%}",
    )
    add("early data accepted", lambda s: f"{s['early_data_accepted']}/{s['early_data_attempted']}")
    add("errors", lambda s: str(s["failed"]))
    label_width = max(len(label) for label, _ in rows)
    widths = [max(len(n), *(len(r[1][i]) for r in rows)) for i, n in enumerate(names)]
    lines = [
        " " * label_width + "  " + "  ".join(n.rjust(w) for n, w in zip(names, widths, strict=True))
    ]
    lines.append("-" * len(lines[0]))
    for label, values in rows:
        cells = "  ".join(v.rjust(w) for v, w in zip(values, widths, strict=True))
        lines.append(f"{label:<{label_width}}  {cells}")
    for name in names:
        for error, count in summary[name]["errors"].items():
            lines.append(f"{name}: {count} x {error}")
    return "\n".join(lines)
