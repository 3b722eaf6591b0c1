"""How long a queued request waits behind the shipped Envoy: the band's TTL, whatever the client
says in ``x-envoy-expected-rq-timeout-ms`` (see ``director.TIMEOUT_HEADER`` for why)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import aiohttp

from tests.e2e.harness import backends, e2e_pool, post, running_envoy, wait_scraped
from tests.support.extproc import make_settings, started_app
from tests.support.model_servers import vllm_metrics

CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
flowControl:
  defaultRequestTTL: 1s
plugins:
- type: queue-scorer
- type: utilization-detector
  parameters: {queueDepthThreshold: 5, metricsStalenessThreshold: 5s}
"""


async def test_a_client_cannot_shorten_a_queued_wait_through_the_shipped_envoy(
    tmp_path: Path,
) -> None:
    """Envoy strips a client's x-envoy-expected-rq-timeout-ms before any filter runs (its
    router sets the header on the upstream request only, after ext_proc, and only from a route
    timeout, 0 in the shipped configs): a queued request waits the band's TTL (1 s, not the
    client's 0.2 s) and leaves with the EPP's JSON 503."""
    async with backends(["127.0.0.2", "127.0.0.3"]) as servers:
        for server in servers:
            server.metrics_text = vllm_metrics(waiting=50, running=10)  # saturated
        config = tmp_path / "config.yaml"
        config.write_text(CONFIG)
        settings = make_settings(tmp_path, e2e_pool(servers), scraping=True)
        settings = replace(settings, scheduling=replace(settings.scheduling, config_file=config))
        async with started_app(settings) as app:
            await wait_scraped(app)
            async with (
                running_envoy(
                    tmp_path, "reference", epp_port=app.ports.ext_proc, epp_tls=False
                ) as envoy,
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
            ):
                start = time.monotonic()
                reply = await post(
                    session,
                    envoy.url,
                    {"model": "m", "prompt": "x"},
                    headers={"x-envoy-expected-rq-timeout-ms": "200"},
                )
                waited = time.monotonic() - start
    assert reply.status == 503
    assert "timed out in queue" in reply.json["error"]["message"]
    assert waited >= 0.9
    assert not any(server.received for server in servers)
