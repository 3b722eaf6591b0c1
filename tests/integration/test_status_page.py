"""The metrics port: /api/status after real traffic, the page's files, and the HTTP probes."""

from __future__ import annotations

from pathlib import Path

import aiohttp
from tests.support.status import PROMPT_MARKER, status_stack


async def test_status_json_shows_pool_endpoints_and_decisions_and_never_a_prompt(
    tmp_path: Path,
) -> None:
    """After two routed requests and a refused one, /api/status lists the pool, its models,
    every endpoint with its metrics (the unscraped one stale), and the decisions newest first
    with the chosen endpoint's scores or the error; no prompt text anywhere."""
    async with status_stack(tmp_path) as stack:
        await stack.wait_scraped(2)
        await stack.complete("food-review")
        await stack.complete("base")
        await stack.refused("no-such-model")
        status = await stack.status()
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{stack.base_url}/api/status") as reply,
        ):
            raw = await reply.text()
            assert reply.headers["Cache-Control"] == "no-store"
    assert PROMPT_MARKER not in raw
    assert status["ready"] is True
    assert status["pool"]["name"] == "pool"
    assert status["refreshIntervalSeconds"] == stack.app.settings.scrape.refresh_interval > 0
    assert [(m["name"], m["criticality"]) for m in status["models"]] == [
        ("base", "Critical"),
        ("batch", "Sheddable"),
        ("food-review", "Standard"),
    ]
    assert [t["percent"] for t in status["models"][2]["targets"]] == [80.0, 20.0]
    first, second, third = status["endpoints"]
    assert (first["address"], first["waiting"], first["running"]) == (
        f"{stack.servers[0].hostport}",
        2,
        3,
    )
    assert (first["kvCacheUsage"], first["activeAdapters"]) == (0.42, ["food-v1"])
    assert first["stale"] is False
    assert first["metricsAgeSeconds"] < 2
    assert (third["stale"], third["metricsAgeSeconds"]) == (True, None)
    assert second["inFlight"] == first["inFlight"] == 0  # both requests finished
    refused, routed, older = status["decisions"]
    assert refused["error"]["status"] == 404
    assert refused["model"] == "no-such-model"
    assert routed["model"] == "base"
    assert older["model"] == "food-review"
    assert older["targetModel"] in {"food-v1", "food-v2"}
    healthy = {stack.servers[0].hostport, stack.servers[1].hostport}
    for decision in (routed, older):
        assert decision["error"] is None
        (endpoint,) = decision["endpoints"]
        assert endpoint in healthy
        assert decision["candidates"] == 3


async def test_page_and_its_files_are_served_with_a_strict_content_policy(
    tmp_path: Path,
) -> None:
    """/ is the page, its script and style sheet come from the package, other names 404."""
    async with status_stack(tmp_path, serving=1) as stack, aiohttp.ClientSession() as session:
        async with session.get(f"{stack.base_url}/") as reply:
            page = await reply.text()
            assert reply.content_type == "text/html"
            assert "default-src 'self'" in reply.headers["Content-Security-Policy"]
        assert 'src="static/status.js"' in page
        for name, kind in (("status.js", "text/javascript"), ("status.css", "text/css")):
            async with session.get(f"{stack.base_url}/static/{name}") as reply:
                assert reply.status == 200
                assert reply.content_type == kind
        for missing in ("/static/index.html", "/static/..%2Fserver.py", "/nope"):
            async with session.get(f"{stack.base_url}{missing}") as reply:
                assert reply.status == 404, missing


async def test_readyz_follows_readiness_and_healthz_stays_as_it_was(tmp_path: Path) -> None:
    """/readyz and /healthz answer 200 while the EPP is ready and 503 when it is not."""
    async with status_stack(tmp_path, serving=1) as stack, aiohttp.ClientSession() as session:
        for path, text in (("/readyz", "ready"), ("/healthz", "ok")):
            async with session.get(f"{stack.base_url}{path}") as reply:
                assert (reply.status, await reply.text()) == (200, text)
        await stack.app.health.set_ready(False)
        for path in ("/readyz", "/healthz"):
            async with session.get(f"{stack.base_url}{path}") as reply:
                assert (reply.status, await reply.text()) == (503, "not ready")
        assert (await stack.status())["ready"] is False


async def test_multi_megabyte_model_names_leave_the_status_small(tmp_path: Path) -> None:
    """40 requests with distinct 2 MB model names (refused: unknown) through the real ext_proc
    server leave /api/status under 100 KB, each name cut and shown once per decision."""
    async with status_stack(tmp_path) as stack:
        for i in range(40):
            await stack.refused(f"{i:02d}\u202e" + "m" * (2 * 1024 * 1024))
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{stack.base_url}/api/status") as reply,
        ):
            raw = await reply.read()
        status = await stack.status()
    assert len(raw) < 100_000
    assert len(status["decisions"]) == 40
    newest = status["decisions"][0]
    assert newest["model"].startswith("39\\u202emmm")
    assert "characters in all" in newest["model"]
    assert newest["error"]["status"] == 404
