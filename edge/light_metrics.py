"""Per-request metrics without locks: plain counts, turned into the exposition when scraped.

`prometheus_client` guards every `labels()` and every `observe()`/`inc()` with a lock, to be safe
under threads: ~3 µs a call, and a request of the edge makes about a dozen. The app runs on one
event loop thread, so these keep plain per-label counts; a scrape (also on that thread, or a
racing read of ints and floats that at worst is one request behind) builds the same families a
labelled `Histogram` or `Counter` would expose, minus the `_created` samples.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Container, Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry


class HistogramChild:
    """Bucket counts of one label set; `observe` is a bisect and two additions."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self._bounds, value)] += 1
        self.sum += value

    def observe_many(self, values: Sequence[float]) -> None:
        bounds, counts = self._bounds, self.counts
        for value in values:
            counts[bisect_left(bounds, value)] += 1
        self.sum += sum(values)


class CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        """Add `amount`; one that is not above 0 (a count a backend reported negative, or NaN)
        is left out: a counter that went down would read to Prometheus as a restart, and
        `rate()` would take all it had counted as new. (prometheus_client raises instead, which
        here would fail the request that counts it.)"""
        if amount > 0:
            self.value += amount


Child = TypeVar("Child", HistogramChild, CounterChild)


class _Metric(Collector, Generic[Child]):
    """Children by label values, made on first use."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], Child] = {}
        self._bound: tuple[int, Callable[[], Container[str]]] | None = None
        if not self.labelnames:
            self.labels()  # exposed from the start, as prometheus_client does
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str) -> Child:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            child = self._children[values] = self._new_child()
        return child

    def bound(self, label: str, values: Callable[[], Container[str]]) -> None:
        """Keep only the children whose `label` is among `values()`, read at each scrape: for
        a label that names something which may go away (a backend that left the fleet), so
        that its series leave the exposition with it instead of piling up."""
        self._bound = (self.labelnames.index(label), values)

    def _live(self) -> list[tuple[tuple[str, ...], Child]]:
        """The children to expose, once those `bound` rules out are dropped."""
        if self._bound is not None:
            index, values = self._bound
            live = values()
            for key in list(self._children):  # a copy: a request may add one meanwhile
                if key[index] not in live:
                    self._children.pop(key, None)
        return list(self._children.items())

    def _new_child(self) -> Child:
        raise NotImplementedError

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        raise NotImplementedError

    def describe(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        return self.collect()  # the registry takes the names from here


class LightHistogram(_Metric[HistogramChild]):
    """A labelled histogram; `labels(*values)` returns the child to `observe` on."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry | None = None,
    ) -> None:
        self._bounds = tuple(sorted(float(b) for b in buckets))
        super().__init__(name, documentation, labelnames, registry=registry)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self._bounds)

    def observe(self, value: float) -> None:
        """For a histogram without labels."""
        self.labels().observe(value)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        edges = [*(repr(b) for b in self._bounds), "+Inf"]
        for values, child in self._live():
            cumulative, running = [], 0
            for edge, count in zip(edges, child.counts, strict=True):
                running += count
                cumulative.append((edge, running))
            family.add_metric(list(values), cumulative, child.sum)
        yield family


class LightCounter(_Metric[CounterChild]):
    """A labelled counter; exposed as `<name>_total`, as prometheus_client does."""

    def _new_child(self) -> CounterChild:
        return CounterChild()

    def inc(self, amount: float = 1.0) -> None:
        """For a counter without labels."""
        self.labels().inc(amount)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._live():
            family.add_metric(list(values), child.value)
        yield family
