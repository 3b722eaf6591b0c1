"""The two gRPC ports: ext_proc (in a process that routes; TLS and mTLS as asked) and the
plaintext health port (in a process that reads the pool: one EPP, a workers' parent)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import grpc

from endpoint_picker.director import Director
from endpoint_picker.errors import ConfigError
from endpoint_picker.extproc.limits import BodyBudget, StreamSlots
from endpoint_picker.extproc.server import (
    ExternalProcessor,
    ExtProcServer,
    HealthState,
    build_health_server,
    start_ext_proc_server,
)
from endpoint_picker.extproc.stream import RequestStream
from endpoint_picker.extproc.tls import load_certificate, load_client_ca, self_signed_certificate
from endpoint_picker.settings import ServerSettings
from endpoint_picker.status import DecisionLog
from endpoint_picker.telemetry.metrics import EppMetrics
from endpoint_picker.types import format_hostport

Tls = tuple[tuple[bytes, bytes] | None, bytes | None]  # (key, chain) and the client CA


def load_tls(server_settings: ServerSettings) -> Tls:
    """The ext_proc port's (key, chain) and client CA; ``ConfigError`` for a bad file."""
    tls = None
    if server_settings.secure_serving:
        tls = (
            load_certificate(server_settings.cert_path)
            if server_settings.cert_path
            else self_signed_certificate()
        )
    client_ca = None
    if server_settings.client_ca_file is not None:
        if tls is None:  # never fall back to plaintext when mTLS was asked for
            raise ConfigError("--client-ca-file needs --secure-serving true")
        client_ca = load_client_ca(server_settings.client_ca_file)
    return tls, client_ca


class ExtProcPort:
    """The ext_proc server of a process that routes, once started; it drains first on stop,
    while the health port still says NOT_SERVING."""

    def __init__(self) -> None:
        self.server: ExtProcServer | None = None
        self._slots: StreamSlots | None = None

    @property
    def streams_accepted(self) -> int:
        """ext_proc streams this process let in since it started serving."""
        return self._slots.accepted if self._slots is not None else 0

    async def start(
        self,
        server_settings: ServerSettings,
        director: Director,
        metrics: EppMetrics,
        decisions: DecisionLog,
        health: HealthState,
        clock: Callable[[], float],
        tls: Tls,
        *,
        reuse_port: bool,  # a worker shares the port with its siblings
    ) -> int:
        # one budget and one stream count for the whole process, shared by every stream
        budget = BodyBudget(server_settings.max_buffered_bytes)
        slots = self._slots = StreamSlots(server_settings.max_concurrent_streams)
        metrics.track_limits(lambda: budget.reserved, lambda: slots.open)
        processor = ExternalProcessor(
            functools.partial(
                RequestStream,
                director,
                metrics,
                clock,
                server_settings.max_request_body_bytes,
                budget=budget,
                max_headers=server_settings.max_request_headers,
                max_header_bytes=server_settings.max_request_header_bytes,
                on_reject=decisions.rejected,
            ),
            slots,
            metrics,
        )
        server, port = await start_ext_proc_server(
            server_settings.ext_proc_server,
            processor,
            health,
            server_settings.bind_address,
            server_settings.grpc_port,
            *tls,
            reuse_port=reuse_port,
            budget=budget,
            limits=server_settings.connections.resolved(server_settings.max_concurrent_streams),
        )
        self.server = server
        return port

    async def drain(self, grace: float) -> None:
        """Refuse new streams and let open ones finish, for ``grace`` seconds at most."""
        if self.server is not None:
            await self.server.stop(grace)
            self.server = None


class HealthPort:
    """gRPC health, plaintext (Kubernetes gRPC probes cannot speak TLS)."""

    def __init__(self) -> None:
        self._server: grpc.aio.Server | None = None

    async def start(self, health: HealthState, server_settings: ServerSettings) -> int:
        address = format_hostport(server_settings.bind_address, server_settings.grpc_health_port)
        try:
            server, port = build_health_server(health, address)
        except RuntimeError as exc:  # grpcio: "Failed to bind to address ..."
            raise ConfigError(f"cannot listen on {address}: {exc}") from exc
        await server.start()
        self._server = server
        return port

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)
            self._server = None
