"""What a hostile or vanished client can do to the h2 ext_proc server, driven by hand over a
real socket: memory it makes the server hold (flow control, the body budget, unread answers),
PING and reset floods, dead and idle connections, and calls that are no gRPC call it serves."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import replace
from pathlib import Path

import h2.events
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2
from h2.errors import ErrorCodes
from h2.settings import SettingCodes
from hyperframe.frame import Frame, GoAwayFrame, PingFrame
from tests.support.extproc import body, error_of, headers, make_settings, started_app
from tests.support.h2client import (
    GRPC_HEADERS,
    OneAnswer,
    RawClient,
    WaitsInFlowControl,
    framed,
    raw_client,
    raw_session,
    serving,
    trailers,
)
from tests.support.polling import until
from tests.support.pool import ONE_POD

from endpoint_picker.app import App
from endpoint_picker.extproc.h2grpc import HEALTH_CHECK_PATH, PROCESS_PATH
from endpoint_picker.extproc.limits import BodyBudget
from endpoint_picker.extproc.server import ExternalProcessor, HealthState, start_ext_proc_server
from endpoint_picker.settings import GrpcConnectionSettings

PROCESS = PROCESS_PATH.decode()
STREAMS = "inference_extension_ext_proc_streams"
BUFFERED = "inference_extension_buffered_request_bytes"
NO_KEEPALIVE = GrpcConnectionSettings(keepalive_time=0, max_connection_idle=0)


def sample(app: App, name: str) -> float:
    return app.metrics.registry.get_sample_value(name, {}) or 0.0


def big_answer(size: int) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(
            response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(
                    streamed_response=pb.StreamedBodyResponse(body=b"x" * size)
                )
            )
        )
    )


# -- item 8: flow control and the body budget --------------------------------------------------


async def test_undecoded_messages_count_toward_the_body_budget_and_past_it_get_a_json_429() -> None:
    """Unfinished messages are held bytes: they count toward --max-buffered-bytes (here 1 MiB),
    a stream that would pass it is answered with the full budget's JSON 429, and resets give
    every byte back."""
    budget = BodyBudget(1 << 20)
    servicer = OneAnswer()
    async with raw_session(servicer, budget=budget, limits=NO_KEEPALIVE) as (_server, client):
        await client.settled()
        for stream_id in (1, 3, 5):  # each announces 40 MiB and sends 400 KB of it
            client.open_headers(stream_id, PROCESS)
            client.send(stream_id, framed(b"x" * 400_000, announced=40 << 20))
        await client.read_until(lambda: bool(trailers(client, 5)))
        assert 800_000 <= budget.reserved < 1 << 20  # streams 1 and 3, held
        status, error = error_of(pb.ProcessingResponse.FromString(client.data(5)[5:]))
        assert status == 429
        assert "too many request bodies" in error["error"]["message"]
        assert trailers(client, 5)[b"grpc-status"] == b"0"
        assert not client.ended(1)
        assert not client.ended(3)
        for stream_id in (1, 3):
            client.h2.reset_stream(stream_id)
        client.writer.write(client.h2.data_to_send())
        await until(lambda: budget.reserved == 0 and servicer.finished == 3)
        assert servicer.read == 0


async def test_a_call_waiting_in_flow_control_acknowledges_nothing_until_its_wait_ends() -> None:
    """What a waiting call receives is not acknowledged (the client's window shrinks by it)
    until the wait ends and it is read; then the window opens again."""
    servicer = WaitsInFlowControl()
    async with raw_session(servicer, limits=NO_KEEPALIVE) as (_server, client):
        await client.settled()
        window = client.h2.remote_settings.initial_window_size  # the server's 4 MiB
        client.open_stream(1, PROCESS, headers().SerializeToString(), end=False)
        await asyncio.sleep(0.05)  # the first message waits
        sent = 3 << 20  # past half the window: h2 would announce it at once
        client.send(1, framed(b"x" * (sent - 5), announced=2 * sent))  # a partial message
        await asyncio.sleep(0.2)
        await client.read_until(lambda: True)  # whatever came
        assert client.h2.local_flow_control_window(1) <= window - sent
        servicer.release.set()
        await client.read_until(lambda: client.h2.local_flow_control_window(1) >= window - 100)
        assert servicer.log == ["wait ended"]


async def test_the_first_settings_announce_a_finite_stream_limit_and_past_it_one_is_refused() -> (
    None
):
    """SETTINGS_MAX_CONCURRENT_STREAMS is --grpc-max-streams-per-connection from the first
    SETTINGS on (not h2's 100, not 2^31-1); that many streams are served at once, and a client
    opening more (as Envoy does) has those refused one by one (REFUSED_STREAM), its connection
    and the other streams untouched."""
    limits = GrpcConnectionSettings(max_streams_per_connection=150)
    servicer = OneAnswer()
    async with raw_session(servicer, limits=limits) as (_server, client):
        for stream_id in range(1, 306, 2):  # 153, sent before the SETTINGS are read
            client.open_stream(stream_id, PROCESS, b"", end=False)
        await client.read_until(lambda: all(client.ended(s) for s in (301, 303, 305)))
        assert client.h2.remote_settings.max_concurrent_streams == 150
        refused = [
            e.stream_id
            for e in client.events
            if isinstance(e, h2.events.StreamReset) and e.error_code == ErrorCodes.REFUSED_STREAM
        ]
        assert refused == [301, 303, 305]
        assert servicer.read == 150
        assert client.terminated() is None
        client.h2.end_stream(1)
        client.writer.write(client.h2.data_to_send())
        await client.read_until(lambda: client.ended(1))
        assert trailers(client, 1)[b"grpc-status"] == b"0"


# -- item 9: a client that does not read ---------------------------------------------------------


async def test_a_client_that_never_reads_stops_being_read_and_then_gets_everything() -> None:
    """A client opening every window but never reading: the server stops reading its requests
    once the socket is full (so it queues little), and serves them all once it reads again."""
    servicer = OneAnswer(big_answer(512 << 10))
    server, _ = await serving(servicer, limits=NO_KEEPALIVE)
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
    raw.connect(("127.0.0.1", server.port))
    client = RawClient(*await asyncio.open_connection(sock=raw))
    try:
        client.h2.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
        client.h2.increment_flow_control_window(2**31 - 1 - 65_535)
        await client.settled()
        streams = range(1, 81, 2)  # 40 answers of 512 KiB, one request at a time
        for stream_id in streams:
            client.open_stream(stream_id, PROCESS, b"", end=True)
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.2)
        (connection,) = server.connections
        transport = connection._transport
        assert transport is not None
        assert servicer.read < 20  # reading stopped (the kernel's buffers hold a few MiB)
        assert transport.get_write_buffer_size() < 2 << 20
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        await client.read_until(lambda: all(client.ended(s) for s in streams))
        assert servicer.read == 40
        assert all(trailers(client, s)[b"grpc-status"] == b"0" for s in streams)
    finally:
        client.writer.close()
        await server.stop(0)


# -- item 10: floods ----------------------------------------------------------------------------


async def calmed(client: RawClient, reason: bytes) -> None:
    """The server ends the connection with GOAWAY ENHANCE_YOUR_CALM and ``reason``."""
    await client.read_until(lambda: client.terminated() is not None)
    goaway = client.terminated()
    assert goaway is not None
    assert goaway.error_code == ErrorCodes.ENHANCE_YOUR_CALM
    assert goaway.additional_data == reason


async def test_a_ping_flood_gets_goaway_enhance_your_calm_and_paced_pings_do_not() -> None:
    """PINGs paced at the permitted interval are answered; three too soon with nothing between
    them end the connection with GOAWAY ENHANCE_YOUR_CALM "too_many_pings" (grpc's rule)."""
    limits = GrpcConnectionSettings(keepalive_time=0, min_ping_interval=0.1)
    async with raw_session(OneAnswer(), limits=limits) as (_server, client):
        await client.settled()
        for i in range(4):
            client.h2.ping(b"paced%03d" % i)
            client.writer.write(client.h2.data_to_send())
            await asyncio.sleep(0.15)
        await client.read_until(
            lambda: sum(isinstance(e, h2.events.PingAckReceived) for e in client.events) == 4
        )
        assert client.terminated() is None
        for i in range(100):
            client.h2.ping(b"flood%03d" % i)
        client.writer.write(client.h2.data_to_send())
        await calmed(client, b"too_many_pings")
        acks = sum(isinstance(e, h2.events.PingAckReceived) for e in client.events)
        assert acks < 4 + 10  # not the whole flood


async def test_streams_reset_right_after_opening_end_the_connection() -> None:
    """Rapid reset (CVE-2023-44487): a client resetting its streams as it opens them gets
    GOAWAY ENHANCE_YOUR_CALM once it has reset half of --grpc-premature-reset-streams; every
    session it opened is closed. A client that lets its calls finish is never counted."""
    limits = GrpcConnectionSettings(keepalive_time=0, premature_reset_streams=20)
    servicer = OneAnswer()
    async with raw_session(servicer, limits=limits) as (server, client):
        await client.settled()
        for stream_id in range(1, 61, 2):  # 30 answered calls first: not premature
            client.open_stream(stream_id, PROCESS, b"", end=True)
        await client.read_until(lambda: client.ended(59))
        for stream_id in range(61, 261, 2):  # then 100 opened and reset at once
            client.open_stream(stream_id, PROCESS, headers().SerializeToString(), end=False)
            client.h2.reset_stream(stream_id)
        client.writer.write(client.h2.data_to_send())
        await calmed(client, b"too_many_resets")
        await until(lambda: not server.connections)
        # 30 reset of 60 opened (30 * 2 >= max(60, 20)): the other 70 never reached a session,
        # and every session opened was closed
        assert servicer.finished == 60


# -- item 11: dead and idle connections ---------------------------------------------------------


async def test_a_peer_gone_silent_loses_its_connection_and_its_streams_release_what_they_held(
    tmp_path: Path,
) -> None:
    """An Envoy that vanishes without closing (it answers nothing, not even a PING): after the
    keepalive time and timeout its connection is closed, and the stream slot and the body
    bytes its request held are released."""
    settings = make_settings(tmp_path, ONE_POD)
    limits = GrpcConnectionSettings(keepalive_time=0.2, keepalive_timeout=0.2)
    server = replace(settings.server, ext_proc_server="h2", connections=limits)
    async with started_app(replace(settings, server=server)) as app:
        client = await raw_client(app.ports.ext_proc)
        await client.settled()
        client.open_stream(1, PROCESS, headers().SerializeToString(), end=False)
        partial = body(b'{"model": "m", "prompt": "' + b"x" * 50_000, end_of_stream=False)
        client.send(1, framed(partial.SerializeToString()))
        await until(lambda: sample(app, STREAMS) == 1 and sample(app, BUFFERED) > 50_000)
        # from here on the client reads nothing and answers nothing
        loop = asyncio.get_running_loop()
        started = loop.time()
        await until(lambda: sample(app, STREAMS) == 0, within=3.0)
        assert 0.3 <= loop.time() - started < 2.0  # keepalive time, then its timeout
        assert sample(app, BUFFERED) == 0
        assert not app._ext_server.connections  # type: ignore[union-attr]
        client.writer.close()


async def test_a_connection_without_streams_for_the_idle_time_is_closed_gracefully() -> None:
    """Idle for --grpc-max-connection-idle: a GOAWAY that still admits streams and a PING,
    then (the PING answered) a final GOAWAY naming the last stream, and the close."""
    limits = GrpcConnectionSettings(keepalive_time=0, max_connection_idle=0.3)
    async with raw_session(OneAnswer(), limits=limits) as (_server, client):
        message = health_pb2.HealthCheckRequest(service="liveness").SerializeToString()
        client.open_stream(1, HEALTH_CHECK_PATH.decode(), message, end=True)
        await client.read_until(lambda: client.ended(1))
        assert trailers(client, 1)[b"grpc-status"] == b"0"
        loop = asyncio.get_running_loop()
        started = loop.time()
        # raw frames from here: h2's client state machine takes nothing after a GOAWAY
        frames, pending = [], b""
        async with asyncio.timeout(3):
            while data := await client.reader.read(65536):
                complete, pending = raw_frames(pending + data)
                for frame in complete:
                    frames.append(frame)
                    if isinstance(frame, PingFrame) and "ACK" not in frame.flags:
                        ack = PingFrame(0, opaque_data=frame.opaque_data, flags=["ACK"])
                        client.writer.write(ack.serialize())
        assert 0.3 <= loop.time() - started < 2.0
        goaways = [(f.last_stream_id, f.error_code) for f in frames if isinstance(f, GoAwayFrame)]
        assert goaways == [(2**31 - 1, 0), (1, 0)]


def raw_frames(data: bytes) -> tuple[list[Frame], bytes]:
    """The whole HTTP/2 frames at the start of ``data``, and what is left of it."""
    frames = []
    while len(data) >= 9:
        frame, length = Frame.parse_frame_header(memoryview(data[:9]))
        if len(data) < 9 + length:
            break
        frame.parse_body(memoryview(data[9 : 9 + length]))
        frames.append(frame)
        data = data[9 + length :]
    return frames, data


async def test_the_grpcio_stack_takes_the_same_keepalive_and_stream_limit() -> None:
    """grpcio gets the flags as channel options: it announces the stream limit and PINGs a
    connection that sent nothing for the keepalive time."""
    limits = GrpcConnectionSettings(keepalive_time=0.2, max_streams_per_connection=77)
    servicer = OneAnswer()
    health = HealthState()
    await health.start()
    server, port = await start_ext_proc_server(
        "grpcio",
        ExternalProcessor(servicer.new_stream),
        health,
        "127.0.0.1",
        0,
        None,
        limits=limits,
    )
    try:
        client = await raw_client(port)
        await client.settled()
        assert client.h2.remote_settings.max_concurrent_streams == 77
        await client.read_until(lambda: client.saw(h2.events.PingReceived))
        client.writer.close()
    finally:
        await server.stop(0)


# -- item 12: what is no gRPC call ----------------------------------------------------------------


async def test_only_a_post_with_a_grpc_content_type_is_served_and_echoes_are_cut() -> None:
    """GET: 405. application/grpcXYZ: 415. application/grpc+json: UNIMPLEMENTED.
    application/grpc+proto and application/grpc;params: served. An unknown 3.9 KB method is
    named in a grpc-message of a few hundred bytes."""
    servicer = OneAnswer()
    async with raw_session(servicer, limits=NO_KEEPALIVE) as (_server, client):
        await client.settled()
        ct = "content-type"
        client.open_headers(1, PROCESS, method="GET", end=True)
        client.open_headers(3, PROCESS, extra=((ct, "application/grpcXYZ"),), end=True)
        client.open_headers(5, PROCESS, extra=((ct, "application/grpc+json"),), end=True)
        for stream_id, kind in ((7, "application/grpc+proto"), (9, "application/grpc; x=y")):
            client.open_headers(stream_id, PROCESS, extra=((ct, kind),))
            client.send(stream_id, framed(b""), end=True)
        client.open_headers(11, "/" + "p" * 3900, end=True)
        await client.read_until(lambda: all(client.ended(s) for s in range(1, 12, 2)))
        responses = {
            e.stream_id: dict(e.headers)
            for e in client.events
            if isinstance(e, h2.events.ResponseReceived)
        }
        assert responses[1][b":status"] == b"405"
        assert responses[3][b":status"] == b"415"
        assert trailers(client, 5)[b"grpc-status"] == b"12"
        assert b"grpc+json" in trailers(client, 5)[b"grpc-message"]
        assert trailers(client, 7)[b"grpc-status"] == b"0"
        assert trailers(client, 9)[b"grpc-status"] == b"0"
        assert servicer.read == 2
        assert trailers(client, 11)[b"grpc-status"] == b"12"
        assert 100 < len(trailers(client, 11)[b"grpc-message"]) < 300


async def test_grpc_timeout_ends_a_waiting_call_with_deadline_exceeded() -> None:
    """A call past its grpc-timeout ends with DEADLINE_EXCEEDED and its session is closed after
    its flow-control wait was cancelled; a malformed grpc-timeout is INTERNAL, unserved."""
    servicer = WaitsInFlowControl()
    async with raw_session(servicer, limits=NO_KEEPALIVE) as (_server, client):
        await client.settled()
        client.open_headers(1, PROCESS, extra=(*GRPC_HEADERS, ("grpc-timeout", "200m")))
        client.send(1, framed(headers().SerializeToString()))
        client.open_headers(3, PROCESS, extra=(*GRPC_HEADERS, ("grpc-timeout", "٣S")), end=True)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await client.read_until(lambda: bool(trailers(client, 1)) and bool(trailers(client, 3)))
        assert 0.15 <= loop.time() - started < 1.5
        assert trailers(client, 1)[b"grpc-status"] == b"4"
        assert trailers(client, 3)[b"grpc-status"] == b"13"
        await until(lambda: servicer.log == ["wait ended", "closed"])
