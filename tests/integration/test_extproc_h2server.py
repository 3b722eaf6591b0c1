"""What only the grpclib ext_proc server does itself: health answers, the GOAWAY drain, the
message size limit, closing every connection on stop."""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tests.support.extproc import (
    body,
    error_of,
    headers,
    json_body,
    lb_metadata,
    make_settings,
    running_app,
)
from tests.support.pki import make_pki
from tests.support.pool import model, pod, pool, pool_yaml

from endpoint_picker.app import App
from endpoint_picker.extproc import wire
from endpoint_picker.extproc.h2server import (
    CLIENT_REST_SECONDS,
    HEALTH_CHECK_METHOD,
    PROCESS_METHOD,
    H2ExtProcServer,
)
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


class OneAnswer:
    """A servicer that answers each message with an empty response, counting what it read."""

    def __init__(self) -> None:
        self.read = 0
        self.finished = 0

    async def Process(
        self, requests: AsyncIterator[pb.ProcessingRequest], _: object
    ) -> AsyncIterator[pb.ProcessingResponse]:
        try:
            async for _message in requests:
                self.read += 1
                yield pb.ProcessingResponse()
        finally:
            self.finished += 1


async def serving(
    servicer: Any, tls: tuple[bytes, bytes] | None = None
) -> tuple[H2ExtProcServer, HealthState]:
    health = HealthState()
    await health.start()
    server = H2ExtProcServer(servicer, health, "127.0.0.1", 0, tls)
    await server.start()
    return server, health


async def test_a_message_past_grpcios_limit_is_refused_before_it_is_read() -> None:
    """grpclib alone would buffer any announced length; both stacks stop at 64 MiB."""
    servicer = OneAnswer()
    server, _ = await serving(servicer)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(body(b"x" * 64))
            await call.read()  # a message within the limit is served
            await call.write(body(b"x" * (wire.MAX_MESSAGE_BYTES + 1)))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call.read()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(wire.MAX_MESSAGE_BYTES) in (refused.value.details() or "")
        assert servicer.read == 1
        assert servicer.finished == 1
    finally:
        await server.stop(0)


async def test_a_client_that_never_half_closes_still_gets_its_status(tmp_path: Path) -> None:
    """After an immediate answer (here the 404 of an unknown path) the stream waits a moment
    for the client to end its side, then ends the call: no status withheld, no task kept."""
    async with running_app(grpclib_settings(tmp_path)) as (_, client):
        call = pb_grpc.ExternalProcessorStub(client.channel).Process()
        await call.write(headers("/admin"))
        status, _ = error_of(await call.read())
        assert status == 404
        loop = asyncio.get_running_loop()
        started = loop.time()
        code = await asyncio.wait_for(call.code(), CLIENT_REST_SECONDS + 3)
        assert code == grpc.StatusCode.OK
        assert loop.time() - started < CLIENT_REST_SECONDS + 1
        stop_started = loop.time()
    assert loop.time() - stop_started < 1.0  # nothing left for the drain to wait for


class RawClient:
    """An HTTP/2 client on a plain socket that keeps its connection, as Envoy does."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.h2.initiate_connection()
        self.events: list[h2.events.Event] = []
        self.closed = asyncio.Event()

    def open_stream(self, stream_id: int, path: str, message: bytes, *, end: bool) -> None:
        self.h2.send_headers(
            stream_id,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", "epp"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ],
        )
        self.h2.send_data(stream_id, b"\0" + struct.pack(">I", len(message)) + message, end)
        self.writer.write(self.h2.data_to_send())

    async def read_until_closed(self) -> None:
        while data := await self.reader.read(65536):
            self.events.extend(self.h2.receive_data(data))
            self.writer.write(self.h2.data_to_send())
        self.closed.set()

    def saw(self, kind: type[h2.events.Event]) -> bool:
        return any(isinstance(event, kind) for event in self.events)


async def within(seconds: float, work: Callable[[], Awaitable[None]]) -> float:
    loop = asyncio.get_running_loop()
    started = loop.time()
    await asyncio.wait_for(work(), seconds)
    return loop.time() - started


async def test_stop_closes_a_connection_whose_stream_outlives_the_grace() -> None:
    """Envoy keeps a connection while a stream is open, and a cancelled handler tells it
    nothing: stop() closes the connection itself (on Python 3.12 the listener's wait_closed
    waits for every connection, and stop() hung here)."""
    servicer = OneAnswer()
    server, _ = await serving(servicer)
    client = RawClient(*await asyncio.open_connection("127.0.0.1", server.port))
    client.open_stream(1, PROCESS_METHOD, headers().SerializeToString(), end=False)
    reading = asyncio.create_task(client.read_until_closed())
    for _ in range(100):
        if servicer.read:
            break
        await asyncio.sleep(0.01)
    assert servicer.read == 1
    assert await within(3.0, lambda: server.stop(0.3)) < 2.0
    await asyncio.wait_for(client.closed.wait(), 2.0)
    assert client.saw(h2.events.ConnectionTerminated)  # the GOAWAY came first
    assert servicer.finished == 1  # the stream's cleanup ran
    client.writer.close()
    await reading


async def test_a_tls_connection_whose_handshake_ends_after_stop_is_refused(tmp_path: Path) -> None:
    """Accepted before the listener closed, handshaken only after stop(): a GOAWAY and the
    close, and its stream is never served."""
    pki = make_pki()
    servicer = OneAnswer()
    server, _ = await serving(servicer, tls=(pki.server.key, pki.server.cert))
    raw = socket.create_connection(("127.0.0.1", server.port))
    raw.setblocking(False)
    await asyncio.sleep(0.2)  # accepted: the handshake waits for a ClientHello
    assert await within(3.0, lambda: server.stop(0)) < 1.0
    context = ssl.create_default_context(cadata=pki.ca.cert.decode())
    context.set_alpn_protocols(["h2"])
    reader, writer = await asyncio.open_connection(
        sock=raw, ssl=context, server_hostname="localhost"
    )
    client = RawClient(reader, writer)
    message = health_pb2.HealthCheckRequest(service="").SerializeToString()
    client.open_stream(1, HEALTH_CHECK_METHOD, message, end=True)
    client.open_stream(3, PROCESS_METHOD, headers().SerializeToString(), end=True)
    await asyncio.wait_for(client.read_until_closed(), 3.0)
    assert client.saw(h2.events.ConnectionTerminated)
    assert not client.saw(h2.events.DataReceived)
    assert not client.saw(h2.events.TrailersReceived)
    assert servicer.read == 0
    writer.close()
