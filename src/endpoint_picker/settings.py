"""Settings: nested frozen dataclasses built once by the CLI, passed down by the app.

Durations are seconds (float) everywhere inside; flags take Go-style units (``50ms``, ``2s``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path

from endpoint_picker.errors import ConfigError

# ServerSettings.ext_proc_server's choices
EXT_PROC_SERVERS = ("grpcio", "h2")
# Accepted for ServerSettings.ext_proc_server and served by another stack (a warning says so):
# grpclib was the default for part of 2026-11-26, until the h2 server replaced it.
EXT_PROC_SERVER_ALIASES = {"grpclib": "h2"}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}


def parse_duration(text: str) -> float:
    """Parse a Go duration (``1m30s``, ``50ms``, ``0``) into seconds; raise ``ConfigError``."""
    raw = text.strip()
    if raw == "0":
        return 0.0
    pos, total = 0, 0.0
    while pos < len(raw):
        match = _DURATION_PART.match(raw, pos)
        if match is None:
            raise ConfigError(f"invalid duration {text!r} (use units such as 50ms, 2s, 1m30s)")
        total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        pos = match.end()
    if not raw:
        raise ConfigError("empty duration")
    return total


def parse_bool(text: str) -> bool:
    """Parse a boolean flag value the way Go's ``strconv.ParseBool`` does."""
    lowered = text.strip().lower()
    if lowered in {"1", "t", "true", "yes", "y", "on"}:
        return True
    if lowered in {"0", "f", "false", "no", "n", "off"}:
        return False
    raise ConfigError(f"invalid boolean {text!r} (use true or false)")


class MetricsAuth(StrEnum):
    """Who may read the metrics port (``--metrics-endpoint-auth``, ``--metrics-token-file``)."""

    OFF = "off"  # anyone who reaches it (the default with --pool-file)
    TOKEN_FILE = "token-file"  # a bearer token listed in --metrics-token-file
    KUBERNETES = "kubernetes"  # TokenReview + SubjectAccessReview (the default in Kubernetes)


@dataclass(frozen=True, slots=True)
class MetricsEndpointSettings:
    """The metrics port's access control and TLS. Auth covers every path but the probes
    (``/healthz``, ``/readyz``) and the status page's own files (``/``, ``/static/``), which
    hold no data: the page fetches its data from ``/api/status`` with the token."""

    auth: MetricsAuth = MetricsAuth.OFF
    token_file: Path | None = None  # one token per line; re-read when it changes
    # Kubernetes reviews: the API call's timeout, and how long answers are reused (the
    # reference EPP keeps them 1 min authenticated, 5 min allowed, 30 s denied).
    review_timeout: float = 5.0
    allow_ttl: float = 60.0  # seconds a token allowed on a path stays allowed
    deny_ttl: float = 10.0  # seconds a rejected (401) or forbidden (403) answer is reused
    cache_entries: int = 1024  # (token, path) answers kept, least recently used dropped
    max_concurrent_reviews: int = 16  # reviews in flight at once (distinct tokens or paths)
    cert_dir: Path | None = None  # tls.crt and tls.key: HTTPS, reloaded when they change
    client_ca_file: Path | None = None  # mutual TLS: clients need a certificate it signed
    cert_reload_interval: float = 1.0  # seconds between looks at tls.crt and tls.key


