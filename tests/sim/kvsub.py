"""A test subscriber for vLLM's KV-event wire, written from vLLM's format (not from the
simulator's encoder): decodes both event encodings into dicts and keeps a per-pod view."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
import zmq.asyncio

# Field order of the positional (array_like) events before vLLM v0.26.
_ARRAY_FIELDS = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}  # fmt: skip
END = b"\xff" * 8


def decode_event(raw: Any) -> dict[str, Any]:
    """One event, map (``{"type": ...}``) or tagged array (``[tag, ...]``), as a dict."""
    if isinstance(raw, dict):
        return raw
    tag, *values = raw
    names = _ARRAY_FIELDS[tag]
    assert len(values) <= len(names), raw
    return {"type": tag, **dict(zip(names, values, strict=False))}


@dataclass
class Batch:
    """One received batch."""

    topic: bytes
    seq: int
    ts: float
    events: list[dict[str, Any]]
    rank: int | None
    raw_events: list[Any]


def decode_batch(topic: bytes, seq_bytes: bytes, payload: bytes) -> Batch:
    """``[topic, seq, payload]`` -> a Batch (the batch itself is ``[ts, events, rank?]``)."""
    assert len(seq_bytes) == 8
    body = msgpack.unpackb(payload, raw=False)
    assert isinstance(body, list), body
    assert 2 <= len(body) <= 3, body
    rank = body[2] if len(body) == 3 else None
    events = [decode_event(e) for e in body[1]]
    return Batch(topic, int.from_bytes(seq_bytes, "big"), body[0], events, rank, body[1])


@dataclass
class View:
    """What a subscriber knows of one pod's cache: hash -> the block's token ids."""

    blocks: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def apply(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "BlockStored":
            size = event["block_size"]
            tokens = event["token_ids"]
            hashes = event["block_hashes"]
            assert len(tokens) == size * len(hashes), event
            for i, h in enumerate(hashes):
                self.blocks[h] = tuple(tokens[i * size : (i + 1) * size])
        elif kind == "BlockRemoved":
            for h in event["block_hashes"]:
                del self.blocks[h]  # a removal of an unknown block would be a publisher bug
        else:
            assert kind == "AllBlocksCleared"
            self.blocks.clear()


class Subscriber:
    """SUB connected (or bound) to publishers; collects batches until told to stop."""

    def __init__(self, endpoint: str, *, bind: bool = False, topic: bytes = b"") -> None:
        self.ctx = zmq.asyncio.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        if bind:
            self.sub.bind(endpoint)
            last = self.sub.getsockopt(zmq.LAST_ENDPOINT)
            assert isinstance(last, bytes)
            self.endpoint = last.decode()
        else:
            self.sub.connect(endpoint)
            self.endpoint = endpoint
        self.batches: list[Batch] = []

    async def settle(self, seconds: float = 0.3) -> None:
        """Touch the socket for ``seconds``: libzmq attaches a newly connected PUB, and sends it
        this SUB's subscription, only when the application calls into the socket; until then
        that PUB drops what it publishes (ZeroMQ's slow joiner)."""
        for _ in range(int(seconds / 0.01)):
            self.sub.getsockopt(zmq.EVENTS)
            await asyncio.sleep(0.01)

    async def drain(self, quiet: float = 0.3) -> list[Batch]:
        """Receive until nothing arrives for ``quiet`` seconds; return everything so far."""
        while True:
            try:
                frames = await asyncio.wait_for(self.sub.recv_multipart(), quiet)
            except TimeoutError:
                return self.batches
            assert len(frames) == 3, frames
            self.batches.append(decode_batch(*frames))

    def close(self) -> None:
        self.sub.close(0)


async def replay(endpoint: str, start: int, *, legacy: bool) -> list[Batch]:
    """Ask a replay ROUTER for every batch from ``start`` (a REQ-framed DEALER request)."""
    ctx = zmq.asyncio.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    out: list[Batch] = []
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 2.0)
            assert frames[0] == b"", frames  # the REQ delimiter
            frames = frames[1:]
            if legacy:
                seq, payload = frames
                if seq == END:
                    assert payload == b""
                    return out
                out.append(decode_batch(b"", seq, payload))
            else:
                topic, seq, payload = frames
                if seq == END:
                    assert topic == b""
                    assert payload == b""
                    return out
                out.append(decode_batch(topic, seq, payload))
    finally:
        dealer.close(0)
