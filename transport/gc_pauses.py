"""How long the garbage collector stops this process, per collection, by generation.

A collection runs inside whatever allocation set it off, on the event loop's thread, so every
request in flight waits it out. A full collection walks every object the collector tracks,
apart from the startup heap that `transport.collector.prepare_collector` freezes before serving.
`serve` keeps collections rare (a young threshold of 10,000, and a prefix tree the collector does
not track: docs/benchmarks.md, "Seventh pass"), so each one this histogram counts is worth a
look. No per-request histogram shows this stall as such; this one does.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Protocol


class _Observer(Protocol):
    def observe(self, value: float) -> None: ...


class _Labelled(Protocol):
    def labels(self, *values: str) -> _Observer: ...


class GcPauseProbe:
    """Times each collection into `histogram.labels(generation)` while started."""

    def __init__(self, histogram: _Labelled) -> None:
        self._by_generation = [histogram.labels(str(g)) for g in range(3)]
        self._started = 0.0

    def start(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def stop(self) -> None:
        """Idempotent."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started:
            self._by_generation[info["generation"]].observe(time.perf_counter() - self._started)
            self._started = 0.0
