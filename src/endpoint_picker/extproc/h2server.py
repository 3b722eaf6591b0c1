"""The ext_proc server on grpclib: gRPC on a pure-Python HTTP/2 stack run by the event loop.

grpcio's asyncio server hands every message across three threads (gRPC's I/O threads, its
completion-queue poller, the event loop), two wake-ups per message; grpclib parses HTTP/2 (h2)
in the event loop's own ``data_received``, so a message costs no thread hop. Measured through
Envoy on this project's machine (README, "Performance"): lower latency and less CPU per
request than grpcio, the no-op floors and the EPP alike. ``epp serve --ext-proc-server``
selects it.

What it serves on the one port, as the grpcio server does: ``ExternalProcessor/Process`` (the
same ``ExternalProcessor`` servicer) and ``grpc.health.v1.Health/Check`` (from ``HealthState``;
``Watch`` is not served: Envoy and Kubernetes probes use ``Check``). TLS and mutual TLS through
an ``ssl.SSLContext`` with ALPN ``h2``. ``stop(grace)`` drains: the listener closes, every
connection gets a GOAWAY (so Envoy opens its next streams elsewhere), open streams get ``grace``
seconds to finish, whatever is left is cancelled and every connection closed (a connection whose
TLS handshake ends during the drain is closed at once). A message longer than grpcio's limit
(``wire.MAX_MESSAGE_BYTES``) is refused with RESOURCE_EXHAUSTED before it is read; grpclib
alone has none.

grpclib has no GOAWAY of its own and h2's state machine refuses every frame after one, so the
frame is written to the transport beside h2: the first step of HTTP/2's graceful shutdown (RFC
9113, 6.8), a GOAWAY with the largest stream id, so that every stream the client has opened goes
on and it opens no more here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import tempfile
import time
import weakref
from asyncio import BaseTransport
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any, cast

import structlog
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError
from grpclib.protocol import H2Protocol
from grpclib.server import Handler as GrpclibHandler
from grpclib.server import Server, Stream
from h2.settings import SettingCodes
from hyperframe.frame import GoAwayFrame

from endpoint_picker.extproc import wire

if TYPE_CHECKING:
    from endpoint_picker.extproc.server import ExternalProcessor, HealthState

log = structlog.get_logger(__name__)

PROCESS_METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"
_MAX_STREAM_ID = 2**31 - 1  # a GOAWAY naming it: every stream the client has opened goes on
# How long a stream whose answer is complete waits for the client to end its side.
CLIENT_REST_SECONDS = 1.0
_CLOSE_SECONDS = 5.0  # how long stop() waits for cancelled handlers to end


class _Services:
    """grpclib's ``IServable``: the method paths and their handlers."""

    def __init__(self, processor: ExternalProcessor, health: HealthState) -> None:
        self._processor = processor
        self._health = health

    def __mapping__(self) -> dict[str, Handler]:
        return {
            PROCESS_METHOD: Handler(
                self._process,
                Cardinality.STREAM_STREAM,
                pb.ProcessingRequest,
                pb.ProcessingResponse,
            ),
            HEALTH_CHECK_METHOD: Handler(
                self._check,
                Cardinality.UNARY_UNARY,
                health_pb2.HealthCheckRequest,
                health_pb2.HealthCheckResponse,
            ),
        }

    async def _process(self, stream: Stream[pb.ProcessingRequest, pb.ProcessingResponse]) -> None:
        # The servicer reads the client's messages as its request iterator; it never uses the
        # context argument, which grpclib has no equivalent of.
        requests = _requests(stream)
        responses = cast(
            AsyncGenerator[pb.ProcessingResponse, None],
            self._processor.Process(requests, None),
        )
        try:
            async for response in responses:
                await stream.send_message(response)
            # The servicer has answered (an immediate response can come before the client has
            # sent its whole request): read what the client still sends before the trailers
            # end the call, as a client that writes its request before reading expects. Envoy
            # closes its side at once after an immediate response or the last response; a
            # client that never does gets its status after CLIENT_REST_SECONDS.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CLIENT_REST_SECONDS):
                    async for _ in requests:
                        pass
        finally:
            # Cancelled while sending (Envoy reset the stream): close the generator now, so
            # that its ``finally`` frees the request's slot and in-flight count at once.
            await responses.aclose()

    async def _check(
        self, stream: Stream[health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse]
    ) -> None:
        request = await stream.recv_message()
        if request is None:
            raise GRPCError(Status.INVALID_ARGUMENT, "a health check needs a request message")
        status = self._health.status(request.service)
        if status is None:
            raise GRPCError(Status.NOT_FOUND, f"unknown service {request.service!r}")
        await stream.send_message(health_pb2.HealthCheckResponse(status=status))


