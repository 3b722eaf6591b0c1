"""The e2e harness: recording model-server backends, the EPP in process, a real Envoy.

Everything binds loopback only and stops by itself: Envoy is killed by its pid with bounded
waits, the backends and the EPP are stopped in ``finally`` blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml
from aiohttp import web

from endpoint_picker.app import App
from endpoint_picker.envoy_config import render
from endpoint_picker.settings import OutlierSettings
from tests.support.extproc import make_settings, started_app
from tests.support.model_servers import free_port, vllm_metrics
from tests.support.pool import model, pod, pool, pool_yaml

ENVOY = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "envoy"
SSE_CHUNKS = 5
SSE_DELAY = 0.2  # seconds between SSE chunks: the stream lasts about a second


@dataclass(frozen=True)
class Received:
    """What one backend saw of one request."""

    path: str
    headers: dict[str, str]
    body: bytes
    chunked: bool

    @property
    def json(self) -> Any:
        return orjson.loads(self.body)


@dataclass
class Backend:
    """A fake model server: records requests, answers JSON or SSE, serves /metrics."""

    address: str
    port: int
    metrics_text: str = field(default_factory=vllm_metrics)
    reset_requests: bool = False  # alive for /metrics, but resets every inference request
    received: list[Received] = field(default_factory=list)
    runner: web.AppRunner | None = None

    async def stop(self) -> None:
        """Stop listening: from now on connections to this endpoint are refused."""
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    @property
    def hostport(self) -> str:
        return f"{self.address}:{self.port}"

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text)

    async def health(self, request: web.Request) -> web.Response:
        """A pod's own /health (vLLM's): recorded, so a test sees whether the gateway sent it."""
        self.received.append(Received(request.path, dict(request.headers), b"", False))
        return web.Response(text="pod")

    async def infer(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()  # aiohttp de-chunks transfer-encoding: chunked
        self.received.append(
            Received(
                request.path,
                {k.lower(): v for k, v in request.headers.items()},
                raw,
                request.headers.get("transfer-encoding", "").lower() == "chunked",
            )
        )
        if self.reset_requests:
            assert request.transport is not None
            request.transport.abort()
            raise ConnectionResetError("backend resets on purpose")
        body = orjson.loads(raw)
        headers = {"x-served-by": self.hostport}
        if not body.get("stream"):
            answer = {
                "id": "cmpl-1",
                "model": body.get("model"),
                "served_by": self.hostport,
                "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            }
            return web.json_response(
                answer, headers=headers, dumps=lambda o: orjson.dumps(o).decode()
            )
        response = web.StreamResponse(
            headers={**headers, "content-type": "text/event-stream", "cache-control": "no-cache"}
        )
        await response.prepare(request)
        for i in range(SSE_CHUNKS):
            if i:
                await asyncio.sleep(SSE_DELAY)
            event = {"id": "cmpl-1", "choices": [{"index": 0, "text": f"t{i}"}]}
            await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@contextlib.asynccontextmanager
async def backends(addresses: Sequence[str]) -> AsyncIterator[list[Backend]]:
    """One backend per loopback address, all on one port (pods share the target port)."""
    port = free_port(addresses[0])
    servers = [Backend(a, port) for a in addresses]
    try:
        for server in servers:
            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_get("/metrics", server.metrics)
            app.router.add_route("*", "/health", server.health)
            app.router.add_post("/v1/completions", server.infer)
            app.router.add_post("/v1/chat/completions", server.infer)
            server.runner = web.AppRunner(app, access_log=None, handle_signals=False)
            await server.runner.setup()
            await web.TCPSite(server.runner, server.address, port).start()
        yield servers
    finally:
        for server in servers:
            await server.stop()


def e2e_pool(servers: Sequence[Backend]) -> str:
    """A pool naming the backends as pods: model "m", and "split" rewritten to "m-v2"."""
    pods = [pod(f"pod-{i}", s.address) for i, s in enumerate(servers)]
    return pool_yaml(
        pool(port=servers[0].port), model("m"), model("split", targets={"m-v2": 1}), *pods
    )


async def wait_scraped(app: App, limit: float = 5.0) -> None:
    """Until the EPP holds scraped metrics for every endpoint of its pool."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        states = app.datastore.endpoint_states()
        if states and all(s.metrics.updated_at > 0 for s in states):
            return
        await asyncio.sleep(0.02)
    raise TimeoutError("the EPP did not scrape every endpoint in time")


@contextlib.asynccontextmanager
async def running_epp(
    tmp_path: Path,
    pool_text: str,
    *,
    tls: bool = True,
    fallbacks: int = 0,
    staleness_threshold: float | None = None,
    refresh_interval: float | None = None,
    port: int = 0,
    outliers: OutlierSettings | None = None,
) -> AsyncIterator[App]:
    """The EPP in process (TLS with a self-signed certificate, like the shipped configs);
    ``port``: its ext_proc port (0: any free one); ``outliers``: outlier detection's settings."""
    settings = make_settings(tmp_path, pool_text, scraping=True)
    settings = replace(
        settings,
        server=replace(settings.server, secure_serving=tls, grpc_port=port),
        scheduling=replace(settings.scheduling, max_fallback_endpoints=fallbacks),
    )
    if staleness_threshold is not None:
        settings = replace(
            settings, scrape=replace(settings.scrape, staleness_threshold=staleness_threshold)
        )
    if refresh_interval is not None:
        settings = replace(
            settings, scrape=replace(settings.scrape, refresh_interval=refresh_interval)
        )
    if outliers is not None:
        settings = replace(settings, outliers=outliers)
    async with started_app(settings) as app:
        yield app


