"""Flow control through the real ext_proc server: requests wait while the pool is saturated,
leave by priority when it has room, and a client that goes away leaves nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from tests.support.extproc import (
    Client,
    completion,
    error_of,
    lb_metadata,
    make_settings,
    running_app,
)
from tests.support.model_servers import FakeModelServer, fake_model_servers, vllm_metrics
from tests.support.polling import until
from tests.support.pool import model, pod, pool, pool_yaml

from endpoint_picker.app import App
from endpoint_picker.requests import LLMRequest
from endpoint_picker.settings import Settings

ADDRS = ["127.0.3.2", "127.0.3.3"]
BUSY = vllm_metrics(waiting=50, running=10)
IDLE = vllm_metrics(waiting=0, running=1)
CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
flowControl:
  defaultRequestTTL: 2s
  priorityBands:
  - priority: -1
    maxRequests: 2
plugins:
- type: queue-scorer
- type: utilization-detector
  parameters: {queueDepthThreshold: 5, metricsStalenessThreshold: 2s}
"""


def flow_settings(
    tmp_path: Path, servers: list[FakeModelServer], config_text: str = CONFIG
) -> Settings:
    text = pool_yaml(
        pool(port=servers[0].port),
        model("crit", criticality="Critical"),
        model("std", criticality="Standard"),
        model("shed", criticality="Sheddable"),
        *(pod(f"p{i}", s.address) for i, s in enumerate(servers)),
    )
    settings = make_settings(tmp_path, text, scraping=True)
    config = tmp_path / "config.yaml"
    config.write_text(config_text)
    return replace(
        settings,
        scrape=replace(settings.scrape, refresh_interval=0.02, staleness_threshold=2.0),
        scheduling=replace(settings.scheduling, config_file=config),
    )


@contextlib.asynccontextmanager
async def flow_app(
    tmp_path: Path, busy: bool = True, config_text: str = CONFIG
) -> AsyncIterator[tuple[App, Client, list[FakeModelServer]]]:
    """Two fake servers (every queue long when ``busy``), the EPP with CONFIG, both scraped."""
    async with fake_model_servers(ADDRS) as servers:
        for s in servers:
            s.metrics_text = BUSY if busy else IDLE
        async with running_app(flow_settings(tmp_path, servers, config_text)) as (app, client):
            await until(lambda: scraped(app))
            assert app.flow is not None
            yield app, client, servers


def scraped(app: App) -> bool:
    states = app.datastore.endpoint_states()
    return len(states) == 2 and all(s.metrics.updated_at > 0 for s in states)


async def send(client: Client, model_name: str, order: list[str]) -> str:
    out = await client.exchange(completion(model_name, "hello"))
    if out[0].HasField("immediate_response"):
        status, _ = error_of(out[0])
        order.append(f"{model_name}:{status}")
        return str(status)
    order.append(model_name)
    return lb_metadata(out[0])


async def test_waiting_requests_leave_by_priority_when_the_pool_has_room(tmp_path: Path) -> None:
    """While every server's queue is long, requests wait in the EPP (none is sent anywhere);
    when one server frees up, Critical goes first, then Standard, then Sheddable; a third
    Sheddable request finds its band full (429) and the queue metrics saw it all."""
    async with flow_app(tmp_path) as (app, client, servers):
        assert app.flow is not None
        order: list[str] = []
        tasks = []
        flow = app.flow
        for name in ("shed", "std", "crit", "shed"):
            tasks.append(asyncio.create_task(send(client, name, order)))
            queued = len(tasks)
            await until(lambda: flow.waiting == queued)  # noqa: B023 (awaited at once)
        refused = await send(client, "shed", order)
        assert refused == "429"
        await asyncio.sleep(0.1)
        assert order == ["shed:429"]  # nothing else left while saturated
        servers[1].metrics_text = IDLE
        picks = await asyncio.wait_for(asyncio.gather(*tasks), 5)
        # the order of dispatch, as scheduled (the clients' own order of arrival can swap
        # under load): the decision log, newest first, refusals included
        scheduled = [d["model"] for d in reversed(app.decisions.recent()) if not d["error"]]
        assert scheduled == ["crit", "std", "shed", "shed"]
        assert sorted(order[1:]) == ["crit", "shed", "shed", "std"]
        assert set(picks) == {servers[1].hostport}
        assert app.flow.waiting == 0
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{app.ports.metrics}/metrics"
            async with session.get(url) as reply:
                text = await reply.text()
        assert 'inference_extension_flow_control_queue_size{priority="-1"} 0.0' in text
        dispatched = (
            "inference_extension_flow_control_request_queue_duration_seconds_count"
            '{outcome="dispatched",priority="1"} 1.0'
        )
        assert dispatched in text
        assert '{outcome="rejected",priority="-1"} 1.0' in text


