"""Failures through a real Envoy: endpoints down, fallback retries, the EPP down."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from endpoint_picker.envoy_config import VARIANTS
from tests.e2e.harness import (
    Backend,
    Envoy,
    backends,
    e2e_pool,
    post,
    running_envoy,
    running_epp,
    wait_scraped,
)
from tests.support.model_servers import free_port, vllm_metrics

pytestmark = pytest.mark.e2e

DESTINATION = "x-gateway-destination-endpoint"
PAYLOAD = {"model": "m", "prompt": "hello"}


@pytest_asyncio.fixture
async def ranked() -> AsyncIterator[list[Backend]]:
    """Three backends the EPP ranks in order: idle, a little busy, very busy."""
    async with backends(("127.0.0.5", "127.0.0.6", "127.0.0.7")) as servers:
        servers[0].metrics_text = vllm_metrics(waiting=0, kv=0.0)
        servers[1].metrics_text = vllm_metrics(waiting=3, kv=0.3)
        servers[2].metrics_text = vllm_metrics(waiting=40, kv=0.9)
        yield servers


@contextlib.asynccontextmanager
async def fallback_gateway(tmp_path: Path, ranked: list[Backend]) -> AsyncIterator[Envoy]:
    """The EPP (one fallback, scraped) and the fallback variant's Envoy listing ``ranked``."""
    async with running_epp(tmp_path, e2e_pool(ranked), fallbacks=1, staleness_threshold=60) as epp:
        await wait_scraped(epp)
        endpoints = [b.hostport for b in ranked]
        async with running_envoy(
            tmp_path, "fallback", epp_port=epp.ports.ext_proc, endpoints=endpoints
        ) as envoy:
            yield envoy


async def test_fallback_retry_lands_on_the_second_endpoint_when_the_first_is_down(
    tmp_path: Path, ranked: list[Backend], own_session: aiohttp.ClientSession
) -> None:
    """Fallback variant: first endpoint refuses connections; the retry serves from the second."""
    first, second, third = ranked
    async with fallback_gateway(tmp_path, ranked) as envoy:
        # The EPP still believes it idle until a scrape is refused; until then Envoy's
        # retry moves on to the second endpoint the EPP named.
        await first.stop()
        for _ in range(3):
            reply = await post(own_session, envoy.url, PAYLOAD)
            assert reply.status == 200, (reply.body, envoy.log_tail())
            assert reply.json["served_by"] == second.hostport
        # first named (not yet known dead, Envoy retried) or second (known dead)
        assert {r.headers[DESTINATION].split(",")[0] for r in second.received} <= {
            first.hostport,
            second.hostport,
        }
        assert not third.received


async def test_fallback_answers_503_when_every_named_endpoint_is_down(
    tmp_path: Path, ranked: list[Backend], own_session: aiohttp.ClientSession
) -> None:
    """Fallback variant fails closed: the EPP's list exhausted, Envoy picks no other endpoint."""
    first, second, third = ranked
    async with fallback_gateway(tmp_path, ranked) as envoy:
        # Both reset every request (alive for /metrics, so the EPP keeps naming them).
        first.reset_requests = second.reset_requests = True
        try:
            reply = await post(own_session, envoy.url, PAYLOAD)
        finally:
            first.reset_requests = second.reset_requests = False
        assert reply.status == 503, reply.body
        assert reply.headers["content-type"] == "application/json", (reply.body, reply.headers)
        assert reply.json["error"]["type"] == "ServiceUnavailable"
        assert len(first.received) == len(second.received) == 1
        assert not third.received


async def test_reference_answers_503_for_a_list_of_endpoints(
    tmp_path: Path, ranked: list[Backend], own_session: aiohttp.ClientSession
) -> None:
    """ORIGINAL_DST routes to one address only: an EPP sending fallbacks gets Envoy's 503."""
    async with (
        running_epp(tmp_path, e2e_pool(ranked), fallbacks=1) as epp,
        running_envoy(tmp_path, "reference", epp_port=epp.ports.ext_proc) as envoy,
    ):
        reply = await post(own_session, envoy.url, PAYLOAD)
    assert reply.status == 503, reply.body
    assert not any(b.received for b in ranked)


