"""Fake model servers on 127.0.x.y serving real-shaped vLLM ``/metrics`` text (aiohttp)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from aiohttp import web

_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)


def vllm_metrics(
    *,
    waiting: int = 0,
    running: int = 0,
    kv: float = 0.0,
    active: Sequence[str] = (),
    pending: Sequence[str] = (),
    max_lora: int = 4,
    model: str = "base",
    lora_info: bool = True,
) -> str:
    """A vLLM v1 ``/metrics`` payload with the gauges the EPP reads amid histograms.

    ``lora_info=False``: no ``vllm:lora_requests_info`` sample, as on a fresh pod.
    """
    labels = f'engine="0",model_name="{model}"'
    lines = [
        "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
        "# TYPE vllm:time_to_first_token_seconds histogram",
    ]
    lines += [
        f'vllm:time_to_first_token_seconds_bucket{{{labels},le="{b}"}} {i * 3}.0'
        for i, b in enumerate(_BUCKETS)
    ]
    lines += [
        f'vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} 60.0',
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{labels}}} {float(running)}",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{labels}}} {float(waiting)}",
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{labels}}} {kv}",
        "# HELP vllm:lora_requests_info Running stats on lora requests.",
        "# TYPE vllm:lora_requests_info gauge",
    ]
    if lora_info:
        lines.append(
            f'vllm:lora_requests_info{{max_lora="{max_lora}",'
            f'running_lora_adapters="{",".join(active)}",'
            f'waiting_lora_adapters="{",".join(pending)}"}} 1.7e+09'
        )
    return "\n".join(lines) + "\n"


@dataclass
class FakeModelServer:
    address: str
    port: int
    metrics_text: str = field(default_factory=vllm_metrics)
    metrics_status: int = 200

    @property
    def hostport(self) -> str:
        return f"{self.address}:{self.port}"


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


@contextlib.asynccontextmanager
async def fake_model_servers(addresses: Sequence[str]) -> AsyncIterator[list[FakeModelServer]]:
    """Start one fake server per address, all on one port (as pods share a target port)."""
    port = free_port(addresses[0])
    servers = [FakeModelServer(a, port) for a in addresses]
    runners: list[web.AppRunner] = []
    try:
        for server in servers:

            async def metrics(_: web.Request, s: FakeModelServer = server) -> web.Response:
                return web.Response(text=s.metrics_text, status=s.metrics_status)

            app = web.Application()
            app.router.add_get("/metrics", metrics)
            runner = web.AppRunner(app, access_log=None, handle_signals=False)
            await runner.setup()
            await web.TCPSite(runner, server.address, port).start()
            runners.append(runner)
        yield servers
    finally:
        for runner in runners:
            await runner.cleanup()
