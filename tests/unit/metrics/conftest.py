"""Every test here must leave no task running on its loop; ``servers`` starts metrics servers."""

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from tests.support.leaks import no_leaked_tasks
from tests.unit.metrics.metrics_builders import MetricsServer

__all__ = ["no_leaked_tasks", "servers"]


@pytest.fixture
async def servers() -> AsyncIterator[Callable[..., Any]]:
    """``await servers(host, body, status=200)``: a started ``MetricsServer``, stopped after."""
    started: list[MetricsServer] = []

    async def make(host: str, body: bytes = b"", status: int = 200) -> MetricsServer:
        server = await MetricsServer(host, body, status=status).start()
        started.append(server)
        return server

    yield make
    for server in started:
        await server.stop()
