"""ScrapeManager against real aiohttp servers on 127.0.0.x: snapshots, failures, task lifecycle."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable, MutableMapping, Sequence
from typing import Any

import pytest
from structlog.testing import capture_logs
from tests.support.polling import until
from tests.unit.metrics.metrics_builders import (
    endpoint,
    sglang_page,
    vllm_fixture,
    vllm_page,
)

from endpoint_picker.metrics.scraper import ScrapeManager
from endpoint_picker.metrics.turns import TurnGate
from endpoint_picker.settings import ScrapeSettings
from endpoint_picker.types import Endpoint, MetricsSnapshot

FAST = ScrapeSettings(refresh_interval=0.02, timeout=0.5)


class Recorder:
    """Collects what the manager hands over, per hostport."""

    def __init__(self) -> None:
        self.calls: list[tuple[Endpoint, MetricsSnapshot]] = []

    def __call__(self, endpoint: Endpoint, snapshot: MetricsSnapshot) -> None:
        self.calls.append((endpoint, snapshot))

    def latest(self, hostport: str) -> MetricsSnapshot | None:
        found = [s for e, s in self.calls if e.hostport == hostport]
        return found[-1] if found else None

    def count(self, hostport: str) -> int:
        return sum(1 for e, _ in self.calls if e.hostport == hostport)


class Clock:
    """A settable monotonic clock."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def manager_factory() -> AsyncIterator[Callable[..., Any]]:
    managers: list[ScrapeManager] = []

    async def make(
        on_snapshot: Recorder, settings: ScrapeSettings = FAST, **kw: Any
    ) -> ScrapeManager:
        manager = ScrapeManager(settings, on_snapshot, **kw)
        managers.append(manager)
        await manager.start()
        return manager

    yield make
    for manager in managers:
        await manager.stop()


def scrape_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("scrape ") and not t.done()]


def events(logs: Sequence[MutableMapping[str, Any]], name: str) -> list[MutableMapping[str, Any]]:
    return [entry for entry in logs if entry["event"] == name]


async def test_snapshots_arrive_per_engine(servers: Any, manager_factory: Any) -> None:
    """Each endpoint's page is parsed with its engine's names and stamped with the clock."""
    vllm = await servers("127.0.0.21", vllm_fixture())
    sglang = await servers("127.0.0.22", sglang_page(3, 1, 0.9))
    recorder = Recorder()
    manager = await manager_factory(recorder, clock=Clock(42.0))
    manager.set_endpoints([vllm.endpoint(), sglang.endpoint("sglang")])

    await until(lambda: recorder.latest(vllm.endpoint().hostport) is not None)
    await until(lambda: recorder.latest(sglang.endpoint().hostport) is not None)
    from_vllm = recorder.latest(vllm.endpoint().hostport)
    from_sglang = recorder.latest(sglang.endpoint().hostport)
    assert from_vllm is not None
    assert from_sglang is not None
    assert (from_vllm.waiting_queue_size, from_vllm.kv_cache_usage) == (7, 0.5)
    assert from_vllm.active_adapters == frozenset({"sql-lora", "chat-lora"})
    assert (from_sglang.waiting_queue_size, from_sglang.block_size) == (3, 64)
    assert from_vllm.updated_at == 42.0


async def test_snapshots_follow_the_page(servers: Any, manager_factory: Any) -> None:
    """A changed page is picked up by a later scrape, in a new snapshot."""
    server = await servers("127.0.0.23", vllm_page(queue=1))
    recorder = Recorder()
    manager = await manager_factory(recorder)
    manager.set_endpoints([server.endpoint()])
    hostport = server.endpoint().hostport
    await until(lambda: recorder.latest(hostport) is not None)
    server.body = vllm_page(queue=9)
    await until(lambda: getattr(recorder.latest(hostport), "waiting_queue_size", 0) == 9)


@pytest.mark.parametrize("failure", ["server gone", "garbage page", "HTTP 500"])
async def test_failing_endpoint_keeps_its_last_snapshot(
    servers: Any, manager_factory: Any, failure: str
) -> None:
    """After a good scrape, failures hand over nothing: the last snapshot stays in place."""
    server = await servers("127.0.0.24", vllm_page(queue=5, kv=0.3))
    recorder = Recorder()
    with capture_logs() as logs:
        manager = await manager_factory(recorder)
        manager.set_endpoints([server.endpoint()])
        hostport = server.endpoint().hostport
        await until(lambda: recorder.count(hostport) > 0)
        if failure == "server gone":
            await server.stop()
        elif failure == "garbage page":
            server.body = b"<html>hello</html>"
        else:
            server.status = 500
        good = recorder.count(hostport)
        await until(lambda: bool(events(logs, "scrape failed")))
        await asyncio.sleep(0.15)  # several more failed scrapes
    assert recorder.count(hostport) <= good + 1  # one scrape may have been in flight
    assert recorder.latest(hostport) == recorder.calls[good - 1][1]
    assert events(logs, "scrape failed")[0]["endpoint"] == hostport


