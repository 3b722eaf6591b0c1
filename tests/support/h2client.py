"""A hand-driven HTTP/2 gRPC client on a raw socket (h2 as the client: it can misbehave as
no gRPC library lets it: never read, reset, flood PINGs, send half a message) and the toy
servicers and server the h2 ext_proc server's tests run it against."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import h2.config
import h2.connection
import h2.events
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from h2.settings import SettingCodes

from endpoint_picker.extproc.h2grpc import H2GrpcServer
from endpoint_picker.extproc.server import ExternalProcessor, HealthState
from endpoint_picker.extproc.tls import server_ssl_context

GRPC_HEADERS = (("content-type", "application/grpc"), ("te", "trailers"))


def framed(message: bytes, announced: int | None = None) -> bytes:
    """A gRPC length-prefixed message; ``announced`` claims another length (a partial one)."""
    size = len(message) if announced is None else announced
    return b"\0" + struct.pack(">I", size) + message


class RawClient:
    """An HTTP/2 client on a plain socket that keeps its connection, as Envoy does."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.h2.initiate_connection()
        self.events: list[h2.events.Event] = []
        self.closed = asyncio.Event()

    def open_stream(self, stream_id: int, path: str, message: bytes, *, end: bool) -> None:
        self.open_headers(stream_id, path)
        self.h2.send_data(stream_id, framed(message), end)
        self.writer.write(self.h2.data_to_send())

    def open_headers(
        self,
        stream_id: int,
        path: str,
        *,
        method: str = "POST",
        extra: Sequence[tuple[str, str]] = GRPC_HEADERS,
        end: bool = False,
    ) -> None:
        """Open a stream with its request headers only (``extra`` after the pseudo-headers)."""
        pseudo = [(":method", method), (":scheme", "http"), (":path", path), (":authority", "epp")]
        self.h2.send_headers(stream_id, [*pseudo, *extra], end_stream=end)
        self.writer.write(self.h2.data_to_send())

    def send(self, stream_id: int, data: bytes, *, end: bool = False) -> None:
        """Send ``data`` on a stream in frames of the largest size allowed."""
        size = self.h2.max_outbound_frame_size
        for start in range(0, max(len(data), 1), size):
            last = start + size >= len(data)
            self.h2.send_data(stream_id, data[start : start + size], end_stream=end and last)
        self.writer.write(self.h2.data_to_send())

    async def settled(self) -> None:
        """Read until the server's SETTINGS have come (its limits and windows apply)."""
        await self.read_until(lambda: self.saw(h2.events.RemoteSettingsChanged))

    def terminated(self) -> h2.events.ConnectionTerminated | None:
        """The server's GOAWAY, if one came."""
        for event in self.events:
            if isinstance(event, h2.events.ConnectionTerminated):
                return event
        return None

    async def read_until_closed(self) -> None:
        while data := await self.reader.read(65536):
            self.events.extend(self.h2.receive_data(data))
            self.writer.write(self.h2.data_to_send())
        self.closed.set()

    async def read_until(self, done: Callable[[], bool], *, acknowledge: bool = True) -> None:
        """Read (acknowledging what arrives, as a client with room does) until ``done()``."""
        while not done():
            data = await asyncio.wait_for(self.reader.read(65536), 3.0)
            assert data, "the server closed the connection"
            for event in self.h2.receive_data(data):
                self.events.append(event)
                if acknowledge and isinstance(event, h2.events.DataReceived):
                    self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            self.writer.write(self.h2.data_to_send())

    def data(self, stream_id: int) -> bytes:
        return b"".join(
            e.data
            for e in self.events
            if isinstance(e, h2.events.DataReceived) and e.stream_id == stream_id
        )

    def ended(self, stream_id: int) -> bool:
        return any(
            isinstance(e, h2.events.StreamEnded | h2.events.StreamReset)
            and e.stream_id == stream_id
            for e in self.events
        )

    def saw(self, kind: type[h2.events.Event]) -> bool:
        return any(isinstance(event, kind) for event in self.events)


def grpc_messages(data: bytes) -> list[bytes]:
    out = []
    while data:
        size = struct.unpack(">I", data[1:5])[0]
        out.append(data[5 : 5 + size])
        data = data[5 + size :]
    return out


def trailers(client: RawClient, stream_id: int) -> dict[bytes, bytes]:
    for event in client.events:
        if isinstance(event, h2.events.TrailersReceived) and event.stream_id == stream_id:
            return dict(event.headers)
        if isinstance(event, h2.events.ResponseReceived) and event.stream_id == stream_id:
            headers = dict(event.headers)
            if b"grpc-status" in headers:  # trailers only
                return headers
    return {}


async def raw_client(port: int, settings: dict[SettingCodes | int, int] | None = None) -> RawClient:
    client = RawClient(*await asyncio.open_connection("127.0.0.1", port))
    if settings:
        client.h2.update_settings(settings)
        client.writer.write(client.h2.data_to_send())
    return client


class OneAnswer:
    """Streams that answer each message with an empty response, counting what they read and
    how many were closed."""

    def __init__(self, answer: pb.ProcessingResponse | None = None) -> None:
        self.read = 0
        self.finished = 0
        self.answer = answer or pb.ProcessingResponse()

    def new_stream(self) -> Any:
        servicer = self

        class Stream:
            queued = False
            finished = False
            request_id = ""

            def handle(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
                servicer.read += 1
                return [servicer.answer]

            def close(self) -> None:
                servicer.finished += 1

        return Stream()


async def serving(
    servicer: NewStreams, tls: tuple[bytes, bytes] | None = None, **server: Any
) -> tuple[H2GrpcServer, HealthState]:
    """An h2 server on 127.0.0.1 answering with ``servicer``'s streams; ``server``: the
    server's keyword arguments (``budget``, ``limits``)."""
    health = HealthState()
    await health.start()
    context = server_ssl_context(tls, None) if tls is not None else None
    server_ = H2GrpcServer(
        ExternalProcessor(servicer.new_stream), health, "127.0.0.1", 0, context, **server
    )
    await server_.start()
    return server_, health


class NewStreams(Protocol):
    def new_stream(self) -> Any: ...


@contextlib.asynccontextmanager
async def raw_session(
    servicer: NewStreams, settings: dict[SettingCodes | int, int] | None = None, **server_: Any
) -> AsyncIterator[tuple[H2GrpcServer, RawClient]]:
    """A server answering with ``servicer``'s streams and a raw client connected to it."""
    server, _ = await serving(servicer, **server_)
    try:
        client = await raw_client(server.port, settings)
        yield server, client
        client.writer.close()
    finally:
        await server.stop(0)


class WaitsInFlowControl:
    """Streams whose first message waits in flow control until the test releases it; each
    logs when its wait ends and when it is closed."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.release = asyncio.Event()

    def new_stream(self) -> Any:
        owner = self

        class Stream:
            finished = False
            request_id = ""

            def __init__(self) -> None:
                self.queued = False

            def handle(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
                self.queued = True
                return []

            async def resume(self) -> list[pb.ProcessingResponse]:
                self.queued = False
                try:
                    await owner.release.wait()
                finally:
                    owner.log.append("wait ended")
                return [pb.ProcessingResponse()]

            def close(self) -> None:
                owner.log.append("closed")

        return Stream()
