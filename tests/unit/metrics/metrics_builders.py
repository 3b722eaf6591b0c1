"""Builders for the metrics tests: Prometheus text, endpoints, real /metrics servers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from endpoint_picker.types import Endpoint

FIXTURES = Path(__file__).parent / "fixtures"
ENGINE_LABEL = "inference.networking.k8s.io/engine-type"


def vllm_fixture() -> bytes:
    """A vLLM v1-shaped page: 2 data-parallel engines, histograms, HELP/TYPE, ~64 KB."""
    return (FIXTURES / "vllm_v1_metrics.txt").read_bytes()


def family(name: str, *samples: str, kind: str = "gauge") -> str:
    """One metric family with HELP/TYPE lines; each sample is the text after the name."""
    lines = [f"# HELP {name} {name} help.", f"# TYPE {name} {kind}"]
    lines += [f"{name}{sample}" for sample in samples]
    return "\n".join(lines) + "\n"


def vllm_page(
    queue: float = 0, running: float = 0, kv: float = 0.0, *, model: str = "m", extra: str = ""
) -> bytes:
    """A minimal vLLM page with one series of each required gauge."""
    labels = f'{{engine="0",model_name="{model}"}}'
    return (
        family("vllm:num_requests_waiting", f"{labels} {queue}")
        + family("vllm:num_requests_running", f"{labels} {running}")
        + family("vllm:kv_cache_usage_perc", f"{labels} {kv}")
        + extra
    ).encode()


def sglang_page(queue: float, running: float, usage: float) -> bytes:
    """A minimal SGLang page."""
    return (
        family("sglang:num_queue_reqs", f'{{model_name="m"}} {queue}')
        + family("sglang:num_running_reqs", f'{{model_name="m"}} {running}')
        + family("sglang:token_usage", f'{{model_name="m"}} {usage}')
        + family("sglang:cache_config_info", '{page_size="64",num_pages="900"} 1.0')
    ).encode()


def endpoint(address: str, port: int, engine: str | None = None, name: str = "") -> Endpoint:
    """An endpoint, labelled with an engine type when one is given."""
    labels = ((ENGINE_LABEL, engine),) if engine is not None else ()
    return Endpoint(name or f"pod-{address}-{port}", "default", address, port, labels)


class MetricsServer:
    """A real aiohttp server on 127.0.0.x serving a settable /metrics page."""

    def __init__(self, host: str, body: bytes = b"", *, status: int = 200) -> None:
        self.host = host
        self.body = body
        self.status = status
        self.delay = 0.0
        self.hits = 0
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._sock: socket.socket | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        return web.Response(body=self.body, status=self.status, content_type="text/plain")

    async def start(self, port: int = 0) -> MetricsServer:
        app = web.Application()
        app.router.add_get("/metrics", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, port))
        self._sock = sock
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def endpoint(self, engine: str | None = None) -> Endpoint:
        return endpoint(self.host, self.port, engine)


async def until(predicate: Callable[[], bool], within: float = 5.0) -> None:
    """Poll ``predicate`` until it holds; fail after ``within`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {within} s")
        await asyncio.sleep(0.01)
