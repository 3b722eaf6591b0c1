"""gRPC health as both ext_proc servers and the plaintext health port report it."""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2

from endpoint_picker.extproc import wire

_READINESS_SERVICES = ("", "readiness", wire.EXT_PROC_SERVICE)


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
