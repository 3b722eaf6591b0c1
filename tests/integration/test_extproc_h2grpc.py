"""What the h2 ext_proc server does itself (grpcio's core does it for the other stack): health
answers, the GOAWAY drain, the message size limit, HTTP/2 flow control, closing every
connection on stop."""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable
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
from h2.settings import SettingCodes
from structlog.testing import capture_logs
from tests.support.extproc import (
    body,
    completion,
    error_of,
    headers,
    json_body,
    lb_metadata,
    make_settings,
    running_app,
)
from tests.support.h2client import (
    OneAnswer,
    RawClient,
    WaitsInFlowControl,
    grpc_messages,
    raw_client,
    raw_session,
    serving,
    trailers,
)
from tests.support.pki import make_pki
from tests.support.pool import ONE_POD

from endpoint_picker.app import App
from endpoint_picker.extproc import h2grpc, wire
from endpoint_picker.extproc.h2grpc import (
    CLIENT_REST_SECONDS,
    HEALTH_CHECK_PATH,
    PROCESS_PATH,
    H2GrpcServer,
)
from endpoint_picker.extproc.server import ExternalProcessor, HealthState
from endpoint_picker.settings import Settings


def h2_settings(tmp_path: Path) -> Settings:
    settings = make_settings(tmp_path, ONE_POD)
    return replace(settings, server=replace(settings.server, ext_proc_server="h2"))


async def test_health_check_unknown_service_is_not_found_and_watch_is_unimplemented(
    tmp_path: Path,
) -> None:
    async with running_app(h2_settings(tmp_path)) as (_, client):
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
    app = App(h2_settings(tmp_path))
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
    server = H2GrpcServer(ExternalProcessor(lambda: None), health, "127.0.0.1", 0)  # type: ignore[arg-type, return-value]
    await server.stop(0)
    assert server.port == 0


async def test_a_message_past_grpcios_limit_is_refused_before_it_is_read() -> None:
    """A message announcing more than grpcio's limit is refused before it is buffered."""
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
    async with running_app(h2_settings(tmp_path)) as (_, client):
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
    client.open_stream(1, PROCESS_PATH.decode(), headers().SerializeToString(), end=False)
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
    client.open_stream(1, HEALTH_CHECK_PATH.decode(), message, end=True)
    client.open_stream(3, PROCESS_PATH.decode(), headers().SerializeToString(), end=True)
    await asyncio.wait_for(client.read_until_closed(), 3.0)
    goaway = [e for e in client.events if isinstance(e, h2.events.ConnectionTerminated)]
    assert goaway
    assert goaway[0].last_stream_id == 0  # nothing of it was served: a client may retry all
    assert not client.saw(h2.events.DataReceived)
    assert not client.saw(h2.events.TrailersReceived)
    assert servicer.read == 0
    writer.close()


async def test_an_answer_larger_than_the_clients_window_waits_for_it_then_the_status() -> None:
    """A 1 MiB answer to a client announcing 16 KiB windows: sent as the client opens them,
    whole and in order, the status after the last byte."""
    answer = pb.ProcessingResponse(
        request_body=pb.BodyResponse(
            response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(
                    streamed_response=pb.StreamedBodyResponse(body=b"x" * (1 << 20))
                )
            )
        )
    )
    servicer = OneAnswer(answer)
    async with raw_session(servicer, {SettingCodes.INITIAL_WINDOW_SIZE: 16384}) as (
        _server,
        client,
    ):
        client.open_stream(1, PROCESS_PATH.decode(), headers().SerializeToString(), end=False)
        client.h2.send_data(1, b"\0" + struct.pack(">I", 0), end_stream=True)  # a 2nd message
        client.writer.write(client.h2.data_to_send())
        await client.read_until(lambda: client.ended(1))
        messages = grpc_messages(client.data(1))
        assert [pb.ProcessingResponse.FromString(m) for m in messages] == [answer, answer]
        assert trailers(client, 1)[b"grpc-status"] == b"0"
        assert (servicer.read, servicer.finished) == (2, 1)