async def test_a_waiting_request_times_out_with_503(tmp_path: Path) -> None:
    async with flow_app(tmp_path) as (_, client, _servers):
        out = await asyncio.wait_for(client.exchange(completion("std", "hello")), 5)
        status, payload = error_of(out[0])
        assert status == 503
        assert "timed out in queue" in payload["error"]["message"]


async def test_a_client_that_goes_away_leaves_no_queued_request_and_no_task(
    tmp_path: Path,
) -> None:
    """The ext_proc stream cancelled while its request waits: the queue is empty at once, the
    server's handler task is gone, and nothing was routed (no in-flight count)."""
    async with flow_app(tmp_path) as (app, client, servers):
        assert app.flow is not None
        before = {t for t in asyncio.all_tasks() if not t.done()}
        call = client.stub.Process()
        for message in completion("crit", "hello"):
            await call.write(message)
        await until(lambda: app.flow is not None and app.flow.waiting == 1)
        call.cancel()
        await until(lambda: app.flow is not None and app.flow.waiting == 0, within=2.0)
        await asyncio.sleep(0.05)
        servers[0].metrics_text = IDLE  # room again: nothing must be dispatched now
        await asyncio.sleep(0.2)
        assert app.inflight.total == 0

        def no_new_tasks() -> bool:
            # grpc keeps its own per-call task of a cancelled call until the server stops
            # (a plain stream cancelled mid-request does the same); any other is ours
            after = {t for t in asyncio.all_tasks() if not t.done()} - before
            after.discard(asyncio.current_task())  # type: ignore[arg-type]
            return all("_request_registered_call" in repr(t) for t in after)

        await until(no_new_tasks, within=2.0)


@pytest.mark.parametrize("name", ["crit", "shed"])
async def test_with_room_requests_skip_the_queue(tmp_path: Path, name: str) -> None:
    async with flow_app(tmp_path, busy=False) as (app, client, servers):
        order: list[str] = []
        pick = await send(client, name, order)
        assert pick in {s.hostport for s in servers}
        assert app.flow is not None
        assert app.flow.waiting == 0


async def test_dispatched_requests_go_only_where_there_is_room(tmp_path: Path) -> None:
    """With flow control the scheduler only sees endpoints with room: a server whose queue is
    long is passed over even when the profile's scorer prefers it (here: its emptier KV
    cache), so requests wait in the EPP's priority queues, not in a server's FCFS queue."""
    prefers_busy = CONFIG.replace("- type: queue-scorer", "- type: kv-cache-utilization-scorer")
    async with flow_app(tmp_path, busy=False, config_text=prefers_busy) as (app, client, servers):
        servers[0].metrics_text = vllm_metrics(waiting=50, running=10, kv=0.0)
        servers[1].metrics_text = vllm_metrics(waiting=0, running=1, kv=0.5)
        await until(lambda: scraped_queue(app, servers[0].hostport) == 50)
        order: list[str] = []
        picks = [await send(client, name, order) for name in ("crit", "std", "shed", "crit")]
        assert picks == [servers[1].hostport] * 4


def scraped_queue(app: App, hostport: str) -> int:
    for state in app.datastore.endpoint_states():
        if state.hostport == hostport:
            return state.metrics.waiting_queue_size
    return -1