@pytest.mark.parametrize("variant", VARIANTS)
async def test_epp_stopped_fails_closed_even_with_a_client_destination_header(
    tmp_path: Path, variant: str, ranked: list[Backend], own_session: aiohttp.ClientSession
) -> None:
    """EPP stopped (FailClose): 5xx, and a client-sent destination header reaches no backend."""
    endpoints = [b.hostport for b in ranked]
    async with (
        running_epp(tmp_path, e2e_pool(ranked)) as epp,
        running_envoy(tmp_path, variant, epp_port=epp.ports.ext_proc, endpoints=endpoints) as envoy,
    ):
        assert (await post(own_session, envoy.url, PAYLOAD)).status == 200
        await epp.stop(drain_timeout=0.2)
        for backend in ranked:
            backend.received.clear()
        for spoof in ({}, {DESTINATION: ranked[2].hostport}):
            reply = await post(own_session, envoy.url, PAYLOAD, headers=spoof)
            assert reply.status == 500, reply.body
            assert reply.headers["content-type"] == "application/json"  # not an empty 500
            assert "endpoint picker failed or cannot be reached" in reply.json["error"]["message"]
    assert not any(b.received for b in ranked)


@pytest.mark.parametrize(
    ("variant", "status"),
    # Envoy 1.40 ignores failure_mode_allow once FULL_DUPLEX_STREAMED bodies went out: 500.
    [("reference", 500), ("fallback", 500), ("buffered", 503)],
)
async def test_fail_open_without_an_epp_still_never_lets_the_client_choose(
    tmp_path: Path,
    variant: str,
    status: int,
    ranked: list[Backend],
    own_session: aiohttp.ClientSession,
) -> None:
    """failure_mode_allow=true, no EPP: unrouted, so 503 (or 500); a client header is dropped."""
    endpoints = [b.hostport for b in ranked]
    async with running_envoy(
        tmp_path,
        variant,
        epp_port=free_port(),  # nothing listens there
        endpoints=endpoints,
        failure_mode_allow=True,
    ) as envoy:
        reply = await post(
            own_session, envoy.url, PAYLOAD, headers={DESTINATION: ranked[0].hostport}
        )
        # (failed once in a full run, not reproduced since: Envoy's log says why next time)
        assert reply.status == status, (reply.body, envoy.log_tail())
    assert not any(b.received for b in ranked)


@pytest.mark.parametrize("variant", ["reference", "buffered"])
async def test_a_killed_pod_costs_at_most_one_error(
    tmp_path: Path, variant: str, ranked: list[Backend], own_session: aiohttp.ClientSession
) -> None:
    """A pod gone between scrapes: Envoy's connect failure takes it out after one 503."""
    for backend in ranked:
        backend.metrics_text = vllm_metrics(waiting=0, kv=0.0)  # all equally attractive
    # Scrapes 30 s apart: the EPP learns of the dead pod from Envoy, not from a scrape.
    async with (
        running_epp(
            tmp_path, e2e_pool(ranked), refresh_interval=30, staleness_threshold=600
        ) as epp,
        running_envoy(tmp_path, variant, epp_port=epp.ports.ext_proc) as envoy,
    ):
        dead = ranked[0]
        await dead.stop()
        replies = [await post(own_session, envoy.url, PAYLOAD) for _ in range(12)]
        failed = [r for r in replies if r.status != 200]
        assert len(failed) <= 1, [r.body for r in failed]
        for reply in failed:
            assert reply.status == 503
            assert reply.json["error"]["type"] == "ServiceUnavailable"
            assert epp.datastore.unreachable == {dead.hostport: "envoy: upstream connect failure"}
        assert {r.json["served_by"] for r in replies if r.status == 200} <= {
            ranked[1].hostport,
            ranked[2].hostport,
        }