def add_subset_hint_filter(config_text: str) -> str:
    """Test-only tweak: a Lua filter turning ``x-test-subset: a,b`` into the subset hint.

    It sets ``envoy.lb.subset_hint`` dynamic metadata as a list, the way a gateway would,
    just before the ext_proc filter (which forwards that namespace to the EPP).
    """
    config = yaml.safe_load(config_text)
    listener = config["static_resources"]["listeners"][0]
    filters = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    names = [f["name"] for f in filters]
    lua = """
function envoy_on_request(handle)
  local hint = handle:headers():get("x-test-subset")
  if hint == nil then return end
  local list = {}
  for entry in string.gmatch(hint, "[^,]+") do table.insert(list, entry) end
  handle:streamInfo():dynamicMetadata():set(
    "envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", list)
end
"""
    filters.insert(
        names.index("envoy.filters.http.ext_proc"),
        {
            "name": "envoy.filters.http.lua",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
                "default_source_code": {"inline_string": lua},
            },
        },
    )
    return yaml.safe_dump(config, sort_keys=False)


@dataclass
class Envoy:
    """A running Envoy: its listener URL and admin URL."""

    url: str
    admin_url: str
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


async def _wait_ready(admin_url: str, process: asyncio.subprocess.Process, limit: float) -> None:
    deadline = time.monotonic() + limit
    client_timeout = aiohttp.ClientTimeout(total=1.0)
    async with aiohttp.ClientSession(timeout=client_timeout) as session:
        while time.monotonic() < deadline:
            if process.returncode is not None:
                raise RuntimeError(f"envoy exited with {process.returncode}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(f"{admin_url}/ready") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.05)
    raise TimeoutError(f"envoy not ready within {limit}s")


@contextlib.asynccontextmanager
async def running_envoy(
    tmp_path: Path,
    variant: str,
    *,
    epp_port: int,
    endpoints: Sequence[str] = (),
    tweak: Callable[[str], str] | None = None,
    **options: Any,
) -> AsyncIterator[Envoy]:
    """Render ``variant`` for free loopback ports, start Envoy, wait for /ready; kill on exit."""
    listen_port, admin_port = free_port(), free_port()
    text = render(
        variant,
        listen_address="127.0.0.1",
        listen_port=listen_port,
        admin_port=admin_port,
        epp_address="127.0.0.1",
        epp_port=epp_port,
        endpoints=endpoints,
        **options,
    )
    if tweak is not None:
        text = tweak(text)
    config = tmp_path / f"envoy-{variant}-{listen_port}.yaml"
    config.write_text(text)
    log_path = config.with_suffix(".log")
    with log_path.open("wb") as log_file:
        process = await asyncio.create_subprocess_exec(
            str(ENVOY),
            "-c",
            str(config),
            "--disable-hot-restart",
            "--concurrency",
            "1",
            "--log-level",
            os.environ.get("E2E_ENVOY_LOG_LEVEL", "warning"),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file,
            stderr=asyncio.subprocess.STDOUT,
        )
    envoy = Envoy(f"http://127.0.0.1:{listen_port}", f"http://127.0.0.1:{admin_port}", log_path)
    try:
        try:
            await _wait_ready(envoy.admin_url, process, limit=15.0)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}\n{envoy.log_tail()}") from exc
        yield envoy
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 5.0)
            except TimeoutError:
                process.kill()
                await asyncio.wait_for(process.wait(), 5.0)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    chunk_times: list[float]  # seconds since the request was sent, per body chunk read

    @property
    def json(self) -> Any:
        return orjson.loads(self.body)


async def post(
    session: aiohttp.ClientSession,
    url: str,
    payload: Any = None,
    *,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
    path: str = "/v1/completions",
    chunked: bool = False,
) -> Reply:
    """POST JSON (or raw bytes) and read the body chunk by chunk, timing each chunk.

    ``chunked``: upload with transfer-encoding: chunked, in 10 KB pieces.
    """
    data = raw if raw is not None else orjson.dumps(payload)

    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(data), 10_000):
            yield data[start : start + 10_000]
            await asyncio.sleep(0)

    sent = time.monotonic()
    async with session.post(
        url + path,
        # aiohttp warns about large raw bytes: BytesIO (sent with a content-length)
        data=pieces() if chunked else io.BytesIO(data),
        headers={"content-type": "application/json", **(headers or {})},
    ) as response:
        parts: list[bytes] = []
        times: list[float] = []
        async for chunk in response.content.iter_any():
            parts.append(chunk)
            times.append(time.monotonic() - sent)
        return Reply(
            response.status,
            {k.lower(): v for k, v in response.headers.items()},
            b"".join(parts),
            times,
        )
