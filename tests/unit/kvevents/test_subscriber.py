"""The subscriptions over real ZeroMQ sockets on 127.0.0.x: following the pool, both socket
modes, gaps repaired by replay or by a rebuild, restarts, malformed messages, dead publishers."""

from __future__ import annotations

import asyncio
import contextlib
from array import array
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from tests.support.kvevents import Removed, Stored, eventually, free_port, publisher

from endpoint_picker.kvevents.feeds import KVEventsConfig
from endpoint_picker.kvevents.index import BlockHasher, BlockIndex
from endpoint_picker.kvevents.subscriber import KVEventsHub
from endpoint_picker.types import Endpoint

A, B = "127.0.3.2", "127.0.3.3"
TOKENS = list(range(1, 13))  # three blocks of four


@dataclass
class Recorder:
    """The hub's observer: what it reported (the EPP's metrics implement the same calls)."""

    events: int = 0
    errors: list[str] = field(default_factory=list)
    gaps: list[bool] = field(default_factory=list)

    def kv_events_received(self, events: int) -> None:
        self.events += events

    def kv_events_error(self, kind: str) -> None:
        self.errors.append(kind)

    def kv_events_gap(self, repaired: bool) -> None:
        self.gaps.append(repaired)

    def track_kv_index(self, size: Callable[[], float], endpoints: Callable[[], float]) -> None:
        pass


def endpoint(address: str) -> Endpoint:
    return Endpoint(f"pod-{address}", "default", address, 8000)


def held(hub: KVEventsHub, pod: str, tokens: list[int] = TOKENS) -> int:
    """How many leading blocks of ``tokens`` the index says ``pod`` holds."""
    keys = hub.index.hasher.chain(hub.index.hasher.root(None), array("I", tokens))
    return hub.index.longest_prefix(keys, [pod])[pod]


def blocks(i: int) -> Stored:
    """Block i of TOKENS, chained on block i-1 (engine hashes 100+i)."""
    return Stored([100 + i], None if i == 0 else 100 + i - 1, TOKENS[4 * i : 4 * i + 4])


@contextlib.asynccontextmanager
async def running(
    config: KVEventsConfig, *pods: str
) -> AsyncIterator[tuple[KVEventsHub, Recorder]]:
    recorder = Recorder()
    index = BlockIndex(BlockHasher(4), max_blocks=1000, max_blocks_per_endpoint=1000)
    hub = KVEventsHub(config, index, observer=recorder)
    hub.set_endpoints([endpoint(p) for p in pods])
    task = asyncio.create_task(hub.run())
    try:
        yield hub, recorder
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_each_pod_is_subscribed_and_its_blocks_indexed() -> None:
    """Connect mode: one SUB per pod at tcp://<pod-ip>:<port>; events land under that pod."""
    port = free_port(A)
    async with (
        publisher(A, port) as pa,
        publisher(B, port, era="array") as pb,
        running(KVEventsConfig(port=port), A, B) as (hub, recorder),
    ):
        await pa.subscribed()
        await pb.subscribed()
        await pa.send([blocks(0), blocks(1)])
        await pb.send([blocks(0)])
        await eventually(lambda: held(hub, A) == 2 and held(hub, B) == 1)
        await pa.send([Removed([101])])
        await eventually(lambda: held(hub, A) == 1)
        assert recorder.events == 4


async def test_a_gap_is_repaired_by_the_replay_socket() -> None:
    """A lost message (seq 1) is asked for from seq 1 on the ROUTER and applied in order."""
    port, replay = free_port(A), free_port(A)
    async with (
        publisher(A, port, replay_port=replay) as pa,
        running(KVEventsConfig(port=port, replay_port=replay), A) as (hub, recorder),
    ):
        await pa.subscribed()
        await pa.send([blocks(0)])
        await pa.send([blocks(1)], lose=True)
        await pa.send([blocks(2)])
        await eventually(lambda: held(hub, A) == 3)
        assert pa.replay_requests == [1]
        assert recorder.gaps == [True]
        shown = hub.describe(A)
        assert shown is not None
        assert (shown["replays"], shown["rebuilds"], shown["events"]) == (1, 0, 3)


async def test_a_gap_without_replay_rebuilds_the_view_from_new_events() -> None:
    """Without a replay socket the pod's view is dropped (a lost BlockRemoved could leave
    blocks it no longer holds) and what follows is indexed again."""
    port = free_port(A)
    async with (
        publisher(A, port) as pa,
        running(KVEventsConfig(port=port), A) as (hub, recorder),
    ):
        await pa.subscribed()
        await pa.send([blocks(0), blocks(1)])
        await eventually(lambda: held(hub, A) == 2)
        await pa.send([Removed([101])], lose=True)
        await pa.send([Stored([7], None, [9, 9, 9, 9])])
        await eventually(lambda: recorder.gaps == [False])
        assert held(hub, A) == 0
        assert held(hub, A, [9, 9, 9, 9]) == 1


async def test_the_first_message_asks_for_what_the_publisher_buffered() -> None:
    """Subscribing to a running server: the replay from 0 brings its earlier blocks."""
    port, replay = free_port(A), free_port(A)
    async with publisher(A, port, replay_port=replay) as pa:
        await pa.send([blocks(0)], lose=True)  # before the EPP subscribed
        async with running(KVEventsConfig(port=port, replay_port=replay), A) as (hub, _):
            await pa.subscribed()
            await pa.send([blocks(1)])
            await eventually(lambda: held(hub, A) == 2)
            assert pa.replay_requests == [0]


