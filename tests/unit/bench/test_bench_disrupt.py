"""``--disrupt``: the bench resets or restarts one simulated server mid-run."""

from __future__ import annotations

from dataclasses import replace

import aiohttp

from endpoint_picker.bench.run import disrupt
from endpoint_picker_sim.config import EngineConfig, ServerConfig
from endpoint_picker_sim.server import SimServer


async def _cached_server() -> SimServer:
    server = SimServer(ServerConfig(model="m", engine=replace(EngineConfig(), time_scale=50.0)))
    await server.start("127.0.0.2", 0)
    body = {"model": "m", "prompt": "abcd" * 100, "max_tokens": 2}
    async with aiohttp.ClientSession() as http, http.post(f"{server.url}/v1/completions",
                                                           json=body) as resp:  # fmt: skip
        assert resp.status == 200
    assert server.engine.blocks.num_cached > 0
    return server


async def test_reset_and_restart_empty_a_real_simulated_servers_cache() -> None:
    """disrupt("reset") and disrupt("restart") each leave the server's prefix cache empty."""
    for kind in ("reset", "restart"):
        server = await _cached_server()
        try:
            await disrupt(kind, server.url, 0.0)
            assert server.engine.blocks.num_cached == 0
        finally:
            await server.stop()
