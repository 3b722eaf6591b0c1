"""Outlier detection through a real Envoy: a wedged pod (accepts, then drops every connection
without answering, ``/metrics`` included) beside three healthy ones."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from endpoint_picker.settings import OutlierSettings
from tests.e2e.harness import (
    Backend,
    Reply,
    backends,
    e2e_pool,
    post,
    running_envoy,
    running_epp,
    wait_scraped,
)

pytestmark = pytest.mark.e2e

PAYLOAD = {"model": "m", "prompt": "hello"}
ADDRESSES = ("127.0.0.12", "127.0.0.13", "127.0.0.14", "127.0.0.15")
BASE_EJECTION = 0.5  # seconds: short, so that the recovery fits in the test


class Wedged:
    """A server that accepts each connection, reads a little, and closes it unanswered."""

    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._open: dict[asyncio.Task[None] | None, asyncio.StreamWriter] = {}

    async def start(self, address: str, port: int) -> None:
        # SO_REUSEPORT: it binds beside the pod's server, which then stops, so that no
        # connection is ever refused (a refused scrape would mark the pod unreachable first)
        self._server = await asyncio.start_server(self._drop, address, port, reuse_port=True)

    async def _drop(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._open[task] = writer
        try:
            if self._server is not None:  # accepted just before ``stop``: close at once
                with contextlib.suppress(ConnectionError, TimeoutError):
                    await asyncio.wait_for(reader.read(4096), 5.0)
        finally:
            writer.close()
            self._open.pop(task, None)

    async def stop(self) -> None:
        """Stop listening, and close the connections still open (their handlers end)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        await asyncio.sleep(0)  # handlers of connections accepted last start, and end
        tasks = [t for t in self._open if t is not None]
        for writer in self._open.values():
            writer.close()
        await asyncio.gather(*tasks, return_exceptions=True)


async def serve(backend: Backend) -> None:
    """(Re)start ``backend``'s model server on its address: the pod recovered."""
    app = web.Application()
    app.router.add_get("/metrics", backend.metrics)
    app.router.add_post("/v1/completions", backend.infer)
    backend.runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await backend.runner.setup()
    await web.TCPSite(backend.runner, backend.address, backend.port, reuse_port=True).start()


async def load(session: aiohttp.ClientSession, url: str, total: int, clients: int) -> list[Reply]:
    """``total`` requests from ``clients`` concurrent clients, each one after the other."""
    replies: list[Reply] = []

    async def client(n: int) -> None:
        for _ in range(n):
            replies.append(await post(session, url, PAYLOAD))

    await asyncio.gather(*(client(total // clients) for _ in range(clients)))
    return replies


@pytest.mark.parametrize("variant", ["reference", "fallback"])
async def test_a_wedged_pod_is_ejected_and_comes_back_once_it_recovers(
    tmp_path: Path, variant: str
) -> None:
    """Of 200 requests at 4 clients, only the 5 failures that eject the wedged pod (and the
    few already on their way to it) fail, where 39-43 did without ejection (the issue: 60-68);
    with fallbacks none fails, and the attempts Envoy retried past it eject it. Once the pod
    serves again, the probe after its ejection brings it back into rotation."""
    fallback = variant == "fallback"
    async with backends(ADDRESSES[1:]) as healthy:
        bad = Backend(ADDRESSES[0], healthy[0].port)
        servers = [bad, *healthy]
        await serve(bad)
        wedge = Wedged()
        try:
            async with (
                # metrics stale only after a minute: only the responses can take the pod out
                running_epp(
                    tmp_path,
                    e2e_pool(servers),
                    staleness_threshold=60,
                    fallbacks=1 if fallback else 0,
                    outliers=OutlierSettings(base_ejection_time=BASE_EJECTION),
                ) as epp,
                running_envoy(
                    tmp_path,
                    variant,
                    epp_port=epp.ports.ext_proc,
                    endpoints=[s.hostport for s in servers],
                ) as envoy,
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session,
            ):
                await wait_scraped(epp)
                # the pod wedges: its last metrics (idle) stay fresh, its connections drop
                await wedge.start(bad.address, bad.port)
                await bad.stop()
                started = time.monotonic()
                replies = await load(session, envoy.url, total=200, clients=4)
                took = time.monotonic() - started
                failed = [r for r in replies if r.status != 200]
                assert {r.status for r in failed} <= {503}
                assert epp.outliers is not None
                status = epp.outliers.status(bad.hostport)
                assert status is not None
                assert status.ejections >= 1
                assert status.last_failure == ("retried" if fallback else "5xx")
                if fallback:  # Envoy's retries hid every failure from the clients
                    assert not failed
                # five eject it, a few more were on their way; then one probe per ejection
                # that ended during the load (the second lasts twice as long)
                probes = int(took // BASE_EJECTION)
                assert len(failed) <= 5 + 3 + probes, (len(failed), took)
                # the pod recovers: once its ejection is over, a request probes it
                await wedge.stop()
                await serve(bad)
                await asyncio.sleep(BASE_EJECTION * status.ejections + 0.1)
                replies = await load(session, envoy.url, total=40, clients=4)
                assert [r.status for r in replies] == [200] * 40
                assert epp.outliers.excluded() == set(), epp.outliers.status(bad.hostport)
                assert bad.received, epp.outliers.status(bad.hostport)  # the probe and more
        finally:
            await wedge.stop()
            await bad.stop()
