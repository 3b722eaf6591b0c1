"""The status page in a real browser (Debian's headless Chromium) against a running EPP.

The page runs under its own content policy (no eval), so every wait is a function, not a
string expression.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import grpc
from playwright.async_api import Page
from tests.integration.test_precise_prefix import ADDRS, BLOCK, WORDS, hostport, precise_app, store
from tests.support.browser import chromium_page
from tests.support.extproc import body, headers, json_body, response_body, response_headers
from tests.support.metrics_auth import DATA_PATHS, READERS, kubernetes_epp
from tests.support.status import PROMPT_MARKER, StatusStack, status_stack

from endpoint_picker.settings import MetricsAuth, MetricsEndpointSettings

WAIT_MS = 5000


async def open_page(page: Page, stack: StatusStack, url: str | None = None) -> None:
    """Load the page and wait for a second update: the page refreshes itself in place."""
    await page.goto(url or f"{stack.base_url}/")
    await two_updates(page)


async def two_updates(page: Page) -> None:
    updates = "seen => Number(document.body.dataset.updated) > seen"
    await page.wait_for_function(updates, arg=0, timeout=WAIT_MS)
    seen = int(await page.get_attribute("body", "data-updated") or 0)
    await page.wait_for_function(updates, arg=seen, timeout=WAIT_MS)


async def row_texts(page: Page, table: str) -> list[str]:
    return await page.locator(f"#{table} tbody tr").all_inner_texts()


async def addresses(page: Page) -> list[str]:
    return await page.eval_on_selector_all(
        "#endpoints tbody tr", "rows => rows.map(r => r.dataset.address)"
    )


async def test_page_shows_each_pods_kv_event_subscription(tmp_path: Path) -> None:
    """With a precise-prefix-cache-scorer, the endpoint table's "KV events" column shows the
    blocks indexed and events received for a pod that published, and "no events yet" for
    one that did not."""
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(60))
    async with precise_app(tmp_path) as ([(app, _)], pubs, tok):
        tokens = tok.encode(prompt).ids
        await store(app, pubs[1], tokens, ADDRS[1])
        async with chromium_page(tmp_path / "chromium") as page:
            await page.goto(f"http://127.0.0.1:{app.ports.metrics}/")
            await two_updates(page)
            cell = '#endpoints tr[data-address="{}"] td:last-child'
            holder = await page.text_content(cell.format(hostport(app, ADDRS[1]))) or ""
            silent = await page.text_content(cell.format(hostport(app, ADDRS[0])))
    assert holder.startswith(f"{len(tokens) // BLOCK} blocks, 1 events, last "), holder
    assert holder.endswith(" ago"), holder
    assert silent == "no events yet"


async def test_page_shows_pool_endpoints_in_flight_and_decisions(tmp_path: Path) -> None:
    """The page shows the pool, each endpoint's queue, running requests, KV usage, adapters
    and state (the unscraped one marked stale), a request in flight, and the decisions with
    their scores or error; it updates itself; no prompt reaches its DOM."""
    async with status_stack(tmp_path) as stack:
        await stack.wait_scraped(2)
        await stack.complete("food-review")
        await stack.refused("no-such-model")
        # one request routed and not finished: in flight until its stream ends
        call = stack.client.stub.Process()
        request = {"model": "base", "prompt": f"still going {PROMPT_MARKER}"}
        await call.write(headers())
        await call.write(body(json_body(request)))
        await call.read()
        try:
            async with chromium_page(tmp_path / "chromium") as page:
                await open_page(page, stack)
                await page.screenshot(path=tmp_path / "status-page.png", full_page=True)
                assert await page.text_content("#pool-name") == "default/pool"
                assert await page.text_content("#ready") == "ready"
                assert await page.text_content("#sum-endpoints") == "3"
                assert await page.text_content("#sum-inflight") == "1"
                assert await page.text_content("#sum-stale") == "1"
                models = await row_texts(page, "models")
                assert any("food-v1 80% (weight 80)" in m for m in models), models
                busy, idle, silent = stack.servers
                rows = await row_texts(page, "endpoints")
                assert await addresses(page) == [busy.hostport, idle.hostport, silent.hostport]
                cells = [r.split("\t") for r in rows]
                # pod, address, engine, queue, running, in flight, KV, adapters, age, state
                assert cells[0][3:5] == ["2", "3"]
                assert cells[0][6].strip() == "42.0%"
                assert cells[0][7] == "food-v1 (1/4 slots)"
                assert cells[0][9] == "ok"
                # no predictor, no KV events
                assert cells[2][8:] == ["never", "stale: never scraped", "\u2013", "\u2013"]
                assert (
                    await page.get_attribute(
                        f'#endpoints tr[data-address="{silent.hostport}"]', "class"
                    )
                    == "stale"
                )
                assert sum(int(c[5]) for c in cells) == 1  # the open request, on one endpoint
                decisions = await row_texts(page, "decisions")
                assert len(decisions) == 3
                newest, refused, routed = decisions
                assert "base" in newest
                assert "404 NotFound: model 'no-such-model' is not served" in refused
                assert "food-review \u2192 food-v" in routed
                assert "passed the filters" in routed
                assert "kv-cache-utilization" in routed  # a scorer's share is shown
                assert PROMPT_MARKER not in await page.content()
                assert PROMPT_MARKER not in await page.inner_text("body")
        finally:
            await call.done_writing()
            while await call.read() is not grpc.aio.EOF:
                pass
    assert (tmp_path / "status-page.png").stat().st_size > 10_000


async def test_page_follows_endpoints_that_come_and_go_without_reloading(tmp_path: Path) -> None:
    """A pod added to and one removed from the pool file appear and disappear on the open
    page within seconds, the rows that stay are the same DOM nodes, the page never reloads,
    and an endpoint whose scrapes start failing turns stale."""
    async with status_stack(tmp_path, serving=2) as stack:
        first, second, third = stack.servers
        third.metrics_status = 200  # scrapes fine once it joins
        await stack.wait_scraped(2)
        async with chromium_page(tmp_path / "chromium") as page:
            await open_page(page, stack)
            assert await addresses(page) == [first.hostport, second.hostport]
            await page.evaluate("window.loadedOnce = true")
            kept = await page.query_selector(f'tr[data-address="{second.hostport}"]')
            assert kept is not None

            stack.set_pool([second, third])
            await page.wait_for_function(
                """wanted => {
                    const rows = [...document.querySelectorAll('#endpoints tbody tr')];
                    return rows.map(r => r.dataset.address).join() === wanted &&
                        rows[1].querySelector('td.state').textContent === 'ok';
                }""",
                arg=f"{second.hostport},{third.hostport}",
                timeout=WAIT_MS,
            )
            assert await page.evaluate("window.loadedOnce") is True
            assert await kept.evaluate("row => row.isConnected") is True
            assert await page.text_content("#sum-endpoints") == "2"

            second.metrics_status = 500  # its last metrics age past the 2 s threshold
            await page.wait_for_function(
                "a => document.querySelector(`tr[data-address='${a}']`).className === 'stale'",
                arg=second.hostport,
                timeout=WAIT_MS,
            )
            assert await page.text_content("#sum-stale") == "1"
            await page.screenshot(path=tmp_path / "status-page-changed.png", full_page=True)


async def test_page_shows_an_ejected_endpoint_and_until_when(tmp_path: Path) -> None:
    """An endpoint whose five responses were 503s shows as ejected on its row (until when,
    its failures in a row and the last kind) and counts among the unhealthy endpoints."""
    async with status_stack(tmp_path, serving=2) as stack:
        first, second, _ = stack.servers
        await stack.wait_scraped(2)
        request = {"model": "base", "prompt": "hello"}
        answer = [response_headers(status=503), response_body(b"{}")]
        for _ in range(5):  # Envoy's 503s for a pod that resets: the subset hint picks it
            await stack.client.exchange(
                [headers(subset=[second.hostport]), body(json_body(request)), *answer]
            )
        async with chromium_page(tmp_path / "chromium") as page:
            await open_page(page, stack)
            selector = f'#endpoints tr[data-address="{second.hostport}"]'
            assert await page.get_attribute(selector, "class") == "ejected"
            state = await page.text_content(f"{selector} td.state") or ""
            assert state.startswith("ejected until "), state
            assert "5 failures in a row, last 5xx; ejection 1" in state, state
            assert await page.text_content(f'tr[data-address="{first.hostport}"] td.state') == "ok"
            assert await page.text_content("#sum-stale") == "1"


# -- with a token required (--metrics-endpoint-auth, --metrics-token-file) ----------------------

TOKEN = "operator-token.with+symbols/="


def token_file_auth(tmp_path: Path) -> MetricsEndpointSettings:
    tokens = tmp_path / "metrics-token"
    tokens.write_text(f"{TOKEN}\n")
    return MetricsEndpointSettings(auth=MetricsAuth.TOKEN_FILE, token_file=tokens)


async def test_page_takes_the_token_from_the_address_as_the_readme_says(tmp_path: Path) -> None:
    """Opened as http://localhost:9090/#token=TOKEN (docs/status-page.md), the page sends the
    token as a bearer token with its fetches and updates as usual; the token leaves the address
    bar at once (the fragment never reaches the server), and a reload of the tab keeps working
    (sessionStorage)."""
    async with status_stack(tmp_path, metrics_endpoint=token_file_auth(tmp_path)) as stack:
        stack.token = TOKEN
        await stack.wait_scraped(2)
        await stack.complete("food-review")
        async with chromium_page(tmp_path / "chromium") as page:
            await open_page(page, stack, f"{stack.base_url}/#token={quote(TOKEN, safe='')}")
            assert page.url == f"{stack.base_url}/"
            assert await page.text_content("#pool-name") == "default/pool"
            assert await page.text_content("#sum-endpoints") == "3"
            assert await page.is_hidden("#auth")
            assert len(await row_texts(page, "decisions")) == 1
            await page.reload()
            await two_updates(page)
            assert await page.get_attribute("body", "data-state") == "ok"
            await page.screenshot(path=tmp_path / "status-page-token.png", full_page=True)


async def test_page_without_a_token_asks_for_one_and_says_when_it_is_refused(
    tmp_path: Path,
) -> None:
    """Opened without a token the page shows the token form (the 401 it got is the only error
    in the console), says so when a wrong token is pasted, and shows the pool once the right
    one is; the form then hides."""
    async with (
        status_stack(tmp_path, metrics_endpoint=token_file_auth(tmp_path)) as stack,
        chromium_page(tmp_path / "chromium", expected=("status of 401",)) as page,
    ):
        await page.goto(f"{stack.base_url}/")
        await page.wait_for_selector("#auth", state="visible", timeout=WAIT_MS)
        assert await page.get_attribute("body", "data-state") == "unauthorized"
        assert "bearer token" in (await page.text_content("#auth-message") or "")
        assert await page.get_attribute("body", "data-updated") == "0"
        await page.screenshot(path=tmp_path / "status-page-sign-in.png", full_page=True)

        await page.fill("#token-input", "not-the-token")
        await page.click("#auth button")
        await page.wait_for_function(
            "() => document.getElementById('auth-message').textContent"
            ".includes('not accepted (401)')",
            timeout=WAIT_MS,
        )
        await page.fill("#token-input", TOKEN)
        await page.click("#auth button")
        await two_updates(page)
        assert await page.is_hidden("#auth")
        assert await page.text_content("#pool-name") == "default/pool"


async def test_page_with_a_kubernetes_token_403_then_one_the_rbac_allows(tmp_path: Path) -> None:
    """Kubernetes mode, as an operator does it: a token of a ServiceAccount without the
    metrics-reader role gets the form saying 403 and why; a new #token= pasted into the same
    tab (no reload) for a ServiceAccount bound to the role shows the status."""
    async with kubernetes_epp(tmp_path, address="127.0.8.19") as (api, base):
        api.add_token("t-dev", "system:serviceaccount:default:dev")
        api.add_token("t-reader", "system:serviceaccount:default:reader", (READERS,))
        api.grant(READERS, *DATA_PATHS)
        async with chromium_page(tmp_path / "chromium", expected=("status of 403",)) as page:
            await page.goto(f"{base}/#token=t-dev")
            await page.wait_for_selector("#auth", state="visible", timeout=WAIT_MS)
            message = await page.text_content("#auth-message") or ""
            assert "not accepted (403)" in message
            assert "dev may not get /api/status" in message
            assert await page.get_attribute("body", "data-state") == "forbidden"
            await page.evaluate("location.hash = 'token=t-reader'")
            await two_updates(page)
            assert await page.text_content("#pool-name") == "default/pool"
            assert await page.is_hidden("#auth")
            assert page.url == f"{base}/"


async def test_page_shows_bidi_and_control_characters_in_a_model_name_escaped(
    tmp_path: Path,
) -> None:
    """A model name carrying a right-to-left override, an isolate and a newline shows on the
    page as typed, with each of them as a visible ``\\u`` escape: nothing after the override
    is reordered, and the row holds no bidi control."""
    evil = "gpt\u202eexe.txt\u2067\n!"
    async with status_stack(tmp_path) as stack:
        await stack.refused(evil)
        async with chromium_page(tmp_path / "chromium") as page:
            await open_page(page, stack)
            (row,) = await row_texts(page, "decisions")
            assert "gpt\\u202eexe.txt\\u2067\\u000a!" in row
            assert not any(c in row for c in "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068")
