"""One Envoy standing in for a fleet of model servers: a listener per endpoint, direct responses.

For the benchmarks that need many endpoints and none of a model server's cost
(``benchmarks/bench_extproc.py``, ``bench_pool_size.py``, ``bench_scrape_budget.py``): each
endpoint answers ``/metrics`` with a given page (the benchmarks pass the 64 KB vLLM v1 page of
the unit tests, filtered by ``name[]`` as vLLM filters it) and anything else with a short JSON
completion. Endpoints are ``host:port`` strings on loopback addresses (``addresses``).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import yaml

from endpoint_picker.bench.model import BenchError
from endpoint_picker.bench.stacks import find_envoy
from endpoint_picker.metrics.engines import BUILTIN_ENGINES
from endpoint_picker_sim.metrics import restrict

BIN = Path(sys.executable).parent
PORT = 18000  # every endpoint's port (one pool port); addresses tell them apart
COMPLETION = (
    '{"id":"cmpl-1","object":"text_completion","model":"m","choices":[{"index":0,'
    '"text":" hello there","finish_reason":"length"}],'
    '"usage":{"prompt_tokens":12,"completion_tokens":2,"total_tokens":14}}'
)
PROMPT = '{"model": "m", "prompt": "' + "Tell me about routing. " * 20 + '", "max_tokens": 2}'


def default_envoy() -> str:
    """``stacks.find_envoy``'s Envoy, or ``envoy`` (a flag's default: ``--help`` works without)."""
    with contextlib.suppress(BenchError):
        return find_envoy()
    return "envoy"


def addresses(count: int, first_subnet: int = 1) -> list[str]:
    """``count`` endpoints on 127.0.<first_subnet>.2 and up (250 per /24), all on ``PORT``."""
    return [f"127.0.{first_subnet + i // 250}.{2 + i % 250}:{PORT}" for i in range(count)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def filtered_metrics_page(page: str) -> str:
    """``page`` as vLLM answers ``/metrics?name[]=...`` for the EPP's default names."""
    return restrict(page, BUILTIN_ENGINES["vllm"].metric_names())


def backend_config(endpoints: Sequence[str], admin_port: int, page: str) -> str:
    """Envoy's config: a listener per endpoint answering ``/metrics`` with ``page`` (filtered
    when the scraper asks for names, as vLLM does) and anything else with a completion."""
    filtered = filtered_metrics_page(page)
    route_config = {
        "name": "backend",
        "max_direct_response_body_size_bytes": 1 << 20,
        "virtual_hosts": [
            {
                "name": "all",
                "domains": ["*"],
                "routes": [
                    *(  # what the EPP asks for by default: vLLM (prometheus_client) filters
                        {
                            "match": {
                                "path": "/metrics",
                                "query_parameters": [{"name": key, "present_match": True}],
                            },
                            "direct_response": {"status": 200, "body": {"inline_string": filtered}},
                        }
                        for key in ("name%5B%5D", "name[]")  # as sent, or decoded
                    ),
                    {
                        "match": {"path": "/metrics"},
                        "direct_response": {
                            "status": 200,
                            "body": {"inline_string": page},
                        },
                    },
                    {
                        "match": {"prefix": "/"},
                        "direct_response": {"status": 200, "body": {"inline_string": COMPLETION}},
                        "response_headers_to_add": [
                            {"header": {"key": "content-type", "value": "application/json"}}
                        ],
                    },
                ],
            }
        ],
    }
    listeners = []
    for i, endpoint in enumerate(endpoints):
        host, port = endpoint.rsplit(":", 1)
        listeners.append(
            {
                "name": f"backend_{i}",
                "address": {"socket_address": {"address": host, "port_value": int(port)}},
                "filter_chains": [
                    {
                        "filters": [
                            {
                                "name": "envoy.filters.network.http_connection_manager",
                                "typed_config": {
                                    "@type": "type.googleapis.com/envoy.extensions.filters."
                                    "network.http_connection_manager.v3.HttpConnectionManager",
                                    "stat_prefix": f"backend_{i}",
                                    "route_config": route_config,
                                    "http_filters": [
                                        {
                                            "name": "envoy.filters.http.router",
                                            "typed_config": {
                                                "@type": "type.googleapis.com/envoy.extensions."
                                                "filters.http.router.v3.Router"
                                            },
                                        }
                                    ],
                                },
                            }
                        ]
                    }
                ],
            }
        )
    return yaml.safe_dump(
        {
            "admin": {
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
            },
            "static_resources": {"listeners": listeners},
        }
    )


def pool_file(endpoints: Sequence[str], path: Path) -> None:
    """A pool file at ``path``: the endpoints (``host:port``, one port) as Ready pods."""
    port = int(endpoints[0].rsplit(":", 1)[1])
    docs: list[dict[str, object]] = [
        {
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": "bench", "namespace": "default"},
            "spec": {
                "selector": {"matchLabels": {"app": "bench"}},
                "targetPorts": [{"number": port}],
            },
        }
    ]
    for i, endpoint in enumerate(endpoints):
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"pod-{i}",
                    "namespace": "default",
                    "labels": {"app": "bench"},
                },
                "status": {
                    "podIP": endpoint.rsplit(":", 1)[0],
                    "conditions": [{"type": "Ready", "status": "True"}],
                },
            }
        )
    path.write_text(yaml.safe_dump_all(docs))


@contextlib.contextmanager
def process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``argv`` running, its output in ``log``; SIGTERM on exit (SIGKILL after 15 s)."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def backend_fleet(
    envoy: str, endpoints: Sequence[str], tmp: Path, page: str, within: float = 30.0
) -> Iterator[None]:
    """The model-server endpoints, answered by one Envoy (``backend_config``), up and ready."""
    admin = free_port()
    (tmp / "backend.yaml").write_text(backend_config(endpoints, admin, page))
    with process(
        [envoy, "-c", str(tmp / "backend.yaml"), "--concurrency", "1",
         "--log-level", "error", "--base-id", str(admin)],
        tmp / "backend.log",
    ):  # fmt: skip
        wait_ready(admin, within)
        yield


def wait_ready(admin_port: int, within: float = 30.0) -> None:
    """Until Envoy's admin ``/ready`` answers 200; ``BenchError`` after ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/ready", timeout=1) as r,
        ):
            if r.status == 200:
                return
        time.sleep(0.2)
    raise BenchError(f"Envoy on admin port {admin_port} not ready within {within:g} s")