@dataclass(frozen=True, slots=True)
class GrpcConnectionSettings:
    """The ext_proc port's HTTP/2 connections, on either gRPC stack: what one client
    connection may hold, and the keepalive that finds peers gone without a word. The names and
    meanings are grpc's (``grpc.keepalive_time_ms`` ...); the h2 stack implements them itself,
    grpcio gets them as channel options."""

    # Streams one connection may have open, announced (SETTINGS_MAX_CONCURRENT_STREAMS); one
    # past it is refused alone (RST_STREAM REFUSED_STREAM). Envoy carries every ext_proc stream
    # of a worker thread on one connection and does not keep to this limit (tests/e2e), so it
    # must stay above Envoy's concurrency: 0 is twice --max-concurrent-streams (whose JSON 429
    # then comes first), or 100,000 when that is 0.
    max_streams_per_connection: int = 0
    # With nothing received for this long, the server sends a PING (grpc's keepalive_time;
    # grpc's default of 2 hours would keep a vanished Envoy's in-flight counts that long) ...
    keepalive_time: float = 30.0
    # ... and closes the connection, ending its streams, when no answer comes within this.
    keepalive_timeout: float = 20.0
    # A connection with no stream for this long is closed with GOAWAY (0: never).
    max_connection_idle: float = 300.0
    # Client PINGs closer together than this, with no data either way between them, are strikes;
    # past two strikes the connection gets GOAWAY ENHANCE_YOUR_CALM ("too_many_pings").
    min_ping_interval: float = 5.0
    # h2 stack: a connection whose client resets at least half of this many streams, before
    # their answer and within a second of opening them (or half of all its streams, past
    # it), is closed with GOAWAY ENHANCE_YOUR_CALM: rapid reset, CVE-2023-44487. Envoy's own
    # premature-reset rule and default; 0: no limit.
    premature_reset_streams: int = 500

    def resolved(self, max_concurrent_streams: int) -> GrpcConnectionSettings:
        """These settings with the stream limit's default (0) made a number."""
        if self.max_streams_per_connection:
            return self
        limit = 2 * max_concurrent_streams if max_concurrent_streams else 100_000
        return replace(self, max_streams_per_connection=limit)


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Listening sockets and shutdown."""

    bind_address: str = "0.0.0.0"
    grpc_port: int = 9002
    grpc_health_port: int = 9003
    metrics_port: int = 9090
    secure_serving: bool = True
    cert_path: Path | None = None  # a folder with tls.crt and tls.key; None: self-signed
    # PEM CA bundle: ext_proc clients (Envoy) must present a certificate it signed (mTLS)
    client_ca_file: Path | None = None
    drain_timeout: float = 30.0  # seconds open streams get to finish after SIGTERM
    # The EPP holds a whole request body before routing it: refuse (413) beyond this.
    max_request_body_bytes: int = 32 * 1024 * 1024
    # All bodies held at once, every stream together: past it a request gets 429. Eight bodies
    # at the per-body limit, or thousands of ordinary prompts; 0: no limit.
    max_buffered_bytes: int = 256 * 1024 * 1024
    # Open ext_proc streams (one per request, open until its response ends): past it a new
    # stream gets 429; 0: no limit.
    max_concurrent_streams: int = 10_000
    # Paths routed besides the OpenAI inference APIs (requests.INFERENCE_PATHS); every other
    # path is a 404 so that a model server's admin API is never reachable through the gateway.
    extra_inference_paths: tuple[str, ...] = ()
    # The most request headers (count, and bytes of names and values) the EPP lets through,
    # its own added headers included: a request past them gets a JSON 431 from the EPP instead
    # of an empty 500 from Envoy, whose limits (max_headers_count, max_request_headers_kb)
    # must be at least these (the shipped configs set 120 and 80 KiB).
    max_request_headers: int = 100
    max_request_header_bytes: int = 60 * 1024
    metrics_endpoint: MetricsEndpointSettings = field(default_factory=MetricsEndpointSettings)
    # Processes that route (`epp serve --workers`): 1 is one process doing everything; more
    # is a parent (pool source, scrapes, health and metrics ports) and that many workers
    # sharing the ext_proc port (see endpoint_picker.workers).
    workers: int = 1
    # Replace a worker once it has served about this many ext_proc streams (0: never): a
    # replacement starts and takes the port before the old one drains, so nothing is refused.
    # It bounds the memory grpcio leaks on every stream Envoy resets (docs/envoy.md, item 6).
    # Any value above 0 runs the parent and workers even with --workers 1.
    worker_max_requests: int = 0
    # The gRPC stack of the ext_proc port: "h2" (the EPP's own server on h2, in the event loop:
    # no thread hop per message, the least CPU per request, measured in
    # docs/results/2026-11-23-performance.md)
    # or "grpcio" (gRPC's C core and its asyncio API). Health-only port: grpcio.
    ext_proc_server: str = "h2"
    # HTTP/2 limits and keepalive of the ext_proc port's connections
    connections: GrpcConnectionSettings = field(default_factory=GrpcConnectionSettings)

    @property
    def supervised(self) -> bool:
        """Whether a parent runs the routing in worker processes."""
        return self.workers > 1 or self.worker_max_requests > 0


GROUP_V1ALPHA2 = "inference.networking.x-k8s.io"  # InferencePool v1alpha2, InferenceModel
GROUP_V1 = "inference.networking.k8s.io"  # InferencePool v1


@dataclass(frozen=True, slots=True)
class KubernetesSettings:
    """The Kubernetes source (``--pool-name`` without ``--pool-file``): where and how to watch."""

    namespace: str = "default"  # --pool-namespace, else $NAMESPACE, else default
    group: str = GROUP_V1  # the InferencePool's API group (v1; --pool-group for v1alpha2)
    kubeconfig: Path | None = None  # None: in-cluster credentials, else $KUBECONFIG, ~/.kube/config
    request_timeout: float = 10.0  # seconds for one list request (connect and read)
    # A watch request asks the API server to end it after this many seconds (timeoutSeconds);
    # the client then watches again from the last resourceVersion it saw.
    watch_timeout: float = 60.0
    # Seconds a watch may stay silent before it is dropped and reopened (past watch_timeout:
    # a healthy server ends a quiet watch itself; a half-open connection never would).
    inactivity_timeout: float = 90.0
    backoff_initial: float = 0.2  # seconds before the first reconnect, doubled up to the max
    backoff_max: float = 10.0
    missing_resource_retry: float = 30.0  # seconds between looks for a CRD that is not installed
    # Active-passive HA (--ha-enable-leader-election): only the holder of the Lease is ready.
    leader_election: bool = False
    lease_name: str = ""  # "": endpoint-picker-<pool name>
    lease_duration: float = 15.0  # seconds a silent holder keeps the Lease
    renew_deadline: float = 10.0  # seconds a leader may fail to renew before it steps down
    retry_period: float = 2.0  # seconds between attempts to acquire or renew


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """Where the pool comes from and how unknown models are treated."""

    pool_file: Path | None = None
    pool_name: str | None = None  # None: the only pool in the source
    # None: the pool's API decides (v1alpha2 rejects unknown models, v1 passes them through)
    allow_unknown_models: bool | None = None
    reload_poll_interval: float = 0.25  # seconds between pool-file change checks
    # Seconds a changed pool file must stay unchanged before it is applied, so that a file
    # caught mid-write is never served (the first load at start is immediate).
    reload_settle_time: float = 0.5
    kubernetes: KubernetesSettings = field(default_factory=KubernetesSettings)


@dataclass(frozen=True, slots=True)
class SchedulingSettings:
    """The scheduler: its config file and how many endpoints each pick returns."""

    config_file: Path | None = None
    max_fallback_endpoints: int = 0
    # --tokenizer: (model, tokenizer.json path) pairs, model "" for every model of the pool;
    # the precise prefix scorer tokenizes prompts with them
    tokenizers: tuple[tuple[str, Path], ...] = ()


@dataclass(frozen=True, slots=True)
class ScrapeSettings:
    """Model-server metrics scraping."""

    refresh_interval: float = 0.05
    timeout: float = 1.0
    # Share of one core scraping may use; the interval stretches past refresh_interval to stay
    # within it (0 disables stretching).
    cpu_budget: float = 0.5
    staleness_threshold: float = 2.0
    # Ask only for the families the engine's fields read (`/metrics?name[]=...`, which
    # prometheus_client servers such as vLLM and SGLang honour); the whole page where that fails.
    name_filter: bool = True
    engine_label: str = "inference.networking.k8s.io/engine-type"
    default_engine: str = "vllm"
    # metric name overrides, e.g. {"vllm": {"queue": "my_queue_metric"}}
    metric_overrides: dict[str, dict[str, str]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class OutlierSettings:
    """Passive health of the endpoints from their responses, as Envoy's outlier detection.

    An endpoint whose responses fail ``consecutive_failures`` times in a row (a 5xx, Envoy's
    own 503 for a reset or a refused connection included, or a failed attempt Envoy retried
    past) is ejected: left out of the candidates for ``base_ejection_time`` times the number
    of times it was ejected in a row, at most ``max_ejection_time``. Then one request is let
    through to it as a probe: a success brings it back, a failure ejects it again for longer.
    At most ``max_ejection_percent`` of the ready endpoints are ejected at once (at least
    one, as Envoy; never the last ready one). ``consecutive_failures`` 0 turns it off.
    """

    consecutive_failures: int = 5  # Envoy's consecutive_5xx
    base_ejection_time: float = 30.0  # Envoy's base_ejection_time
    max_ejection_time: float = 300.0  # Envoy's max_ejection_time
    # Envoy's default is 10 (with at least one host): a pool of 2-16 model servers would
    # then eject one at a time; half keeps the other half serving while two of four fail.
    max_ejection_percent: int = 50

    @property
    def enabled(self) -> bool:
        return self.consecutive_failures > 0


@dataclass(frozen=True, slots=True)
class LoggingSettings:
    format: str = "text"  # text | json
    level: str = "info"  # debug | info | warning | error


@dataclass(frozen=True, slots=True)
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    pool: PoolSettings = field(default_factory=PoolSettings)
    scheduling: SchedulingSettings = field(default_factory=SchedulingSettings)
    scrape: ScrapeSettings = field(default_factory=ScrapeSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    outliers: OutlierSettings = field(default_factory=OutlierSettings)