async def test_a_sequence_going_back_is_a_restarted_server() -> None:
    """Seq back to 0: the server restarted with an empty cache; the old view goes."""
    port = free_port(A)
    async with publisher(A, port) as pa, running(KVEventsConfig(port=port), A) as (hub, _):
        await pa.subscribed()
        await pa.send([blocks(0), blocks(1)])
        await pa.send([blocks(2)])
        await eventually(lambda: held(hub, A) == 3)
        pa.seq = 0
        await pa.send([Stored([1], None, [9, 9, 9, 9])])
        await eventually(lambda: held(hub, A, [9, 9, 9, 9]) == 1)
        assert held(hub, A) == 0


async def test_malformed_messages_are_counted_and_the_subscriber_goes_on() -> None:
    """Bad frames and bad payloads are logged and counted; the next good message applies."""
    port = free_port(A)
    async with (
        publisher(A, port) as pa,
        running(KVEventsConfig(port=port), A) as (hub, recorder),
    ):
        await pa.subscribed()
        await pa.send_raw([b"", b"\0"])
        await pa.send_raw([b"", (0).to_bytes(8, "big"), b"\xc1not msgpack"])
        pa.seq = 1
        await pa.send([blocks(0)])
        await eventually(lambda: held(hub, A) == 1)
        assert recorder.errors == ["decode", "decode"]


async def test_a_pod_that_leaves_loses_its_subscription_and_blocks() -> None:
    """Removed from the pool: its socket closes and nothing of it stays in the index."""
    port = free_port(A)
    async with publisher(A, port) as pa, running(KVEventsConfig(port=port), A, B) as (hub, _):
        await pa.subscribed()
        await pa.send([blocks(0)])
        await eventually(lambda: held(hub, A) == 1)
        hub.set_endpoints([endpoint(B)])
        assert held(hub, A) == 0
        await eventually(lambda: A not in hub._subscriptions)
        await pa.send([blocks(1)])  # no longer heard
        await asyncio.sleep(0.1)
        assert hub.index.endpoints == frozenset()


async def test_a_dead_publisher_ages_out() -> None:
    """Disconnected past deadAfter: its blocks stop counting, and the status page says so."""
    port = free_port(A)
    config = KVEventsConfig(port=port, dead_after=0.2, sweep_interval=0.05)
    async with running(config, A) as (hub, _):
        async with publisher(A, port) as pa:  # it ends first: that is the test
            await pa.subscribed()
            await pa.send([blocks(0)])
            await eventually(lambda: held(hub, A) == 1)
            assert (hub.describe(A) or {}).get("state") == "live"
        await eventually(lambda: held(hub, A) == 0)
        await eventually(lambda: (hub.describe(A) or {}).get("state") == "dead")


async def test_bind_mode_reads_the_pod_from_the_topic() -> None:
    """Every pod connects to the EPP's socket and names itself in kv@<pod-ip>@<model>;
    a topic naming no pod of the pool is ignored."""
    config = KVEventsConfig(bind_endpoint="tcp://127.0.0.1:*")
    async with running(config, A) as (hub, recorder):
        await eventually(lambda: hub.bound_port != 0)
        async with (
            publisher("127.0.0.1", hub.bound_port, topic=f"kv@{A}@m", connect=True) as pa,
            publisher("127.0.0.1", hub.bound_port, topic="kv@10.9.9.9@m", connect=True) as px,
        ):
            await pa.subscribed()
            await px.subscribed()
            await px.send([blocks(0)])
            await pa.send([blocks(0), blocks(1)])
            await eventually(lambda: held(hub, A) == 2 and recorder.errors == ["unknown_topic"])
            assert hub.index.endpoints == frozenset({A})


async def test_a_silent_pod_ages_out_when_asked() -> None:
    """silenceTimeout: nothing heard that long and the pod's blocks stop counting."""
    config = KVEventsConfig(bind_endpoint="tcp://127.0.0.1:*", silence_timeout=0.2,
                            sweep_interval=0.05)  # fmt: skip
    async with running(config, A) as (hub, _):
        await eventually(lambda: hub.bound_port != 0)
        async with publisher("127.0.0.1", hub.bound_port, topic=f"kv@{A}@m", connect=True) as pa:
            await pa.subscribed()
            await pa.send([blocks(0)])
            await eventually(lambda: held(hub, A) == 1)
            await eventually(lambda: held(hub, A) == 0)


def test_config_defaults_match_vllm_and_llm_d() -> None:
    """Port 5557 as vLLM's default endpoint and llm-d's socketPort; no topic filter."""
    config = KVEventsConfig()
    assert (config.port, config.topic_filter, config.bind_endpoint) == (5557, "", "")
    assert replace(config, replay_port=5558).replay_port == 5558


async def test_a_message_over_the_size_limit_is_refused_and_the_subscription_goes_on() -> None:
    """ZeroMQ drops the connection of a publisher sending past maxMessageBytes (nothing of it
    is read); the SUB socket reconnects and the next messages are indexed."""
    port = free_port(A)
    async with (
        publisher(A, port) as pa,
        running(KVEventsConfig(port=port, max_message_bytes=2048), A) as (hub, _),
    ):
        await pa.subscribed()
        small = Stored([1], None, [7] * 4)
        await pa.send_raw([b"", (0).to_bytes(8, "big"), b"\x00" * 4096])
        await pa.subscribed()  # dropped, then back
        pa.seq = 1
        await pa.send([small])
        await eventually(lambda: held(hub, A, [7] * 4) == 1)
