"""The parent-worker channel: frames round-trip, EOF and bad frames end the channel."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator

import pytest

from endpoint_picker.datastore import Datastore
from endpoint_picker.datastore.objects import ClusterState, InferenceModel, InferencePool, Pod
from endpoint_picker.settings import Settings
from endpoint_picker.types import Criticality, Endpoint, MetricsSnapshot
from endpoint_picker.workers.messages import (
    Ask,
    ChannelClosed,
    Init,
    MetricsUpdate,
    PoolUpdate,
    encode,
    pack_pool,
    read_message,
    unpack_pool,
)


def cluster() -> ClusterState:
    pool = InferencePool(
        "pool", "ns", "inference.networking.x-k8s.io/v1alpha2", (("a", "b"),), (8000,)
    )
    model = InferenceModel("m", "ns", "m", Criticality.CRITICAL, (), "pool", None, 0)
    pods = tuple(Pod(f"p{i}", "ns", (("a", "b"),), f"127.0.0.{i}", True) for i in (2, 3))
    return ClusterState(pools=(pool,), models=(model,), pods=pods)


@contextlib.asynccontextmanager
async def channel() -> AsyncIterator[tuple[asyncio.StreamReader, socket.socket]]:
    """A reader on one end of a socketpair, and the other end to write raw bytes on."""
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    try:
        with theirs:
            yield reader, theirs
    finally:
        writer.close()
        await writer.wait_closed()


async def test_messages_round_trip_through_a_socketpair() -> None:
    """Init, a pool update and a metrics batch arrive equal, in order, from one stream."""
    state = Datastore().apply(cluster())
    endpoint = state.endpoints[0]
    messages = [
        Init(Settings(), 1, 2, 64, (b"key", b"chain"), None),
        PoolUpdate(pack_pool(state), ((endpoint.hostport, 0),)),
        MetricsUpdate(((endpoint, MetricsSnapshot(waiting_queue_size=3, updated_at=5.0)),)),
        Ask(7, "metrics"),
    ]
    async with channel() as (reader, theirs):
        theirs.sendall(b"".join(encode(m) for m in messages))
        received = [await read_message(reader) for _ in messages]
    assert received == messages
    update = received[1]
    assert isinstance(update, PoolUpdate)
    assert unpack_pool(update.state) == state


async def test_a_closed_channel_and_a_broken_frame_raise_channel_closed() -> None:
    """EOF mid-frame, an oversized length and an undecodable pickle all end the channel."""
    for raw in (
        encode(Ask(1, "x"))[:-2],
        struct.pack(">I", 1 << 30),
        struct.pack(">I", 3) + b"abc",
    ):
        async with channel() as (reader, theirs):
            theirs.sendall(raw)
            theirs.shutdown(socket.SHUT_WR)
            with pytest.raises(ChannelClosed):
                await read_message(reader)


def test_an_installed_pool_state_equals_the_applied_one() -> None:
    """A worker's datastore installs the parent's resolved pool: same endpoints and models."""
    parent, worker = Datastore(), Datastore()
    state = parent.apply(cluster())
    seen: list[tuple[Endpoint, ...]] = []
    worker.on_endpoints_changed(seen.append)
    worker.install(unpack_pool(pack_pool(state)))
    assert worker.endpoints == parent.endpoints
    assert worker.model("m") == parent.model("m")
    assert seen == [parent.endpoints]
