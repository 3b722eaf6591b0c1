"""Informed picks through the gRPC protocol, with fake model servers serving /metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.support.extproc import (
    FakeClock,
    all_scraped_at,
    completion,
    error_of,
    fleet_settings,
    lb_metadata,
    wait_for_metrics,
)
from tests.support.extproc import running_app as _running_app
from tests.support.model_servers import FakeModelServer, fake_model_servers, vllm_metrics
from tests.support.pool import model

from endpoint_picker.app import App
from endpoint_picker.settings import Settings


def settings_for(
    tmp_path: Path, servers: list[FakeModelServer], config: str | None = None
) -> Settings:
    return fleet_settings(
        tmp_path,
        servers,
        model("crit", criticality="Critical"),
        model("shed", criticality="Sheddable"),
        model("lora-a"),
        config=config,
    )


async def pick(client, model_name: str = "crit") -> str:  # type: ignore[no-untyped-def]
    out = await client.exchange(completion(model_name))
    return lb_metadata(out[0])


ADDRS = ["127.0.1.2", "127.0.1.3", "127.0.1.4"]


@pytest.mark.parametrize(
    ("metrics", "winner"),
    [
        (
            [
                vllm_metrics(waiting=9, kv=0.3),
                vllm_metrics(waiting=1, kv=0.3),
                vllm_metrics(waiting=5, kv=0.3),
            ],
            1,
        ),
        ([vllm_metrics(kv=0.9), vllm_metrics(kv=0.7), vllm_metrics(kv=0.1)], 2),
        (
            [
                vllm_metrics(active=["x"]),
                vllm_metrics(active=["lora-a"]),
                vllm_metrics(pending=["x"], max_lora=1),
            ],
            1,
        ),
    ],
    ids=["lower-queue", "lower-kv", "adapter-loaded"],
)
async def test_informed_pick(tmp_path: Path, metrics: list[str], winner: int) -> None:
    """The lower queue wins; the lower KV usage wins; the endpoint with the adapter wins."""
    clock = FakeClock()
    async with fake_model_servers(ADDRS) as servers:
        for server, text in zip(servers, metrics, strict=True):
            server.metrics_text = text
        async with _running_app(settings_for(tmp_path, servers), clock=clock) as (app, client):
            await wait_for_metrics(app, all_scraped_at(clock))
            model_name = "lora-a" if "lora-a" in metrics[1] else "crit"
            picks = {await pick(client, model_name) for _ in range(10)}
    assert picks == {servers[winner].hostport}


async def test_base_model_traffic_reaches_a_pod_without_lora_info(tmp_path: Path) -> None:
    """Base-model requests spread over a fresh pod (no LoRA sample yet) and a LoRA-ready one."""
    clock = FakeClock()
    async with fake_model_servers(ADDRS[:2]) as servers:
        servers[0].metrics_text = vllm_metrics(model="crit")
        servers[1].metrics_text = vllm_metrics(model="crit", lora_info=False)
        async with _running_app(settings_for(tmp_path, servers), clock=clock) as (app, client):
            await wait_for_metrics(app, all_scraped_at(clock))
            picks = {await pick(client, "crit") for _ in range(30)}
    assert picks == {servers[0].hostport, servers[1].hostport}


async def test_shedding_by_criticality(tmp_path: Path) -> None:
    """Overloaded pool: critical still routes, sheddable gets 429 until one endpoint has room."""
    clock = FakeClock()
    async with fake_model_servers(ADDRS) as servers:
        for server in servers:
            server.metrics_text = vllm_metrics(waiting=20, kv=0.95)
        async with _running_app(settings_for(tmp_path, servers), clock=clock) as (app, client):
            await wait_for_metrics(app, all_scraped_at(clock))
            assert await pick(client, "crit")
            out = await client.exchange(completion("shed"))
            status, error = error_of(out[0])
            assert (status, error["error"]["type"]) == (429, "ResourceExhausted")
            servers[2].metrics_text = vllm_metrics(waiting=0, kv=0.1)

            def room(app: App) -> bool:
                return app.datastore.endpoint_states()[2].metrics.waiting_queue_size == 0

            await wait_for_metrics(app, room)
            assert await pick(client, "shed") == servers[2].hostport


async def test_dead_metrics_endpoint_stops_being_preferred_once_stale(tmp_path: Path) -> None:
    """An endpoint whose /metrics dies keeps its last snapshot, then loses once it is stale."""
    clock = FakeClock()
    async with fake_model_servers(ADDRS[:2]) as servers:
        servers[0].metrics_text = vllm_metrics(waiting=0)
        servers[1].metrics_text = vllm_metrics(waiting=3)
        async with _running_app(settings_for(tmp_path, servers), clock=clock) as (app, client):
            await wait_for_metrics(app, all_scraped_at(clock))
            assert await pick(client) == servers[0].hostport
            servers[0].metrics_status = 500
            clock.now += 1.0  # not yet stale (threshold 2 s): still preferred on its last snapshot

            def fresh_b(app: App) -> bool:
                return app.datastore.endpoint_states()[1].metrics.updated_at == clock.now

            await wait_for_metrics(app, fresh_b)
            assert await pick(client) == servers[0].hostport
            clock.now += 5.0
            await wait_for_metrics(app, fresh_b)
            assert {await pick(client) for _ in range(5)} == {servers[1].hostport}
