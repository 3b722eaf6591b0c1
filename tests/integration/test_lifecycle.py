"""Hot reload of the pool file, health states, TLS, drain."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tests.support.extproc import (
    body,
    completion,
    headers,
    json_body,
    lb_metadata,
    make_settings,
    running_app,
    started_app,
)
from tests.support.polling import until
from tests.support.pool import ONE_POD, model, pod, pool, pool_yaml

from endpoint_picker.app import App
from endpoint_picker.extproc.tls import self_signed_certificate

# each test runs on both gRPC stacks of the ext_proc port (tests/integration/conftest.py)
pytestmark = pytest.mark.usefixtures("ext_proc_server")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _eventually(check, within: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + within
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_pool_file_edit_applies_and_bad_edit_keeps_last_good(tmp_path: Path) -> None:
    """An edit takes effect within a second; an invalid edit keeps the last good state."""
    settings = make_settings(tmp_path, ONE_POD)
    pool_file = settings.pool.pool_file
    assert pool_file is not None
    async with running_app(settings) as (_, client):
        pool_file.write_text(pool_yaml(pool(), model("m"), pod("b", "127.0.0.3")))

        async def moved() -> bool:
            out = await client.exchange(completion())
            return lb_metadata(out[0]) == "127.0.0.3:8000"

        await _eventually(moved, within=1.5)
        for bad in (b"kind: InferenceModel\napiVersion: nope\n", b"\xff\xfe not text"):
            pool_file.write_bytes(bad)
            await asyncio.sleep(0.3)
            out = await client.exchange(completion())
            assert lb_metadata(out[0]) == "127.0.0.3:8000"
        # the watch survived the bad edits: a good one still applies
        pool_file.write_text(pool_yaml(pool(), model("m"), pod("c", "127.0.0.4")))

        async def moved_again() -> bool:
            out = await client.exchange(completion())
            return lb_metadata(out[0]) == "127.0.0.4:8000"

        await _eventually(moved_again, within=1.5)


async def test_refused_empty_pool_shows_in_metrics_and_healthz(tmp_path: Path) -> None:
    """A pool file emptied by mistake keeps routing; /metrics and /healthz say it was refused."""
    settings = make_settings(tmp_path, ONE_POD, reload_settle_time=0.1)
    pool_file = settings.pool.pool_file
    assert pool_file is not None
    async with running_app(settings) as (app, client), aiohttp.ClientSession() as session:
        base = f"http://127.0.0.1:{app.ports.metrics}"
        pool_file.write_text(pool_yaml(pool(), model("m")))

        async def refused() -> bool:
            async with session.get(f"{base}/metrics") as reply:
                text = await reply.text()
            return 'inference_extension_pool_reload_total{result="rejected_empty"} 1.0' in text

        await _eventually(refused, within=2.0)
        async with session.get(f"{base}/metrics") as reply:
            assert "inference_extension_pool_source_healthy 0.0" in await reply.text()
        async with session.get(f"{base}/healthz") as reply:
            assert reply.status == 200  # still ready: the last good pool serves
            assert "refused" in await reply.text()
        out = await client.exchange(completion())
        assert lb_metadata(out[0]) == "127.0.0.2:8000"


async def _health(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        return int(reply.status)


@pytest.mark.parametrize(
    "service", ["", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"]
)
async def test_health_serving_when_loaded_not_serving_while_draining(
    tmp_path: Path, service: str
) -> None:
    """Readiness names are SERVING once loaded, NOT_SERVING when unready; liveness stays."""
    async with started_app(
        make_settings(tmp_path, pool_yaml(pool(), pod("a", "127.0.0.2"))), drain_timeout=0.2
    ) as app:
        assert await _health(app.ports.health, service) == SERVING
        assert await _health(app.ports.ext_proc, service) == SERVING
        await app.health.set_ready(False)  # what stop() does first
        assert await _health(app.ports.health, service) == NOT_SERVING
        assert await _health(app.ports.health, "liveness") == SERVING


async def test_tls_ext_proc_with_generated_certificate(tmp_path: Path) -> None:
    """Secure serving works with a certificate from --cert-path; health stays plaintext."""
    from dataclasses import replace

    key, cert = self_signed_certificate()
    (tmp_path / "tls.key").write_bytes(key)
    (tmp_path / "tls.crt").write_bytes(cert)
    settings = make_settings(tmp_path, ONE_POD)
    settings = replace(
        settings, server=replace(settings.server, secure_serving=True, cert_path=tmp_path)
    )
    async with started_app(settings, drain_timeout=0.2) as app:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert)
        async with grpc.aio.secure_channel(
            f"127.0.0.1:{app.ports.ext_proc}",
            credentials,
            options=[("grpc.ssl_target_name_override", "localhost")],
        ) as channel:
            from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(headers())
            await call.write(body(json_body({"model": "m", "prompt": "x"})))
            await call.done_writing()
            out = [r async for r in call]
        assert lb_metadata(out[0]) == "127.0.0.2:8000"
        assert await _health(app.ports.health, "") == SERVING


async def test_drain_finishes_open_streams_refuses_new_ones_and_reports_not_serving(
    tmp_path: Path,
) -> None:
    """While draining: health says NOT_SERVING, new streams are refused, an open one finishes."""
    settings = make_settings(tmp_path, ONE_POD)
    async with running_app(settings) as (app, client):
        health_port = app.ports.health
        call = client.stub.Process()
        await call.write(headers())
        # the server holds the stream before the drain starts (a loaded machine may not have
        # delivered the first write yet, and then grpc.aio's stop finds nothing in flight)
        await until(lambda: app.streams_accepted == 1)
        started = asyncio.get_running_loop().time()
        stopping = asyncio.create_task(app.stop(drain_timeout=5.0))
        await asyncio.sleep(0.2)
        for service in ("", "readiness"):
            assert await _health(health_port, service) == NOT_SERVING
        assert await _health(health_port, "liveness") == SERVING
        refused = await client.exchange_error([headers()])
        assert refused == grpc.StatusCode.UNAVAILABLE
        await call.write(body(json_body({"model": "m", "prompt": "x"})))
        first = await call.read()
        await call.done_writing()
        assert lb_metadata(first) == "127.0.0.2:8000"
        await stopping
        # it returned when the open stream ended, not at the end of the grace period
        assert asyncio.get_running_loop().time() - started < 4.0


async def test_port_in_use_is_a_config_error(tmp_path: Path) -> None:
    """A port another process holds is a ConfigError (one line, exit 2 from the CLI)."""
    from dataclasses import replace

    from endpoint_picker.errors import ConfigError

    settings = make_settings(tmp_path, pool_yaml(pool(), pod("a", "127.0.0.2")))
    async with running_app(settings) as (app, _):
        for field in ("grpc_port", "metrics_port"):
            taken = replace(
                settings,
                server=replace(settings.server, **{field: getattr(app.ports, _PORTS[field])}),
            )
            second = App(taken)
            try:
                with pytest.raises(ConfigError, match="cannot listen on"):
                    await second.start()
            finally:
                await second.stop(drain_timeout=0)


_PORTS = {"grpc_port": "ext_proc", "metrics_port": "metrics"}
