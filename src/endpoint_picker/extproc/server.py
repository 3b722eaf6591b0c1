"""The gRPC servers: ext_proc (with health) and a plaintext health-only port."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

import grpc
import structlog
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from endpoint_picker.errors import ConfigError, ErrorCode
from endpoint_picker.extproc import responses, wire
from endpoint_picker.extproc.h2grpc import H2GrpcServer
from endpoint_picker.extproc.h2policy import MAX_PING_STRIKES
from endpoint_picker.extproc.limits import BUDGET_FULL, BodyBudget, StreamSlots
from endpoint_picker.extproc.stream import RequestStream
from endpoint_picker.extproc.tls import server_ssl_context
from endpoint_picker.settings import EXT_PROC_SERVER_ALIASES, GrpcConnectionSettings
from endpoint_picker.telemetry.metrics import EppMetrics
from endpoint_picker.types import format_hostport

log = structlog.get_logger(__name__)

_READINESS_SERVICES = ("", "readiness", wire.EXT_PROC_SERVICE)


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Envoy's ext_proc service: one ``RequestStream`` per ``Process`` stream."""

    def __init__(
        self,
        new_stream: Callable[[], RequestStream],
        slots: StreamSlots | None = None,
        metrics: EppMetrics | None = None,
    ) -> None:
        self._new_stream = new_stream  # the composition root binds the stream's dependencies
        self._slots = slots or StreamSlots(0)
        self._metrics = metrics

    def open_stream(self) -> RequestStream | None:
        """A new stream's state, or None when ``--max-concurrent-streams`` refuses it (counted
        and logged here; answer its first message with ``refusal()``). ``close_stream`` ends a
        stream this returned."""
        stream = self._new_stream()
        if self._slots.try_acquire():
            return stream
        stream.close()
        log.debug("ext_proc stream refused", open_streams=self._slots.open)
        if self._metrics is not None:
            self._metrics.stream_limit_rejections.inc()
            self._metrics.request_failed("", "", ErrorCode.RESOURCE_EXHAUSTED)
        return None

    def close_stream(self, stream: RequestStream) -> None:
        self._slots.release()
        stream.close()

    def budget_refusal(self) -> pb.ProcessingResponse:
        """The answer to a call whose undecoded message does not fit ``--max-buffered-bytes``
        (the h2 stack counts them): the JSON 429 of a full body budget, counted as it is."""
        if self._metrics is not None:
            self._metrics.buffer_budget_rejections.inc()
            self._metrics.request_failed("", "", ErrorCode.RESOURCE_EXHAUSTED)
        return responses.immediate_error(ErrorCode.RESOURCE_EXHAUSTED, BUDGET_FULL)

    @staticmethod
    def refusal() -> pb.ProcessingResponse:
        # A JSON 429 on the first message: gRPC's own RESOURCE_EXHAUSTED would reach the client
        # as Envoy's empty 500.
        return responses.immediate_error(
            ErrorCode.RESOURCE_EXHAUSTED,
            "the endpoint picker has too many open requests; retry later",
        )

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ProcessingResponse]:
        stream = self.open_stream()
        if stream is None:
            async for _ in request_iterator:
                yield self.refusal()
                return
            return
        try:
            async for message in request_iterator:
                out = stream.handle(message)
                if stream.queued:  # flow control holds the request until the pool has room
                    out = await stream.resume()
                for response in out:
                    yield response
                if stream.finished:
                    return
        except Exception:
            log.exception("ext_proc stream failed", request_id=stream.request_id)
            raise
        finally:
            self.close_stream(stream)


