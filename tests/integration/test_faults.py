"""Faults around the EPP, through the real ext_proc protocol: model servers whose /metrics
misbehave, pods that leave while their responses stream, and pool files rewritten under load."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import structlog
from aiohttp import web
from tests.support.extproc import (
    Client,
    completion,
    error_of,
    lb_metadata,
    make_settings,
    response_body,
    response_headers,
    running_app,
)
from tests.support.model_servers import free_port, vllm_metrics
from tests.support.pool import model, pod, pool, pool_yaml

from endpoint_picker.app import App


@dataclass
class Misbehaving:
    """A model server's /metrics with one fault: hang, garbage, 500, huge page, or flapping."""

    address: str
    fault: str
    served: int = 0

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        self.served += 1
        if self.fault == "hang":
            await asyncio.sleep(30)  # bounded; the EPP's scrape timeout ends it much sooner
        if self.fault == "garbage":
            return web.Response(body=b"\x00\xff this is not prometheus {{{\n" * 100)
        if self.fault == "error":
            return web.Response(status=500, text="internal error")
        if self.fault == "huge":  # 50 MB, streamed: the EPP stops reading at its cap
            response = web.StreamResponse(headers={"content-type": "text/plain"})
            await response.prepare(request)
            line = b"vllm:num_requests_waiting 1\n" * 37_000  # about 1 MB
            with contextlib.suppress(ConnectionError):
                for _ in range(50):
                    await response.write(line)
            return response
        if self.fault == "flap" and (time.monotonic() // 0.3) % 2:
            return web.Response(status=503, text="flapping")
        return web.Response(text=vllm_metrics(waiting=1, running=2))


@contextlib.asynccontextmanager
async def misbehaving(faults: dict[str, str]) -> AsyncIterator[tuple[int, list[Misbehaving]]]:
    port = free_port(next(iter(faults)))
    servers = [Misbehaving(address, fault) for address, fault in faults.items()]
    runners = []
    try:
        for server in servers:
            app = web.Application()
            app.router.add_get("/metrics", server.metrics)
            runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.1)
            await runner.setup()
            await web.TCPSite(runner, server.address, port).start()
            runners.append(runner)
        yield port, servers
    finally:
        for runner in runners:
            await runner.cleanup()


@contextlib.contextmanager
def captured_logs() -> Iterator[list[dict[str, object]]]:
    with structlog.testing.capture_logs() as logs:
        yield logs


async def route(client: Client) -> tuple[str, float]:
    """The endpoint a request is routed to, and how long routing took."""
    started = time.monotonic()
    out = await client.exchange(completion("m", "hello"))
    return lb_metadata(out[0]), time.monotonic() - started


async def test_misbehaving_metrics_never_stop_or_slow_routing(tmp_path: Path) -> None:
    """Five servers whose /metrics hangs, answers garbage, a 500, a 50 MB page or flaps, and
    one healthy server: every request is routed at once, never to an endpoint whose metrics
    are stale while a fresh one exists; the broken ones are marked stale; each condition is
    logged once per change, not once per scrape."""
    faults = {
        "127.0.5.2": "hang",
        "127.0.5.3": "garbage",
        "127.0.5.4": "error",
        "127.0.5.5": "huge",
        "127.0.5.6": "flap",
        "127.0.5.7": "good",
    }
    async with misbehaving(faults) as (port, servers):
        pods = [pod(f"p{i}", s.address) for i, s in enumerate(servers)]
        settings = make_settings(tmp_path, pool_yaml(pool(port=port), model("m"), *pods),
                                 scraping=True)  # fmt: skip
        settings = replace(
            settings,
            scrape=replace(
                settings.scrape, refresh_interval=0.05, timeout=0.3, staleness_threshold=0.5
            ),
        )
        with captured_logs() as logs:
            async with running_app(settings) as (app, client):
                good = f"127.0.5.7:{port}"
                await _until_fresh(app, good)
                picks: list[str] = []
                slowest = 0.0
                for _ in range(60):
                    pick, took = await route(client)
                    picks.append(pick)
                    slowest = max(slowest, took)
                    await asyncio.sleep(0.02)  # 1.2 s: scrapes of every kind happen meanwhile
                states = {s.hostport: s for s in app.datastore.endpoint_states()}
                now = time.monotonic()
                for address in ("127.0.5.2", "127.0.5.3", "127.0.5.4", "127.0.5.5"):
                    age = now - states[f"{address}:{port}"].metrics.updated_at
                    assert age > 0.5, f"{address} should be stale"
        assert slowest < 0.25, f"a request waited {slowest:.3f} s while scrapes misbehaved"
        assert set(picks) <= {good, f"127.0.5.6:{port}"}, set(picks)
        failed = [e for e in logs if e["event"] in ("scrape failed", "scrape still failing")]
        per_endpoint: dict[object, int] = {}
        for event in failed:
            per_endpoint[event["endpoint"]] = per_endpoint.get(event["endpoint"], 0) + 1
        for address in ("127.0.5.2", "127.0.5.3", "127.0.5.4", "127.0.5.5"):
            assert per_endpoint.get(f"{address}:{port}") == 1, per_endpoint
        # the flapping server changes state about every 0.3 s: logged per change, not per scrape
        flaps = per_endpoint.get(f"127.0.5.6:{port}", 0)
        scrapes = next(s for s in servers if s.fault == "flap").served
        assert 1 <= flaps < scrapes / 2, (flaps, scrapes)
        assert any(e["event"] == "scrape recovered" for e in logs)


