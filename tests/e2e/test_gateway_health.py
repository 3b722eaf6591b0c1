"""The gateway's /health through each shipped Envoy config, for real, as the pool file turns
every pod NotReady: Envoy -> EPP (TLS) -> backends on 127.0.0.x."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import orjson
import pytest

from endpoint_picker.envoy_config import VARIANTS
from tests.e2e.harness import Backend, e2e_pool, post, running_envoy, running_epp, wait_scraped

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(30)]


def _not_ready(pool_text: str) -> str:
    """The same pool file, complete, with every pod's Ready condition False."""
    return pool_text.replace("status: 'True'", "status: 'False'")


@pytest.mark.parametrize("variant", VARIANTS)
async def test_health_follows_the_pool_and_never_reaches_a_pod(
    tmp_path: Path,
    pool_backends: list[Backend],
    session: aiohttp.ClientSession,
    variant: str,
) -> None:
    """GET/HEAD /health: 200 while the pool has a ready endpoint; after a pool-file edit that
    marks every pod NotReady, 503 (JSON for GET, as the EPP's other errors) for /health and
    for completions alike; no request reaches a pod."""
    ready = e2e_pool(pool_backends)
    assert _not_ready(ready) != ready
    async with (
        running_epp(tmp_path, ready) as epp,
        running_envoy(
            tmp_path,
            variant,
            epp_port=epp.ports.ext_proc,
            endpoints=[b.hostport for b in pool_backends],
        ) as envoy,
    ):
        await wait_scraped(epp)
        for method in ("GET", "HEAD"):
            async with session.request(method, envoy.url + "/health") as reply:
                assert (reply.status, await reply.read()) == (200, b"")
        (tmp_path / "pool.yaml").write_text(_not_ready(ready))
        for _ in range(200):  # the file source settles for 0.5 s before it applies
            if not epp.datastore.endpoints:
                break
            await asyncio.sleep(0.02)
        assert not epp.datastore.endpoints
        async with session.get(envoy.url + "/health") as reply:
            assert reply.status == 503
            assert reply.headers["content-type"] == "application/json"
            error = orjson.loads(await reply.read())["error"]
        assert error == {
            "message": "no ready endpoint in the pool",
            "type": "ServiceUnavailable",
            "code": 503,
        }
        async with session.head(envoy.url + "/health") as reply:
            assert (reply.status, await reply.read()) == (503, b"")
        refused = await post(session, envoy.url, {"model": "m", "prompt": "x"})
        assert refused.status == 503, refused.body
        assert refused.json["error"]["message"] == "no ready endpoint in the pool"
    assert not any(b.received for b in pool_backends)