async def test_failures_are_logged_once_then_rate_limited(
    servers: Any, manager_factory: Any
) -> None:
    """A failing endpoint logs once, again only after 30 s of clock, and once on recovery."""
    server = await servers("127.0.0.25", vllm_page(), status=500)
    clock = Clock()
    recorder = Recorder()
    with capture_logs() as logs:
        manager = await manager_factory(recorder, clock=clock)
        manager.set_endpoints([server.endpoint()])
        await until(lambda: server.hits >= 6)
        assert len(events(logs, "scrape failed")) == 1
        assert events(logs, "scrape still failing") == []

        clock.now += 31
        hits = server.hits
        await until(lambda: server.hits >= hits + 3)
        still = events(logs, "scrape still failing")
        assert len(still) == 1
        assert still[0]["since_last_log"] >= 5

        server.status = 200
        await until(lambda: recorder.count(server.endpoint().hostport) > 0)
        await until(lambda: bool(events(logs, "scrape recovered")))
    assert len(events(logs, "scrape failed")) == 1
    assert len(events(logs, "scrape recovered")) == 1


async def test_timeout_is_honoured(servers: Any, manager_factory: Any) -> None:
    """A server slower than the timeout fails that scrape in about the timeout, then is retried."""
    server = await servers("127.0.0.26", vllm_page())
    server.delay = 30.0
    recorder = Recorder()
    loop = asyncio.get_running_loop()
    with capture_logs() as logs:
        manager = await manager_factory(
            recorder, ScrapeSettings(refresh_interval=0.02, timeout=0.2)
        )
        started = loop.time()
        manager.set_endpoints([server.endpoint()])
        await until(lambda: bool(events(logs, "scrape failed")))
        elapsed = loop.time() - started
        await until(lambda: server.hits >= 2)
    assert 0.15 <= elapsed < 2.0
    assert "Timeout" in events(logs, "scrape failed")[0]["error_type"]
    assert recorder.calls == []


async def test_set_endpoints_starts_and_stops_tasks(servers: Any) -> None:
    """Tasks follow set_endpoints by hostport, and stop() leaves no task behind."""
    a, b, c = [await servers(f"127.0.0.{n}", vllm_page()) for n in (27, 28, 29)]
    recorder = Recorder()
    manager = ScrapeManager(FAST, recorder)
    manager.set_endpoints([a.endpoint(), b.endpoint()])  # before start: remembered
    assert scrape_tasks() == []
    await manager.start()
    try:
        await until(lambda: recorder.count(a.endpoint().hostport) > 0)
        await until(lambda: recorder.count(b.endpoint().hostport) > 0)
        assert sorted(t.get_name() for t in scrape_tasks()) == [
            f"scrape {a.endpoint().hostport}",
            f"scrape {b.endpoint().hostport}",
        ]

        manager.set_endpoints([b.endpoint(), c.endpoint()])
        await until(lambda: recorder.count(c.endpoint().hostport) > 0)
        await until(lambda: len(scrape_tasks()) == 2)
        assert sorted(manager.endpoints()) == sorted([b.endpoint().hostport, c.endpoint().hostport])
        a_count = recorder.count(a.endpoint().hostport)
        await asyncio.sleep(0.1)
        assert recorder.count(a.endpoint().hostport) == a_count
    finally:
        await manager.stop()
    assert scrape_tasks() == []
    assert manager.endpoints() == []


async def test_changed_labels_restart_with_the_new_engine(
    servers: Any, manager_factory: Any
) -> None:
    """Relabelling an endpoint's engine type switches the metric names it is read with."""
    server = await servers("127.0.0.30", sglang_page(4, 0, 0.2))
    recorder = Recorder()
    with capture_logs() as logs:
        manager = await manager_factory(recorder)
        manager.set_endpoints([server.endpoint("vllm")])
        await until(lambda: bool(events(logs, "scrape failed")))  # vLLM names on an SGLang page
        manager.set_endpoints([server.endpoint("sglang")])
        await until(lambda: recorder.count(server.endpoint().hostport) > 0)
    snapshot = recorder.latest(server.endpoint().hostport)
    assert snapshot is not None
    assert snapshot.waiting_queue_size == 4


