"""What a request records its metrics through: a lock-free histogram for code that runs on one
event loop, exposed via prometheus_client, and a cache of prometheus_client's labelled children.

``prometheus_client.Histogram.observe`` takes a lock per bucket update and scans the buckets
linearly: several microseconds, paid a dozen times per request. Everything here runs on the
event loop thread, so a bisect and two additions suffice; the standard custom-collector API
(``HistogramMetricFamily``) turns the counts into the exposition format.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class HistogramChild:
    """One label set's counts: ``counts[i]`` observations fell in ``(bound[i-1], bound[i]]``."""

    __slots__ = ("_bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last slot is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self._bounds, value)] += 1
        self.total += value


class LoopHistogram(Collector):
    """A labelled histogram; register it with a ``CollectorRegistry`` like any collector."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]
    ) -> None:
        bounds = tuple(float(b) for b in buckets if not math.isinf(b))
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"{name}: buckets must be strictly increasing")
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._bounds = bounds
        # the same `le` text as prometheus_client (which ships this helper untyped)
        self._le = [floatToGoString(b) for b in bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        self._children: dict[tuple[str, ...], HistogramChild] = {}

    def labels(self, *values: str) -> HistogramChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self._labelnames):
                raise ValueError(f"{self._name}: expected labels {self._labelnames}")
            child = self._children[values] = HistogramChild(self._bounds)
        return child

    def observe(self, value: float) -> None:
        """For a histogram without labels."""
        self.labels().observe(value)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            self._name, self._documentation, labels=list(self._labelnames)
        )
        for values, child in self._children.items():
            cumulative, running = [], 0
            for le, count in zip(self._le, child.counts, strict=True):
                running += count
                cumulative.append((le, float(running)))
            family.add_metric(list(values), cumulative, child.total)
        yield family

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self._name, self._documentation, labels=list(self._labelnames))


class Children:
    """Cached ``metric.labels(...)`` children: prometheus_client's lookup costs microseconds.

    Bounded because label values are bounded (``EppMetrics`` caps model names).
    """

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._cache: dict[tuple[str, ...], Any] = {}

    def __call__(self, *labels: str) -> Any:
        child = self._cache.get(labels)
        if child is None:
            child = self._cache[labels] = self._metric.labels(*labels)
        return child