async def _until_fresh(app: App, hostport: str, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while True:
        states = {s.hostport: s for s in app.datastore.endpoint_states()}
        state = states.get(hostport)
        if state is not None and state.metrics.updated_at > 0:
            return
        assert time.monotonic() < deadline, f"{hostport} never scraped"
        await asyncio.sleep(0.02)


async def test_a_pod_that_leaves_mid_response_finishes_its_stream(tmp_path: Path) -> None:
    """A routed request whose pod turns unready, then disappears, while its response streams:
    the stream completes normally; new requests go elsewhere at once; nothing stays in flight."""
    a, b = pod("a", "127.0.6.2"), pod("b", "127.0.6.3")
    settings = make_settings(tmp_path, pool_yaml(pool(), model("m"), a, b))
    pool_file = settings.pool.pool_file
    assert pool_file is not None
    async with running_app(settings) as (app, client):
        for change in ("unready", "deleted"):
            call = await client.open(completion("m", "hello"))
            first = await call.read()
            chosen = lb_metadata(first)
            await call.read()  # the body chunk that follows the routed headers
            address = chosen.split(":")[0]
            other = "127.0.6.3" if address == "127.0.6.2" else "127.0.6.2"
            leaving = pod("x", address, ready=False)
            remaining = [pod("y", other)] + ([leaving] if change == "unready" else [])
            pool_file.write_text(pool_yaml(pool(), model("m"), *remaining))
            await _until_gone(app, chosen)
            assert app.inflight.count(chosen) == 1  # still streaming there
            await call.write(response_headers(content_type="text/event-stream"))
            await call.read()
            for i in range(3):
                await call.write(response_body(b'data: {"i": %d}\n\n' % i, end_of_stream=False))
                reply = await call.read()
                assert reply.HasField("response_body"), reply
            await call.write(response_body(b"data: [DONE]\n\n", end_of_stream=True))
            await call.read()
            await call.done_writing()
            assert app.inflight.count(chosen) == 0
            for _ in range(5):
                pick, _took = await route(client)
                assert pick == f"{other}:8000"
            pool_file.write_text(pool_yaml(pool(), model("m"), a, b))
            await _until_count(app, 2)


async def _until_gone(app: App, hostport: str) -> None:
    deadline = time.monotonic() + 3
    while any(s.hostport == hostport for s in app.datastore.endpoint_states()):
        assert time.monotonic() < deadline, f"{hostport} still in the pool"
        await asyncio.sleep(0.02)


async def _until_count(app: App, count: int) -> None:
    deadline = time.monotonic() + 3
    while len(app.datastore.endpoint_states()) != count:
        assert time.monotonic() < deadline, "pool did not come back"
        await asyncio.sleep(0.02)


async def test_pool_file_rewritten_renamed_truncated_and_deleted_under_load(
    tmp_path: Path,
) -> None:
    """Four clients route without pause while the pool file is replaced by an atomic rename,
    truncated to zero bytes mid-write, and deleted: no request fails, the last good pool
    serves throughout, and /healthz says when the file is refused."""
    a, b, c = pod("a", "127.0.7.2"), pod("b", "127.0.7.3"), pod("c", "127.0.7.4")
    settings = make_settings(tmp_path, pool_yaml(pool(), model("m"), a, b), reload_settle_time=0.1)
    pool_file = settings.pool.pool_file
    assert pool_file is not None
    failures: list[str] = []
    picks: set[str] = set()
    stop = asyncio.Event()

    async def load(client: Client) -> None:
        while not stop.is_set():
            out = await client.exchange(completion("m", "hello"))
            if out[0].HasField("immediate_response"):
                failures.append(str(error_of(out[0])))
            else:
                picks.add(lb_metadata(out[0]))

    async with running_app(settings) as (app, client):
        workers = [asyncio.create_task(load(client)) for _ in range(4)]
        try:
            staged = tmp_path / "pool.yaml.tmp"
            staged.write_text(pool_yaml(pool(), model("m"), a, b, c))
            os.replace(staged, pool_file)  # what editors and config managers do
            await _until_count(app, 3)
            pool_file.write_bytes(b"")  # truncated mid-write, and left so
            await asyncio.sleep(0.4)
            assert len(app.datastore.endpoint_states()) == 3
            pool_file.unlink()
            await asyncio.sleep(0.4)
            assert len(app.datastore.endpoint_states()) == 3
            pool_file.write_text(pool_yaml(pool(), model("m"), a))
            await _until_count(app, 1)
            await asyncio.sleep(0.1)
        finally:
            stop.set()
            await asyncio.gather(*workers)
    assert not failures, failures[:5]
    assert picks == {"127.0.7.2:8000", "127.0.7.3:8000", "127.0.7.4:8000"}
