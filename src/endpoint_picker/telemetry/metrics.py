"""The EPP's own Prometheus metrics, named as the reference EPP of the InferenceModel era (v0.5).

Existing dashboards query these names, label sets and buckets. Each app owns one registry
(no global state), served as text by the app's metrics server on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from endpoint_picker.errors import ErrorCode
from endpoint_picker.telemetry.collectors import (
    CallbackCounter,
    EjectedCollector,
    PoolCollector,
    PredictorCollector,
)
from endpoint_picker.telemetry.collectors import PoolStats as PoolStats
from endpoint_picker.telemetry.families import COUNTERS_AND_GAUGES, HISTOGRAMS
from endpoint_picker.telemetry.histogram import Children, LoopHistogram

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

    # set from the tables in families.py
    request_total: Counter
    request_error_total: Counter
    running_requests: Gauge
    invalid_usage_total: Counter
    flow_queue_size: Gauge
    flow_queue_bytes: Gauge
    prefix_indexer_size: Gauge
    pool_reload_total: Counter
    pool_source_healthy: Gauge
    buffered_request_bytes: Gauge
    ext_proc_streams: Gauge
    buffer_budget_rejections: Counter
    stream_limit_rejections: Counter
    scrape_interval: Gauge
    scrape_cpu_share: Gauge
    event_loop_tasks: Gauge
    endpoint_failures: Counter
    endpoint_ejections: Counter
    request_duration: LoopHistogram
    request_sizes: LoopHistogram
    response_sizes: LoopHistogram
    input_tokens: LoopHistogram
    output_tokens: LoopHistogram
    scheduler_e2e: LoopHistogram
    plugin_durations: LoopHistogram
    prefix_hit_ratio: LoopHistogram
    flow_queue_duration: LoopHistogram

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
        for attribute, kind, name, doc, labels in COUNTERS_AND_GAUGES:
            setattr(self, attribute, kind(name, doc, labels, registry=r))
        for attribute, name, doc, labels, buckets in HISTOGRAMS:
            histogram = LoopHistogram(name, doc, labels, buckets)
            r.register(histogram)
            setattr(self, attribute, histogram)
        self._model_labels: set[str] = set()  # names labelled as themselves so far
        self._minted = 0  # of which not configured by the pool (at most MAX_MODEL_LABELS)
        self._request_total = Children(self.request_total)
        self._request_error_total = Children(self.request_error_total)
        self._running_requests = Children(self.running_requests)
        self._invalid_usage_total = Children(self.invalid_usage_total)
        if pool_stats is not None:
            r.register(PoolCollector(pool_stats))
        self._predictor = PredictorCollector()
        r.register(self._predictor)
        for result in POOL_RELOAD_RESULTS:  # every outcome exported from the start, at 0
            self.pool_reload_total.labels(result)
        self._scrapes_deferred = CallbackCounter(
            "inference_extension_metrics_scrape_steps_deferred",
            "Scrape steps (a send or a parse) that waited for a later event-loop turn because "
            "scrapes that came due together had used this turn's share.",
        )
        r.register(self._scrapes_deferred)
        self.event_loop_tasks.set_function(_event_loop_tasks)
        self._failure_labels: set[tuple[str, str]] = set()
        self._ejected = EjectedCollector()
        r.register(self._ejected)
        # vLLM's KV-cache events (kvevents/), for precise-prefix-cache-scorer
        self.kv_events_total = Counter(
            "inference_extension_kv_events",
            "KV-cache events (BlockStored, BlockRemoved, AllBlocksCleared) applied to the index.",
            registry=r,
        )
        self.kv_events_errors_total = Counter(
            "inference_extension_kv_events_errors",
            "KV-cache event messages refused, by kind: decode (a frame, batch or event that "
            "does not decode), unknown_event (an event type this EPP does not know, skipped), "
            "unknown_topic (bind mode: a topic naming no pod of the pool), replay (a replay "
            "request that failed).",
            ["kind"],
            registry=r,
        )
        for refused in ("decode", "unknown_event", "unknown_topic", "replay"):
            self.kv_events_errors_total.labels(refused)
        self.kv_events_gaps_total = Counter(
            "inference_extension_kv_events_gaps",
            "Gaps in a publisher's sequence numbers, by outcome: replayed (the replay socket "
            "filled it) or rebuilt (that endpoint's view dropped and rebuilt from new events).",
            ["outcome"],
            registry=r,
        )
        for outcome in ("replayed", "rebuilt"):
            self.kv_events_gaps_total.labels(outcome)
        self.kv_index_blocks = Gauge(
            "inference_extension_kv_index_blocks",
            "Blocks in the KV-event index, over every endpoint.",
            registry=r,
        )
        self.kv_index_endpoints = Gauge(
            "inference_extension_kv_index_endpoints",
            "Endpoints with blocks in the KV-event index.",
            registry=r,
        )

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

    # -- the KV-events hub's observer (kvevents.feeds.KVEventsObserver) -------------------

    def kv_events_received(self, events: int) -> None:
        self.kv_events_total.inc(events)

    def kv_events_error(self, kind: str) -> None:
        self.kv_events_errors_total.labels(kind).inc()

    def kv_events_gap(self, repaired: bool) -> None:
        self.kv_events_gaps_total.labels("replayed" if repaired else "rebuilt").inc()

    def track_kv_index(self, size: Callable[[], float], endpoints: Callable[[], float]) -> None:
        self.kv_index_blocks.set_function(size)
        self.kv_index_endpoints.set_function(endpoints)

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
