"""Latency learned from the EPP's own traffic, through the real ext_proc server: the stream
times each response (its first bytes for the predictor's TTFT, its end for the latency
objective's time per output token), the plugin learns each endpoint's, and traffic leaves the
endpoint that is slow."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from tests.support.extproc import (
    Client,
    FakeClock,
    all_scraped_at,
    fleet_settings,
    running_app,
    timed_request,
    wait_for_metrics,
)
from tests.support.model_servers import fake_model_servers
from tests.support.pool import model

from endpoint_picker.datastore.decode import OBJECTIVE_P95_KEY

# (client, clock, seconds the response takes, subset) -> the endpoint it went to
Served = Callable[[Client, FakeClock, float, list[str] | None], Awaitable[str]]
TOKENS = 10


async def streamed(
    client: Client, clock: FakeClock, ttft: float, subset: list[str] | None = None
) -> str:
    """One streamed completion whose first bytes come ``ttft`` seconds of the EPP's clock
    later."""
    completion = {"model": "m", "prompt": "hello", "stream": True}
    chunks = (b'data: {"choices": [{"text": "a"}]}\n\n', b"data: [DONE]\n\n")
    return await timed_request(
        client, clock, completion, ttft, chunks, content_type="text/event-stream", subset=subset
    )


async def with_usage(
    client: Client, clock: FakeClock, per_token: float, subset: list[str] | None = None
) -> str:
    """One ``crit`` request answered after ``per_token`` x ``TOKENS`` seconds of the EPP's
    clock with a usage report of ``TOKENS`` output tokens."""
    usage = orjson.dumps({"usage": {"prompt_tokens": 3, "completion_tokens": TOKENS}})
    request = {"model": "crit", "prompt": "hello"}
    return await timed_request(client, clock, request, per_token * TOKENS, [usage], subset=subset)


def objective_model() -> dict[str, Any]:
    crit = model("crit")
    crit["spec"]["objective"] = {OBJECTIVE_P95_KEY: "50ms"}
    return crit


@dataclass(frozen=True)
class Case:
    addrs: list[str]
    plugin: str  # the scorer's config entry
    model: Callable[[], dict[str, Any]]
    served: Served
    slow: float  # what the slow endpoint takes (seconds; per token for the objective)
    fast: float
    rounds: int  # requests each endpoint serves first, in turn, by subset hint
    picks: int  # requests routed freely after
    staleness_threshold: float

    def config(self) -> str:
        return (
            "apiVersion: inference.networking.x-k8s.io/v1alpha1\n"
            "kind: EndpointPickerConfig\n"
            f"plugins:\n{self.plugin}- type: max-score-picker\n"
        )


PREDICTED = Case(
    ["127.0.9.12", "127.0.9.13", "127.0.9.14"],
    "- type: predicted-latency-scorer\n",
    lambda: model("m"),
    streamed,
    slow=2.0,  # a 2 s first token against 50 ms
    fast=0.05,
    rounds=5,
    picks=12,
    staleness_threshold=1e6,
)
OBJECTIVE = Case(
    ["127.0.9.2", "127.0.9.3", "127.0.9.4"],
    "- type: slo-aware-scorer\n  parameters: {minSamples: 3}\n",
    objective_model,
    with_usage,
    slow=0.2,  # 200 ms per output token against a 50 ms objective
    fast=0.01,
    rounds=3,
    picks=20,
    staleness_threshold=2.0,
)


@pytest.mark.parametrize("case", [PREDICTED, OBJECTIVE], ids=["predicted", "objective"])
async def test_traffic_leaves_the_slow_endpoint(tmp_path: Path, case: Case) -> None:
    """After each endpoint served a few requests, one of them slow, no request goes there any
    more and the others share the traffic; the predictor's error gauge has a row per
    endpoint."""
    clock = FakeClock()
    async with fake_model_servers(case.addrs) as servers:
        settings = fleet_settings(
            tmp_path,
            servers,
            case.model(),
            config=case.config(),
            staleness_threshold=case.staleness_threshold,
        )
        slow = servers[0].hostport
        async with running_app(settings, clock=clock) as (app, client):
            await wait_for_metrics(app, all_scraped_at(clock))
            for _ in range(case.rounds):
                for server in servers:
                    seconds = case.slow if server.hostport == slow else case.fast
                    await case.served(client, clock, seconds, [server.hostport])
            picks = [await case.served(client, clock, case.fast, None) for _ in range(case.picks)]
            exported = app.metrics.render().decode()
    assert slow not in picks
    if case is OBJECTIVE:
        assert set(picks) == {s.hostport for s in servers[1:]}
    else:
        gauge = "inference_extension_latency_predictor_ttft_relative_error"
        assert sum(line.startswith(gauge + "{") for line in exported.splitlines()) == len(servers)
