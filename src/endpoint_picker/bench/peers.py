"""The peer routers ``epp bench`` compares against: vllm-router and sglang-router.

Both are Rust routers shipped as Python wheels (the ``bench-peers`` extra), launched here as
``python -m <package>.launch_router --worker-urls URL ...`` in a child process. What they ask of
the model servers, as seen against ``epp sim`` (vLLM's OpenAI server):

- both: ``GET /health`` at startup and every 60 s; ``/readiness`` on the router answers 200 with
  ``healthy_workers`` once the workers are registered. Both add fields to the body they forward
  (``ignore_eos: false``, ``skip_special_tokens``...), which vLLM and the simulator ignore;
  sglang-router sends chat's ``max_tokens`` as ``max_completion_tokens``.
- vllm-router (``cache_aware``): before *every* request it asks *each* worker for
  ``POST /v1/completions/render`` (or ``/v1/chat/completions/render``) and then ``POST /tokenize``,
  to match prefixes on token ids. The simulator answers both 404, and the router falls back to
  matching on the request's text (``render_unavailable`` in its debug log): 2 extra round trips
  per worker per request, which the simulator's event loop pays for (4 servers, 600 streamed
  requests: 0.91 s of simulator CPU, against 0.18 s with ``round_robin``; 2026-11-23).
- sglang-router: at registration it probes each worker for gRPC (HTTP/2 prior knowledge: the
  simulator logs an aiohttp ``BadHttpMessage`` traceback per probe, harmless), then
  ``GET /server_info``, ``/get_server_info``, ``/model_info``, ``/get_model_info``, all 404, so the
  workers register with model ``unknown``; routing works regardless (one tree for all models).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from endpoint_picker.bench.model import BenchError

DEFAULT_POLICY = "cache_aware"


@dataclass(frozen=True, slots=True)
class PeerRouter:
    """How to launch one peer router."""

    name: str  # as in --stack
    package: str  # the importable package, to tell "not installed" early
    launcher: str  # the module run with ``python -m``
    # Policies that work against a plain fleet: kv_aware needs vLLM's KV-event stream (ZMQ),
    # manual needs routing-key headers, bucket is for prefill/decode disaggregation.
    policies: tuple[str, ...]
    log_level: str  # warnings only: per-request logging would cost CPU the fleet needs
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # added to the environment

    @property
    def command(self) -> tuple[str, ...]:
        """How to run it: with this interpreter, where the package was found."""
        return (sys.executable, "-m", self.launcher)


PEERS = {
    "vllm-router": PeerRouter(
        name="vllm-router",
        package="vllm_router",
        launcher="vllm_router.launch_router",
        policies=(
            "cache_aware",
            "round_robin",
            "random",
            "power_of_two",
            "consistent_hash",
            "sticky_least_loaded",
        ),
        log_level="warning",
        # its --log-level warning still logs at info (0.1.17); the Rust filter obeys RUST_LOG
        env=(("RUST_LOG", "warn"),),
    ),
    "sglang-router": PeerRouter(
        name="sglang-router",
        package="sglang_router",
        launcher="sglang_router.launch_router",
        policies=("cache_aware", "round_robin", "random", "power_of_two"),
        log_level="warn",
        # its default waits up to 180 s for in-flight requests on SIGTERM
        extra_args=("--shutdown-grace-period-secs", "1"),
    ),
}


def require(name: str) -> PeerRouter:
    """The peer router ``name``; ``BenchError`` when its package is not installed."""
    peer = PEERS[name]
    if importlib.util.find_spec(peer.package) is None:
        raise BenchError(
            f"{name} is not installed: pip install -e '.[bench-peers]' (or pip install {name})"
        )
    return peer


def router_args(
    peer: PeerRouter,
    policy: str,
    *,
    worker_urls: list[str],
    host: str,
    port: int,
    metrics_port: int,
) -> list[str]:
    """The words after ``python -m <launcher>``."""
    return [
        "--host", host, "--port", str(port),
        "--worker-urls", *worker_urls,
        "--policy", policy,
        # Prometheus defaults to a fixed port (29000): two routers, or a leftover, would clash.
        "--prometheus-host", host, "--prometheus-port", str(metrics_port),
        # The fleet is healthy before the router starts; the default re-check is 30 s away.
        "--worker-startup-check-interval", "1",
        "--log-level", peer.log_level,
        *peer.extra_args,
    ]  # fmt: skip


def readiness(workers: int) -> Callable[[int, Any], bool]:
    """Whether a ``GET /readiness`` answer (status, JSON body) means all ``workers`` are in:
    sglang-router serves before its workers are registered, but counts them in the body."""

    def ready(status: int, body: Any) -> bool:
        if status != 200:
            return False
        if isinstance(body, dict) and isinstance(body.get("healthy_workers"), int):
            return bool(body["healthy_workers"] >= workers)
        return True

    return ready
