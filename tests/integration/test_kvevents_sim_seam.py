"""The EPP's KV-events subscriber against the simulator's own publisher (``epp sim``'s
``KvEventPublisher``), over real ZeroMQ sockets, in both wires: where the two halves of the
precise prefix cache meet."""

from __future__ import annotations

import asyncio
import contextlib
from array import array
from collections.abc import AsyncIterator

import pytest
from tests.support.kvevents import eventually, free_port

from endpoint_picker.kvevents.feeds import KVEventsConfig
from endpoint_picker.kvevents.index import BlockHasher, BlockIndex
from endpoint_picker.kvevents.subscriber import KVEventsHub
from endpoint_picker.types import Endpoint
from endpoint_picker_sim.config import KvEventsConfig, Wire
from endpoint_picker_sim.kvevents import BlockStored
from endpoint_picker_sim.kvpublisher import KvEventPublisher

POD = "127.0.3.9"
BLOCK = 4


def stored(first: int) -> BlockStored:
    """One block of four token ids, ``first`` to ``first + 3``, a chain of its own."""
    return BlockStored((first,), None, tuple(range(first, first + BLOCK)), BLOCK)


def held(hub: KVEventsHub, first: int) -> bool:
    hasher = hub.index.hasher
    keys = hasher.chain(hasher.root(None), array("I", range(first, first + BLOCK)))
    return hub.index.longest_prefix(keys, [POD])[POD] == 1


@contextlib.asynccontextmanager
async def hub_on(port: int, replay: int) -> AsyncIterator[KVEventsHub]:
    index = BlockIndex(BlockHasher(BLOCK), max_blocks=100, max_blocks_per_endpoint=100)
    hub = KVEventsHub(KVEventsConfig(port=port, replay_port=replay), index)
    hub.set_endpoints([Endpoint("pod", "default", POD, 8000)])
    task = asyncio.create_task(hub.run())
    try:
        yield hub
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.timeout(15)
@pytest.mark.parametrize("wire", ["current", "legacy"])
async def test_subscribing_late_replays_what_the_simulator_published_before(wire: Wire) -> None:
    """A batch the simulator published before the EPP subscribed comes back through its replay
    socket, in either wire (the current one puts the topic before seq in replay answers)."""
    port, replay = free_port(POD), free_port(POD)
    config = KvEventsConfig(
        endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}",  # bound on POD
        topic="kv@${POD_IP}@m", wire=wire,
    )  # fmt: skip
    pub = KvEventPublisher(config, POD, 0, 1)
    pub.start()
    try:
        pub.publish([stored(1000)])  # nobody listens yet: only the replay buffer has it
        async with hub_on(port, replay) as hub:
            # publish until the hub hears one: its first message (seq > 0) asks for the rest
            for first in range(2000, 2000 + 4 * 200, 4):
                pub.publish([stored(first)])
                await asyncio.sleep(0.02)
                if held(hub, first):
                    break
            else:
                raise AssertionError("the subscriber never heard the publisher")
            await eventually(lambda: held(hub, 1000), within=3.0)
    finally:
        await pub.stop()