async def test_a_client_that_stops_reading_holds_only_its_own_stream() -> None:
    """A stream whose client opens no window waits; a second stream on the same connection is
    still answered (its own window), and resetting the first frees its session."""
    big = pb.ProcessingResponse(
        request_body=pb.BodyResponse(
            response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(
                    streamed_response=pb.StreamedBodyResponse(body=b"x" * 200_000)
                )
            )
        )
    )
    servicer = OneAnswer(big)
    async with raw_session(servicer) as (_server, client):
        client.open_stream(1, PROCESS_PATH.decode(), headers().SerializeToString(), end=False)
        await client.read_until(lambda: len(client.data(1)) >= 65535, acknowledge=False)
        assert len(client.data(1)) == 65535  # the default window, then nothing
        client.open_stream(3, PROCESS_PATH.decode(), b"", end=True)
        # stream 3's window is its own, but the connection's is spent: open it (only)
        client.h2.increment_flow_control_window(1 << 20)
        client.writer.write(client.h2.data_to_send())
        await client.read_until(lambda: len(client.data(3)) >= 65535, acknowledge=False)
        assert len(client.data(3)) == 65535  # its own window, full; its status waits
        assert not client.ended(1)
        assert not client.ended(3)
        client.h2.reset_stream(1)
        client.h2.reset_stream(3)
        client.writer.write(client.h2.data_to_send())
        for _ in range(100):
            if servicer.finished == 2:
                break
            await asyncio.sleep(0.01)
        assert servicer.finished == 2


async def test_messages_split_over_frames_and_packed_into_one_are_each_answered() -> None:
    servicer = OneAnswer()
    async with raw_session(servicer) as (_server, client):
        one = headers().SerializeToString()
        framed = b"\0" + struct.pack(">I", len(one)) + one
        client.h2.send_headers(
            1,
            [(":method", "POST"), (":scheme", "http"), (":path", PROCESS_PATH.decode()),
             (":authority", "epp"), ("content-type", "application/grpc")],
        )  # fmt: skip
        for i in range(0, len(framed), 3):  # one message in 3-byte frames
            client.h2.send_data(1, framed[i : i + 3])
            client.writer.write(client.h2.data_to_send())
            await asyncio.sleep(0)
        client.h2.send_data(1, framed * 3, end_stream=True)  # three in one frame
        client.writer.write(client.h2.data_to_send())
        await client.read_until(lambda: client.ended(1))
        assert len(grpc_messages(client.data(1))) == 4
        assert trailers(client, 1)[b"grpc-status"] == b"0"
        assert (servicer.read, servicer.finished) == (4, 1)


async def test_what_is_not_a_served_grpc_call_gets_a_clear_answer() -> None:
    """Not gRPC: HTTP 415. Another method: UNIMPLEMENTED. A compressed message: UNIMPLEMENTED.
    A message that is not a ProcessingRequest: INTERNAL. No session is left open."""
    servicer = OneAnswer()
    async with raw_session(servicer) as (_server, client):
        client.h2.send_headers(
            1,
            [(":method", "POST"), (":scheme", "http"), (":path", PROCESS_PATH.decode()),
             (":authority", "epp"), ("content-type", "application/json")],
            end_stream=True,
        )  # fmt: skip
        client.open_stream(3, "/envoy.service.ext_proc.v3.ExternalProcessor/Other", b"", end=True)
        client.open_stream(5, PROCESS_PATH.decode(), b"", end=False)
        client.h2.send_data(5, b"\1" + struct.pack(">I", 1) + b"x", end_stream=True)
        client.open_stream(7, PROCESS_PATH.decode(), b"\xff\xff\xff", end=True)
        client.open_stream(9, "/nope", b"", end=False)  # the client would go on sending
        client.writer.write(client.h2.data_to_send())
        await client.read_until(lambda: all(client.ended(s) for s in (1, 3, 5, 7, 9)))
        responses = {
            e.stream_id: dict(e.headers)
            for e in client.events
            if isinstance(e, h2.events.ResponseReceived)
        }
        assert responses[1][b":status"] == b"415"
        assert trailers(client, 3)[b"grpc-status"] == b"12"
        assert b"Other" in trailers(client, 3)[b"grpc-message"]
        assert trailers(client, 5)[b"grpc-status"] == b"12"
        # stream 7: an empty message is answered; the garbage one is INTERNAL
        assert trailers(client, 7)[b"grpc-status"] == b"13"
        assert trailers(client, 9)[b"grpc-status"] == b"12"
        assert any(  # then asked to stop sending (RFC 9113, 8.1), so h2 forgets the stream
            isinstance(e, h2.events.StreamReset) and e.stream_id == 9 and e.error_code == 0
            for e in client.events
        )
        assert servicer.finished == 2  # streams 5 and 7 had sessions; both closed


async def test_a_client_breaking_the_protocol_loses_its_connection_and_nothing_else() -> None:
    servicer = OneAnswer()
    async with raw_session(servicer) as (server, client):
        client.open_stream(1, PROCESS_PATH.decode(), headers().SerializeToString(), end=False)
        await client.read_until(lambda: bool(client.data(1)))
        client.writer.write(b"\x00\x00\x04\x09\x00\x00\x00\x00\x01garb")  # CONTINUATION
        await asyncio.wait_for(client.read_until_closed(), 3.0)
        assert client.saw(h2.events.ConnectionTerminated)  # h2's GOAWAY, then the close
        assert servicer.finished == 1
        other = await raw_client(server.port)  # the server goes on
        message = health_pb2.HealthCheckRequest(service="liveness").SerializeToString()
        other.open_stream(1, HEALTH_CHECK_PATH.decode(), message, end=True)
        await other.read_until(lambda: other.ended(1))
        assert trailers(other, 1)[b"grpc-status"] == b"0"
        other.writer.close()


