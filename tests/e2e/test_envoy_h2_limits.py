"""The h2 ext_proc server's stream limit per connection against a real Envoy, which carries
every request of a worker thread on one connection."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from endpoint_picker.extproc.h2grpc import H2GrpcServer
from endpoint_picker.settings import GrpcConnectionSettings
from tests.e2e.harness import backends, e2e_pool, post, running_envoy
from tests.support.extproc import make_settings, started_app

pytestmark = pytest.mark.e2e


async def test_envoy_past_the_stream_limit_loses_those_requests_only(tmp_path: Path) -> None:
    """Envoy does not keep to SETTINGS_MAX_CONCURRENT_STREAMS on its ext_proc connection (why
    the limit defaults to twice --max-concurrent-streams): with 4 per connection and twelve
    concurrent streamed requests, the streams past 4 are refused alone (Envoy answers those
    500, naming the EPP; it opens more connections after), the others are served, and no
    connection is closed. (Measured: 8 served, 4 refused, 3 connections.)"""
    async with backends(("127.0.8.2", "127.0.8.3")) as fleet:
        settings = make_settings(tmp_path, e2e_pool(fleet), scraping=True)
        limits = GrpcConnectionSettings(max_streams_per_connection=4)
        server = replace(settings.server, connections=limits, secure_serving=True)
        async with started_app(replace(settings, server=server)) as app:
            endpoints = [b.hostport for b in fleet]
            async with (
                running_envoy(
                    tmp_path, "reference", epp_port=app.ports.ext_proc, endpoints=endpoints
                ) as envoy,
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session,
            ):
                assert (await post(session, envoy.url, {"model": "m", "prompt": "x"})).status == 200
                ext_proc = app._ext_server
                assert isinstance(ext_proc, H2GrpcServer)
                first = set(ext_proc.connections)
                payload = {"model": "m", "prompt": "hello", "stream": True}
                replies = await asyncio.gather(
                    *(post(session, envoy.url, payload) for _ in range(12))
                )
                served = [r for r in replies if r.status == 200]
                assert len(served) >= 4
                assert all(r.body.endswith(b"data: [DONE]\n\n") for r in served)
                refused = [r for r in replies if r.status != 200]
                assert refused  # Envoy sent past the limit
                assert all(r.status == 500 and b"endpoint picker" in r.body for r in refused)
                assert first <= set(ext_proc.connections)  # not one connection was closed
                assert (await post(session, envoy.url, {"model": "m", "prompt": "x"})).status == 200
