"""The EPP's own Prometheus metrics, named as the reference EPP of the InferenceModel era (v0.5).

Existing dashboards query these names, label sets and buckets. Each app owns one registry
(no global state), served as text by the app's metrics server on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from endpoint_picker.errors import ErrorCode
from endpoint_picker.telemetry.histogram import LoopHistogram

_DURATION_BUCKETS = (
    0.005,
    0.025,
    0.05,
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1.0,
    1.25,
    1.5,
    2,
    3,
    4,
    5,
    6,
    8,
    10,
    15,
    20,
    30,
    45,
    60,
    120,
    180,
    240,
    300,
    360,
    480,
    600,
    900,
    1200,
    1800,
    2700,
    3600,
)
# The reference EPP's tables, exactly: dashboards keyed on `le` depend on them (its 32778 in
# the response-size and input-token tables, beside 32768 for request sizes, is kept as is).
_REQUEST_SIZE_BUCKETS = (
    64,
    128,
    256,
    512,
    1024,
    2048,
    4096,
    8192,
    16384,
    32768,
    65536,
    131072,
    262144,
    524288,
    1048576,
    2097152,
    4194304,
    8388608,
    16777216,
    33554432,
    67108864,
    134217728,
    268435456,
    536870912,
    1073741824,
)
_RESPONSE_SIZE_BUCKETS = (
    1,
    8,
    16,
    32,
    64,
    128,
    256,
    512,
    1024,
    2048,
    4096,
    8192,
    16384,
    32778,
    65536,
)
_INPUT_TOKEN_BUCKETS = (
    1,
    8,
    16,
    32,
    64,
    128,
    256,
    512,
    1024,
    2048,
    4096,
    8192,
    16384,
    32778,
    65536,
    131072,
    262144,
    524288,
    1048576,
)
_OUTPUT_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
_SCHEDULER_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclass(frozen=True, slots=True)
class PoolStats:
    name: str
    average_kv_cache_utilization: float
    average_queue_size: float
    ready_pods: int


class _PoolCollector(Collector):
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


class _EjectedCollector(Collector):
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


class _PredictorCollector(Collector):
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


class _CallbackCounter(Collector):
    """A counter whose owner keeps the count: ``read`` at scrape time, absent until set."""

    def __init__(self, name: str, documentation: str) -> None:
        self._name = name
        self._documentation = documentation
        self.read: Callable[[], float] | None = None

    def collect(self) -> Iterator[CounterMetricFamily]:
        if self.read is not None:
            yield CounterMetricFamily(self._name, self._documentation, value=self.read())


class _Children:
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


# Our error kinds as the reference EPP labels `error_code` (dashboards filter on these).
_REFERENCE_ERROR_CODES = {
    ErrorCode.BAD_REQUEST: "BadRequest",
    ErrorCode.PAYLOAD_TOO_LARGE: "BadRequest",
    ErrorCode.NOT_FOUND: "BadConfiguration",
    ErrorCode.RESOURCE_EXHAUSTED: "InferencePoolResourceExhausted",
    ErrorCode.HEADERS_TOO_LARGE: "BadRequest",
    ErrorCode.SERVICE_UNAVAILABLE: "ServiceUnavailable",
    ErrorCode.INTERNAL: "Internal",
}
MODEL_SERVER_ERROR = "ModelServerError"  # the model server answered with an error status
# Clients choose model names: a name the pool does not configure gets a label of its own only
# when the EPP routes it (a pool that passes unknown models), and past this many such names new
# ones are labelled "other", so a stream of made-up names cannot grow /metrics without bound.
# Names the pool configures are bounded by the pool itself and never count against this budget.
MAX_MODEL_LABELS = 1000
MAX_LABEL_LENGTH = 256
OTHER_MODELS = "other"
# The pool source's outcomes (datastore.sources.file.ReloadResult, which this layer cannot import)
POOL_RELOAD_RESULTS = ("applied", "rejected_empty", "invalid")


def _nothing_configured(name: str) -> bool:
    return False


def _event_loop_tasks() -> float:
    """Tasks not yet done in the running event loop; 0 when there is none (a rendering thread)."""
    try:
        return float(len(asyncio.all_tasks()))
    except RuntimeError:  # no running event loop in this thread
        return 0.0


class EppMetrics:
    """Every metric the EPP exports; also the scheduler's timing observer.

    Histograms are ``LoopHistogram``s (lock-free, event-loop only); counters and the gauge are
    prometheus_client's, with their label children cached.
    """

    def __init__(
        self,
        pool_stats: Callable[[], PoolStats | None] | None = None,
        is_configured_model: Callable[[str], bool] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # The standard process_* (memory, CPU, open fds) and python_* families that
        # prometheus_client's global registry would carry; ours is per app, so register them.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self._is_configured = is_configured_model or _nothing_configured
        model_labels = ["model_name", "target_model_name"]
        self.request_total = Counter(
            "inference_model_request",
            "Counter of inference model requests broken out for each model and target model.",
            model_labels,
            registry=r,
        )
        self.request_error_total = Counter(
            "inference_model_request_error",
            "Counter of inference model requests errors broken out for each model and target "
            "model.",
            [*model_labels, "error_code"],
            registry=r,
        )
        self.running_requests = Gauge(
            "inference_model_running_requests",
            "Inference model number of running requests in each model.",
            ["model_name"],
            registry=r,
        )
        self.invalid_usage_total = Counter(
            "inference_extension_model_server_invalid_usage",
            "Responses whose token usage was not a plausible count (negative, fractional, "
            "absurdly large or not a number) and was left out of the token histograms.",
            model_labels,
            registry=r,
        )
        histograms: tuple[tuple[str, str, str, list[str], tuple[float, ...]], ...] = (
            ("request_duration", "inference_model_request_duration_seconds",
             "Inference model response latency distribution in seconds for each model and "
             "target model.", model_labels, _DURATION_BUCKETS),
            ("request_sizes", "inference_model_request_sizes",
             "Inference model requests size distribution in bytes for each model and target "
             "model.", model_labels, _REQUEST_SIZE_BUCKETS),
            ("response_sizes", "inference_model_response_sizes",
             "Inference model responses size distribution in bytes for each model and target "
             "model.", model_labels, _RESPONSE_SIZE_BUCKETS),
            ("input_tokens", "inference_model_input_tokens",
             "Inference model input token count distribution for requests in each model.",
             model_labels, _INPUT_TOKEN_BUCKETS),
            ("output_tokens", "inference_model_output_tokens",
             "Inference model output token count distribution for requests in each model.",
             model_labels, _OUTPUT_TOKEN_BUCKETS),
            ("scheduler_e2e", "inference_extension_scheduler_e2e_duration_seconds",
             "Scheduling end-to-end latency distribution in seconds.", [], _SCHEDULER_BUCKETS),
            ("plugin_durations", "inference_extension_plugin_duration_seconds",
             "Plugin processing latency distribution in seconds for each extension point, "
             "plugin type and plugin name.",
             ["extension_point", "plugin_type", "plugin_name"], _SCHEDULER_BUCKETS),
            ("flow_queue_duration",
             "inference_extension_flow_control_request_queue_duration_seconds",
             "Time requests spent in the flow-control queue, by priority band and outcome "
             "(dispatched, rejected, evicted, expired, cancelled).",
             ["priority", "outcome"], _QUEUE_BUCKETS),
            ("prefix_hit_ratio", "inference_extension_prefix_indexer_hit_ratio",
             "Ratio of prefix length matched to the request's prefix length (the best "
             "endpoint's match, per request).", [], _RATIO_BUCKETS),
        )  # fmt: skip
        for attribute, name, doc, labels, buckets in histograms:
            histogram = LoopHistogram(name, doc, labels, buckets)
            r.register(histogram)
            setattr(self, attribute, histogram)
        self.request_duration: LoopHistogram
        self.request_sizes: LoopHistogram
        self.response_sizes: LoopHistogram
        self.input_tokens: LoopHistogram
        self.output_tokens: LoopHistogram
        self.scheduler_e2e: LoopHistogram
        self.plugin_durations: LoopHistogram
        self.prefix_hit_ratio: LoopHistogram
        self.flow_queue_duration: LoopHistogram
        self.flow_queue_size = Gauge(
            "inference_extension_flow_control_queue_size",
            "Requests waiting in the flow-control queue, by priority band.",
            ["priority"],
            registry=r,
        )
        self.flow_queue_bytes = Gauge(
            "inference_extension_flow_control_queue_bytes",
            "Request body bytes waiting in the flow-control queue, by priority band.",
            ["priority"],
            registry=r,
        )
        self.prefix_indexer_size = Gauge(
            "inference_extension_prefix_indexer_size",
            "Size of the prefix indexer: block hashes held over every endpoint.",
            registry=r,
        )
        self._model_labels: set[str] = set()  # names labelled as themselves so far
        self._minted = 0  # of which not configured by the pool (at most MAX_MODEL_LABELS)
        self._request_total = _Children(self.request_total)
        self._request_error_total = _Children(self.request_error_total)
        self._running_requests = _Children(self.running_requests)
        self._invalid_usage_total = _Children(self.invalid_usage_total)
        if pool_stats is not None:
            r.register(_PoolCollector(pool_stats))
        self._predictor = _PredictorCollector()
        r.register(self._predictor)
        # The pool source (datastore/sources/file.py) reports each settled change it handles.
        self.pool_reload_total = Counter(
            "inference_extension_pool_reload",
            "Settled changes of the pool source by outcome: applied, rejected_empty (would have "
            "removed every pod) or invalid (missing, unreadable or not a valid pool).",
            ["result"],
            registry=r,
        )
        for result in POOL_RELOAD_RESULTS:  # every outcome exported from the start, at 0
            self.pool_reload_total.labels(result)
        self.pool_source_healthy = Gauge(
            "inference_extension_pool_source_healthy",
            "1 while the pool source's current content is the pool in force; 0 while it is "
            "refused and the last good pool is kept.",
            registry=r,
        )
        # The ext_proc server's process-wide limits (extproc/limits.py); the gauges are read
        # at scrape time through ``track_limits``, so the hot path never touches them.
        self.buffered_request_bytes = Gauge(
            "inference_extension_buffered_request_bytes",
            "Bytes of request bodies held before routing, all ext_proc streams together.",
            registry=r,
        )
        self.ext_proc_streams = Gauge(
            "inference_extension_ext_proc_streams", "Open ext_proc streams.", registry=r
        )
        self.buffer_budget_rejections = Counter(
            "inference_extension_buffer_budget_rejections",
            "Requests answered 429 because the buffered request bodies were at their budget.",
            registry=r,
        )
        self.stream_limit_rejections = Counter(
            "inference_extension_stream_limit_rejections",
            "ext_proc streams answered 429 because the concurrent-stream limit was reached.",
            registry=r,
        )
        # Scraping the model servers (metrics/scraper.py), read at scrape time through
        # ``track_scraping``: with hundreds of endpoints the CPU budget stretches the interval.
        self.scrape_interval = Gauge(
            "inference_extension_metrics_refresh_interval_seconds",
            "Seconds between two scrapes of one model server now: the configured refresh "
            "interval, or longer when scraping every endpoint at it would exceed the CPU budget.",
            registry=r,
        )
        self.scrape_cpu_share = Gauge(
            "inference_extension_metrics_scrape_cpu_share",
            "Estimated fraction of one core that scraping the model servers uses.",
            registry=r,
        )
        self._scrapes_deferred = _CallbackCounter(
            "inference_extension_metrics_scrape_steps_deferred",
            "Scrape steps (a send or a parse) that waited for a later event-loop turn because "
            "scrapes that came due together had used this turn's share.",
        )
        r.register(self._scrapes_deferred)
        # Read when /metrics is rendered, which the metrics server does on the event loop; a
        # count that climbs under steady load is a leak (epp bench soak watches it).
        self.event_loop_tasks = Gauge(
            "inference_extension_event_loop_tasks",
            "asyncio tasks not yet done in the EPP's event loop (0 when rendered off the loop).",
            registry=r,
        )
        self.event_loop_tasks.set_function(_event_loop_tasks)
        # Outlier detection (datastore/health.py): labelled by the pool's endpoints, whose
        # series are removed when they leave the pool.
        self.endpoint_failures = Counter(
            "inference_extension_endpoint_failures",
            "Routed requests that failed on an endpoint, by kind: 5xx (a 5xx response, Envoy's "
            "503 for a reset included), connect (Envoy could not connect) or retried (Envoy "
            "retried past it to a fallback endpoint).",
            ["endpoint", "kind"],
            registry=r,
        )
        self.endpoint_ejections = Counter(
            "inference_extension_endpoint_ejections",
            "Times outlier detection ejected the endpoint.",
            ["endpoint"],
            registry=r,
        )
        self._failure_labels: set[tuple[str, str]] = set()
        self._ejected = _EjectedCollector()
        r.register(self._ejected)

    # -- the scheduler's observer protocol ----------------------------------------------------

    def plugin_duration(
        self, extension_point: str, plugin_type: str, plugin_name: str, seconds: float
    ) -> None:
        self.plugin_durations.labels(extension_point, plugin_type, plugin_name).observe(seconds)

    def scheduler_duration(self, seconds: float) -> None:
        self.scheduler_e2e.observe(seconds)

    # -- request lifecycle ----------------------------------------------------------------------

    def _label(self, model: str, mint: bool = False) -> str:
        """``model`` as a label value: itself when the pool configures it or it was minted
        before; minted (``mint``: the EPP routed it) while the budget lasts; else "other". A
        name the EPP refuses (a 404 for an unknown model) never becomes a series of its own."""
        if model in self._model_labels or not model:  # "": refused before a model was read
            return model
        if len(model) > MAX_LABEL_LENGTH:
            return OTHER_MODELS
        if self._is_configured(model):
            self._model_labels.add(model)  # bounded by the pool's own configuration
            return model
        if not mint or self._minted >= MAX_MODEL_LABELS:
            return OTHER_MODELS
        self._minted += 1
        self._model_labels.add(model)
        return model

    def request_started(self, model: str, target: str, request_bytes: int) -> None:
        if not model:  # requests without a model (GET /v1/models) are not model traffic
            return
        model, target = self._label(model, mint=True), self._label(target, mint=True)
        self._request_total(model, target).inc()
        self.request_sizes.labels(model, target).observe(request_bytes)
        self._running_requests(model).inc()

    def request_failed(self, model: str, target: str, code: ErrorCode | str) -> None:
        error_code = code if isinstance(code, str) else _REFERENCE_ERROR_CODES[code]
        self._request_error_total(self._label(model), self._label(target), error_code).inc()

    def request_finished(
        self,
        model: str,
        target: str,
        *,
        seconds: float,
        response_bytes: int,
        input_tokens: int | None,
        output_tokens: int | None,
        invalid_usage: bool = False,
    ) -> None:
        if not model:
            return
        model, target = self._label(model), self._label(target)
        self._running_requests(model).dec()
        if invalid_usage:
            self._invalid_usage_total(model, target).inc()
        self.request_duration.labels(model, target).observe(seconds)
        self.response_sizes.labels(model, target).observe(response_bytes)
        if input_tokens:  # as the reference: zero or unknown counts are not observed
            self.input_tokens.labels(model, target).observe(input_tokens)
        if output_tokens:
            self.output_tokens.labels(model, target).observe(output_tokens)

    def request_abandoned(self, model: str) -> None:
        """A routed request whose stream ended before its response did."""
        if model:
            self._running_requests(self._label(model)).dec()

    # -- the prefix-cache scorer's observer (scheduling.prefix) ------------------------------

    def prefix_hit_ratio_observed(self, ratio: float) -> None:
        self.prefix_hit_ratio.observe(ratio)

    def track_prefix_index(self, size: Callable[[], float]) -> None:
        self.prefix_indexer_size.set_function(size)

    # -- the latency predictor's observer (scheduling.predictor) -----------------------------

    def track_latency_predictor(self, errors: Callable[[], Mapping[str, float]]) -> None:
        self._predictor.read = errors

    # -- flow control's observer (flowcontrol.FlowObserver) ------------------------------------

    def queue_changed(self, priority: int, requests: int, size: int) -> None:
        band = str(priority)
        self.flow_queue_size.labels(band).set(requests)
        self.flow_queue_bytes.labels(band).set(size)

    def left(self, priority: int, outcome: str, waited: float) -> None:
        self.flow_queue_duration.labels(str(priority), outcome).observe(waited)

    def track_limits(
        self, buffered_bytes: Callable[[], float], open_streams: Callable[[], float]
    ) -> None:
        self.buffered_request_bytes.set_function(buffered_bytes)
        self.ext_proc_streams.set_function(open_streams)

    def track_scraping(
        self,
        interval: Callable[[], float],
        cpu_share: Callable[[], float],
        deferred: Callable[[], float],
    ) -> None:
        self.scrape_interval.set_function(interval)
        self.scrape_cpu_share.set_function(cpu_share)
        self._scrapes_deferred.read = deferred

    def pool_reload(self, result: str) -> None:
        """The pool source's observer: one settled change and its outcome."""
        self.pool_reload_total.labels(result).inc()
        self.pool_source_healthy.set(1 if result == "applied" else 0)

    def endpoint_failed(self, hostport: str, kind: str) -> None:
        self.endpoint_failures.labels(hostport, kind).inc()
        self._failure_labels.add((hostport, kind))

    def endpoint_ejected(self, hostport: str) -> None:
        self.endpoint_ejections.labels(hostport).inc()

    def endpoints_forgotten(self, hostports: Iterable[str]) -> None:
        """Endpoints that left the pool: drop their series."""
        gone = set(hostports)
        for labels in [x for x in self._failure_labels if x[0] in gone]:
            self._failure_labels.discard(labels)
            self.endpoint_failures.remove(*labels)
        for hostport in gone:
            with contextlib.suppress(KeyError):  # never ejected
                self.endpoint_ejections.remove(hostport)

    def track_ejections(self, ejected: Callable[[], Iterable[str]]) -> None:
        self._ejected.read = ejected

    def render(self) -> bytes:
        return generate_latest(self.registry)