async def test_unknown_engine_logs_once_and_uses_default(
    servers: Any, manager_factory: Any
) -> None:
    """An unknown engine label is reported once per engine name and read as the default engine."""
    a = await servers("127.0.0.31", vllm_page(queue=2))
    b = await servers("127.0.0.32", vllm_page(queue=3))
    recorder = Recorder()
    with capture_logs() as logs:
        manager = await manager_factory(recorder)
        manager.set_endpoints([a.endpoint("mystery"), b.endpoint("mystery")])
        await until(lambda: recorder.count(a.endpoint().hostport) > 0)
        await until(lambda: recorder.count(b.endpoint().hostport) > 0)
    unknown = events(logs, "unknown engine type, scraping with the default engine's names")
    assert [entry["engine"] for entry in unknown] == ["mystery"]


async def test_callback_errors_do_not_stop_scraping(servers: Any, manager_factory: Any) -> None:
    """An on_snapshot that raises is logged and the loop keeps scraping."""
    server = await servers("127.0.0.33", vllm_page())
    calls: list[MetricsSnapshot] = []

    def flaky(endpoint: Endpoint, snapshot: MetricsSnapshot) -> None:
        calls.append(snapshot)
        if len(calls) == 1:
            raise RuntimeError("datastore hiccup")

    with capture_logs() as logs:
        manager = await manager_factory(flaky)
        manager.set_endpoints([server.endpoint()])
        await until(lambda: len(calls) >= 3)
    assert events(logs, "scrape failed")[0]["error"] == "datastore hiccup"


async def test_refused_connections_fail_fast(manager_factory: Any) -> None:
    """An endpoint with nothing listening is a logged failure, not a crashed task."""
    sock = socket.socket()
    sock.bind(("127.0.0.34", 0))
    port = sock.getsockname()[1]
    sock.close()
    recorder = Recorder()
    with capture_logs() as logs:
        manager = await manager_factory(recorder)
        manager.set_endpoints([endpoint("127.0.0.34", port)])
        await until(lambda: bool(events(logs, "scrape failed")))
        await asyncio.sleep(0.05)
    assert len(scrape_tasks()) == 1
    assert recorder.calls == []


@pytest.mark.parametrize(("staleness", "cap"), [(2.0, 0.5), (0.0, 1.0), (0.1, 0.05)])
def test_interval_cap_comes_from_staleness(staleness: float, cap: float) -> None:
    """The budget never stretches the interval past a quarter of the staleness threshold."""
    settings = ScrapeSettings(refresh_interval=0.05, staleness_threshold=staleness)
    manager = ScrapeManager(settings, Recorder())
    assert manager.budget.max_interval == pytest.approx(cap)


async def test_interval_stretches_with_measured_cost(servers: Any, manager_factory: Any) -> None:
    """The manager's interval is the budget's for its current number of endpoints."""
    a = await servers("127.0.0.35", vllm_page())
    b = await servers("127.0.0.36", vllm_page())
    manager = await manager_factory(Recorder(), cpu_budget=0.5)
    manager.set_endpoints([a.endpoint(), b.endpoint()])
    await until(lambda: manager.budget.samples > 0)
    manager.budget.cost_per_scrape = 0.05  # as if each scrape cost 50 ms of CPU
    assert manager.interval == pytest.approx(0.2)  # 2 * 50 ms / 0.5


async def test_one_scrape_in_sixteen_is_metered(servers: Any, manager_factory: Any) -> None:
    """The budget's samples come from one scrape in 16, the first one included (reading the
    thread's CPU clock costs a system call, several a scrape)."""
    server = await servers("127.0.0.40", vllm_page())
    recorder = Recorder()
    manager = await manager_factory(recorder, cpu_budget=0.5)
    manager.set_endpoints([server.endpoint()])
    await until(lambda: manager.budget.samples > 0)
    assert recorder.count(server.endpoint().hostport) <= 2
    await until(lambda: recorder.count(server.endpoint().hostport) >= 40)
    await manager.stop()
    scrapes = recorder.count(server.endpoint().hostport)
    # (+1: a metered scrape that stop() cancelled still records what it spent)
    assert 1 + (scrapes - 1) // 16 <= manager.budget.samples <= 2 + scrapes // 16


async def test_scrapes_reuse_one_connection(servers: Any, manager_factory: Any) -> None:
    """Successive scrapes of an endpoint travel on one kept-alive connection."""
    server = await servers("127.0.0.37", vllm_page())
    manager = await manager_factory(Recorder())
    manager.set_endpoints([server.endpoint()])
    await until(lambda: server.hits >= 5)
    assert len(set(server.peers)) == 1


