"""Predicted latency through the real ext_proc server: the stream's first response bytes time
each request's TTFT, the predictor learns each endpoint's, traffic leaves the slow one, and the
predictor's error is exported as a metric."""

from __future__ import annotations

from pathlib import Path

from tests.support.extproc import Client, running_app
from tests.support.fleet import (
    FakeClock,
    all_scraped_at,
    fleet_settings,
    timed_request,
    wait_for_metrics,
)
from tests.support.model_servers import fake_model_servers
from tests.support.pool import model

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
    completion = {"model": "m", "prompt": "hello", "stream": True}
    chunks = (b'data: {"choices": [{"text": "a"}]}\n\n', b"data: [DONE]\n\n")
    return await timed_request(
        client, clock, completion, ttft, chunks, content_type="text/event-stream", subset=subset
    )


async def test_traffic_leaves_the_endpoint_predicted_slow(tmp_path: Path) -> None:
    """After each endpoint served a few streamed requests, one with a 2 s first token against
    50 ms, no request goes there any more, and the error gauge has a row per endpoint."""
    clock = FakeClock()
    async with fake_model_servers(ADDRS) as servers:
        settings = fleet_settings(
            tmp_path, servers, model("m"), config=CONFIG, staleness_threshold=1e6
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
