"""The ``epp`` command: ``serve``, ``validate``, ``sim``, ``bench`` and ``--version``.

Flags are parsed into ``Settings`` here and nowhere else. Bad input: one line, exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from endpoint_picker import __version__
from endpoint_picker.errors import ConfigError
from endpoint_picker.settings import (
    EXT_PROC_SERVER_ALIASES,
    EXT_PROC_SERVERS,
    GROUP_V1,
    GROUP_V1ALPHA2,
    GrpcConnectionSettings,
    KubernetesSettings,
    LoggingSettings,
    MetricsAuth,
    MetricsEndpointSettings,
    OutlierSettings,
    PoolSettings,
    SchedulingSettings,
    ScrapeSettings,
    ServerSettings,
    Settings,
    parse_bool,
    parse_duration,
)
from endpoint_picker.telemetry.logs import configure_logging, log_levels
from endpoint_picker.types import MAX_PORT, ascii_int

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one clear line (and exit 2), not a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _typed(convert: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    """Turn a ``ConfigError`` from a converter into argparse's own error."""

    def wrapper(text: str) -> Any:
        try:
            return convert(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    wrapper.__name__ = name  # argparse says "invalid <name> value"
    return wrapper


def _port(text: str) -> int:
    value = ascii_int(text.strip(), MAX_PORT)
    if value is None:
        raise ConfigError(f"invalid port value: {text!r} (a number in 0..{MAX_PORT})")
    return value


def _non_negative(text: str) -> int:
    value = ascii_int(text.strip(), 2**63 - 1)
    if value is None:
        raise ConfigError(f"invalid count value: {text!r} (a whole number >= 0)")
    return value


def _cgroup_cpus(path: str = "/sys/fs/cgroup/cpu.max") -> int:
    """CPUs the cgroup v2 quota allows, rounded up (a large number when unlimited or unknown)."""
    try:
        quota, _, period = Path(path).read_text(encoding="ascii").partition(" ")
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError, ZeroDivisionError):  # "max", no cgroup v2, or unreadable
        return 1 << 16


def _workers(text: str) -> int:
    """``N`` >= 1, or ``auto``: the cores this process may run on, capped by the cgroup's CPU
    quota (a pod limited to 2 CPUs on a 64-core node gets 2 workers, not 64)."""
    if text.strip() == "auto":
        return max(1, min(len(os.sched_getaffinity(0)), _cgroup_cpus()))
    value = ascii_int(text.strip(), 1 << 16)
    if not value:
        raise ConfigError(f"{text!r} is not a number >= 1 or auto")
    return value


def _grpc_connections(args: argparse.Namespace) -> GrpcConnectionSettings:
    if args.grpc_keepalive_time and args.grpc_keepalive_timeout <= 0:
        raise ConfigError("--grpc-keepalive-timeout must be above 0 with --grpc-keepalive-time")
    return GrpcConnectionSettings(
        max_streams_per_connection=args.grpc_max_streams_per_connection,
        keepalive_time=args.grpc_keepalive_time,
        keepalive_timeout=args.grpc_keepalive_timeout,
        max_connection_idle=args.grpc_max_connection_idle,
        min_ping_interval=args.grpc_min_ping_interval,
        premature_reset_streams=args.grpc_premature_reset_streams,
    )


DURATION = _typed(parse_duration, "duration")
BOOL = _typed(parse_bool, "boolean")
PORT = _typed(_port, "port")
COUNT = _typed(_non_negative, "count")