async def test_a_reset_while_waiting_closes_the_stream_only_after_the_wait_has_ended() -> None:
    """``RequestStream.resume`` routes a request that flow control admitted in the same turn
    as the cancellation, and only the close after that finishes it (its in-flight count)."""
    servicer = WaitsInFlowControl()
    async with raw_session(servicer) as (server, client):
        client.open_stream(1, PROCESS_PATH.decode(), headers().SerializeToString(), end=False)
        await asyncio.sleep(0.1)
        client.h2.reset_stream(1)
        client.writer.write(client.h2.data_to_send())
        for _ in range(100):
            if "closed" in servicer.log:
                break
            await asyncio.sleep(0.01)
        assert servicer.log == ["wait ended", "closed"]
        assert not server.cancelled


async def test_a_client_sending_on_while_its_request_waits_is_refused_past_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(h2grpc, "_MAX_UNREAD_BYTES", 10_000)
    servicer = WaitsInFlowControl()
    async with raw_session(servicer) as (_server, client):
        client.open_stream(1, PROCESS_PATH.decode(), headers().SerializeToString(), end=False)
        for _ in range(4):  # 4 x 4 KB while the first message waits
            client.h2.send_data(1, b"\0" + struct.pack(">I", 5000) + b"x" * 4000)
            client.writer.write(client.h2.data_to_send())
        await client.read_until(lambda: bool(trailers(client, 1)))
        assert trailers(client, 1)[b"grpc-status"] == b"8"  # RESOURCE_EXHAUSTED
        assert servicer.log[-1:] == ["closed"]  # the wait (if it had begun) ended first


async def test_the_drain_waits_for_a_status_held_for_the_clients_half_close() -> None:
    """A call answered in full whose client has not ended its side holds its status for up to
    CLIENT_REST_SECONDS: stop() with a longer grace waits for it rather than cut it off."""

    class FinishesAtOnce(OneAnswer):
        def new_stream(self) -> Any:
            stream = super().new_stream()
            stream.finished = True
            return stream

    servicer = FinishesAtOnce()
    server, _ = await serving(servicer)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(headers())
        await call.read()
        took = await within(5.0, lambda: server.stop(5.0))
        assert await call.code() == grpc.StatusCode.OK
    assert took < CLIENT_REST_SECONDS + 1.0


async def test_the_retired_grpclib_stack_is_served_by_h2_with_a_warning(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, ONE_POD)
    settings = replace(settings, server=replace(settings.server, ext_proc_server="grpclib"))
    with capture_logs() as logs:
        async with running_app(settings) as (app, client):
            assert isinstance(app._ext_server, H2GrpcServer)
            out = await client.exchange(completion())
            assert lb_metadata(out[0]) == "127.0.0.2:8000"
    warned = [e for e in logs if e.get("ext_proc_server") == "grpclib"]
    assert warned
    assert warned[0]["log_level"] == "warning"
    assert warned[0]["serving"] == "h2"


async def test_a_stream_opened_after_the_drains_last_goaway_is_refused_not_reset() -> None:
    """Once nothing is busy, the drain names the last stream it received in a second GOAWAY; a
    stream the client opened before seeing it gets RST_STREAM REFUSED_STREAM (a gRPC client
    retries it on another connection) instead of dying in a connection reset."""
    servicer = OneAnswer()
    async with raw_session(servicer) as (server, client):
        client.open_stream(1, PROCESS_PATH.decode(), headers().SerializeToString(), end=True)
        await client.read_until(lambda: client.ended(1))
        (connection,) = list(server.connections)
        connection.last_goaway()  # what stop() sends when its calls are done
        client.open_stream(3, PROCESS_PATH.decode(), headers().SerializeToString(), end=True)
        received = b""
        # RST_STREAM: length 4, type 3, no flags, stream 3; error REFUSED_STREAM (0x7)
        refused = b"\x00\x00\x04\x03\x00" + struct.pack(">II", 3, 7)
        async with asyncio.timeout(3):
            while refused not in received:  # raw frames: h2's client state ends at a GOAWAY
                data = await client.reader.read(65536)
                assert data, "the server closed the connection"
                received += data
        assert servicer.read == 1  # stream 3 was never served
