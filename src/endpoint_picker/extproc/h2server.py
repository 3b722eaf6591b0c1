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
seconds to finish, and whatever is left is cancelled. grpclib has no GOAWAY of its own and h2's
state machine refuses every frame after one, so the frame is written to the transport beside
h2: the first step of HTTP/2's graceful shutdown (RFC 9113, 6.8), a GOAWAY with the largest
stream id, so that every stream the client has opened goes on and it opens no more here.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import tempfile
import time
import weakref
from asyncio import BaseTransport
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any, cast

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError
from grpclib.protocol import H2Protocol
from grpclib.server import Handler as GrpclibHandler
from grpclib.server import Server, Stream
from h2.settings import SettingCodes
from hyperframe.frame import GoAwayFrame

if TYPE_CHECKING:
    from endpoint_picker.extproc.server import ExternalProcessor, HealthState

PROCESS_METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"
_MAX_STREAM_ID = 2**31 - 1  # a GOAWAY naming it: every stream the client has opened goes on


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
        # The servicer's generator reads the stream as its request iterator; it never uses the
        # context argument, which grpclib has no equivalent of.
        responses = cast(
            AsyncGenerator[pb.ProcessingResponse, None],
            self._processor.Process(cast(AsyncIterator[pb.ProcessingRequest], stream), None),
        )
        try:
            async for response in responses:
                await stream.send_message(response)
            # The servicer has answered (an immediate response can come before the client has
            # sent its whole request): read what the client still sends before the trailers
            # end the call, as a client that writes its request before reading expects. Envoy
            # closes its side at once after an immediate response or the last response.
            async for _ in stream:
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

    def connection_made(self, transport: BaseTransport) -> None:
        super().connection_made(transport)
        h2 = cast(Any, self.connection)._connection
        h2.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: _MAX_STREAM_ID})
        self.connection.flush()


class _TrackingServer(Server):
    """grpclib's server, keeping each connection's protocol (grpclib keeps only handlers),
    which the drain needs to send GOAWAYs."""

    def __init__(self, services: _Services) -> None:
        super().__init__([services])
        self.protocols: weakref.WeakSet[H2Protocol] = weakref.WeakSet()

    def _protocol_factory(self) -> H2Protocol:
        default = super()._protocol_factory()
        protocol = _Protocol(default.handler, default.config, default.h2_config)
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
        cast(Any, self._server)._server.close()  # the listener: no new connections
        protocols = self._live_protocols()
        for protocol in protocols:
            _send_goaway(protocol)
        deadline = None if grace is None else time.monotonic() + grace
        while any(not _handler(protocol).check_closed() for protocol in protocols):
            if deadline is not None and time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        self._server.close()  # cancels the handlers still running
        await self._server.wait_closed()
        for protocol in protocols:
            if not protocol.connection.is_closing():
                protocol.connection.close()

    def _live_protocols(self) -> list[H2Protocol]:
        return [p for p in self._server.protocols if hasattr(p, "connection")]


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