def _add_pool_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pool-file", type=Path, help="the pool file (InferencePool, InferenceModels, Pods)"
    )
    p.add_argument(
        "--pool-name",
        help="which InferencePool to serve: in the pool file (default: the only one), or, "
        "without --pool-file, the one to watch in Kubernetes",
    )


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    d = Settings()
    _add_pool_flags(p)
    p.add_argument(
        "--pool-namespace",
        metavar="NS",
        help="Kubernetes: the pool's namespace (default: $NAMESPACE, then default)",
    )
    p.add_argument(
        "--pool-group",
        choices=(GROUP_V1ALPHA2, GROUP_V1),
        default=d.pool.kubernetes.group,
        help="Kubernetes: the InferencePool's API group (v1alpha2 or v1)",
    )
    p.add_argument(
        "--ha-enable-leader-election",
        action="store_true",
        help="Kubernetes: active-passive HA; only the holder of a coordination.k8s.io Lease "
        "reports ready",
    )
    p.add_argument(
        "--kubeconfig",
        type=Path,
        metavar="PATH",
        help="Kubernetes: credentials (default: in-cluster, then $KUBECONFIG, ~/.kube/config)",
    )
    p.add_argument(
        "--pool-file-settle-time",
        type=DURATION,
        default=d.pool.reload_settle_time,
        metavar="DURATION",
        help="a changed pool file is applied once it has stayed unchanged this long",
    )
    p.add_argument("--config-file", type=Path, help="an EndpointPickerConfig YAML file")
    p.add_argument("--bind-address", default=d.server.bind_address, help="listen address")
    p.add_argument("--grpc-port", type=PORT, default=d.server.grpc_port, help="ext_proc port")
    p.add_argument(
        "--grpc-health-port", type=PORT, default=d.server.grpc_health_port, help="gRPC health"
    )
    p.add_argument(
        "--metrics-port", type=PORT, default=d.server.metrics_port, help="Prometheus /metrics"
    )
    p.add_argument(
        "--metrics-endpoint-auth",
        type=BOOL,
        nargs="?",
        const=True,
        default=None,
        metavar="BOOL",
        help="requests to the metrics port (but /healthz, /readyz and the status page's own "
        "files) need a bearer token the Kubernetes API allows to get the path (TokenReview, "
        "SubjectAccessReview); default: on with the Kubernetes source, off with --pool-file",
    )
    p.add_argument(
        "--metrics-token-file",
        type=Path,
        metavar="PATH",
        help="metrics port: accept only the bearer tokens in this file (one per line), "
        "instead of asking Kubernetes; re-read when it changes",
    )
    p.add_argument(
        "--metrics-cert-dir",
        type=Path,
        metavar="DIR",
        help="metrics port: HTTPS with DIR/tls.crt and DIR/tls.key, reloaded when they change",
    )
    p.add_argument(
        "--metrics-client-ca-file",
        type=Path,
        metavar="PATH",
        help="metrics port: mutual TLS; clients must present a certificate this CA bundle "
        "signed (needs --metrics-cert-dir)",
    )
    p.add_argument(
        "--secure-serving",
        type=BOOL,
        default=d.server.secure_serving,
        metavar="BOOL",
        help="TLS on the ext_proc port (self-signed unless --cert-path)",
    )
    p.add_argument("--cert-path", type=Path, metavar="DIR", help="folder with tls.crt, tls.key")
    p.add_argument(
        "--client-ca-file",
        type=Path,
        metavar="PATH",
        help="mutual TLS: PEM CA bundle; ext_proc clients must present a certificate it signed",
    )
    p.add_argument(
        "--allow-unknown-models",
        type=BOOL,
        default=None,
        metavar="BOOL",
        help="route models no InferenceModel names (default: v1 pools yes, v1alpha2 no)",
    )
    p.add_argument(
        "--max-fallback-endpoints", type=COUNT, default=0, metavar="N", help="after the primary"
    )
    p.add_argument(
        "--workers",
        type=_typed(_workers, "workers"),
        default=d.server.workers,
        metavar="N|auto",
        help="ext_proc worker processes sharing the port (auto: the usable cores); above 1, a "
        "parent reads the pool, scrapes and serves health and metrics for all of them",
    )
    p.add_argument(
        "--worker-max-requests",
        type=COUNT,
        default=d.server.worker_max_requests,
        metavar="N",
        help="replace a worker after about N ext_proc streams (each worker's limit gets up to "
        "10%% more, so they do not all turn over at once); the replacement serves before the "
        "old one drains. Bounds grpcio's per-stream leak (docs/envoy.md). 0: never; above 0 "
        "runs a parent and workers even with --workers 1",
    )
    p.add_argument(
        "--drain-timeout",
        type=DURATION,
        default=d.server.drain_timeout,
        metavar="DURATION",
        help="on SIGTERM, how long open streams may finish",
    )
    p.add_argument(
        "--max-request-body-size",
        type=COUNT,
        default=d.server.max_request_body_bytes,
        metavar="BYTES",
        help="larger request bodies are refused with 413",
    )
    p.add_argument(
        "--max-buffered-bytes",
        type=COUNT,
        default=d.server.max_buffered_bytes,
        metavar="BYTES",
        help="request bodies held at once, all streams together; past it 429 (0: no limit)",
    )
    p.add_argument(
        "--ext-proc-server",
        choices=(*EXT_PROC_SERVERS, *EXT_PROC_SERVER_ALIASES),
        default=d.server.ext_proc_server,
        help="the ext_proc port's gRPC stack: h2 (the EPP's own gRPC server on h2, in the event "
        "loop: no thread hop per message, the least CPU) or grpcio (gRPC's C core); grpclib, "
        "the default before, is now served by h2",
    )
    p.add_argument(
        "--max-concurrent-streams",
        type=COUNT,
        default=d.server.max_concurrent_streams,
        metavar="N",
        help="open ext_proc streams (one per request); past it 429 (0: no limit)",
    )
    # -- the ext_proc port's HTTP/2 connections (GrpcConnectionSettings), both stacks --
    c = d.server.connections
    p.add_argument(
        "--grpc-max-streams-per-connection",
        type=COUNT,
        default=c.max_streams_per_connection,
        metavar="N",
        help="streams one ext_proc connection may have open, announced "
        "(SETTINGS_MAX_CONCURRENT_STREAMS); one past it is refused (REFUSED_STREAM). Envoy does "
        "not keep to it: stay above its concurrency. 0: twice --max-concurrent-streams, or "
        "100000 when that is 0",
    )
    p.add_argument(
        "--grpc-keepalive-time",
        type=DURATION,
        default=c.keepalive_time,
        metavar="DURATION",
        help="PING an ext_proc connection that sent nothing for this long (0: never)",
    )
    p.add_argument(
        "--grpc-keepalive-timeout",
        type=DURATION,
        default=c.keepalive_timeout,
        metavar="DURATION",
        help="close a connection whose PING is not answered within this, ending its streams "
        "(and their in-flight counts)",
    )
    p.add_argument(
        "--grpc-max-connection-idle",
        type=DURATION,
        default=c.max_connection_idle,
        metavar="DURATION",
        help="close (GOAWAY) an ext_proc connection without streams for this long (0: never)",
    )
    p.add_argument(
        "--grpc-min-ping-interval",
        type=DURATION,
        default=c.min_ping_interval,
        metavar="DURATION",
        help="client PINGs closer than this with no data between are strikes; past 2, GOAWAY "
        "ENHANCE_YOUR_CALM (too_many_pings)",
    )
    p.add_argument(
        "--grpc-premature-reset-streams",
        type=COUNT,
        default=c.premature_reset_streams,
        metavar="N",
        help="h2 stack: close (GOAWAY ENHANCE_YOUR_CALM) a connection whose client reset half "
        "of N streams (or half of all, past N) within 1s of opening them, unanswered: rapid "
        "reset (0: no limit)",
    )
    p.add_argument(
        "--max-request-headers",
        type=COUNT,
        default=d.server.max_request_headers,
        metavar="N",
        help="request headers allowed, the EPP's own included (431 past it); keep it below "
        "Envoy's max_headers_count",
    )
    p.add_argument(
        "--max-request-headers-kb",
        type=COUNT,
        default=d.server.max_request_header_bytes // 1024,
        metavar="KIB",
        help="request header bytes allowed, the EPP's own included (431 past it); keep it "
        "below Envoy's max_request_headers_kb",
    )
    p.add_argument(
        "--extra-inference-path",
        type=_typed(_inference_path, "path"),
        action="append",
        default=[],
        metavar="PATH",
        help="also route this path (e.g. /v1/rerank) like an inference API; repeatable. Every "
        "path other than /v1/completions, /v1/chat/completions, /v1/embeddings and /v1/models "
        "is answered 404",
    )
    p.add_argument(
        "--refresh-metrics-interval",
        type=DURATION,
        default=d.scrape.refresh_interval,
        metavar="DURATION",
        help="model-server /metrics scrape interval",
    )
    p.add_argument(
        "--metrics-scrape-timeout",
        type=DURATION,
        default=d.scrape.timeout,
        metavar="DURATION",
        help="timeout of one scrape",
    )
    p.add_argument(
        "--metrics-staleness-threshold",
        type=DURATION,
        default=d.scrape.staleness_threshold,
        metavar="DURATION",
        help="metrics older than this are stale",
    )
    p.add_argument(
        "--metrics-cpu-budget",
        type=float,
        default=d.scrape.cpu_budget,
        metavar="CORES",
        help="share of a core scraping may use; the interval stretches to fit (0: never)",
    )
    p.add_argument(
        "--metrics-name-filter",
        type=BOOL,
        default=d.scrape.name_filter,
        metavar="BOOL",
        help="scrape /metrics?name[]=... for only the metrics the scheduler reads (servers "
        "built on prometheus_client, such as vLLM and SGLang, then render a page of about 2 KB "
        "instead of about 64); an endpoint whose filtered page lacks them gets the whole page",
    )
    for flag, what in (
        ("--total-queued-requests-metric", "waiting-queue"),
        ("--total-running-requests-metric", "running-requests"),
        ("--kv-cache-usage-percentage-metric", "KV-cache usage"),
        ("--lora-info-metric", "LoRA info"),
    ):
        p.add_argument(flag, metavar="NAME", help=f"the vLLM {what} metric name")
    p.add_argument(
        "--engine-metric",
        type=_typed(_engine_metric, "engine metric"),
        action="append",
        default=[],
        metavar="ENGINE.FIELD=METRIC",
        help="override one metric of any engine (fields: queue, running, kv_usage, lora_info, "
        "cache_info, ...; see docs/metrics.md); repeatable",
    )
    _add_outlier_flags(p)
    p.add_argument("--log-format", choices=("text", "json"), default="text")
    p.add_argument("--log-level", choices=log_levels(), default="info")


