"""Per-turn figures of a multi-turn run: what the client sent and its TTFT at chosen turns.

With `--turns 10 20`, `quicedge bench` prints, for each configuration and each of those turns
(counted from 1), the requests that reached it, the client's request bytes (body and headers;
p50) and TTFT p50/p99, so a stored conversation (`+stored`) can be set against full-history resend.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from bench.summary import nearest_rank


def _percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100): a measured value, so with 10 requests p99 is the
    slowest (the summary table interpolates between ranks instead)."""
    return nearest_rank(values, q)


def by_turn(records: Iterable[dict[str, Any]], turns: Sequence[int]) -> list[dict[str, Any]]:
    """One row per (configuration, turn): n, request bytes p50, TTFT p50 and p99 (ms)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for rec in records:
        number = rec["turn"] + 1
        if number in turns and rec.get("error") is None and rec.get("ttft_ms") is not None:
            groups.setdefault((rec["config"], number), []).append(rec)
    rows = []
    for (config, number), recs in sorted(groups.items(), key=lambda item: (item[0][1], item[0][0])):
        ttft = [r["ttft_ms"] for r in recs]
        sizes = [r["request_bytes"] for r in recs if r.get("request_bytes") is not None]
        rows.append(
            {
                "config": config,
                "turn": number,
                "n": len(recs),
                "request_bytes_p50": _percentile(sizes, 50),
                "ttft_p50_ms": _percentile(ttft, 50),
                "ttft_p99_ms": _percentile(ttft, 99),
            }
        )
    return rows


def format_turns(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["config         turn    n   request bytes p50   TTFT p50 ms   TTFT p99 ms"]
    for row in rows:
        size = row["request_bytes_p50"]
        lines.append(
            f"{row['config']:<14} {row['turn']:>4} {row['n']:>4}   "
            f"{size if size is not None else '-':>17}   {row['ttft_p50_ms']:>11.1f}   "
            f"{row['ttft_p99_ms']:>11.1f}"
        )
    return "\n".join(lines)
