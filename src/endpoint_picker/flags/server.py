"""``epp serve``'s flags for ``ServerSettings``: ports and TLS, what requests may hold, the
ext_proc port's connections, processes and shutdown (the table goes on in ``serve``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from endpoint_picker.errors import ConfigError
from endpoint_picker.flags.spec import README, Flag
from endpoint_picker.flags.values import BOOL, COUNT, DURATION, INFERENCE_PATH, PORT, WORKERS
from endpoint_picker.settings import EXT_PROC_SERVER_ALIASES, EXT_PROC_SERVERS, MetricsAuth


def _metrics_auth(args: argparse.Namespace) -> MetricsAuth:
    """``--metrics-endpoint-auth`` and friends: the reference's default (on) where there is a
    Kubernetes API to ask, off on a laptop with a pool file unless a token file is given."""
    wanted = args.metrics_endpoint_auth  # None: not given
    kubernetes = args.pool_file is None
    if args.metrics_token_file is not None:
        if wanted is False:
            raise ConfigError(
                "--metrics-token-file turns auth on: drop --metrics-endpoint-auth=false"
            )
        return MetricsAuth.TOKEN_FILE
    if not (kubernetes if wanted is None else wanted):
        return MetricsAuth.OFF
    if not kubernetes:
        raise ConfigError(
            "--metrics-endpoint-auth with --pool-file needs --metrics-token-file PATH "
            "(there is no Kubernetes API to check tokens with)"
        )
    return MetricsAuth.KUBERNETES


PORTS = (
    Flag(
        "--bind-address", "server.bind_address", "listen address",
        doc="listen address of all three ports", metavar="ADDRESS",
    ),
    Flag(
        "--grpc-port", "server.grpc_port", "ext_proc port",
        doc="ext_proc (and gRPC health)", read=PORT, metavar="PORT",
    ),
    Flag(
        "--ext-proc-server", "server.ext_proc_server",
        "the ext_proc port's gRPC stack: h2 (the EPP's own gRPC server on h2, in the event "
        "loop: no thread hop per message, the least CPU) or grpcio (gRPC's C core); grpclib, "
        "the default before, is now served by h2",
        doc="the ext_proc port's gRPC stack: `h2` (the EPP's own server for its two gRPC "
        "methods on the `h2` HTTP/2 library, in the event loop: no thread hop and no task per "
        "message, 40% less CPU per request than grpclib and half of grpcio's, measured in "
        f"[Performance]({README}#performance)) or `grpcio` (gRPC's C core and its asyncio API). "
        "Both serve ext_proc and health `Check` on the port, TLS and mutual TLS, `--workers`, "
        "and drain the same way. `grpclib`, the default before h2 (2026-11-26), is still "
        "accepted and served by h2 (a warning says so)",
        metavar="h2|grpcio", choices=(*EXT_PROC_SERVERS, *EXT_PROC_SERVER_ALIASES),
    ),
    Flag(
        "--grpc-health-port", "server.grpc_health_port", "gRPC health",
        doc="gRPC health, always plaintext (Kubernetes probes cannot do TLS)",
        read=PORT, metavar="PORT",
    ),
    Flag(
        "--metrics-port", "server.metrics_port", "Prometheus /metrics",
        doc="the EPP's own Prometheus metrics at `/metrics`, the live [status page]"
        f"({README}#status-page) at `/` (JSON at `/api/status`), and the HTTP probes "
        "`/healthz` and `/readyz`",
        read=PORT, metavar="PORT",
    ),
    Flag(
        "--secure-serving", "server.secure_serving",
        "TLS on the ext_proc port (self-signed unless --cert-path)",
        doc="TLS on the ext_proc port; a self-signed certificate is generated unless "
        "`--cert-path DIR` holds `tls.crt` and `tls.key`",
        read=BOOL, metavar="BOOL",
    ),
    Flag(
        "--cert-path", "server.cert_path", "folder with tls.crt, tls.key",
        doc="the ext_proc port's certificate: a folder with `tls.crt` and `tls.key` (needs "
        "`--secure-serving true`)",
        read=Path, metavar="DIR", shown="self-signed",
    ),
    Flag(
        "--client-ca-file", "server.client_ca_file",
        "mutual TLS: PEM CA bundle; ext_proc clients must present a certificate it signed",
        doc="mutual TLS on the ext_proc port (needs `--secure-serving true`): only clients "
        "presenting a certificate signed by a CA in this PEM bundle can connect; a missing or "
        "non-PEM file exits 2. Envoy's side: `epp envoy-config --epp-client-cert "
        "--epp-client-key [--epp-ca]`, see [docs/envoy.md]"
        "(envoy.md#mutual-tls-between-envoy-and-the-epp)",
        read=Path, metavar="PATH",
    ),
    Flag(
        "--metrics-endpoint-auth", "server.metrics_endpoint.auth",
        "requests to the metrics port (but /healthz, /readyz and the status page's own files) "
        "need a bearer token the Kubernetes API allows to get the path (TokenReview, "
        "SubjectAccessReview)",
        doc="the metrics port answers only bearer tokens the API server allows to `get` the "
        "path (TokenReview, SubjectAccessReview); the probes and the page's own files stay "
        f"open. See [Who may read the metrics port]({README}#who-may-read-the-metrics-port)",
        read=BOOL, metavar="BOOL", kind="optional", default=None,
        shown="on with the Kubernetes source, off with `--pool-file`", derive=_metrics_auth,
    ),
    Flag(
        "--metrics-token-file", "server.metrics_endpoint.token_file",
        "metrics port: accept only the bearer tokens in this file (one per line), instead of "
        "asking Kubernetes; re-read when it changes",
        doc="instead of Kubernetes: accept the bearer tokens listed in this file (one per "
        "line), re-read when it changes; works with `--pool-file` too",
        read=Path, metavar="PATH",
    ),
    Flag(
        "--metrics-cert-dir", "server.metrics_endpoint.cert_dir",
        "metrics port: HTTPS with DIR/tls.crt and DIR/tls.key, reloaded when they change",
        read=Path, metavar="DIR", shown="plain HTTP",
    ),
    Flag(
        "--metrics-client-ca-file", "server.metrics_endpoint.client_ca_file",
        "metrics port: mutual TLS; clients must present a certificate this CA bundle signed "
        "(needs --metrics-cert-dir)",
        read=Path, metavar="PATH",
    ),
)  # fmt: skip

LIMITS = (
    Flag(
        "--max-request-body-size", "server.max_request_body_bytes",
        "larger request bodies are refused with 413",
        doc="the EPP holds a body until it can route it: larger bodies get 413",
        read=COUNT, metavar="BYTES",
    ),
    Flag(
        "--max-buffered-bytes", "server.max_buffered_bytes",
        "request bodies held at once, all streams together; past it 429 (0: no limit)",
        doc="all the bodies held at once, every stream together (256 MiB: eight bodies at the "
        "per-body limit, or thousands of ordinary prompts): a chunk that would pass it gets a "
        "JSON 429 and the stream's bytes are given back; a stream gives its bytes back when its "
        "body is routed or refused, or when it ends or is cancelled. 0: no limit; otherwise at "
        "least `--max-request-body-size`",
        read=COUNT, metavar="BYTES",
    ),
    Flag(
        "--max-concurrent-streams", "server.max_concurrent_streams",
        "open ext_proc streams (one per request); past it 429 (0: no limit)",
        doc="open ext_proc streams (one per request, open until its response ends): a stream "
        "past it gets a JSON 429 on its first message (not gRPC's RESOURCE_EXHAUSTED, which "
        "Envoy would turn into an empty 500). 0: no limit",
        read=COUNT, metavar="N",
    ),
    Flag(
        "--max-request-headers", "server.max_request_headers",
        "request headers allowed, the EPP's own included (431 past it); keep it below Envoy's "
        "max_headers_count",
        doc="request headers allowed, the EPP's own included: past it a JSON 431 (keep it "
        "below Envoy's `max_headers_count`, 120 in the shipped configs)",
        read=COUNT, metavar="N",
    ),
    Flag(
        "--max-request-headers-kb", "server.max_request_header_bytes",
        "request header bytes allowed, the EPP's own included (431 past it); keep it below "
        "Envoy's max_request_headers_kb",
        doc="the same for the headers' bytes (Envoy's `max_request_headers_kb`: 80 in the "
        "shipped configs)",
        read=COUNT, metavar="KIB", unit=1024,
    ),
    Flag(
        "--extra-inference-path", "server.extra_inference_paths",
        "also route this path (e.g. /v1/rerank) like an inference API; repeatable. Every path "
        "other than /v1/completions, /v1/chat/completions, /v1/embeddings and /v1/models is "
        "answered 404",
        doc="also route this path like an inference API (e.g. `/v1/rerank`, `/v1/score`), "
        "repeatable; every other path but the OpenAI APIs is a 404. Give Envoy the same with "
        "`epp envoy-config --inference-path`",
        read=INFERENCE_PATH, metavar="PATH", kind="repeat", default=[], store=tuple,
    ),
)  # fmt: skip

CONNECTIONS = (
    Flag(
        "--grpc-max-streams-per-connection", "server.connections.max_streams_per_connection",
        "streams one ext_proc connection may have open, announced "
        "(SETTINGS_MAX_CONCURRENT_STREAMS); one past it is refused (REFUSED_STREAM). Envoy does "
        "not keep to it: stay above its concurrency. 0: twice --max-concurrent-streams, or "
        "100000 when that is 0",
        doc="streams one ext_proc connection may have open, announced in SETTINGS; one past it "
        "is refused alone (REFUSED_STREAM). Envoy does not keep to it (measured: it opens the "
        "streams anyway), so stay above Envoy's concurrency: `--max-concurrent-streams` and its "
        "JSON 429 are what Envoy meets first",
        read=COUNT, metavar="N",
        shown="0 (= 2 x `--max-concurrent-streams`, 20,000; 100,000 if that is 0)",
    ),
    Flag(
        "--grpc-keepalive-time", "server.connections.keepalive_time",
        "PING an ext_proc connection that sent nothing for this long (0: never)",
        doc="PING an ext_proc connection that sent nothing for this long (0: never); grpc's "
        "default is 2 h, which would keep a vanished Envoy's in-flight counts for 2 h "
        "(`grpc.keepalive_time_ms`)",
        read=DURATION, metavar="DURATION",
    ),
    Flag(
        "--grpc-keepalive-timeout", "server.connections.keepalive_timeout",
        "close a connection whose PING is not answered within this, ending its streams (and "
        "their in-flight counts)",
        doc="close a connection whose PING gets no answer within this; its streams end and "
        "release their in-flight counts and held bytes",
        read=DURATION, metavar="DURATION",
    ),
    Flag(
        "--grpc-max-connection-idle", "server.connections.max_connection_idle",
        "close (GOAWAY) an ext_proc connection without streams for this long (0: never)",
        doc="a connection with no stream this long gets GOAWAY (grpc's two-step graceful "
        "close), then is closed (0: never; `grpc.max_connection_idle_ms`)",
        read=DURATION, metavar="DURATION",
    ),
    Flag(
        "--grpc-min-ping-interval", "server.connections.min_ping_interval",
        "client PINGs closer than this with no data between are strikes; past 2, GOAWAY "
        "ENHANCE_YOUR_CALM (too_many_pings)",
        doc="client PINGs closer than this, with no headers or data either way in between, are "
        "strikes; past 2: GOAWAY `ENHANCE_YOUR_CALM` \"too_many_pings\" (grpc core's policy)",
        read=DURATION, metavar="DURATION",
    ),
    Flag(
        "--grpc-premature-reset-streams", "server.connections.premature_reset_streams",
        "h2 stack: close (GOAWAY ENHANCE_YOUR_CALM) a connection whose client reset half of N "
        "streams (or half of all, past N) within 1s of opening them, unanswered: rapid reset "
        "(0: no limit)",
        doc="h2 stack: GOAWAY `ENHANCE_YOUR_CALM` \"too_many_resets\" once the client has "
        "reset, unanswered and within 1 s of opening, half of N streams (or half of all its "
        "streams, past N): Envoy's rule against rapid reset (CVE-2023-44487); a ratio never "
        "punishes an Envoy that cancels many long generations at once. 0: off",
        read=COUNT, metavar="N",
    ),
)  # fmt: skip

PROCESSES = (
    Flag(
        "--workers", "server.workers",
        "ext_proc worker processes sharing the port (auto: the usable cores); above 1, a parent "
        "reads the pool, scrapes and serves health and metrics for all of them",
        doc="ext_proc worker processes sharing the port; `auto`: the cores this process may run "
        "on (capped by the cgroup's CPU quota). Above 1, a parent reads the pool, scrapes and "
        f"serves the health and metrics ports for all of them (see [Workers]"
        f"({README}#workers---workers-n))",
        read=WORKERS, metavar="N|auto",
    ),
    Flag(
        "--worker-max-requests", "server.worker_max_requests",
        "replace a worker after about N ext_proc streams (each worker's limit gets up to 10% "
        "more, so they do not all turn over at once); the replacement serves before the old one "
        "drains. Bounds grpcio's per-stream leak (docs/envoy.md). 0: never; above 0 runs a "
        "parent and workers even with --workers 1",
        doc="replace a worker after about N ext_proc streams, its successor serving before it "
        "drains; 0: never. Bounds grpcio's per-stream leak with `--ext-proc-server grpcio` "
        f"(see [Workers]({README}#workers---workers-n)); the default h2 stack does not leak. "
        "Above 0 runs a parent and workers even with `--workers 1`",
        read=COUNT, metavar="N",
    ),
    Flag(
        "--drain-timeout", "server.drain_timeout",
        "on SIGTERM, how long open streams may finish",
        doc="on SIGTERM: report NOT_SERVING (the health port keeps answering until the drain "
        "ends), refuse new streams, let open ones finish; a second signal exits at once",
        read=DURATION, metavar="DURATION",
    ),
)  # fmt: skip
