"""Builders for the metrics tests: Prometheus text, endpoints, real /metrics servers."""

from __future__ import annotations

import asyncio
import socket
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
    """A real aiohttp server on 127.0.0.x (or ::1) serving a settable /metrics page.

    ``chunked`` sends the page in chunks of ``chunk_size`` bytes; ``close`` answers with
    ``Connection: close``. ``peers`` lists the client port of every request (the server's view
    of which connection carried it), ``headers`` the last request's headers.
    """

    def __init__(self, host: str, body: bytes = b"", *, status: int = 200) -> None:
        self.host = host
        self.body = body
        self.status = status
        self.delay = 0.0
        self.chunked = False
        self.chunk_size = 4096
        self.close = False
        self.hits = 0
        self.peers: list[int] = []
        self.headers: dict[str, str] = {}
        self.queries: list[str] = []  # each request's raw query string
        # What a request with a query (a name[] filter) gets instead: (body, status).
        self.filtered: tuple[bytes, int] | None = None
        self.port = 0
        self._release = asyncio.Event()  # ends every delay at once (stop)
        self._handlers: set[asyncio.Task[object]] = set()
        self._runner: web.AppRunner | None = None
        self._sock: socket.socket | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        peer = request.transport.get_extra_info("peername") if request.transport else None
        self.peers.append(peer[1] if peer else -1)
        self.headers = dict(request.headers)
        self.queries.append(request.query_string)
        body, status = self.body, self.status  # as when asked: a late answer is the old page
        if request.query_string and self.filtered is not None:
            body, status = self.filtered
        if self.delay:
            task = asyncio.current_task()
            assert task is not None
            self._handlers.add(task)
            try:
                await asyncio.wait_for(self._release.wait(), self.delay)
            except TimeoutError:
                pass
            finally:
                self._handlers.discard(task)
        if not self.chunked:
            response = web.Response(body=body, status=status, content_type="text/plain")
            if self.close:
                response.force_close()
            return response
        stream = web.StreamResponse(status=status)
        stream.content_type = "text/plain"
        stream.enable_chunked_encoding()
        if self.close:
            stream.force_close()
        await stream.prepare(request)
        for start in range(0, len(body), self.chunk_size):
            await stream.write(body[start : start + self.chunk_size])
        await stream.write_eof()
        return stream

    @property
    def open_connections(self) -> int:
        """Client connections the server still holds open."""
        return len(self._runner.server.connections) if self._runner and self._runner.server else 0

    async def start(self, port: int = 0) -> MetricsServer:
        app = web.Application()
        app.router.add_get("/metrics", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
        await self._runner.setup()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, port))
        self._sock = sock
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()
        return self

    async def stop(self) -> None:
        # A delayed handler whose client has gone is not awaited by aiohttp's cleanup: end it.
        self._release.set()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def endpoint(self, engine: str | None = None) -> Endpoint:
        return endpoint(self.host, self.port, engine)
