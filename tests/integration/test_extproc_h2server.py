"""What only the grpclib ext_proc server does itself: health answers, the GOAWAY drain."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tests.support.extproc import body, headers, json_body, lb_metadata, make_settings, running_app
from tests.support.pool import model, pod, pool, pool_yaml

from endpoint_picker.app import App
from endpoint_picker.extproc.h2server import H2ExtProcServer
from endpoint_picker.extproc.server import ExternalProcessor, HealthState
from endpoint_picker.settings import Settings

POOL = pool_yaml(pool(), model("m"), pod("a", "127.0.0.2"))


def grpclib_settings(tmp_path: Path) -> Settings:
    settings = make_settings(tmp_path, POOL)
    return replace(settings, server=replace(settings.server, ext_proc_server="grpclib"))


async def test_health_check_unknown_service_is_not_found_and_watch_is_unimplemented(
    tmp_path: Path,
) -> None:
    async with running_app(grpclib_settings(tmp_path)) as (_, client):
        stub = health_pb2_grpc.HealthStub(client.channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=2)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=2)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=2)
        with pytest.raises(grpc.aio.AioRpcError) as watched:
            await watch.read()
        assert watched.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_drain_lets_streams_on_every_connection_finish_and_cancels_past_grace(
    tmp_path: Path,
) -> None:
    """Two connections each hold an open stream: the one that finishes in time is answered,
    the one still open when the grace ends is cancelled, and stop() returns at the grace."""
    app = App(grpclib_settings(tmp_path))
    await app.start()
    port = app.ports.ext_proc
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as first,
        grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
        ) as second,
    ):
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

        finishing = pb_grpc.ExternalProcessorStub(first).Process()
        lingering = pb_grpc.ExternalProcessorStub(second).Process()
        for call in (finishing, lingering):
            await call.write(headers())
        await asyncio.sleep(0.1)
        loop = asyncio.get_running_loop()
        started = loop.time()
        stopping = asyncio.create_task(app.stop(drain_timeout=1.0))
        await asyncio.sleep(0.1)
        await finishing.write(body(json_body({"model": "m", "prompt": "x"})))
        assert lb_metadata(await finishing.read()) == "127.0.0.2:8000"
        await finishing.done_writing()
        await stopping
        assert 0.9 <= loop.time() - started < 3.0  # waited out the grace for the other one
        with pytest.raises(grpc.aio.AioRpcError):  # cancelled by the drain: an error status
            await lingering.read()


async def test_stop_before_start_is_a_no_op() -> None:
    health = HealthState()
    server = H2ExtProcServer(ExternalProcessor(lambda: None), health, "127.0.0.1", 0)  # type: ignore[arg-type, return-value]
    await server.stop(0)
    assert server.port == 0