async def _requests(
    stream: Stream[pb.ProcessingRequest, pb.ProcessingResponse],
) -> AsyncIterator[pb.ProcessingRequest]:
    """The client's messages. grpclib reads a message of any announced length (up to 4 GiB)
    into memory; this refuses one longer than ``MAX_MESSAGE_BYTES`` (grpcio's limit in
    ``server.py``) before reading a byte of it."""
    frames = cast(Any, stream)._stream  # grpclib's HTTP/2 stream under the gRPC one
    while True:
        prefix = await frames.recv_data(5)  # compressed flag, then the length (big-endian)
        if not prefix:
            return
        size = int.from_bytes(prefix[1:5], "big")
        if prefix[0]:
            raise GRPCError(Status.UNIMPLEMENTED, "compressed messages are not supported")
        if size > wire.MAX_MESSAGE_BYTES:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"a message of {size} bytes exceeds the limit of {wire.MAX_MESSAGE_BYTES}",
            )
        yield pb.ProcessingRequest.FromString(await frames.recv_data(size))


def server_ssl_context(tls: tuple[bytes, bytes], client_ca: bytes | None) -> ssl.SSLContext:
    """A TLS server context from PEM (key, certificate chain), requiring a client certificate
    signed by ``client_ca`` when given; ALPN offers HTTP/2 only, as gRPC needs."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    key, chain = tls
    # The ssl module loads a key and chain from files only: a private temporary folder, gone
    # once loaded.
    with tempfile.TemporaryDirectory(prefix="epp-tls-") as folder:
        key_path, chain_path = os.path.join(folder, "tls.key"), os.path.join(folder, "tls.crt")
        with open(key_path, "wb") as f:
            f.write(key)
        with open(chain_path, "wb") as f:
            f.write(chain)
        context.load_cert_chain(chain_path, key_path)
    if client_ca is not None:
        context.load_verify_locations(cadata=client_ca.decode("ascii"))
        context.verify_mode = ssl.CERT_REQUIRED
    context.set_alpn_protocols(["h2"])
    return context


class _Protocol(H2Protocol):
    """One connection. h2 announces at most 100 concurrent streams, and an ext_proc stream
    lives as long as its request (seconds for a completion): past 100 Envoy would open more
    connections. As grpcio, allow any number; ``--max-concurrent-streams`` caps them all,
    every connection together, with a JSON 429 rather than a refused stream."""

    def __init__(self, server: _TrackingServer, default: H2Protocol) -> None:
        super().__init__(default.handler, default.config, default.h2_config)
        self._server = server
        self._refused = False

    def connection_made(self, transport: BaseTransport) -> None:
        super().connection_made(transport)
        if self._server.stopping:
            # accepted before the listener closed, its TLS handshake done only now: no streams
            self._refused = True
            _send_goaway(self)
            self.connection.close()
            return
        h2 = cast(Any, self.connection)._connection
        h2.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: _MAX_STREAM_ID})
        self.connection.flush()

    def data_received(self, data: bytes) -> None:
        if not self._refused:  # what arrived with the handshake of a refused connection: dropped
            super().data_received(data)


class _TrackingServer(Server):
    """grpclib's server, keeping each connection's protocol (grpclib keeps only handlers),
    which the drain needs to send GOAWAYs."""

    def __init__(self, services: _Services) -> None:
        super().__init__([services])
        self.protocols: weakref.WeakSet[H2Protocol] = weakref.WeakSet()
        self.stopping = False

    def _protocol_factory(self) -> H2Protocol:
        protocol = _Protocol(self, super()._protocol_factory())
        self.protocols.add(protocol)
        return protocol


class H2ExtProcServer:
    """The grpclib ext_proc server: ``start`` binds and listens, ``stop(grace)`` drains."""

    def __init__(
        self,
        processor: ExternalProcessor,
        health: HealthState,
        host: str,
        port: int,
        tls: tuple[bytes, bytes] | None = None,
        client_ca: bytes | None = None,
        *,
        reuse_port: bool = False,
    ) -> None:
        self._server = _TrackingServer(_Services(processor, health))
        self._host = host
        self._port = port
        self._ssl = server_ssl_context(tls, client_ca) if tls is not None else None
        self._reuse_port = reuse_port
        self._started = False
        self.port = 0

    async def start(self) -> None:
        """Bind and listen; raises ``OSError`` when the address cannot be bound."""
        await self._server.start(
            self._host or None,
            self._port,
            ssl=self._ssl,
            reuse_address=True,
            # A port in use fails loudly unless this is a worker of one parent (which holds it).
            reuse_port=self._reuse_port,
        )
        self._started = True
        listener = cast(Any, self._server)._server
        self.port = int(listener.sockets[0].getsockname()[1])

    async def stop(self, grace: float | None) -> None:
        """Refuse new connections and streams, let open streams finish within ``grace``
        seconds (None: wait for them), then cancel what is left and close."""
        if not self._started:
            return
        self._started = False
        self._server.stopping = True
        cast(Any, self._server)._server.close()  # the listener: no new connections
        protocols = self._live_protocols()
        for protocol in protocols:
            _send_goaway(protocol)
        await _handlers_done([_handler(protocol) for protocol in protocols], grace)
        self._server.close()  # cancels the handlers still running
        # Close every connection (a fresh look: a TLS handshake may have ended during the
        # grace): Envoy keeps one open as long as a stream is, and a cancelled handler tells it
        # nothing. Then wait for the cancelled handlers only. grpclib's wait_closed would also
        # wait for asyncio's listener, which from Python 3.12.1 waits for every connection,
        # one still in its TLS handshake included (closed in connection_made when it ends).
        for protocol in self._live_protocols():
            if not protocol.connection.is_closing():
                protocol.connection.close()
        handlers = [_handler(protocol) for protocol in list(self._server.protocols)]
        if not await _handlers_done(handlers, _CLOSE_SECONDS):
            log.warning("ext_proc handlers still running after stop", seconds=_CLOSE_SECONDS)

    def _live_protocols(self) -> list[H2Protocol]:
        return [p for p in self._server.protocols if hasattr(p, "connection")]


async def _handlers_done(handlers: list[GrpclibHandler], seconds: float | None) -> bool:
    """Wait until every handler has no stream left, at most ``seconds`` (None: no limit);
    whether they all finished."""
    deadline = None if seconds is None else time.monotonic() + seconds
    while not all(handler.check_closed() for handler in handlers):
        if deadline is not None and time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def _handler(protocol: H2Protocol) -> GrpclibHandler:
    return cast(GrpclibHandler, protocol.handler)


def _send_goaway(protocol: H2Protocol) -> None:
    """HTTP/2's graceful shutdown: no new streams, the open ones go on (RFC 9113, 6.8)."""
    connection = protocol.connection
    if connection.is_closing():
        return
    frame = GoAwayFrame(0)
    frame.last_stream_id = _MAX_STREAM_ID
    frame.error_code = 0
    cast(Any, connection)._transport.write(frame.serialize())
