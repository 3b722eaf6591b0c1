"""The metric families the EPP exports: the attribute of ``EppMetrics`` holding each, its kind,
name, help and labels (and a histogram's buckets), as the reference EPP exports them."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

DURATION_BUCKETS = (
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
REQUEST_SIZE_BUCKETS = tuple(2**n for n in range(6, 31))  # 64 B to 1 GiB
RESPONSE_SIZE_BUCKETS = (1, *(2**n for n in range(3, 15)), 32778, 65536)  # 1 B to 64 KiB
INPUT_TOKEN_BUCKETS = (*RESPONSE_SIZE_BUCKETS, *(2**n for n in range(17, 21)))  # to 1 Mi tokens
OUTPUT_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
SCHEDULER_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_MODEL_LABELS = ("model_name", "target_model_name")
# (EppMetrics attribute, kind, name, help, labels)
COUNTERS_AND_GAUGES: tuple[
    tuple[str, type[Counter] | type[Gauge], str, str, tuple[str, ...]], ...
] = (
    ("request_total", Counter, "inference_model_request",
     "Counter of inference model requests broken out for each model and target model.",
     _MODEL_LABELS),
    ("request_error_total", Counter, "inference_model_request_error",
     "Counter of inference model requests errors broken out for each model and target "
     "model.",
     (*_MODEL_LABELS, "error_code")),
    ("running_requests", Gauge, "inference_model_running_requests",
     "Inference model number of running requests in each model.",
     ("model_name",)),
    ("invalid_usage_total", Counter, "inference_extension_model_server_invalid_usage",
     "Responses whose token usage was not a plausible count (negative, fractional, "
     "absurdly large or not a number) and was left out of the token histograms.",
     _MODEL_LABELS),
    ("flow_queue_size", Gauge, "inference_extension_flow_control_queue_size",
     "Requests waiting in the flow-control queue, by priority band.",
     ("priority",)),
    ("flow_queue_bytes", Gauge, "inference_extension_flow_control_queue_bytes",
     "Request body bytes waiting in the flow-control queue, by priority band.",
     ("priority",)),
    ("prefix_indexer_size", Gauge, "inference_extension_prefix_indexer_size",
     "Size of the prefix indexer: block hashes held over every endpoint.",
     ()),
    # The pool source (datastore/sources/file.py) reports each settled change it handles.
    ("pool_reload_total", Counter, "inference_extension_pool_reload",
     "Settled changes of the pool source by outcome: applied, rejected_empty (would have "
     "removed every pod) or invalid (missing, unreadable or not a valid pool).",
     ("result",)),
    ("pool_source_healthy", Gauge, "inference_extension_pool_source_healthy",
     "1 while the pool source's current content is the pool in force; 0 while it is "
     "refused and the last good pool is kept.",
     ()),
    # The ext_proc server's process-wide limits (extproc/limits.py); the gauges are read at
    # scrape time through ``EppMetrics.track_limits``, so the hot path never touches them.
    ("buffered_request_bytes", Gauge, "inference_extension_buffered_request_bytes",
     "Bytes of request bodies held before routing, all ext_proc streams together.",
     ()),
    ("ext_proc_streams", Gauge, "inference_extension_ext_proc_streams",
     "Open ext_proc streams.",
     ()),
    ("buffer_budget_rejections", Counter, "inference_extension_buffer_budget_rejections",
     "Requests answered 429 because the buffered request bodies were at their budget.",
     ()),
    ("stream_limit_rejections", Counter, "inference_extension_stream_limit_rejections",
     "ext_proc streams answered 429 because the concurrent-stream limit was reached.",
     ()),
    # Scraping the model servers (metrics/scraper.py), read at scrape time through
    # ``EppMetrics.track_scraping``: with hundreds of endpoints the CPU budget stretches the
    # interval.
    ("scrape_interval", Gauge, "inference_extension_metrics_refresh_interval_seconds",
     "Seconds between two scrapes of one model server now: the configured refresh "
     "interval, or longer when scraping every endpoint at it would exceed the CPU budget.",
     ()),
    ("scrape_cpu_share", Gauge, "inference_extension_metrics_scrape_cpu_share",
     "Estimated fraction of one core that scraping the model servers uses.",
     ()),
    # Read when /metrics is rendered, which the metrics server does on the event loop; a count
    # that climbs under steady load is a leak (epp bench soak watches it).
    ("event_loop_tasks", Gauge, "inference_extension_event_loop_tasks",
     "asyncio tasks not yet done in the EPP's event loop (0 when rendered off the loop).",
     ()),
    # Outlier detection (datastore/health.py): labelled by the pool's endpoints, whose series are
    # removed when they leave the pool.
    ("endpoint_failures", Counter, "inference_extension_endpoint_failures",
     "Routed requests that failed on an endpoint, by kind: 5xx (a 5xx response, Envoy's "
     "503 for a reset included), connect (Envoy could not connect) or retried (Envoy "
     "retried past it to a fallback endpoint).",
     ("endpoint", "kind")),
    ("endpoint_ejections", Counter, "inference_extension_endpoint_ejections",
     "Times outlier detection ejected the endpoint.",
     ("endpoint",)),
)  # fmt: skip
# (EppMetrics attribute, name, help, labels, buckets)
HISTOGRAMS: tuple[tuple[str, str, str, tuple[str, ...], tuple[float, ...]], ...] = (
    ("request_duration", "inference_model_request_duration_seconds",
     "Inference model response latency distribution in seconds for each model and "
     "target model.", _MODEL_LABELS, DURATION_BUCKETS),
    ("request_sizes", "inference_model_request_sizes",
     "Inference model requests size distribution in bytes for each model and target "
     "model.", _MODEL_LABELS, REQUEST_SIZE_BUCKETS),
    ("response_sizes", "inference_model_response_sizes",
     "Inference model responses size distribution in bytes for each model and target "
     "model.", _MODEL_LABELS, RESPONSE_SIZE_BUCKETS),
    ("input_tokens", "inference_model_input_tokens",
     "Inference model input token count distribution for requests in each model.",
     _MODEL_LABELS, INPUT_TOKEN_BUCKETS),
    ("output_tokens", "inference_model_output_tokens",
     "Inference model output token count distribution for requests in each model.",
     _MODEL_LABELS, OUTPUT_TOKEN_BUCKETS),
    ("scheduler_e2e", "inference_extension_scheduler_e2e_duration_seconds",
     "Scheduling end-to-end latency distribution in seconds.", (), SCHEDULER_BUCKETS),
    ("plugin_durations", "inference_extension_plugin_duration_seconds",
     "Plugin processing latency distribution in seconds for each extension point, "
     "plugin type and plugin name.",
     ("extension_point", "plugin_type", "plugin_name"), SCHEDULER_BUCKETS),
    ("flow_queue_duration",
     "inference_extension_flow_control_request_queue_duration_seconds",
     "Time requests spent in the flow-control queue, by priority band and outcome "
     "(dispatched, rejected, evicted, expired, cancelled).",
     ("priority", "outcome"), QUEUE_BUCKETS),
    ("prefix_hit_ratio", "inference_extension_prefix_indexer_hit_ratio",
     "Ratio of prefix length matched to the request's prefix length (the best "
     "endpoint's match, per request).", (), RATIO_BUCKETS),
)  # fmt: skip
