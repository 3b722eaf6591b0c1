"""The parent's port holding and health: a foreign process is refused, health needs a worker."""

from __future__ import annotations

import socket

import pytest
from grpc_health.v1 import health_pb2

from endpoint_picker.errors import ConfigError
from endpoint_picker.workers.pool import GatedHealth, hold_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_a_port_another_process_listens_on_is_refused() -> None:
    """A port already listened on (without SO_REUSEPORT, as a single EPP does) fails loudly."""
    with socket.socket() as foreign:
        foreign.bind(("127.0.0.1", 0))
        foreign.listen()
        with pytest.raises(ConfigError, match="cannot listen on"):
            hold_port("127.0.0.1", foreign.getsockname()[1])


def test_the_held_port_admits_reuseport_workers_and_refuses_others() -> None:
    """While held, a SO_REUSEPORT listener (a worker) binds it; a plain bind is refused."""
    holder, port = hold_port("127.0.0.1", 0)
    with holder, socket.socket() as worker, socket.socket() as foreign:
        worker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        worker.bind(("127.0.0.1", port))
        worker.listen()
        with pytest.raises(OSError, match="in use"):
            foreign.bind(("127.0.0.1", port))


def test_a_second_parent_cannot_take_a_held_port() -> None:
    """Before any worker listens, a second `epp serve --workers` on the same port fails."""
    holder, port = hold_port("127.0.0.1", 0)
    with holder, pytest.raises(ConfigError, match="cannot listen on"):
        hold_port("127.0.0.1", port)


async def test_health_serves_only_while_the_parent_is_ready_and_a_worker_serves() -> None:
    """Ready needs both; losing every worker turns it NOT_SERVING; workers hear the parent."""
    told: list[bool] = []
    health = GatedHealth(told.append)
    await health.start()
    await health.set_ready(True)
    assert not health.ready
    await health.workers_serving(True)
    assert health.ready
    reply = await health.servicer.Check(health_pb2.HealthCheckRequest(service=""), None)
    assert reply.status == SERVING
    await health.workers_serving(False)
    reply = await health.servicer.Check(health_pb2.HealthCheckRequest(service=""), None)
    assert reply.status == NOT_SERVING
    assert told == [False, True]
