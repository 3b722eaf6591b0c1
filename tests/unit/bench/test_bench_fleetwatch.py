"""FleetWatch against tiny servers serving the simulator's real /metrics page as it changes."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from tests.sim.builders import engine, request
from tests.support.model_servers import vllm_metrics

from endpoint_picker.bench.fleetwatch import FleetWatch, parse_page
from endpoint_picker_sim.config import EngineConfig
from endpoint_picker_sim.engine import Engine
from endpoint_picker_sim.metrics import MetricsRenderer


class SimMetricsServer:
    """Serves ``MetricsRenderer``'s page for an engine the test changes by hand."""

    def __init__(self) -> None:
        self.engine: Engine = engine()[0]
        self.failing = False
        self.text: str | None = None  # served instead of the sim's page when set
        self._renderer = MetricsRenderer("m", EngineConfig())
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        self._runner = web.AppRunner(app, access_log=None)
        self.url = ""

    async def start(self) -> SimMetricsServer:
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def metrics(self, _: web.Request) -> web.Response:
        if self.failing:
            return web.Response(status=500)
        return web.Response(text=self.text or self._renderer.render(self.engine))

    def serve(self, requests: int, queries: int, hits: int, late: float = 0.0) -> None:
        """Advance the counters as if the engine had done some work."""
        s = self.engine.stats
        s.success_length += requests
        s.prefix_queries += queries
        s.prefix_hits += hits
        s.oracle_hits += hits + (queries - hits) // 2  # the fleet held half of the misses
        s.step_planned_wall += 1.0
        s.step_late_wall += late


@pytest.fixture
async def sims() -> AsyncIterator[list[SimMetricsServer]]:
    servers = [await SimMetricsServer().start() for _ in range(2)]
    yield servers
    for server in servers:
        await server.stop()


def test_parse_page_reads_the_simulators_exposition() -> None:
    """The sim's counter names (_total) and gauges are found; buckets and HELP lines are not."""
    eng = engine()[0]
    eng.add(request("x" * 64))
    eng.stats.prefix_queries, eng.stats.success_length = 48, 3
    page = parse_page(MetricsRenderer("m", EngineConfig()).render(eng) + "sim:other_total 9\n")
    assert page["vllm:num_requests_waiting"] == [1.0]
    assert page["vllm:prefix_cache_queries_total"] == [48.0]
    assert sum(page["vllm:request_success_total"]) == 3.0  # summed over finished_reason
    assert page["sim:step_behind_seconds_total"] == [0.0]
    assert "sim:other_total" not in page


def test_parse_page_handles_braces_in_labels_timestamps_and_nan() -> None:
    """The value is read after the label block even if labels hold spaces or braces."""
    text = (
        'vllm:num_requests_waiting{model_name="a} b"} 4 1700000000\n'
        "vllm:num_requests_running 2\n"
        'vllm:kv_cache_usage_perc{engine="0"} NaN\n'
    )
    page = parse_page(text)
    assert page == {"vllm:num_requests_waiting": [4.0], "vllm:num_requests_running": [2.0]}


async def test_fleetwatch_reports_deltas_and_samples(sims: list[SimMetricsServer]) -> None:
    """Counter deltas cover only the run, gauges are sampled during it, sim clocks are read."""
    a, b = sims
    a.serve(100, 1000, 1000, late=0.5)  # before the run: must not count
    watch = FleetWatch([a.url, b.url + "/"], interval=0.02)
    await watch.start()
    a.serve(7, 400, 100, late=0.02)
    b.serve(3, 200, 150)
    a.engine.add(request("y" * 64))
    await asyncio.sleep(0.08)
    fleet = await watch.stop()
    first, second = fleet.servers
    assert first.name == a.url.removeprefix("http://")
    assert (first.requests, first.prefix_cache_queries, first.prefix_cache_hits) == (7, 400, 100)
    assert (second.requests, second.prefix_cache_queries, second.prefix_cache_hits) == (3, 200, 150)
    assert first.step_planned_seconds == pytest.approx(1.0)
    assert first.step_late_seconds == pytest.approx(0.02)
    assert first.step_behind_seconds == 0.0
    assert (first.oracle_hits, second.oracle_hits) == (250.0, 175.0)
    assert len(first.samples) >= 3  # baseline, at least one tick, the final scrape
    assert [s.waiting for s in first.samples][-1] == 1.0
    assert all(0 <= s.t < 1.0 for s in first.samples)


async def test_fleetwatch_counts_from_the_end_of_the_warmup(sims: list[SimMetricsServer]) -> None:
    """With a warm-up, work done during it is left out of the deltas; samples still cover it."""
    a, _ = sims
    watch = FleetWatch([a.url], interval=0.02, warmup=0.1)
    await watch.start()
    a.serve(50, 5000, 0)  # during the warm-up: cold misses, not measured
    await asyncio.sleep(0.2)
    a.serve(4, 400, 300)
    fleet = await watch.stop()
    (first,) = fleet.servers
    assert (first.requests, first.prefix_cache_queries, first.prefix_cache_hits) == (4, 400, 300)
    assert first.samples[0].t < 0.1 < first.samples[-1].t


async def test_scrape_failures_are_tolerated(sims: list[SimMetricsServer]) -> None:
    """A failing server's samples are skipped; its last good scrape gives the deltas."""
    a, _ = sims
    watch = FleetWatch([a.url], interval=0.02)
    await watch.start()
    a.serve(5, 0, 0)
    await asyncio.sleep(0.05)
    a.failing = True
    a.serve(1, 0, 0)  # never seen
    await asyncio.sleep(0.05)
    [obs] = (await watch.stop()).servers
    assert obs.requests == 5
    assert obs.samples


async def test_a_real_vllm_has_no_clock_series(sims: list[SimMetricsServer]) -> None:
    """A vLLM page has no sim:* series: the clock fields are None, the gauges still sampled."""
    a, _ = sims
    a.text = vllm_metrics(waiting=2)
    watch = FleetWatch([a.url], interval=0.02)
    await watch.start()
    [obs] = (await watch.stop()).servers
    assert (obs.step_planned_seconds, obs.step_late_seconds, obs.step_behind_seconds) == (
        None, None, None)  # fmt: skip
    assert obs.samples[-1].waiting == 2.0


async def test_an_unreachable_server_yields_zeros() -> None:
    """A server that never answers gives zero deltas and no samples, not an exception."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: connections are refused
    watch = FleetWatch([f"http://127.0.0.1:{port}"], interval=0.02)
    await watch.start()
    [obs] = (await watch.stop()).servers
    assert (obs.requests, obs.samples, obs.step_planned_seconds) == (0, (), None)
