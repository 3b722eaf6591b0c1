"""The ext_proc server on grpcio (``--ext-proc-server grpcio``), and the plaintext health port.

A peer of ``h2grpc`` on the same sessions (``session.ExternalProcessor``): grpcio's servicer
loop hands each message to the session and yields its answer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import structlog
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2_grpc

from endpoint_picker.errors import ConfigError
from endpoint_picker.extproc import wire
from endpoint_picker.extproc.h2policy import MAX_PING_STRIKES
from endpoint_picker.extproc.health import HealthState
from endpoint_picker.extproc.session import ExternalProcessor
from endpoint_picker.settings import GrpcConnectionSettings

log = structlog.get_logger(__name__)


class GrpcioServicer(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Envoy's ext_proc service on grpcio: one session per ``Process`` stream."""

    def __init__(self, processor: ExternalProcessor) -> None:
        self._processor = processor

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ProcessingResponse]:
        processor = self._processor
        stream = processor.open_stream()
        if stream is None:
            async for _ in request_iterator:
                yield processor.refusal()
                return
            return
        try:
            async for message in request_iterator:
                for response in await processor.answer(stream, message):
                    yield response
                if stream.finished:
                    return
        except Exception:
            log.exception("ext_proc stream failed", request_id=stream.request_id)
            raise
        finally:
            processor.close_stream(stream)


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def server_options(
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


async def start_grpcio_server(
    processor: ExternalProcessor,
    health_state: HealthState,
    address: str,
    tls: tuple[bytes, bytes] | None,
    client_ca: bytes | None,
    *,
    reuse_port: bool,
    limits: GrpcConnectionSettings | None,
) -> tuple[grpc.aio.Server, int]:
    """The grpcio ext_proc server (health served there too) listening on ``address``."""
    server = grpc.aio.server(options=server_options(reuse_port, limits))
    pb_grpc.add_ExternalProcessorServicer_to_server(GrpcioServicer(processor), server)
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
