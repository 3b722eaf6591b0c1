"""KV-cache events over real ZeroMQ sockets on 127.0.0.x, decoded by a subscriber written from
vLLM's wire format (``kvsub``), checked against the simulator's own cache."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import aiohttp
import msgpack
import pytest
from tokenizers import Tokenizer

from endpoint_picker.bench.tokenizer import build_tokenizer
from endpoint_picker_sim.cluster import running_servers
from endpoint_picker_sim.config import KvEventsConfig, ServerConfig, SimConfig, Wire
from endpoint_picker_sim.kvevents import BlockRemoved, BlockStored, encode_batch, wire_hash
from endpoint_picker_sim.kvpublisher import KvEventPublisher
from endpoint_picker_sim.server import SimServer
from endpoint_picker_sim.tokenids import approx_token_ids
from endpoint_picker_sim.tokenizer import render_chat

from .builders import prompt, server_config
from .conftest import serving
from .kvsub import Subscriber, View, decode_batch, replay

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
HOST = "127.0.0.2"


def kv_config(wire: Wire = "current", **overrides: object) -> KvEventsConfig:
    """Bind on an ephemeral port of the server's address, replay likewise."""
    base = KvEventsConfig(
        endpoint="tcp://*:*", replay_endpoint="tcp://*:*", topic="kv@${POD_IP}@m", wire=wire
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


def events_server(wire: Wire = "current", **engine: object) -> ServerConfig:
    return replace(server_config(**engine), kv_events=kv_config(wire))


async def complete(http: aiohttp.ClientSession, url: str, text: str, max_tokens: int = 2) -> None:
    body = {"model": MODEL, "prompt": text, "max_tokens": max_tokens}
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` every 5 ms for up to 5 s (the engine's state has no event to wait on)."""
    async with asyncio.timeout(5.0):
        while not condition():  # noqa: ASYNC110 - polled state, nothing to await
            await asyncio.sleep(0.005)


async def subscribed(server: SimServer) -> Subscriber:
    """A subscriber connected to ``server``'s PUB, past ZeroMQ's slow-joiner window."""
    assert server.publisher is not None
    sub = Subscriber(server.publisher.endpoint)
    await asyncio.sleep(0.2)
    return sub


@pytest.mark.parametrize("wire", ["current", "legacy"])
async def test_event_stream_mirrors_the_cache_through_evictions(
    wire: Wire, http: aiohttp.ClientSession
) -> None:
    """Stored/removed events, applied in seq order, rebuild exactly the blocks the server caches,
    with the prompts' token ids, through evictions; seqs run 0, 1, 2, ... without a gap."""
    async with serving(events_server(wire, num_gpu_blocks=40), HOST) as server:
        sub = await subscribed(server)
        try:
            texts = [prompt(160, seed) for seed in "abcdefgh"]  # 10 blocks each, 40 in the cache
            for text in texts:
                await complete(http, server.url, text)
            batches = await sub.drain()
        finally:
            sub.close()
    assert [b.seq for b in batches] == list(range(len(batches)))
    assert all(b.topic == f"kv@{HOST}@m".encode() and b.rank == 0 for b in batches)
    events = [e for b in batches for e in b.events]
    assert any(e["type"] == "BlockRemoved" for e in events), "the small cache must evict"
    view = View()
    for event in events:
        view.apply(event)
    cached = {wire_hash(h) for h in server.engine.blocks.cached_hashes()}
    assert set(view.blocks) == cached
    # Every stored block is a 16-token slice of one of the prompts, at a block boundary.
    slices = {
        tuple(ids[i : i + 16])
        for ids in map(approx_token_ids, texts)
        for i in range(0, len(ids) - 15, 16)
    }
    assert set(view.blocks.values()) <= slices
    first = next(e for e in events if e["type"] == "BlockStored")
    assert first["parent_block_hash"] is None
    assert first["token_ids"][:16] == approx_token_ids(texts[0])[:16]
    raw = batches[0].raw_events[0]
    assert isinstance(raw, dict if wire == "current" else list)


async def test_replay_returns_the_missed_batches_from_a_bounded_buffer() -> None:
    """A replay request for seq k gets batches k.. still buffered, with the topic, then the end
    marker; the buffer keeps only the last ``buffer_steps`` batches."""
    pub = KvEventPublisher(kv_config(buffer_steps=4), HOST, 0, 1)
    pub.start()
    try:
        for i in range(6):
            pub.publish([BlockRemoved((i,))])
        assert pub.replay_endpoint is not None
        got = await replay(pub.replay_endpoint, 3, legacy=False)
        assert [b.seq for b in got] == [3, 4, 5]
        assert [b.events[0]["block_hashes"] for b in got] == [[3], [4], [5]]
        assert {b.topic for b in got} == {f"kv@{HOST}@m".encode()}
        everything = await replay(pub.replay_endpoint, 0, legacy=False)
        assert [b.seq for b in everything] == [2, 3, 4, 5]
    finally:
        await pub.stop()


async def test_legacy_replay_frames_have_no_topic() -> None:
    """Before vLLM v0.26 a replayed batch was ``[seq, payload]`` and the end ``[END, b""]``."""
    pub = KvEventPublisher(kv_config("legacy"), HOST, 0, 1)
    pub.start()
    try:
        pub.publish([BlockRemoved((7,))])
        assert pub.replay_endpoint is not None
        got = await replay(pub.replay_endpoint, 0, legacy=True)
        assert [(b.seq, b.raw_events) for b in got] == [(0, [["BlockRemoved", [7], "GPU", 0]])]
    finally:
        await pub.stop()


async def test_reset_prefix_cache_announces_all_blocks_cleared(
    http: aiohttp.ClientSession,
) -> None:
    """POST /reset_prefix_cache empties the cache and publishes AllBlocksCleared; the subscriber's
    view then matches the (empty) cache."""
    async with serving(events_server(), HOST) as server:
        sub = await subscribed(server)
        try:
            await complete(http, server.url, prompt(64, "r"))
            async with http.post(f"{server.url}/reset_prefix_cache") as resp:
                assert resp.status == 200
            batches = await sub.drain()
        finally:
            sub.close()
    assert server.engine.blocks.num_cached == 0
    assert batches[-1].events == [{"type": "AllBlocksCleared"}]
    view = View()
    for event in (e for b in batches for e in b.events):
        view.apply(event)
    assert view.blocks == {}


async def test_reset_with_running_requests_preempts_them_and_they_still_finish(
    http: aiohttp.ClientSession,
) -> None:
    """A reset under load is refused (blocks in use) unless reset_running_requests=true, which
    preempts the running requests; they recompute and complete."""
    config = events_server(time_scale=1.0)
    async with serving(config, HOST) as server:
        task = asyncio.create_task(complete(http, server.url, prompt(64, "s"), max_tokens=60))
        await until(lambda: bool(server.engine.running))
        async with http.post(f"{server.url}/reset_prefix_cache") as resp:
            assert resp.status == 200
        await asyncio.sleep(0.05)
        assert server.engine.blocks.num_cached > 0  # refused: the running request holds blocks
        url = f"{server.url}/reset_prefix_cache?reset_running_requests=true"
        async with http.post(url) as resp:
            assert resp.status == 200
        await asyncio.sleep(0.05)
        assert server.engine.stats.preemptions >= 1
        await asyncio.wait_for(task, 5)  # recomputed, then finished with a 200


async def test_connect_mode_every_pod_to_one_bound_subscriber(
    http: aiohttp.ClientSession,
) -> None:
    """With a connect endpoint every pod of ``--servers 2`` connects to one subscriber that binds;
    topics ``kv@<pod-ip>@<model>`` tell them apart, each with its own seqs from 0."""
    sub = Subscriber("tcp://127.0.0.1:*", bind=True)
    kv = kv_config(endpoint=sub.endpoint, topic=f"kv@${{POD_IP}}@{MODEL}")
    sim = SimConfig(server=replace(server_config(), kv_events=kv), servers=2, port=0)
    try:
        async with running_servers(sim) as servers:
            assert not any(s.publisher is None or s.publisher.binds for s in servers)
            await sub.settle()
            for server in servers:
                await complete(http, server.url, prompt(48, "c"))
            batches = await sub.drain()
    finally:
        sub.close()
    by_topic: dict[bytes, list[int]] = {}
    for b in batches:
        by_topic.setdefault(b.topic, []).append(b.seq)
    topics = {f"kv@127.0.0.{i}@{MODEL}".encode() for i in (2, 3)}
    assert set(by_topic) == topics
    assert all(seqs == list(range(len(seqs))) for seqs in by_topic.values())


async def test_a_tokenizer_file_puts_its_token_ids_on_the_wire(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """With --tokenizer the prompt's tokens and the stored events' token ids are the tokenizer's."""
    path = build_tokenizer(tmp_path)  # the bench's BPE
    text = "the cache routes the request to the server " * 6
    ids = Tokenizer.from_file(str(path)).encode(text).ids
    config = replace(events_server(), tokenizer=str(path))
    async with serving(config, HOST) as server:
        sub = await subscribed(server)
        try:
            body = {"model": MODEL, "prompt": text, "max_tokens": 1}
            async with http.post(f"{server.url}/v1/completions", json=body) as resp:
                usage = (await resp.json())["usage"]
            batches = await sub.drain()
        finally:
            sub.close()
    assert usage["prompt_tokens"] == len(ids)
    stored = [e for b in batches for e in b.events if e["type"] == "BlockStored"]
    assert stored
    assert stored[0]["token_ids"] == ids[: len(stored[0]["token_ids"])]
    assert len(stored[0]["token_ids"]) == 16 * (len(ids) // 16)


async def test_chat_prompts_are_rendered_then_tokenized_without_special_tokens(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """A chat request's ids are the tokenizer's encoding of the Llama-3-style rendering (which
    holds the BOS), without the tokenizer's own special tokens, as vLLM tokenizes chat."""
    path = build_tokenizer(tmp_path)  # the bench's BPE
    messages = [("system", "the cache routes the request " * 4), ("user", "a prefix of tokens")]
    ids = Tokenizer.from_file(str(path)).encode(render_chat(messages), add_special_tokens=False).ids
    async with serving(replace(events_server(), tokenizer=str(path)), HOST) as server:
        sub = await subscribed(server)
        try:
            body = {"model": MODEL, "max_tokens": 1,
                    "messages": [{"role": r, "content": c} for r, c in messages]}  # fmt: skip
            async with http.post(f"{server.url}/v1/chat/completions", json=body) as resp:
                assert (await resp.json())["usage"]["prompt_tokens"] == len(ids)
            batches = await sub.drain()
        finally:
            sub.close()
    stored = next(e for b in batches for e in b.events if e["type"] == "BlockStored")
    assert stored["token_ids"] == ids[: 16 * (len(ids) // 16)]


def test_map_encoding_is_vllm_0_26s_tagged_map() -> None:
    """A stored LoRA block in the current encoding: a map led by "type", unsigned 64-bit hashes,
    the LoRA name as each block's extra key, the sliding window omitted (its default)."""
    ev = BlockStored((-1, 5), None, tuple(range(4)), 2, lora_id=1, lora_name="sql")
    body = msgpack.unpackb(encode_batch(1.5, [ev], "map"), raw=False)
    assert body[0] == 1.5
    assert body[2] == 0
    assert list(body[1][0].items()) == [
        ("type", "BlockStored"),
        ("block_hashes", [2**64 - 1, 5]),
        ("parent_block_hash", None),
        ("token_ids", [0, 1, 2, 3]),
        ("block_size", 2),
        ("lora_id", 1),
        ("medium", "GPU"),
        ("lora_name", "sql"),
        ("extra_keys", [["sql"], ["sql"]]),
        ("group_idx", 0),
        ("kv_cache_spec_kind", "full_attention"),
    ]


def test_array_encoding_is_the_legacy_positional_union() -> None:
    """The legacy encoding: ``[tag, block_hashes, parent, token_ids, block_size, lora_id, medium,
    lora_name, extra_keys, group_idx, kind]``, decoded by position."""
    ev = BlockStored((3,), 2, (9, 9), 2)
    batch = decode_batch(b"t", (0).to_bytes(8, "big"), encode_batch(2.0, [ev], "array"))
    assert batch.raw_events == [
        ["BlockStored", [3], 2, [9, 9], 2, None, "GPU", None, [None], 0, "full_attention"]
    ]
    assert batch.events[0]["parent_block_hash"] == 2


async def test_the_oracle_counts_a_prefix_another_server_holds(
    http: aiohttp.ClientSession,
) -> None:
    """sim:prefix_cache_oracle_hits counts the longest prefix cached anywhere in the fleet: a
    prompt served by pod 0 and then sent to pod 1 misses on pod 1 but hits in the oracle."""
    sim = SimConfig(server=server_config(), servers=2, port=0)
    text = prompt(160, "o")
    async with running_servers(sim) as servers:
        await complete(http, servers[0].url, text)
        await complete(http, servers[1].url, text)
    second = servers[1].engine.stats
    assert second.prefix_hits == 0
    assert second.oracle_hits == 144  # 9 full blocks: the last token is always computed


async def test_restart_loses_the_cache_silently_and_restarts_the_sequence(
    http: aiohttp.ClientSession,
) -> None:
    """POST /sim/restart behaves as a crashed vLLM: in-flight requests fail, the cache empties
    with no event, and the next batch is seq 0 again (a subscriber must notice the seq reset)."""
    async with serving(events_server(time_scale=1.0), HOST) as server:
        sub = await subscribed(server)
        try:
            await complete(http, server.url, prompt(64, "x"))
            body = {"model": MODEL, "prompt": prompt(64, "y"), "max_tokens": 500}
            inflight = asyncio.create_task(http.post(f"{server.url}/v1/completions", json=body))
            await until(lambda: bool(server.engine.running))
            async with http.post(f"{server.url}/sim/restart") as resp:
                assert resp.status == 200
            async with await inflight as resp:
                assert resp.status == 503
            assert server.engine.blocks.num_cached == 0
            await complete(http, server.url, prompt(64, "z"))
            batches = await sub.drain()
        finally:
            sub.close()
    seqs = [b.seq for b in batches]
    # The in-flight request's prompt blocks may or may not have been announced before the crash.
    restart = max(i for i, seq in enumerate(seqs) if seq == 0)
    assert restart > 0
    assert seqs == [*range(restart), *range(len(seqs) - restart)]
    after = batches[restart:]
    assert all(e["type"] != "AllBlocksCleared" for b in batches for e in b.events)
    view = View()
    for event in (e for b in after for e in b.events):
        view.apply(event)
    assert set(view.blocks) == {wire_hash(h) for h in server.engine.blocks.cached_hashes()}


@pytest.mark.parametrize(
    ("endpoint", "bound"),
    [("tcp://*:5557", True), ("tcp://[::]:5557", True), ("tcp://10.0.0.1:5557", False),
     ("tcp://${POD_IP}:5557", False), ("ipc:///tmp/kv", True)],
)  # fmt: skip
def test_a_wildcard_endpoint_binds_on_the_servers_address(endpoint: str, bound: bool) -> None:
    """vLLM's rule on the endpoint as configured: `tcp://*:5557` (`--kv-events-port`) binds,
    on the server's own address, though the resolved endpoint has no wildcard left."""
    pub = KvEventPublisher(KvEventsConfig(endpoint=endpoint), "127.0.3.9", 0, 1)
    assert pub.binds is bound
    if endpoint == "tcp://*:5557":
        assert pub.endpoint == "tcp://127.0.3.9:5557"
