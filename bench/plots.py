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

    def finish(fig: Any, ax: Any, xlabel: str, ylabel: str, title: str, name: str) -> Path:
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if by_config:
            ax.legend()
        path = directory / name
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, recs in by_config.items():
        ttft = sorted(r["ttft_ms"] for r in recs)
        ax.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", label=name)
    cdf = finish(
        fig, ax, "TTFT (ms), as the client sees it", "fraction of requests", "TTFT CDF",
        "ttft_cdf.png",
    )  # fmt: skip

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, recs in by_config.items():
        points = [
            (r["cached_fraction"], r["ttft_ms"]) for r in recs if r["cached_fraction"] is not None
        ]
        if points:
            ax.scatter([p[0] for p in points], [p[1] for p in points], s=12, alpha=0.6, label=name)
    cached = finish(
        fig, ax, "cached fraction of the prompt (cached_tokens / prompt_tokens)", "TTFT (ms)",
        "TTFT against prefix-cache hit", "ttft_vs_cached.png",
    )  # fmt: skip
    return [cdf, cached]
