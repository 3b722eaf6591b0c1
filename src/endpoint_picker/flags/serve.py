"""``epp serve``'s flags: the one table the parser, the settings and ``docs/flags.md`` come from.

Each flag names the settings field it fills; defaults are the fields' own (``settings.py``).
Regenerate the reference after a change: ``python -m endpoint_picker.flags > docs/flags.md``
(``make flags-doc``); ``tests/unit/flags/test_serve_flags.py`` fails while it is stale.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from endpoint_picker.errors import ConfigError
from endpoint_picker.flags.server import CONNECTIONS, LIMITS, PORTS, PROCESSES
from endpoint_picker.flags.spec import README, Flag, Groups, build_settings, markdown
from endpoint_picker.flags.values import BOOL, COUNT, DURATION, ENGINE_METRIC, PERCENT, TOKENIZER
from endpoint_picker.settings import GROUP_V1, GROUP_V1ALPHA2, Settings
from endpoint_picker.telemetry.logs import log_levels


def _namespace(given: str | None) -> str:
    return given or os.environ.get("NAMESPACE") or "default"


def _overrides(given: list[tuple[str, str, str]]) -> dict[str, dict[str, str]]:
    overrides: dict[str, dict[str, str]] = {}
    for engine, field, spec in given:
        overrides.setdefault(engine, {})[field] = spec
    return overrides


POOL_FILE = Flag(
    "--pool-file", "pool.pool_file", "the pool file (InferencePool, InferenceModels, Pods)",
    doc="the pool file; watched: a change applies once it has stayed unchanged for the settle "
    f"time (see [Changing the pool file]({README}#changing-the-pool-file-while-serving)). "
    "`epp serve` needs this or `--pool-name`",
    read=Path, metavar="PATH",
)  # fmt: skip
POOL_NAME = Flag(
    "--pool-name", "pool.pool_name", "which InferencePool to serve: in the pool file, or, "
    "without --pool-file, the one to watch in Kubernetes",
    doc="with `--pool-file`: which InferencePool of the file to serve (several pools and no "
    "name is an error listing them). **Without `--pool-file`: watch this InferencePool in "
    f"Kubernetes** (see [The Kubernetes source]({README}#the-kubernetes-source))",
    metavar="NAME", shown="the only pool",
)  # fmt: skip
CONFIG_FILE = Flag(
    "--config-file", "scheduling.config_file", "an EndpointPickerConfig YAML file",
    doc=f"an `EndpointPickerConfig` (see [Scheduling]({README}#scheduling))",
    read=Path, metavar="PATH", shown="the default profile",
)  # fmt: skip

POOL = (
    POOL_FILE,
    Flag(
        "--pool-file-settle-time", "pool.reload_settle_time",
        "a changed pool file is applied once it has stayed unchanged this long",
        doc="how long a changed pool file must stay unchanged (inode, size, mtime and content) "
        "before it is applied; the first load at start is immediate",
        read=DURATION, metavar="DURATION",
    ),
    POOL_NAME,
    Flag(
        "--pool-namespace", "pool.kubernetes.namespace", "Kubernetes: the pool's namespace",
        doc="Kubernetes: the namespace of the pool, its InferenceModels and its pods",
        metavar="NS", default=None, shown="`$NAMESPACE`, then `default`", store=_namespace,
    ),
    Flag(
        "--pool-group", "pool.kubernetes.group", f"Kubernetes: the InferencePool's API group: "
        f"{GROUP_V1} (v1) or {GROUP_V1ALPHA2} (the legacy v1alpha2)",
        doc=f"Kubernetes: the InferencePool's API group: `{GROUP_V1}` (`v1`, what current "
        f"gateways read) or `{GROUP_V1ALPHA2}` (the legacy `v1alpha2`)",
        metavar="GROUP", choices=(GROUP_V1ALPHA2, GROUP_V1),
    ),
    Flag(
        "--kubeconfig", "pool.kubernetes.kubeconfig",
        "Kubernetes: credentials (without it: in-cluster, then $KUBECONFIG, ~/.kube/config)",
        doc="Kubernetes: credentials; without it the pod's service account, then "
        "`$KUBECONFIG`, then `~/.kube/config`",
        read=Path, metavar="PATH", shown="in-cluster",
    ),
    Flag(
        "--ha-enable-leader-election", "pool.kubernetes.leader_election",
        "Kubernetes: active-passive HA; only the holder of a coordination.k8s.io Lease "
        "reports ready",
        doc="Kubernetes: active-passive HA; only the replica holding the `coordination.k8s.io` "
        "Lease `endpoint-picker-<pool>` reports ready (see [Deploying on a cluster]"
        f"({README}#deploying-on-a-cluster))",
        kind="switch",
    ),
    Flag(
        "--allow-unknown-models", "pool.allow_unknown_models",
        "route models no InferenceModel names", read=BOOL, metavar="BOOL",
        shown="per pool API: v1 yes, v1alpha2 no",
    ),
)  # fmt: skip


def _tokenizers(given: list[tuple[str, Path]]) -> tuple[tuple[str, Path], ...]:
    models = [model for model, _ in given]
    for model in models:
        if models.count(model) > 1:
            which = f"model {model!r}" if model else "the whole pool"
            raise ConfigError(f"--tokenizer: two tokenizers for {which}")
    return tuple(given)


SCHEDULING = (
    CONFIG_FILE,
    Flag(
        "--max-fallback-endpoints", "scheduling.max_fallback_endpoints",
        "fallbacks after the primary", read=COUNT, metavar="N",
    ),
    Flag(
        "--tokenizer", "scheduling.tokenizers",
        "a model's tokenizer.json (MODEL=PATH), or every model's (PATH), for "
        "precise-prefix-cache-scorer; a tokenizer_config.json beside it gives the chat "
        "template; repeatable",
        doc="a model's Hugging Face `tokenizer.json` (`MODEL=PATH`; a directory holding one "
        "will do), or every model's (`PATH`), repeatable; the chat template comes from a "
        "`tokenizer_config.json` beside it. `precise-prefix-cache-scorer` tokenizes prompts "
        "with it (see [Precise prefix cache](scheduling.md#precise-prefix-cache))",
        read=TOKENIZER, metavar="[MODEL=]PATH", kind="repeat", default=[], shown="none",
        store=_tokenizers,
    ),
)  # fmt: skip


def _vllm_metric(flag: str, field: str, what: str) -> Flag:
    return Flag(
        flag, f"scrape.metric_overrides.vllm.{field}", f"the vLLM {what} metric name",
        doc=f"the vLLM {what} metric name (the reference EPP's flag; the same as "
        f"`--engine-metric vllm.{field}=NAME`, which it overrides)",
        metavar="NAME", default=None, shown="vLLM's",
    )  # fmt: skip


SCRAPING = (
    Flag(
        "--refresh-metrics-interval", "scrape.refresh_interval",
        "model-server /metrics scrape interval", read=DURATION, metavar="DURATION",
    ),
    Flag(
        "--metrics-scrape-timeout", "scrape.timeout", "timeout of one scrape",
        read=DURATION, metavar="DURATION",
    ),
    Flag(
        "--metrics-staleness-threshold", "scrape.staleness_threshold",
        "metrics older than this are stale", read=DURATION, metavar="DURATION",
    ),
    Flag(
        "--metrics-cpu-budget", "scrape.cpu_budget",
        "share of a core scraping may use; the interval stretches to fit (0: never)",
        doc="share of one core scraping may use: past it the interval stretches (0: never; "
        f"see [Model-server metrics]({README}#model-server-metrics))",
        read=float, metavar="CORES",
    ),
    Flag(
        "--metrics-name-filter", "scrape.name_filter",
        "scrape /metrics?name[]=... for only the metrics the scheduler reads (servers built on "
        "prometheus_client, such as vLLM and SGLang, then render a page of about 2 KB instead "
        "of about 64); an endpoint whose filtered page lacks them gets the whole page",
        read=BOOL, metavar="BOOL",
    ),
    _vllm_metric("--total-queued-requests-metric", "queue", "waiting-queue"),
    _vllm_metric("--total-running-requests-metric", "running", "running-requests"),
    _vllm_metric("--kv-cache-usage-percentage-metric", "kv_usage", "KV-cache usage"),
    _vllm_metric("--lora-info-metric", "lora_info", "LoRA info"),
    Flag(
        "--engine-metric", "scrape.metric_overrides",
        "override one metric of any engine (fields: queue, running, kv_usage, lora_info, "
        "cache_info, ...; see docs/metrics.md); repeatable",
        doc="override any engine's metric, repeatable: `--engine-metric "
        "sglang.queue=sglang:num_queue_reqs`; fields and the fallback syntax in "
        "[docs/metrics.md](metrics.md)",
        read=ENGINE_METRIC, metavar="ENGINE.FIELD=METRIC", kind="repeat", default=[],
        shown="built-in names", store=_overrides,
    ),
)  # fmt: skip

OUTLIERS = (
    Flag(
        "--outlier-consecutive-failures", "outliers.consecutive_failures",
        "eject an endpoint after N failed requests in a row (a 5xx, Envoy's 503 for a reset or "
        "refused connection, or an attempt Envoy retried past); 0: never",
        doc="eject an endpoint after N failed requests in a row: a 5xx (Envoy's own 503 for a "
        "reset or refused connection included) or an attempt Envoy retried past it; 0 turns "
        "outlier detection off (see [Outlier ejection](serving.md#outlier-ejection))",
        read=COUNT, metavar="N",
    ),
    Flag(
        "--outlier-base-ejection-time", "outliers.base_ejection_time",
        "an ejection lasts this times the ejections in a row; then one request probes it",
        doc="an ejection lasts this x the ejections in a row; then one request probes the "
        "endpoint, and its success brings it back",
        read=DURATION, metavar="DURATION",
    ),
    Flag(
        "--outlier-max-ejection-time", "outliers.max_ejection_time", "the longest ejection",
        read=DURATION, metavar="DURATION",
    ),
    Flag(
        "--outlier-max-ejection-percent", "outliers.max_ejection_percent",
        "the most of the ready endpoints ejected at once; at least one whatever the percentage "
        "(as Envoy), never the last ready one",
        read=PERCENT, metavar="PERCENT",
    ),
)  # fmt: skip

LOGS = (
    Flag(
        "--log-format", "logging.format", "text or json; structured logs with the request id, "
        "never the prompt", metavar="text|json", choices=("text", "json"),
    ),
    Flag(
        "--log-level", "logging.level", "the least severe level logged",
        metavar="LEVEL", choices=log_levels(), doc="the least severe level logged: "
        + ", ".join(f"`{level}`" for level in log_levels()),
    ),
)  # fmt: skip

SERVE: Groups = (
    ("The pool: a file, or Kubernetes", POOL),
    ("Scheduling", SCHEDULING),
    ("Ports and TLS", PORTS),
    ("What requests may hold", LIMITS),
    ("The ext_proc port's connections (both gRPC stacks)", CONNECTIONS),
    ("Processes and shutdown", PROCESSES),
    ("Model-server metrics", SCRAPING),
    ("Outlier ejection (as Envoy's)", OUTLIERS),
    ("Logs", LOGS),
)
VALIDATE = (POOL_FILE, POOL_NAME, CONFIG_FILE)  # `epp validate` reads the same files


def _check_flags(args: argparse.Namespace) -> None:
    """Flags that contradict each other, before the settings are built."""
    if args.pool_file is None and not args.pool_name:
        raise ConfigError("give --pool-file PATH, or --pool-name NAME to watch Kubernetes")
    if args.pool_file is not None and (
        args.pool_namespace or args.kubeconfig or args.ha_enable_leader_election
    ):
        raise ConfigError(
            "--pool-namespace, --kubeconfig and --ha-enable-leader-election are for Kubernetes, "
            "not --pool-file"
        )
    if args.cert_path is not None and not args.secure_serving:
        raise ConfigError("--cert-path needs --secure-serving true")
    if args.client_ca_file is not None and not args.secure_serving:
        raise ConfigError("--client-ca-file needs --secure-serving true")
    if 0 < args.max_buffered_bytes < args.max_request_body_size:
        # one body at the per-body limit could never fit: it would get 429 forever
        raise ConfigError("--max-buffered-bytes must be 0 or at least --max-request-body-size")


def _check_settings(settings: Settings) -> None:
    """Settings that cannot work together (after --metrics-endpoint-auth's own checks)."""
    endpoint, connections = settings.server.metrics_endpoint, settings.server.connections
    if endpoint.client_ca_file is not None and endpoint.cert_dir is None:
        raise ConfigError("--metrics-client-ca-file needs --metrics-cert-dir")
    if connections.keepalive_time and connections.keepalive_timeout <= 0:
        raise ConfigError("--grpc-keepalive-timeout must be above 0 with --grpc-keepalive-time")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """``epp serve``'s parsed flags as ``Settings``; a contradiction is a ``ConfigError``."""
    _check_flags(args)
    settings = build_settings(args, (flag for _, flags in SERVE for flag in flags))
    _check_settings(settings)
    return settings


DOC_HEAD = """# `epp serve` flags

Generated from `src/endpoint_picker/flags/serve.py`, which also builds `epp serve --help` and
the settings, by `python -m endpoint_picker.flags > docs/flags.md` (or `make flags-doc`); a test
fails while this file is stale. Defaults are the settings' own (`src/endpoint_picker/settings.py`).

Durations take Go-style units (`50ms`, `2s`, `1m30s`); booleans `true`/`false` (both
`--secure-serving false` and `--secure-serving=false`). A bad flag or a bad file prints one line
and exits 2. `epp validate --pool-file PATH [--config-file PATH]` checks files offline and prints
what it found; `epp --version` prints the version.
"""


def reference() -> str:
    """``docs/flags.md``."""
    return f"{DOC_HEAD}\n{markdown(SERVE)}"
