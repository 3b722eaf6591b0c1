"""precise-prefix-cache-scorer through the real ext_proc server: vLLM-format KV events from
real ZeroMQ publishers on the endpoints' addresses decide where a prompt goes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from tests.integration.test_informed_scheduling import settings_for
from tests.support.extproc import completion, lb_metadata, response_body
from tests.support.extproc import response_headers as response_headers_message
from tests.support.extproc import running_app as _running_app
from tests.support.kvevents import (
    Cleared,
    Publisher,
    Removed,
    Stored,
    build_tokenizer,
    eventually,
    free_port,
    publisher,
)
from tests.support.model_servers import FakeModelServer, fake_model_servers
from tokenizers import Tokenizer

import endpoint_picker.director as director_module
from endpoint_picker import prepared
from endpoint_picker.app import App
from endpoint_picker.kvevents.subscriber import KVEventsHub
from endpoint_picker.requests import LLMRequest
from endpoint_picker.settings import Settings

ADDRS = ["127.0.4.2", "127.0.4.3", "127.0.4.4"]
BLOCK = 4
CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-scorer
  parameters:
    tokenProcessorConfig: {{blockSize: {block}, hashSeed: "42"}}
    kvEventsConfig: {{socketPort: {port}}}
    {extra}
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: precise-prefix-cache-scorer
    weight: 10
  - pluginRef: queue-scorer
"""
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "answer", "haiku"]


def precise_settings(
    tmp_path: Path, servers: list[FakeModelServer], tokenizer: Path, port: int, extra: str = ""
) -> Settings:
    tmp_path.mkdir(parents=True, exist_ok=True)
    settings = settings_for(tmp_path, servers)
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(block=BLOCK, port=port, extra=extra))
    scheduling = replace(settings.scheduling, config_file=config, tokenizers=(("", tokenizer),))
    return replace(settings, scheduling=scheduling)


@contextlib.asynccontextmanager
async def precise_app(
    tmp_path: Path, replicas: int = 1, extra: str = ""
) -> AsyncIterator[tuple[list[tuple[App, Any]], list[Publisher], Tokenizer]]:
    """Three fake servers, a vLLM-format publisher on each one's address, and ``replicas``
    EPPs, each subscribed to every publisher on its own."""
    tokenizer_path = build_tokenizer(tmp_path / "tok")
    port = free_port(ADDRS[0])
    async with (
        fake_model_servers(ADDRS) as servers,
        contextlib.AsyncExitStack() as stack,
    ):
        publishers = [await stack.enter_async_context(publisher(a, port)) for a in ADDRS]
        apps = []
        for i in range(replicas):
            settings = precise_settings(tmp_path / f"epp{i}", servers, tokenizer_path, port, extra)
            apps.append(await stack.enter_async_context(_running_app(settings)))
            for p in publishers:
                await p.subscribed()
        yield apps, publishers, Tokenizer.from_file(str(tokenizer_path))


def hub_of(app: App) -> KVEventsHub:
    assert app.director is not None
    routing = app._parts.routing
    assert routing is not None
    assert routing.components.kv_events is not None
    return routing.components.kv_events


def hostport(app: App, address: str) -> str:
    return next(e.hostport for e in app.datastore.endpoints if e.address == address)


async def route(client: Any, prompt: str) -> str:
    out = await client.exchange(
        [*completion("crit", prompt), response_headers_message(), response_body(b"{}")]
    )
    return lb_metadata(out[0])


