"""The EPP fed by the Kubernetes source: real client, API-server double, ext_proc, health."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tests.support.extproc import (
    Client,
    completion,
    lb_metadata,
    started_app,
)
from tests.support.kubeapi import FakeKubeApi, serve_kube_api
from tests.support.metrics_auth import kubernetes_settings
from tests.support.model_servers import fake_model_servers
from tests.support.polling import until
from tests.support.pool import model, pod, pool

from endpoint_picker.app import App
from endpoint_picker.settings import Settings

pytestmark = pytest.mark.timeout(30)

ADDRS = ["127.0.7.2", "127.0.7.3", "127.0.7.4", "127.0.7.5"]
SCRAPE_INTERVAL = 0.2  # the slack the issue allows after a deletion is served


def settings_for(api: FakeKubeApi, tmp_path: Path) -> Settings:
    """What `epp serve --pool-name pool --kubeconfig ...` parses to, with quick reconnects."""
    settings = kubernetes_settings(
        api,
        tmp_path,
        "--pool-namespace",
        "default",
        "--drain-timeout",
        "1s",
        "--refresh-metrics-interval",
        f"{int(SCRAPE_INTERVAL * 1000)}ms",
    )
    assert settings.pool.pool_file is None
    kubernetes = replace(settings.pool.kubernetes, backoff_initial=0.05, backoff_max=0.2)
    return replace(settings, pool=replace(settings.pool, kubernetes=kubernetes))


async def readiness(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=2)
        return int(reply.status)


@dataclass
class Routed:
    at: float  # loop time the request was sent
    endpoint: str


async def route_forever(client: Client, out: list[Routed], worker: int) -> None:
    loop = asyncio.get_running_loop()
    for n in itertools.count():
        sent = loop.time()
        prompt = f"worker {worker} request {n}: a prompt of its own"
        reply = await client.exchange(completion("base", prompt))
        out.append(Routed(sent, lb_metadata(reply[0])))


async def test_pods_come_and_go_under_traffic(tmp_path: Path) -> None:
    """Ready only after the first sync; no request goes to a pod after its deletion (or loss of
    readiness) was served to the watch, beyond one scrape interval; a new pod gets traffic."""
    async with fake_model_servers(ADDRS) as servers, serve_kube_api("127.0.7.9") as api:
        port = servers[0].port
        api.put(model("base", criticality="Critical"))
        for i, server in enumerate(servers[:3]):
            api.put(pod(f"p{i}", server.address))
        async with started_app(settings_for(api, tmp_path), drain_timeout=0.2) as app:
            assert await readiness(app.ports.health) == health_pb2.HealthCheckResponse.NOT_SERVING
            api.put(pool(port=port))  # the pool appears: the first full sync can complete
            await until(lambda: app.health.ready, within=2)
            assert await readiness(app.ports.health) == health_pb2.HealthCheckResponse.SERVING

            loop = asyncio.get_running_loop()
            routed: list[Routed] = []
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.ports.ext_proc}") as channel:
                client = Client(channel)
                workers = [asyncio.create_task(route_forever(client, routed, w)) for w in range(4)]
                try:
                    await until(lambda: len(routed) >= 40, within=5)
                    api.delete(pod("p1", servers[1].address))
                    deleted_at = loop.time()
                    await asyncio.sleep(0.5)
                    api.put(pod("p3", servers[3].address))
                    added_at = loop.time()
                    await until(
                        lambda: any(r.endpoint == servers[3].hostport for r in routed), within=1
                    )
                    api.put(pod("p0", servers[0].address, ready=False))
                    unready_at = loop.time()
                    await asyncio.sleep(0.5)
                    done_at = loop.time()
                finally:
                    for worker in workers:
                        worker.cancel()
                    await asyncio.gather(*workers, return_exceptions=True)

    assert {r.endpoint for r in routed if r.at < deleted_at} <= {s.hostport for s in servers[:3]}
    late_to_p1 = [r for r in routed if r.at > deleted_at + SCRAPE_INTERVAL]
    assert late_to_p1, "traffic went on after the deletion"
    assert all(r.endpoint != servers[1].hostport for r in late_to_p1)
    late_to_p0 = [r for r in routed if unready_at + SCRAPE_INTERVAL < r.at < done_at]
    assert late_to_p0
    assert all(r.endpoint != servers[0].hostport for r in late_to_p0)
    assert any(r.endpoint == servers[3].hostport and r.at > added_at for r in routed)


async def test_watch_reconnects_while_serving(tmp_path: Path) -> None:
    """A dropped watch and a 410 leave the EPP ready and serving; the next change still lands."""
    async with fake_model_servers(ADDRS[:2]) as servers, serve_kube_api("127.0.7.9") as api:
        api.put(pool(port=servers[0].port))
        api.put(model("base"))
        api.put(pod("p0", servers[0].address))
        async with started_app(settings_for(api, tmp_path), drain_timeout=0.2) as app:
            assert app.kubernetes is not None
            await asyncio.wait_for(app.kubernetes.synced.wait(), 2)
            api.drop()
            api.expire()
            api.put(pod("p1", servers[1].address))
            await until(lambda: len(app.datastore.endpoints) == 2, within=2)
            assert app.health.ready


async def test_leader_election_only_the_leader_is_ready(tmp_path: Path) -> None:
    """With --ha-enable-leader-election two synced replicas agree on one ready leader; when it
    stops (and releases the Lease) the standby turns ready."""
    async with fake_model_servers(ADDRS[:1]) as servers, serve_kube_api("127.0.7.9") as api:
        api.put(pool(port=servers[0].port))
        api.put(model("base"))
        api.put(pod("p0", servers[0].address))
        base = settings_for(api, tmp_path)
        kubernetes = replace(
            base.pool.kubernetes,
            leader_election=True,
            lease_duration=2.0,
            renew_deadline=1.0,
            retry_period=0.1,
        )
        settings = replace(base, pool=replace(base.pool, kubernetes=kubernetes))
        first, second = App(settings), App(settings)
        await first.start()
        await until(lambda: first.health.ready, within=3)
        await second.start()
        stopped_first = False
        try:
            assert second.kubernetes is not None
            await asyncio.wait_for(second.kubernetes.synced.wait(), 2)
            await asyncio.sleep(0.5)
            assert first.health.ready
            assert not second.health.ready  # synced, but standing by
            assert await readiness(second.ports.health) == (
                health_pb2.HealthCheckResponse.NOT_SERVING
            )
            lease = api.objects[("coordination.k8s.io/v1", "leases")][
                ("default", "endpoint-picker-pool")
            ]
            assert first.elector is not None
            assert lease["spec"]["holderIdentity"] == first.elector.identity
            await first.stop(drain_timeout=0.1)
            stopped_first = True
            await until(lambda: second.health.ready, within=1)
        finally:
            if not stopped_first:
                await first.stop(drain_timeout=0.1)
            await second.stop(drain_timeout=0.1)


async def test_worker_processes_follow_the_kubernetes_source(tmp_path: Path) -> None:
    """`--worker-max-requests` (a parent and a worker process, as grpcio deployments run):
    the parent watches the API and fans the pool out; the worker routes on it, a deleted pod
    gets no more traffic, and readiness follows the first sync."""
    from endpoint_picker.workers import build_parent

    async with fake_model_servers(ADDRS[:3]) as servers, serve_kube_api("127.0.7.9") as api:
        api.put(model("base"))
        for i, server in enumerate(servers):
            api.put(pod(f"p{i}", server.address))
        settings = settings_for(api, tmp_path)
        settings = replace(settings, server=replace(settings.server, worker_max_requests=1000))
        app = build_parent(settings)
        await app.start()
        try:
            assert await readiness(app.ports.health) == health_pb2.HealthCheckResponse.NOT_SERVING
            api.put(pool(port=servers[0].port))
            await until(lambda: app.health.ready, within=5)
            routed: list[Routed] = []
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.ports.ext_proc}") as channel:
                client = Client(channel)
                task = asyncio.create_task(route_forever(client, routed, 0))
                try:
                    await until(lambda: len(routed) >= 30, within=10)
                    assert {r.endpoint for r in routed} <= {s.hostport for s in servers}
                    api.delete(pod("p1", servers[1].address))
                    deleted_at = asyncio.get_running_loop().time()
                    await asyncio.sleep(1.0)
                finally:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
        finally:
            await app.stop(drain_timeout=0.2)
    late = [r for r in routed if r.at > deleted_at + 0.5]
    assert late, "traffic stopped after the deletion"
    assert all(r.endpoint != servers[1].hostport for r in late)