async def test_removal_and_stop_close_connections(servers: Any) -> None:
    """A removed endpoint's connection is closed, and stop() closes all the others."""
    a, b = [await servers(f"127.0.0.{n}", vllm_page()) for n in (38, 39)]
    manager = ScrapeManager(FAST, Recorder())
    await manager.start()
    try:
        manager.set_endpoints([a.endpoint(), b.endpoint()])
        await until(lambda: a.hits >= 2 and b.hits >= 2)
        assert (a.open_connections, b.open_connections) == (1, 1)
        manager.set_endpoints([b.endpoint()])
        await until(lambda: a.open_connections == 0)
    finally:
        await manager.stop()
    await until(lambda: b.open_connections == 0)
    assert b.open_connections == 0


async def test_a_server_that_goes_away_is_reported_unreachable_at_once(
    servers: Any, manager_factory: Any
) -> None:
    """A refused scrape (a killed pod) reports the endpoint unreachable on that very scrape."""
    server = await servers("127.0.0.35", vllm_page())
    unreachable: list[tuple[str, str]] = []
    recorder = Recorder()
    manager = await manager_factory(
        recorder, on_unreachable=lambda h, r: unreachable.append((h, r))
    )
    manager.set_endpoints([server.endpoint()])
    hostport = server.endpoint().hostport
    await until(lambda: recorder.count(hostport) > 0)
    assert unreachable == []
    await server.stop()
    await until(lambda: bool(unreachable))
    assert unreachable[0][0] == hostport
    assert "ConnectionRefusedError" in unreachable[0][1]


@pytest.mark.parametrize("failure", ["slow", "status 500", "garbage page"])
async def test_slow_or_bad_pages_are_not_unreachable(
    servers: Any, manager_factory: Any, failure: str
) -> None:
    """A timeout, an error status or a bad page is a failed scrape, not a dead endpoint."""
    server = await servers("127.0.0.36", vllm_page())
    if failure == "slow":
        server.delay = 30.0
    elif failure == "status 500":
        server.status = 500
    else:
        server.body = b"<html>hello</html>"
    unreachable: list[tuple[str, str]] = []
    with capture_logs() as logs:
        manager = await manager_factory(
            Recorder(),
            ScrapeSettings(refresh_interval=0.02, timeout=0.1),
            on_unreachable=lambda h, r: unreachable.append((h, r)),
        )
        manager.set_endpoints([server.endpoint()])
        await until(lambda: bool(events(logs, "scrape failed")))
        await asyncio.sleep(0.1)
    assert unreachable == []


class AlwaysLater(TurnGate):
    """A gate that never admits at once: every step waits for a later iteration."""

    def admit(self) -> bool:
        return False


async def test_scrapes_pass_the_turn_gate(servers: Any) -> None:
    """Every send and every parse waits at the gate when it says so; each endpoint still gets
    its snapshots, and stop() leaves nothing waiting there."""
    hosts = [await servers(f"127.0.0.{n}", vllm_page(queue=n)) for n in range(40, 46)]
    recorder = Recorder()
    manager = ScrapeManager(FAST, recorder)
    manager.gate = AlwaysLater(batch=1)
    manager.set_endpoints([host.endpoint() for host in hosts])
    await manager.start()
    try:
        for host in hosts:
            hostport = host.endpoint().hostport
            await until(lambda hostport=hostport: recorder.count(hostport) >= 2)
    finally:
        await manager.stop()
    snapshots = sum(recorder.count(host.endpoint().hostport) for host in hosts)
    assert manager.gate.deferred >= 2 * snapshots  # a wait before its send and its parse
    assert {recorder.latest(h.endpoint().hostport).waiting_queue_size for h in hosts} == set(
        range(40, 46)
    )
    await asyncio.sleep(0)  # the gate's pending turn skips the cancelled
    assert manager.gate.waiting == 0
    assert scrape_tasks() == []


def busy(seconds: float) -> None:
    """Hold the event loop (a step's CPU) for ``seconds``."""
    until_time = time.perf_counter() + seconds
    while time.perf_counter() < until_time:
        pass


async def test_a_sliced_manager_defers_steps_past_its_share_and_an_unsliced_one_never() -> None:
    """Sliced (picks share the loop), a step that comes after an iteration's share of scrape
    work waits; unsliced (a workers' parent), every step runs at once."""
    for sliced, admitted in ((True, False), (False, True)):
        gate = ScrapeManager(FAST, Recorder(), sliced=sliced).gate
        assert gate.admit()
        busy(0.002)  # a share of 0.3 ms is long gone
        assert gate.admit() is admitted