class HealthState:
    """gRPC health: ``liveness`` always SERVING; readiness names SERVING once the pool loads."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()
        self._ready = False
        # the same statuses for the h2 ext_proc server, which answers Check itself
        self._statuses: dict[str, int] = {}

    async def start(self) -> None:
        await self._set("liveness", health_pb2.HealthCheckResponse.SERVING)
        await self.set_ready(False)

    async def _set(self, service: str, status: int) -> None:
        self._statuses[service] = status
        await self.servicer.set(service, status)

    def status(self, service: str) -> int | None:
        """A service's serving status; None for a service this server does not know."""
        return self._statuses.get(service)

    async def set_ready(self, ready: bool) -> None:
        self._ready = ready
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in _READINESS_SERVICES:
            await self._set(service, status)

    @property
    def ready(self) -> bool:
        return self._ready


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def _server_options(
    reuse_port: bool = False, limits: GrpcConnectionSettings | None = None
) -> list[tuple[str, int]]:
    """grpcio's channel options: the same connection limits and keepalive as the h2 stack's
    (``GrpcConnectionSettings``; grpc core has its own rapid-reset defences)."""
    limits = (limits or GrpcConnectionSettings()).resolved(0)
    options = [
        # A port already in use must fail loudly, not be shared with another process; only the
        # workers of one `epp serve --workers N` share theirs (their parent holds the port).
        ("grpc.so_reuseport", 1 if reuse_port else 0),
        ("grpc.max_receive_message_length", wire.MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", wire.MAX_MESSAGE_BYTES),
        ("grpc.max_concurrent_streams", limits.max_streams_per_connection),
        # the least time between client PINGs without data (more: strikes, then GOAWAY)
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(limits.min_ping_interval)),
        ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
        ("grpc.keepalive_timeout_ms", _ms(limits.keepalive_timeout)),
    ]
    if limits.keepalive_time:  # grpc's own default (2 hours) otherwise
        options.append(("grpc.keepalive_time_ms", _ms(limits.keepalive_time)))
    if limits.max_connection_idle:
        options.append(("grpc.max_connection_idle_ms", _ms(limits.max_connection_idle)))
    return options


class ExtProcServer(Protocol):
    """What the app holds of either stack's ext_proc server: it drains on ``stop``."""

    async def stop(self, grace: float | None) -> None: ...


async def start_ext_proc_server(
    stack: str,
    processor: ExternalProcessor,
    health_state: HealthState,
    host: str,
    port: int,
    tls: tuple[bytes, bytes] | None,
    client_ca: bytes | None = None,
    *,
    reuse_port: bool = False,
    budget: BodyBudget | None = None,
    limits: GrpcConnectionSettings | None = None,
) -> tuple[ExtProcServer, int]:
    """The ext_proc server (health served there too) on ``stack`` ("h2" or "grpcio"),
    listening; returns it with its bound port. ``ConfigError`` when the address cannot be bound.

    ``tls`` is (key, certificate chain) in PEM; ``client_ca`` (PEM, needs ``tls``) turns on
    mutual TLS: only clients with a certificate signed by it can open a connection.
    ``reuse_port``: SO_REUSEPORT, for the workers of one parent (``epp serve --workers``).
    ``budget``: the process's body budget, which the h2 stack's undecoded messages count
    toward; ``limits``: both stacks' connection limits and keepalive.
    """
    address = format_hostport(host, port)
    if stack in EXT_PROC_SERVER_ALIASES:
        log.warning(
            "this ext_proc server stack is no longer shipped; serving with its replacement",
            ext_proc_server=stack,
            serving=EXT_PROC_SERVER_ALIASES[stack],
        )
        stack = EXT_PROC_SERVER_ALIASES[stack]
    if stack == "h2":
        context = server_ssl_context(tls, client_ca) if tls is not None else None
        h2 = H2GrpcServer(
            processor,
            health_state,
            host,
            port,
            context,
            reuse_port=reuse_port,
            budget=budget,
            limits=limits,
        )
        try:
            await h2.start()
        except OSError as exc:
            raise ConfigError(f"cannot listen on {address}: {exc.strerror}") from exc
        return h2, h2.port
    server = grpc.aio.server(options=_server_options(reuse_port, limits))
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_state.servicer, server)
    try:
        if tls is None:
            bound = server.add_insecure_port(address)
        else:
            credentials = grpc.ssl_server_credentials(
                [tls], root_certificates=client_ca, require_client_auth=client_ca is not None
            )
            bound = server.add_secure_port(address, credentials)
    except RuntimeError as exc:  # grpcio: "Failed to bind to address ..."
        raise ConfigError(f"cannot listen on {address}: {exc}") from exc
    await server.start()
    return server, bound


def build_health_server(health_state: HealthState, address: str) -> tuple[grpc.aio.Server, int]:
    """Plaintext health only: Kubernetes gRPC probes cannot speak TLS."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(health_state.servicer, server)
    return server, server.add_insecure_port(address)
