"""Fixtures: simulated servers on 127.0.0.x, ephemeral ports, stopped after each test."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest

from endpoint_picker_sim.config import ServerConfig
from endpoint_picker_sim.server import SimServer
from tests.support.leaks import no_leaked_tasks

from .builders import server_config


@contextlib.asynccontextmanager
async def serving(config: ServerConfig, host: str = "127.0.0.2") -> AsyncIterator[SimServer]:
    """One started server; stopped on exit."""
    server = SimServer(config)
    await server.start(host, 0)
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    """A default fast server."""
    async with serving(server_config()) as server:
        yield server


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """An HTTP client with a short timeout."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


__all__ = ["no_leaked_tasks"]
