"""Envoy as a plain load balancer over the fleet (the ``rr`` and ``lr`` targets, no EPP).

The listener has the shape of ``deploy/envoy/templates/reference.yaml`` where it matters for
timing: an HTTP connection manager with no route timeout and the same stream idle timeout,
HTTP/1.1 to the model servers, circuit breakers raised out of the way. Everything else of the
reference (ext_proc, the buffer filter, header limits, JSON local replies) is left out: these
targets are the baseline the EPP is measured against, not a gateway to deploy. Every path is
routed, so ``/v1/models`` and ``/metrics`` reach a model server too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

from endpoint_picker.envoy_config import DEFAULT_CONNECT_TIMEOUT, DEFAULT_STREAM_IDLE_TIMEOUT

# Envoy's lb_policy per target. LEAST_REQUEST is Envoy's default flavour of it: two random
# choices, the one with fewer active requests wins (the servers are equally weighted).
LB_POLICIES = {"rr": "ROUND_ROBIN", "lr": "LEAST_REQUEST"}

# Envoy's default of 1024 concurrent requests per cluster would cap an overload run.
_UNLIMITED = 100000
_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
_HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"


def _socket(address: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": address, "port_value": port}}


def direct_config(
    target: str,
    *,
    endpoints: Sequence[tuple[str, int]],
    listen_port: int,
    admin_port: int,
    address: str = "127.0.0.1",
) -> dict[str, Any]:
    """The bootstrap of ``target`` (``rr`` or ``lr``) as a dict; ``render_direct`` dumps it."""
    if target not in LB_POLICIES:
        raise ValueError(f"no direct Envoy config for {target!r}")
    if not endpoints:
        raise ValueError("the fleet has no endpoints")
    route = {"cluster": "fleet", "timeout": "0s"}  # generations run for minutes
    hcm = {
        "@type": f"{_HCM}.HttpConnectionManager",
        "stat_prefix": "bench_direct",
        "codec_type": "AUTO",
        "stream_idle_timeout": f"{DEFAULT_STREAM_IDLE_TIMEOUT:g}s",
        "route_config": {
            "name": "fleet",
            "virtual_hosts": [
                {
                    "name": "fleet",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": route}],
                }
            ],
        },
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}}],
    }
    listener = {
        "name": "bench_direct",
        "address": _socket(address, listen_port),
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager",
                          "typed_config": hcm}]}
        ],
    }  # fmt: skip
    cluster = {
        "name": "fleet",
        "type": "STATIC",
        "lb_policy": LB_POLICIES[target],
        "connect_timeout": f"{DEFAULT_CONNECT_TIMEOUT:g}s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _HTTP_OPTIONS,
                "explicit_http_config": {"http_protocol_options": {}},  # HTTP/1.1, as vLLM
            }
        },
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": _UNLIMITED,
                    "max_pending_requests": _UNLIMITED,
                    "max_requests": _UNLIMITED,
                }
            ]
        },
        "load_assignment": {
            "cluster_name": "fleet",
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _socket(h, p)}} for h, p in endpoints]}
            ],
        },
    }
    return {
        "admin": {"address": _socket(address, admin_port)},
        "static_resources": {"listeners": [listener], "clusters": [cluster]},
    }


def render_direct(
    target: str,
    *,
    endpoints: Sequence[tuple[str, int]],
    listen_port: int,
    admin_port: int,
    address: str = "127.0.0.1",
) -> str:
    """``direct_config`` as Envoy YAML."""
    config = direct_config(
        target,
        endpoints=endpoints,
        listen_port=listen_port,
        admin_port=admin_port,
        address=address,
    )
    return yaml.safe_dump(config, sort_keys=False)
