"""The histogram families the EPP exports: the attribute of ``EppMetrics`` holding each, its
name, help, labels and buckets, as the reference EPP exports them."""

from __future__ import annotations

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
