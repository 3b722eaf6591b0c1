"""The custom collectors of ``EppMetrics``: values read from their owners at scrape time, never
on the request path (what a request records goes through ``histogram``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


@dataclass(frozen=True, slots=True)
class PoolStats:
    name: str
    average_kv_cache_utilization: float
    average_queue_size: float
    ready_pods: int


class PoolCollector(Collector):
    """Pool gauges computed at scrape time from the live datastore (never stale)."""

    def __init__(self, stats: Callable[[], PoolStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self._stats()
        families = (
            (
                "inference_pool_average_kv_cache_utilization",
                "The average kv cache utilization for an inference server pool.",
                lambda s: s.average_kv_cache_utilization,
            ),
            (
                "inference_pool_average_queue_size",
                "The average number of requests pending in the model server queue.",
                lambda s: s.average_queue_size,
            ),
            (
                "inference_pool_ready_pods",
                "The number of ready pods in the inference server pool.",
                lambda s: float(s.ready_pods),
            ),
        )
        for name, doc, value in families:
            family = GaugeMetricFamily(name, doc, labels=["name"])
            if stats is not None:
                family.add_metric([stats.name], value(stats))
            yield family


class EjectedCollector(Collector):
    """``inference_extension_endpoint_ejected``: 1 per endpoint ejected now, read at scrape
    time from the outlier detector (summed over workers: how many of them eject it)."""

    def __init__(self) -> None:
        self.read: Callable[[], Iterable[str]] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "inference_extension_endpoint_ejected",
            "1 while outlier detection keeps the endpoint out of the candidates.",
            labels=["endpoint"],
        )
        for hostport in self.read() if self.read is not None else ():
            family.add_metric([hostport], 1.0)
        yield family


class PredictorCollector(Collector):
    """The latency predictor's recent TTFT error per endpoint, read at scrape time (endpoints
    that left the pool are gone from it, so the label set is the pool's)."""

    NAME = "inference_extension_latency_predictor_ttft_relative_error"

    def __init__(self) -> None:
        self.read: Callable[[], Mapping[str, float]] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            self.NAME,
            "Recent mean absolute relative error of the predicted time to first token, per "
            "endpoint (exponentially weighted over about 20 samples).",
            labels=["endpoint"],
        )
        if self.read is not None:
            for endpoint, error in sorted(self.read().items()):
                family.add_metric([endpoint], error)
        yield family


class CallbackCounter(Collector):
    """A counter whose owner keeps the count: ``read`` at scrape time, absent until set."""

    def __init__(self, name: str, documentation: str) -> None:
        self._name = name
        self._documentation = documentation
        self.read: Callable[[], float] | None = None

    def collect(self) -> Iterator[CounterMetricFamily]:
        if self.read is not None:
            yield CounterMetricFamily(self._name, self._documentation, value=self.read())
