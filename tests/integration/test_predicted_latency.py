"""Predicted latency through the real ext_proc server: the stream's first response bytes time
each request's TTFT, the predictor learns each endpoint's, traffic leaves the slow one, and the
predictor's error is exported as a metric."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import grpc
from tests.integration.test_informed_scheduling import FakeClock, all_scraped_at, wait_for_metrics
from tests.support.extproc import (
    Client,
    body,
    headers,
    json_body,
    lb_metadata,
    make_settings,
    response_body,
    response_headers,
    running_app,
)
from tests.support.model_servers import fake_model_servers
from tests.support.pool import model, pod, pool, pool_yaml

ADDRS = ["127.0.9.12", "127.0.9.13", "127.0.9.14"]
CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: predicted-latency-scorer
- type: max-score-picker
"""


async def served(
    client: Client, clock: FakeClock, ttft: float, subset: list[str] | None = None
) -> str:
    """One streamed completion, routed (within ``subset``), whose first bytes come ``ttft``
    seconds of the EPP's clock later; the endpoint it went to."""
    call = client.stub.Process()
    await call.write(headers(subset=subset))
    await call.write(body(json_body({"model": "m", "prompt": "hello", "stream": True})))
    routing = await call.read()
    await call.read()  # the request body, streamed back
    await call.write(response_headers("text/event-stream"))
    clock.now += ttft
    await call.write(response_body(b'data: {"choices": [{"text": "a"}]}\n\n', False))
    await call.write(response_body(b"data: [DONE]\n\n"))
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:  # the response path's answers
        pass
    return lb_metadata(routing)


async def test_traffic_leaves_the_endpoint_predicted_slow(tmp_path: Path) -> None:
    """After each endpoint served a few streamed requests, one with a 2 s first token against
    50 ms, no request goes there any more, and the error gauge has a row per endpoint."""
    clock = FakeClock()
    async with fake_model_servers(ADDRS) as servers:
        pods = [pod(f"p{i}", s.address) for i, s in enumerate(servers)]
        settings = make_settings(tmp_path, pool_yaml(pool(port=servers[0].port), model("m"), *pods))
        config = tmp_path / "config.yaml"
        config.write_text(CONFIG)
        settings = replace(
            settings,
            scrape=replace(settings.scrape, refresh_interval=0.02, staleness_threshold=1e6),
            scheduling=replace(settings.scheduling, config_file=config),
        )
        slow = servers[0].hostport
        async with running_app(settings, clock=clock) as (app, client):
            await wait_for_metrics(app, all_scraped_at(clock))
            for _ in range(5):  # each endpoint in turn, by subset hint
                for server in servers:
                    ttft = 2.0 if server.hostport == slow else 0.05
                    await served(client, clock, ttft, subset=[server.hostport])
            picks = [await served(client, clock, 0.05) for _ in range(12)]
            exported = app.metrics.render().decode()
    assert slow not in picks
    gauge = "inference_extension_latency_predictor_ttft_relative_error"
    assert sum(line.startswith(gauge + "{") for line in exported.splitlines()) == len(servers)
