"""The latency objective through the real ext_proc server: the stream times each response,
the tracker learns each endpoint's latency per output token, objective traffic moves away
from the endpoint that breaks the objective."""

from __future__ import annotations

from pathlib import Path

import orjson
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

from endpoint_picker.datastore.decode import OBJECTIVE_P95_KEY

ADDRS = ["127.0.9.2", "127.0.9.3", "127.0.9.4"]
CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: slo-aware-scorer
  parameters: {minSamples: 3}
- type: max-score-picker
"""
TOKENS = 10


async def served(
    client: Client, clock: FakeClock, per_token: float, subset: list[str] | None = None
) -> str:
    """One ``crit`` request, routed (within ``subset``), answered after ``per_token`` x
    ``TOKENS`` seconds of the EPP's clock with a usage report; the endpoint it went to."""
    usage = orjson.dumps({"usage": {"prompt_tokens": 3, "completion_tokens": TOKENS}})
    request = {"model": "crit", "prompt": "hello"}
    return await timed_request(client, clock, request, per_token * TOKENS, [usage], subset=subset)


async def test_objective_traffic_leaves_the_endpoint_that_breaks_the_objective(
    tmp_path: Path,
) -> None:
    """After each endpoint served a few requests, where one took 200 ms per output token
    against a 50 ms objective, no objective request goes there any more."""
    clock = FakeClock()
    crit = model("crit")
    crit["spec"]["objective"] = {OBJECTIVE_P95_KEY: "50ms"}
    async with fake_model_servers(ADDRS) as servers:
        settings = fleet_settings(tmp_path, servers, crit, config=CONFIG)
        slow = servers[0].hostport
        async with running_app(settings, clock=clock) as (app, client):
            await wait_for_metrics(app, all_scraped_at(clock))
            for _ in range(3):  # each endpoint in turn, by subset hint
                for server in servers:
                    per_token = 0.2 if server.hostport == slow else 0.01
                    await served(client, clock, per_token, subset=[server.hostport])
            picks = [await served(client, clock, 0.01) for _ in range(20)]
    assert slow not in picks
    assert set(picks) == {s.hostport for s in servers[1:]}
