"""Starting the ext_proc server (health served there too) on the chosen stack.

The two stacks are peers on the same sessions (``session``): ``h2grpc`` (gRPC straight on h2,
the default) and ``grpcio_server``. This module only picks one, and names what the composition
root imports (``ExternalProcessor``, ``HealthState``, ``build_health_server``).
"""

from __future__ import annotations

from typing import Protocol

import structlog

from endpoint_picker.errors import ConfigError
from endpoint_picker.extproc.grpcio_server import build_health_server, start_grpcio_server
from endpoint_picker.extproc.h2grpc import H2GrpcServer
from endpoint_picker.extproc.health import HealthState
from endpoint_picker.extproc.limits import BodyBudget
from endpoint_picker.extproc.session import ExternalProcessor
from endpoint_picker.extproc.tls import server_ssl_context
from endpoint_picker.settings import EXT_PROC_SERVER_ALIASES, GrpcConnectionSettings
from endpoint_picker.types import format_hostport

__all__ = [
    "ExtProcServer",
    "ExternalProcessor",
    "HealthState",
    "build_health_server",
    "start_ext_proc_server",
]

log = structlog.get_logger(__name__)


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
    if stack != "h2":
        return await start_grpcio_server(
            processor,
            health_state,
            address,
            tls,
            client_ca,
            reuse_port=reuse_port,
            limits=limits,
        )
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
