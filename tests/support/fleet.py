"""An in-process EPP over a fleet of fake model servers, on a clock the test moves: its
settings, the clock, waiting for the first scrapes, and one request whose response takes a
chosen time (what the latency-learning plugins learn from)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc

from endpoint_picker.app import App
from endpoint_picker.settings import Settings
from tests.support.extproc import (
    Client,
    body,
    headers,
    json_body,
    lb_metadata,
    make_settings,
    response_body,
    response_headers,
)
from tests.support.model_servers import FakeModelServer
from tests.support.pool import pod, pool, pool_yaml


class FakeClock:
    """Monotonic time the test moves by hand: staleness never depends on machine load."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fleet_settings(
    tmp_path: Path,
    servers: Sequence[FakeModelServer],
    *models: dict[str, Any],
    config: str | None = None,
    staleness_threshold: float = 2.0,
) -> Settings:
    """Settings for an EPP whose pool is ``servers`` (a pod each) serving ``models``, scraped
    every 20 ms, scheduled by ``config`` (the default profile without)."""
    pods = [pod(f"p{i}", s.address) for i, s in enumerate(servers)]
    settings = make_settings(tmp_path, pool_yaml(pool(port=servers[0].port), *models, *pods))
    scheduling = settings.scheduling
    if config is not None:
        config_file = tmp_path / "config.yaml"
        config_file.write_text(config)
        scheduling = replace(scheduling, config_file=config_file)
    return replace(
        settings,
        scrape=replace(
            settings.scrape, refresh_interval=0.02, staleness_threshold=staleness_threshold
        ),
        scheduling=scheduling,
    )


async def wait_for_metrics(app: App, check: Callable[[App], bool], within: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not check(app):
        assert asyncio.get_running_loop().time() < deadline, "metrics did not arrive in time"
        await asyncio.sleep(0.02)


def all_scraped_at(clock: FakeClock) -> Callable[[App], bool]:
    def check(app: App) -> bool:
        return all(s.metrics.updated_at == clock.now for s in app.datastore.endpoint_states())

    return check


async def timed_request(
    client: Client,
    clock: FakeClock,
    payload: dict[str, Any],
    seconds: float,
    chunks: Sequence[bytes],
    *,
    content_type: str = "application/json",
    subset: list[str] | None = None,
) -> str:
    """One request of ``payload``, routed (within ``subset``), whose response of
    ``content_type`` brings its body (``chunks``) ``seconds`` of the EPP's clock after its
    headers; the endpoint it went to."""
    call = client.stub.Process()
    await call.write(headers(subset=subset))
    await call.write(body(json_body(payload)))
    routing = await call.read()
    await call.read()  # the request body, streamed back
    await call.write(response_headers(content_type))
    clock.now += seconds
    for i, chunk in enumerate(chunks):
        await call.write(response_body(chunk, i == len(chunks) - 1))
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:  # the response path's answers
        pass
    return lb_metadata(routing)
