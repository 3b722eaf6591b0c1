"""The parent-worker channel: messages round-trip whatever their size (split into frames), EOF
and bad frames end the channel, a worker's answer too large is trimmed, never fatal."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator

import pytest
import structlog.testing

from endpoint_picker.datastore import Datastore
from endpoint_picker.datastore.objects import ClusterState, InferenceModel, InferencePool, Pod
from endpoint_picker.settings import Settings
from endpoint_picker.types import Criticality, Endpoint, MetricsSnapshot
from endpoint_picker.workers import messages
from endpoint_picker.workers.link import WorkerLink
from endpoint_picker.workers.messages import (
    MAX_FRAME,
    Answer,
    Ask,
    ChannelClosed,
    Init,
    MessageTooLarge,
    MetricsUpdate,
    PoolUpdate,
    encode,
    encode_answer,
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


def send_soon(sock: socket.socket, data: bytes, then_close: bool = False) -> asyncio.Task[None]:
    """Write ``data`` on ``sock`` from the event loop (more than a socketpair buffers), then
    shut its write side when asked."""

    async def send() -> None:
        await asyncio.get_running_loop().sock_sendall(sock, data)
        if then_close:
            sock.shutdown(socket.SHUT_WR)

    sock.setblocking(False)
    return asyncio.create_task(send())


async def test_a_message_over_a_frame_is_split_and_read_back_whole() -> None:
    """An answer of 3.5 frames (a worker's decisions with long names, a large exposition) goes
    as frames of at most MAX_FRAME bytes and arrives whole, with the message after it."""
    big = Answer(1, [bytes([i]) * (MAX_FRAME // 2) for i in range(7)])
    frames = encode(big)
    headers, offset = [], 0
    while offset < len(frames):
        (word,) = struct.unpack_from(">I", frames, offset)
        headers.append(word)
        offset += 4 + (word & 0x7FFF_FFFF)
    assert len(headers) == 4
    assert all(h & 0x8000_0000 for h in headers[:-1])
    assert not headers[-1] & 0x8000_0000
    assert all(h & 0x7FFF_FFFF <= MAX_FRAME for h in headers)
    async with channel() as (reader, theirs):
        sent = send_soon(theirs, frames + encode(Ask(2, "m")))
        assert await read_message(reader) == big
        assert await read_message(reader) == Ask(2, "m")
        await sent


async def test_eof_at_a_message_boundary_says_so_a_cut_message_does_not() -> None:
    """The worker's exit (EOF between messages) is ``eof``; EOF inside a split message is not."""
    for raw, eof in ((b"", True), (encode(Answer(1, b"y" * (MAX_FRAME + 1)))[:-1], False)):
        async with channel() as (reader, theirs):
            sent = send_soon(theirs, raw, then_close=True)
            with pytest.raises(ChannelClosed) as caught:
                await read_message(reader)
            await sent
            assert caught.value.eof is eof


def test_a_message_past_the_limit_raises_for_the_sender_to_trim(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``encode`` refuses a message over MAX_MESSAGE with its size (here lowered to 1 MB)."""
    monkeypatch.setattr(messages, "MAX_MESSAGE", 1024 * 1024)
    monkeypatch.setattr(messages, "MAX_FRAME", 64 * 1024)
    with pytest.raises(MessageTooLarge) as caught:
        encode(Answer(1, b"z" * (2 * 1024 * 1024)))
    assert caught.value.size > 2 * 1024 * 1024
    assert len(encode(Answer(1, b"z" * 512 * 1024))) > 512 * 1024  # under it: split, sent


async def test_an_answer_too_large_is_trimmed_and_still_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past MAX_MESSAGE (lowered to 1 MB) a worker's decisions go as their newest half until
    they fit, an exposition as no answer: a frame is always sent, and it reads back."""
    monkeypatch.setattr(messages, "MAX_MESSAGE", 1024 * 1024)
    monkeypatch.setattr(messages, "MAX_FRAME", 64 * 1024)
    decisions = [{"model": f"{i}" + "d" * 100_000} for i in range(40)]
    frames = encode_answer(Ask(3, "decisions"), decisions)
    exposition = encode_answer(Ask(4, "metrics"), b"# HELP " + b"x" * (2 * 1024 * 1024))
    async with channel() as (reader, theirs):
        sent = send_soon(theirs, frames + exposition)
        trimmed = await read_message(reader)
        nothing = await read_message(reader)
        await sent
    assert isinstance(trimmed, Answer)
    assert trimmed.ask_id == 3
    assert 0 < len(trimmed.payload) < 40
    assert trimmed.payload == decisions[: len(trimmed.payload)]  # the newest ones
    assert nothing == Answer(4, None)


async def test_the_parent_logs_why_it_drops_a_worker_channel() -> None:
    """A link that reads an unreadable frame logs an error with the reason; a worker that
    exits (EOF between messages) is logged as a closed channel, not an error."""
    for raw, level, words in (
        (struct.pack(">I", 1 << 30), "error", "frame of 1073741824 bytes"),
        (b"", "info", ""),
    ):
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        link = WorkerLink(0, reader, writer, lambda index, serving: None)
        with theirs, structlog.testing.capture_logs() as logs:
            theirs.sendall(raw)
            theirs.shutdown(socket.SHUT_WR)
            await asyncio.wait_for(link.run(), 5)
            await link.close()
        (entry,) = [e for e in logs if e["event"].startswith(("dropping", "worker channel"))]
        assert entry["log_level"] == level
        assert words in entry.get("reason", "")
