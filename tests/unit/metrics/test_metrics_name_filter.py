"""Scrapes ask for only the engine's metrics (``/metrics?name[]=...``), and fall back to the
whole page where a server's filtered page is unusable.

Against a real prometheus_client HTTP server (what vLLM and SGLang serve /metrics with) and
real aiohttp servers on 127.0.0.x.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server
from structlog.testing import capture_logs
from tests.support.polling import until
from tests.unit.metrics.metrics_builders import MetricsServer, vllm_page
from tests.unit.metrics.test_metrics_scraper import FAST, Recorder

from endpoint_picker.metrics.engines import BUILTIN_ENGINES, EngineMetricNames, parse_specs
from endpoint_picker.metrics.scraper import METRICS_PATH, ScrapeManager, filtered_path
from endpoint_picker.settings import ScrapeSettings
from endpoint_picker.types import Endpoint

UNUSABLE = "filtered metrics page unusable, scraping the whole page from now on"


def test_filtered_path_names_every_metric_the_engine_reads_once() -> None:
    """Fallback names included, each once, percent-encoded; a table reading nothing asks for
    the plain page."""
    path = filtered_path(BUILTIN_ENGINES["vllm"])
    parts = urlsplit(path)
    assert parts.path == METRICS_PATH
    assert "[" not in path
    assert ":" not in parts.query
    assert parse_qs(parts.query) == {
        "name[]": [
            "vllm:num_requests_waiting",
            "vllm:num_requests_running",
            "vllm:kv_cache_usage_perc",
            "vllm:gpu_cache_usage_perc",
            "vllm:lora_requests_info",
            "vllm:cache_config_info",
        ]
    }
    shared = EngineMetricNames(queue=parse_specs('q{a="1"},q'), kv_usage=parse_specs("q"))
    assert parse_qs(urlsplit(filtered_path(shared)).query) == {"name[]": ["q"]}
    assert filtered_path(EngineMetricNames()) == METRICS_PATH


class _CountingGauge(Gauge):
    """A gauge that counts how often the registry renders it."""

    collects = 0

    def collect(self) -> Any:
        type(self).collects += 1
        return super().collect()


@pytest.fixture
def vllm_registry_server() -> Iterator[tuple[int, CollectorRegistry]]:
    """prometheus_client's own HTTP server on 127.0.0.31 with vLLM's gauges and one more
    family the EPP never reads."""
    registry = CollectorRegistry()
    labels = ["engine", "model_name"]
    Gauge("vllm:num_requests_waiting", "w", labels, registry=registry).labels("0", "m").set(4)
    Gauge("vllm:num_requests_running", "r", labels, registry=registry).labels("0", "m").set(9)
    Gauge("vllm:kv_cache_usage_perc", "kv", labels, registry=registry).labels("0", "m").set(0.5)
    _CountingGauge.collects = 0
    unread = _CountingGauge("vllm:unread", "a family no field reads", labels, registry=registry)
    unread.labels("0", "m").set(1)
    server, thread = start_http_server(0, addr="127.0.0.31", registry=registry)
    try:
        yield server.server_port, registry
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
async def managers() -> AsyncIterator[list[ScrapeManager]]:
    started: list[ScrapeManager] = []
    yield started
    for manager in started:
        await manager.stop()


async def _scrape(
    managers: list[ScrapeManager], host: str, port: int, settings: ScrapeSettings = FAST
) -> Recorder:
    recorder = Recorder()
    manager = ScrapeManager(settings, recorder)
    managers.append(manager)
    await manager.start()
    manager.set_endpoints([Endpoint("pod", "default", host, port)])
    return recorder


async def test_prometheus_client_renders_only_what_the_scheduler_reads(
    vllm_registry_server: tuple[int, CollectorRegistry], managers: list[ScrapeManager]
) -> None:
    """The real library vLLM serves /metrics with honours the filter: the snapshot is right and
    the family nobody reads is never rendered."""
    port, _ = vllm_registry_server
    recorder = await _scrape(managers, "127.0.0.31", port)
    hostport = f"127.0.0.31:{port}"
    await until(lambda: recorder.count(hostport) >= 3)
    snapshot = recorder.latest(hostport)
    assert snapshot is not None
    assert (snapshot.waiting_queue_size, snapshot.running_requests) == (4, 9)
    assert snapshot.kv_cache_usage == 0.5
    assert _CountingGauge.collects == 0


async def test_without_the_filter_the_whole_page_is_rendered(
    vllm_registry_server: tuple[int, CollectorRegistry], managers: list[ScrapeManager]
) -> None:
    """``name_filter=False`` asks for plain /metrics (the control of the test above)."""
    port, _ = vllm_registry_server
    settings = ScrapeSettings(refresh_interval=0.02, timeout=0.5, name_filter=False)
    recorder = await _scrape(managers, "127.0.0.31", port, settings)
    await until(lambda: recorder.count(f"127.0.0.31:{port}") >= 1)
    assert _CountingGauge.collects >= 1


@pytest.fixture
async def server() -> AsyncIterator[MetricsServer]:
    started = await MetricsServer("127.0.0.32", vllm_page(queue=3, kv=0.25)).start()
    yield started
    await started.stop()


@pytest.mark.parametrize(
    "filtered",
    [
        (b"", 200),  # an old prometheus_client in multiprocess mode: the filter drops everything
        (b"bad query\n", 400),  # a server that refuses the query
        (b"", 404),
    ],
    ids=["empty page", "HTTP 400", "HTTP 404"],
)
async def test_an_unusable_filtered_page_falls_back_to_the_whole_page_for_good(
    server: MetricsServer, managers: list[ScrapeManager], filtered: tuple[bytes, int]
) -> None:
    """The first scrape already hands over the whole page's snapshot; every later one asks
    for the whole page; said once."""
    server.filtered = filtered
    with capture_logs() as logs:
        recorder = await _scrape(managers, server.host, server.port)
        hostport = server.endpoint().hostport
        await until(lambda: recorder.count(hostport) >= 4)
    assert server.queries[0].startswith("name[]=vllm:")  # as aiohttp decodes it
    assert server.queries[1:] == [""] * (len(server.queries) - 1)
    first = recorder.calls[0][1]
    assert (first.waiting_queue_size, first.kv_cache_usage) == (3, 0.25)
    assert [e["event"] for e in logs if e["event"] == UNUSABLE] == [UNUSABLE]
    assert not [e for e in logs if e["event"] == "scrape failed"]


async def test_a_server_lacking_the_metrics_keeps_the_filter(
    server: MetricsServer, managers: list[ScrapeManager]
) -> None:
    """When the whole page lacks them too the filter was not at fault: each scrape asks the
    filtered page first again, and fails as before."""
    server.body = b"# an unrelated exporter\nup 1\n"
    server.filtered = (b"", 200)
    with capture_logs() as logs:
        await _scrape(managers, server.host, server.port)
        await until(lambda: len(server.queries) >= 6)
    assert [bool(q) for q in server.queries[:6]] == [True, False] * 3
    assert not [e for e in logs if e["event"] == UNUSABLE]
    failed = [e for e in logs if e["event"] == "scrape failed"]
    assert len(failed) == 1
    assert "missing metrics" in failed[0]["error"]


async def test_a_server_error_on_the_filtered_page_is_not_blamed_on_the_filter(
    server: MetricsServer, managers: list[ScrapeManager]
) -> None:
    """A 5xx is the server's trouble, not the query's: no second GET, no fallback."""
    server.filtered = (b"", 503)
    with capture_logs() as logs:
        await _scrape(managers, server.host, server.port)
        await until(lambda: len(server.queries) >= 3)
    assert all(server.queries)
    assert not [e for e in logs if e["event"] == UNUSABLE]
