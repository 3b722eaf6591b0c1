"""Outlier detection through the real ext_proc server: Envoy's 503s for a pod eject it, retries
Envoy made past a pod count against that pod, a probe brings it back, a client that hangs up
counts against nobody; the metrics and the status page show it."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
from tests.integration.test_flow_control import IDLE, flow_app
from tests.support.extproc import (
    Client,
    completion,
    lb_metadata,
    make_settings,
    response_body,
    response_headers,
    running_app,
)
from tests.support.polling import until
from tests.support.pool import model, pod, pool, pool_yaml

from endpoint_picker.app import App
from endpoint_picker.settings import OutlierSettings, Settings

BAD, GOOD = "127.0.0.2:8000", "127.0.0.3:8000"
POOL = pool_yaml(
    pool(), model("m"), *(pod(f"p{i}", f"127.0.0.{i}") for i in range(2, 6))
)  # four pods
# Envoy's local reply when the upstream closed the connection before answering (response
# flag UC), as the shipped configs render it: what ext_proc sees on the response path.
RESET_REPLY = b'{"error":{"code":503,"message":"no model server could answer: upstream_reset_before_response_started{connection_termination}","type":"ServiceUnavailable"}}'  # noqa: E501


def settings_for(tmp_path: Path, *, fallbacks: int = 0, base: float = 0.3) -> Settings:
    settings = make_settings(tmp_path, POOL)
    return replace(
        settings,
        scheduling=replace(settings.scheduling, max_fallback_endpoints=fallbacks),
        outliers=OutlierSettings(base_ejection_time=base),
    )


async def request(
    client: Client,
    subset: list[str],
    status: int = 200,
    served: str | None = None,
    model_name: str = "m",
) -> str:
    """One request through the stream, answered with ``status``; the EPP's destination."""
    call = await client.open(completion(model_name, "hello", subset=subset))
    first = await call.read()
    destination = lb_metadata(first)  # type: ignore[arg-type]
    await call.write(response_headers(status=status, served=served))
    await call.write(response_body(RESET_REPLY if status >= 500 else b"{}"))
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:
        pass
    return destination


async def page(app: App, path: str) -> str:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{app.ports.metrics}{path}") as reply,
    ):
        return await reply.text()


async def test_consecutive_503s_eject_a_pod_and_a_probe_brings_it_back(tmp_path: Path) -> None:
    """Five of Envoy's reset 503s for one pod take it out of the candidates (shown in /metrics
    and /api/status); after the ejection time one request probes it, and its 200 brings it back."""
    async with running_app(settings_for(tmp_path)) as (app, client):
        for _ in range(5):
            assert await request(client, [BAD], status=503) == BAD
        assert app.outliers is not None
        assert app.outliers.excluded() == {BAD}
        routed = [await request(client, [BAD, GOOD]) for _ in range(10)]
        assert routed == [GOOD] * 10
        metrics = await page(app, "/metrics")
        assert (
            f'inference_extension_endpoint_failures_total{{endpoint="{BAD}",kind="5xx"}} 5.0'
            in metrics
        )
        assert f'inference_extension_endpoint_ejected{{endpoint="{BAD}"}} 1.0' in metrics
        assert f'inference_extension_endpoint_ejections_total{{endpoint="{BAD}"}} 1.0' in metrics
        status = await endpoints(app)
        assert status[BAD]["outlier"]["state"] == "ejected"
        assert status[BAD]["outlier"]["consecutiveFailures"] == 5
        assert status[GOOD]["outlier"] is None
        await asyncio.sleep(0.35)  # the ejection is over: the next pick of BAD is its probe
        while await request(client, [BAD, GOOD]) != BAD:
            pass
        assert app.outliers.excluded() == set()
        back = (await endpoints(app))[BAD]["outlier"]
        assert (back["state"], back["consecutiveFailures"], back["ejections"]) == ("ok", 0, 1)
        assert BAD in {await request(client, [BAD, GOOD]) for _ in range(20)}


async def test_an_attempt_envoy_retried_past_counts_against_that_pod(tmp_path: Path) -> None:
    """With fallbacks, Envoy's retry hides a pod that resets: each response served by the second
    endpoint named counts a failure of the first, and five eject it."""
    async with running_app(settings_for(tmp_path, fallbacks=1, base=30)) as (app, client):
        for _ in range(60):
            destination = await request(client, [BAD, GOOD], served=GOOD)
            if destination == GOOD:  # BAD is out: GOOD alone is named
                break
        assert app.outliers is not None
        assert app.outliers.excluded() == {BAD}
        metrics = await page(app, "/metrics")
        assert (
            f'inference_extension_endpoint_failures_total{{endpoint="{BAD}",kind="retried"}} 5.0'
            in metrics
        )
        assert f'endpoint="{GOOD}"' not in metrics  # it served: no failure of its own


async def test_a_client_hanging_up_ejects_nobody(tmp_path: Path) -> None:
    """Streams that end after routing without a response (the client left) are no failure."""
    async with running_app(settings_for(tmp_path)) as (app, client):
        for _ in range(10):
            call = await client.open(completion("m", "hello", subset=[BAD]))
            assert lb_metadata(await call.read()) == BAD  # type: ignore[arg-type]
            call.cancel()
        await asyncio.sleep(0.05)
        assert app.outliers is not None
        assert app.outliers.status(BAD) is None
        assert "inference_extension_endpoint_failures_total{" not in await page(app, "/metrics")


async def endpoints(app: App) -> dict[str, Any]:
    """/api/status's endpoints by address."""
    return {e["address"]: e for e in orjson.loads(await page(app, "/api/status"))["endpoints"]}


async def test_an_ejected_idle_pod_is_no_room_for_flow_control(tmp_path: Path) -> None:
    """With flow control, a pod ejected while its last metrics say idle does not count as
    room: a request waits in the queue instead of being sent to the busy pods."""
    async with flow_app(tmp_path) as (app, client, servers):
        _busy, idle = servers
        idle.metrics_text = IDLE
        await until(lambda: app.datastore.metrics_of(idle.hostport).waiting_queue_size == 0)
        for _ in range(5):  # its five 503s eject it ("std": test_flow_control's pool)
            destination = await request(client, [idle.hostport], status=503, model_name="std")
            assert destination == idle.hostport
        assert app.outliers is not None
        assert app.outliers.excluded() == {idle.hostport}
        flow = app.flow
        assert flow is not None
        decided = len(app.decisions.recent())
        waiting = asyncio.create_task(client.exchange(completion("std", "hello")))
        await until(lambda: flow.waiting == 1)
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        assert len(app.decisions.recent()) == decided  # it waited: routed nowhere
