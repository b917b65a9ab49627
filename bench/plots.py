"""PNG plots of a run (matplotlib, Agg backend, from the `bench` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_plots(records: list[dict[str, Any]], directory: Path) -> list[Path]:
    """TTFT CDF per configuration, and TTFT against the cached fraction of the prompt."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # the bench extra is not installed
        raise RuntimeError("--plots needs matplotlib: pip install 'quicedge[bench]'") from exc
    directory.mkdir(parents=True, exist_ok=True)
    by_config: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        if rec["ttft_ms"] is not None and rec["error"] is None:
            by_config.setdefault(rec["config"], []).append(rec)
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, recs in by_config.items():
        ttft = sorted(r["ttft_ms"] for r in recs)
        ax.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", label=name)
    ax.set_xlabel("TTFT (ms), as the client sees it")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(True, alpha=0.3)
    if by_config:
        ax.legend()
    path = directory / "ttft_cdf.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, recs in by_config.items():
        points = [
            (r["cached_fraction"], r["ttft_ms"]) for r in recs if r["cached_fraction"] is not None
        ]
        if points:
            ax.scatter([p[0] for p in points], [p[1] for p in points], s=12, alpha=0.6, label=name)
    ax.set_xlabel("cached fraction of the prompt (cached_tokens / prompt_tokens)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT against prefix-cache hit")
    ax.grid(True, alpha=0.3)
    if by_config:
        ax.legend()
    path = directory / "ttft_vs_cached.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
    return written