async def test_a_subset_hinted_request_waits_for_its_own_endpoint_without_holding_others(
    tmp_path: Path,
) -> None:
    """Server 0 busy, server 1 idle: a request whose subset hint names server 0 waits in the
    queue (it is not sent into server 0's queue), while a request of the same priority without
    a hint goes past it to server 1; when server 0 frees up the hinted one goes there."""
    async with flow_app(tmp_path, busy=False) as (app, client, servers):
        assert app.flow is not None
        flow = app.flow
        servers[0].metrics_text = BUSY
        await until(lambda: app.datastore.endpoint_states()[0].metrics.waiting_queue_size == 50)
        hinted_messages = completion("std", "pinned", subset=[servers[0].hostport])
        hinted = asyncio.create_task(client.exchange(hinted_messages))
        await until(lambda: flow.waiting == 1)
        free = await asyncio.wait_for(send(client, "std", []), 5)
        assert free == servers[1].hostport  # went past the waiting, hinted request
        await asyncio.sleep(0.1)
        assert not hinted.done()
        assert flow.waiting == 1
        servers[0].metrics_text = IDLE
        out = await asyncio.wait_for(hinted, 5)
        assert lb_metadata(out[0]) == servers[0].hostport
        assert flow.waiting == 0


async def test_requests_that_expired_or_went_away_leave_nothing_in_the_epp(
    tmp_path: Path,
) -> None:
    """Large queued requests, each with a fairness id of its own, that time out (503) or whose
    client goes away leave no trace: no flow, no request object, nothing waiting."""
    short_ttl = CONFIG.replace("defaultRequestTTL: 2s", "defaultRequestTTL: 500ms")
    async with flow_app(tmp_path, config_text=short_ttl) as (app, client, _servers):
        assert app.flow is not None
        flow = app.flow
        prompt = "x" * (256 * 1024)

        def large(i: int) -> list[pb.ProcessingRequest]:
            fairness = {"x-gateway-inference-fairness-id": f"tenant-{i}"}
            return completion("std", prompt, extra=fairness)

        calls = []
        for i in range(5):  # these clients go away while their requests wait
            call = client.stub.Process()
            for message in large(100 + i):
                await call.write(message)
            calls.append(call)
        await until(lambda: flow.waiting == 5)
        assert flow.flows == 5
        for call in calls:
            call.cancel()
        await until(lambda: flow.waiting == 0)
        expiring = [asyncio.create_task(client.exchange(large(i))) for i in range(10)]
        await until(lambda: flow.waiting == 10)
        assert flow.flows == 10
        outs = await asyncio.wait_for(asyncio.gather(*expiring), 5)
        assert {error_of(out[0])[0] for out in outs} == {503}
        await until(lambda: flow.waiting == 0)
        del outs, expiring, calls
        gc.collect()
        kept = [o for o in gc.get_objects() if isinstance(o, LLMRequest) and o.model == "std"]
        assert kept == []
        assert flow.flows == 0


async def test_only_an_ascii_expected_timeout_shortens_a_wait(tmp_path: Path) -> None:
    """``x-envoy-expected-rq-timeout-ms: 200`` leaves the queue after 0.2 s; ``²`` (a 500
    before) and Arabic-Indic ``٢٠٠`` are not numbers: those wait the band's TTL (0.8 s)."""
    ttl = CONFIG.replace("defaultRequestTTL: 2s", "defaultRequestTTL: 800ms")
    async with flow_app(tmp_path, config_text=ttl) as (_app, client, _servers):
        loop = asyncio.get_running_loop()

        async def waited(header: str) -> tuple[int, float]:
            start = loop.time()
            extra = {"x-envoy-expected-rq-timeout-ms": header}
            out = await client.exchange(completion("std", "hello", extra=extra))
            status, payload = error_of(out[0])
            assert "timed out in queue" in payload["error"]["message"]
            return status, loop.time() - start

        ascii_digits, superscript, arabic_indic = await asyncio.wait_for(
            asyncio.gather(waited("200"), waited("²"), waited("٢٠٠")), 5
        )
        assert ascii_digits[0] == superscript[0] == arabic_indic[0] == 503
        assert ascii_digits[1] < 0.6
        assert superscript[1] >= 0.7
        assert arabic_indic[1] >= 0.7