def _percent(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 100:
        raise ConfigError(f"{value} is not a percentage 0..100")
    return value


def _add_outlier_flags(p: argparse.ArgumentParser) -> None:
    """Outlier detection (``OutlierSettings``), named after Envoy's fields."""
    d = OutlierSettings()
    p.add_argument(
        "--outlier-consecutive-failures",
        type=COUNT,
        default=d.consecutive_failures,
        metavar="N",
        help="eject an endpoint after N failed requests in a row (a 5xx, Envoy's 503 for a "
        "reset or refused connection, or an attempt Envoy retried past); 0: never",
    )
    p.add_argument(
        "--outlier-base-ejection-time",
        type=DURATION,
        default=d.base_ejection_time,
        metavar="DURATION",
        help="an ejection lasts this times the ejections in a row; then one request probes it",
    )
    p.add_argument(
        "--outlier-max-ejection-time",
        type=DURATION,
        default=d.max_ejection_time,
        metavar="DURATION",
        help="the longest ejection",
    )
    p.add_argument(
        "--outlier-max-ejection-percent",
        type=_typed(_percent, "percentage"),
        default=d.max_ejection_percent,
        metavar="PERCENT",
        help="the most of the ready endpoints ejected at once; at least one whatever the "
        "percentage (as Envoy), never the last ready one",
    )


def _outlier_settings(args: argparse.Namespace) -> OutlierSettings:
    return OutlierSettings(
        consecutive_failures=args.outlier_consecutive_failures,
        base_ejection_time=args.outlier_base_ejection_time,
        max_ejection_time=args.outlier_max_ejection_time,
        max_ejection_percent=args.outlier_max_ejection_percent,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="epp", description="Endpoint Picker for the Gateway API Inference Extension"
    )
    parser.add_argument("--version", action="version", version=f"epp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    serve = sub.add_parser(
        "serve",
        help="serve ext_proc for Envoy",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_serve_flags(serve)
    validate = sub.add_parser("validate", help="check a pool file and/or a scheduler config")
    _add_pool_flags(validate)
    validate.add_argument("--config-file", type=Path, help="an EndpointPickerConfig YAML file")
    sub.add_parser("sim", help="run simulated vLLM servers (see `epp sim --help`)", add_help=False)
    sub.add_parser("bench", help="measure routing quality (see `epp bench --help`)", add_help=False)
    sub.add_parser(
        "envoy-config",
        help="render an Envoy config (see `epp envoy-config --help`)",
        add_help=False,
    )
    return parser


def _inference_path(text: str) -> str:
    """An absolute path without query, e.g. ``/v1/rerank``."""
    path = text.strip()
    if not path.startswith("/") or "?" in path or any(c.isspace() for c in path):
        raise ConfigError(f"invalid path {text!r} (use an absolute path such as /v1/rerank)")
    return path


def _engine_metric(text: str) -> tuple[str, str, str]:
    """``ENGINE.FIELD=SPEC`` (e.g. ``sglang.queue=sglang:num_queue_reqs``)."""
    key, sep, spec = text.partition("=")
    engine, dot, field = key.partition(".")
    if not sep or not dot or not engine or not field:
        raise ConfigError(f"invalid --engine-metric {text!r} (use ENGINE.FIELD=METRIC)")
    return engine.strip(), field.strip(), spec.strip()


def _metric_overrides(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    overrides: dict[str, dict[str, str]] = {}
    for engine, field, spec in args.engine_metric:
        overrides.setdefault(engine, {})[field] = spec
    flags = {
        "queue": args.total_queued_requests_metric,
        "running": args.total_running_requests_metric,
        "kv_usage": args.kv_cache_usage_percentage_metric,
        "lora_info": args.lora_info_metric,
    }
    for field, spec in flags.items():
        if spec:
            overrides.setdefault("vllm", {})[field] = spec
    return overrides


def _metrics_endpoint(args: argparse.Namespace) -> MetricsEndpointSettings:
    """``--metrics-endpoint-auth`` and friends: the reference's default (on) where there is a
    Kubernetes API to ask, off on a laptop with a pool file unless a token file is given."""
    wanted = args.metrics_endpoint_auth  # None: not given
    kubernetes = args.pool_file is None
    if args.metrics_token_file is not None:
        if wanted is False:
            raise ConfigError(
                "--metrics-token-file turns auth on: drop --metrics-endpoint-auth=false"
            )
        auth = MetricsAuth.TOKEN_FILE
    elif not (kubernetes if wanted is None else wanted):
        auth = MetricsAuth.OFF
    elif not kubernetes:
        raise ConfigError(
            "--metrics-endpoint-auth with --pool-file needs --metrics-token-file PATH "
            "(there is no Kubernetes API to check tokens with)"
        )
    else:
        auth = MetricsAuth.KUBERNETES
    if args.metrics_client_ca_file is not None and args.metrics_cert_dir is None:
        raise ConfigError("--metrics-client-ca-file needs --metrics-cert-dir")
    return MetricsEndpointSettings(
        auth=auth,
        token_file=args.metrics_token_file,
        cert_dir=args.metrics_cert_dir,
        client_ca_file=args.metrics_client_ca_file,
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
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
    return Settings(
        server=ServerSettings(
            bind_address=args.bind_address,
            grpc_port=args.grpc_port,
            grpc_health_port=args.grpc_health_port,
            metrics_port=args.metrics_port,
            secure_serving=args.secure_serving,
            cert_path=args.cert_path,
            client_ca_file=args.client_ca_file,
            drain_timeout=args.drain_timeout,
            max_request_body_bytes=args.max_request_body_size,
            max_buffered_bytes=args.max_buffered_bytes,
            max_concurrent_streams=args.max_concurrent_streams,
            extra_inference_paths=tuple(args.extra_inference_path),
            max_request_headers=args.max_request_headers,
            max_request_header_bytes=args.max_request_headers_kb * 1024,
            metrics_endpoint=_metrics_endpoint(args),
            workers=args.workers,
            worker_max_requests=args.worker_max_requests,
            ext_proc_server=args.ext_proc_server,
            connections=_grpc_connections(args),
        ),
        pool=PoolSettings(
            pool_file=args.pool_file,
            pool_name=args.pool_name,
            allow_unknown_models=args.allow_unknown_models,
            reload_settle_time=args.pool_file_settle_time,
            kubernetes=KubernetesSettings(
                namespace=args.pool_namespace or os.environ.get("NAMESPACE") or "default",
                group=args.pool_group,
                kubeconfig=args.kubeconfig,
                leader_election=args.ha_enable_leader_election,
            ),
        ),
        scheduling=SchedulingSettings(
            config_file=args.config_file, max_fallback_endpoints=args.max_fallback_endpoints
        ),
        scrape=ScrapeSettings(
            refresh_interval=args.refresh_metrics_interval,
            timeout=args.metrics_scrape_timeout,
            staleness_threshold=args.metrics_staleness_threshold,
            cpu_budget=args.metrics_cpu_budget,
            name_filter=args.metrics_name_filter,
            metric_overrides=_metric_overrides(args),
        ),
        logging=LoggingSettings(format=args.log_format, level=args.log_level),
        outliers=_outlier_settings(args),
    )


async def _serve(settings: Settings) -> None:
    from endpoint_picker.app import (  # grpc: keep --help fast
        App,
        freeze_startup_heap,
        return_large_blocks_to_os,
    )

    return_large_blocks_to_os()
    if settings.server.supervised:
        from endpoint_picker.workers import build_parent

        app = build_parent(settings)
    else:
        app = App(settings, before_listen=freeze_startup_heap)
    loop = asyncio.get_running_loop()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            app.request_stop()  # drain
        else:  # a second Ctrl-C / SIGTERM: the operator wants out now
            print("epp: second signal, exiting without draining", file=sys.stderr)
            app.kill_workers()  # or they would drain on their own, holding the port
            os._exit(1)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        await app.start()
        if settings.server.supervised:  # the parent routes nothing: no request to hold
            freeze_startup_heap()
        await app.wait_stopped()
    finally:
        await app.stop()


def _validate(args: argparse.Namespace) -> int:
    from endpoint_picker.datastore.pool import pool_pods, resolve_pool
    from endpoint_picker.datastore.sources.file import load_pool_file
    from endpoint_picker.director import criticality_of_priority
    from endpoint_picker.scheduling import describe, load_config

    if args.pool_file is None and args.config_file is None:
        raise ConfigError("give --pool-file and/or --config-file")
    if args.pool_file is not None:
        state = load_pool_file(args.pool_file)
        resolved = resolve_pool(state, args.pool_name)
        pool = resolved.pool
        print(
            f"{args.pool_file}: InferencePool {pool.namespace}/{pool.name} ({pool.api_version}), "
            f"ports {', '.join(map(str, pool.target_ports))}"
        )
        for model in resolved.models.values():
            split = ", ".join(f"{t.name}={t.weight}" for t in model.target_models) or "no split"
            print(f"  model {model.model_name}: {model.criticality.value}, {split}")
        for objective in resolved.objectives.values():
            crit = criticality_of_priority(objective.priority).value
            print(f"  objective {objective.name}: priority {objective.priority} ({crit})")
        for endpoint in resolved.endpoints:
            print(f"  endpoint {endpoint.hostport} (pod {endpoint.pod_name})")
        unready = sum(1 for p in pool_pods(pool, state.pods) if not (p.ready and p.pod_ip))
        print(
            f"  {len(resolved.endpoints)} endpoints; {len(state.pods) - resolved.pod_count} pods "
            f"not in the pool, {unready} of the pool not Ready or without an IP"
        )
        # A warning, not an error: serving takes the file and routes to each address once,
        # so validate exits 0 (as for NotReady pods) and says it where a CI log shows it.
        for duplicate in resolved.duplicates:
            print(f"epp: warning: duplicate pod address: {duplicate.describe()}", file=sys.stderr)
    if args.config_file is not None:
        try:
            text = args.config_file.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read: {exc.strerror}", str(args.config_file)) from exc
        # load_config builds every plugin once, so it catches what serving would
        print(describe(load_config(text, str(args.config_file))))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sim"]:
        from endpoint_picker_sim.cli import main as sim_main

        return int(sim_main(argv[1:]))
    if argv[:1] == ["bench"]:
        from endpoint_picker.bench.cli import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["envoy-config"]:
        from endpoint_picker.envoy_config import main as envoy_config_main

        return envoy_config_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            settings = settings_from_args(args)
            configure_logging(settings.logging.format, settings.logging.level)
            asyncio.run(_serve(settings))
            return 0
        if args.command == "validate":
            return _validate(args)
    except ConfigError as exc:
        print(f"epp: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    parser.print_help()
    return EXIT_USAGE
