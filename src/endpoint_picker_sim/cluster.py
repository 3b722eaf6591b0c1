"""Several simulated servers in one process and one event loop, on consecutive addresses.

The servers share one loaded tokenizer file, and each engine sees the others' caches for the
oracle hit count (``sim:prefix_cache_oracle_hits``).
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import AsyncIterator

from endpoint_picker_sim.config import SimConfig
from endpoint_picker_sim.server import SimServer
from endpoint_picker_sim.tokenids import HfTokenIds, TokenIdScheme


def addresses(first: str, count: int) -> list[str]:
    """``count`` consecutive IPv4 addresses starting at ``first`` (127.0.0.2, 127.0.0.3, ...)."""
    start = ipaddress.IPv4Address(first)
    return [str(start + i) for i in range(count)]


@contextlib.asynccontextmanager
async def running_servers(sim: SimConfig) -> AsyncIterator[list[SimServer]]:
    """Start ``sim.servers`` servers, each with its own engine task; stop them all on exit."""
    servers: list[SimServer] = []
    shared: TokenIdScheme | None = None
    if sim.server.tokenizer is not None:
        shared = HfTokenIds(sim.server.tokenizer)
    try:
        for index, host in enumerate(addresses(sim.address, sim.servers)):
            server = SimServer(sim.server_config(index), index, None, sim.servers, shared)
            servers.append(server)
            await server.start(host, sim.port)
        fleet = tuple(server.engine.blocks for server in servers)
        for server in servers:
            server.engine.fleet = fleet
        yield servers
    finally:
        for server in reversed(servers):
            await server.stop()