async def store(app: App, pub: Publisher, tokens: list[int], address: str) -> None:
    """Publish the prompt's full blocks as vLLM would (one BlockStored) and wait till indexed."""
    full = len(tokens) // BLOCK * BLOCK
    hashes = [bytes([i % 256]) * 32 for i in range(full // BLOCK)]
    await pub.send([Stored(hashes, None, tokens[:full], block_size=BLOCK)])
    hub = hub_of(app)
    await eventually(lambda: hub.index.blocks_of(address) >= full // BLOCK)


async def test_the_endpoint_holding_the_longest_prefix_gets_the_request(tmp_path: Path) -> None:
    """B holds the whole prompt, C half of it, A nothing: every request goes to B; once B's
    blocks are evicted (BlockRemoved), C, holding the longest prefix left, gets them."""
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(60))
    async with precise_app(tmp_path) as ([(app, client)], pubs, tok):
        tokens = tok.encode(prompt).ids
        await store(app, pubs[1], tokens, ADDRS[1])
        await store(app, pubs[2], tokens[: len(tokens) // 2], ADDRS[2])
        picks = {await route(client, prompt) for _ in range(5)}
        assert picks == {hostport(app, ADDRS[1])}
        await pubs[1].send([Removed([bytes([0]) * 32])])  # its first block: no prefix left
        await eventually(lambda: hub_of(app).index.blocks_of(ADDRS[1]) < len(tokens) // BLOCK)
        picks = {await route(client, prompt) for _ in range(5)}
        assert picks == {hostport(app, ADDRS[2])}
        exported = app.metrics.render().decode()
        assert "inference_extension_kv_events_total 3.0" in exported


async def test_the_status_page_shows_each_pods_kv_event_subscription(tmp_path: Path) -> None:
    """/api/status's endpoint rows show each pod's KV-event subscription: blocks indexed,
    events received, a gap rebuilt, the last event's age; a silent pod has none yet."""
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(60))
    async with precise_app(tmp_path) as ([(app, _)], pubs, tok):
        tokens = tok.encode(prompt).ids
        await store(app, pubs[1], tokens, ADDRS[1])
        first, second = tokens[:BLOCK], tokens[BLOCK : 2 * BLOCK]
        await pubs[2].send([Stored([1], None, first, block_size=BLOCK)])
        await pubs[2].send([Stored([2], 1, second, block_size=BLOCK)], lose=True)
        await pubs[2].send([Stored([3], None, first, block_size=BLOCK)])  # after the rebuild
        await eventually(lambda: (hub_of(app).describe(ADDRS[2]) or {}).get("events") == 2)
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{app.ports.metrics}/api/status") as reply,
        ):
            rows = {e["address"]: e["kvEvents"] for e in (await reply.json())["endpoints"]}
    silent, holder, rebuilt = (rows[hostport(app, a)] for a in ADDRS)
    assert silent == {"state": "waiting", "blocks": 0, "events": 0, "replays": 0,
                      "rebuilds": 0, "lastEventAgeSeconds": None}  # fmt: skip
    assert (holder["state"], holder["blocks"], holder["events"]) == (
        "live",
        len(tokens) // BLOCK,
        1,
    )
    assert 0 <= holder["lastEventAgeSeconds"] < 5
    assert (rebuilt["blocks"], rebuilt["events"], rebuilt["rebuilds"]) == (1, 2, 1)


@pytest.mark.parametrize(("extra", "expected_waits"), [
    ("prefixStoreConfig: {cacheSize: 0}", 1), ("prefixStoreConfig: {cacheSize: 1000}", 0),
])  # fmt: skip
async def test_a_long_prompt_is_tokenized_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: str, expected_waits: int
) -> None:
    """Without the prefix store, a prompt past inlineBytes waits for a thread (once: then its
    hashes are cached); with it, no request waits (its leading blocks decide while a thread
    tokenizes it whole); either way it routes by its real prefix."""
    waits: list[str] = []

    def recorded(request: LLMRequest, *args: Any) -> Any:
        waits.append(request.request_id)
        return prepared.after_work(request, *args)

    monkeypatch.setattr(director_module, "after_work", recorded)
    prompt = " ".join(WORDS[(i * 3) % len(WORDS)] for i in range(2000))  # about 10 KB
    async with precise_app(tmp_path, extra=extra) as ([(app, client)], pubs, tok):
        tokens = tok.encode(prompt).ids
        await store(app, pubs[2], tokens, ADDRS[2])
        picks = {await route(client, prompt) for _ in range(3)}
        assert picks == {hostport(app, ADDRS[2])}
    assert len(waits) == expected_waits


async def test_replicas_subscribed_on_their_own_route_alike(tmp_path: Path) -> None:
    """Two EPP replicas hear the same events, so they send every prompt to the endpoint
    that holds it, without a word between them; an eviction moves both."""
    prompts = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(40)) for i in range(6)]
    async with precise_app(tmp_path, replicas=2) as (apps, pubs, tok):
        for i, prompt in enumerate(prompts):
            tokens = tok.encode(prompt).ids
            full = len(tokens) // BLOCK * BLOCK
            hashes = [i * 1000 + b for b in range(full // BLOCK)]
            await pubs[i % 3].send([Stored(hashes, None, tokens[:full], block_size=BLOCK)])
        for app, _ in apps:
            hub = hub_of(app)
            await eventually(lambda h=hub: h.index.size == sum(
                len(tok.encode(p).ids) // BLOCK for p in prompts))  # fmt: skip
        for i, prompt in enumerate(prompts):
            holder = hostport(apps[0][0], ADDRS[i % 3])
            assert [await route(client, prompt) for _, client in apps] == [holder, holder]
        await pubs[0].send([Cleared()])  # the first server's cache reset...
        tokens = tok.encode(prompts[0]).ids
        before = hub_of(apps[0][0]).index.blocks_of(ADDRS[1])
        await pubs[1].send([Stored([7], None, tokens[:BLOCK], block_size=BLOCK)])  # ...B has 1
        for app, _ in apps:
            await eventually(
                lambda a=app: (
                    hub_of(a).index.blocks_of(ADDRS[0]) == 0
                    and hub_of(a).index.blocks_of(ADDRS[1]) == before + 1
                )
            )
        holder = hostport(apps[0][0], ADDRS[1])
        assert [await route(client, prompts[0]) for _, client in apps] == [holder, holder]
