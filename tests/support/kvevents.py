"""vLLM's KV-cache event publishing, for the tests: msgpack as msgspec writes it (both
encodings), a real ZeroMQ PUB socket with vLLM's framing and its replay ROUTER, and a small BPE
tokenizer built in-process.

The encoding follows ``vllm/distributed/kv_events.py``: ``KVEventBatch(ts, events,
data_parallel_rank=None)`` and tagged event structs with ``omit_defaults``; before v0.26 every
struct was ``array_like`` (``[tag, field, ...]``, trailing defaults dropped), since then maps
(``{"type": tag, field: value}``, default-valued fields dropped; fields without a default are
always written, nil or not).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgpack
import zmq
import zmq.asyncio

Era = Literal["map", "array"]
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class Stored:
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int = 4
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list[Any] | None = None  # default None: omitted
    group_idx: int | None = None  # default None: omitted


@dataclass(frozen=True)
class Removed:
    block_hashes: list[Any]
    medium: str | None = "GPU"
    group_idx: int | None = None


@dataclass(frozen=True)
class Cleared:
    pass


# (name, has a default) in declaration order, as vLLM declares them
_STORED = [("block_hashes", False), ("parent_block_hash", False), ("token_ids", False),
           ("block_size", False), ("lora_id", False), ("medium", False), ("lora_name", False),
           ("extra_keys", True), ("group_idx", True)]  # fmt: skip
_REMOVED = [("block_hashes", False), ("medium", False), ("group_idx", True)]


def _struct(tag: str, values: list[tuple[str, bool, Any]], era: Era) -> Any:
    if era == "array":
        out: list[Any] = [tag, *(v for _, _, v in values)]
        while len(out) > 1 and values[len(out) - 2][1] and out[-1] is None:
            out.pop()  # omit_defaults drops trailing fields equal to their default
        return out
    mapped: dict[str, Any] = {"type": tag}
    for name, has_default, value in values:
        if not (has_default and value is None):
            mapped[name] = value
    return mapped


def event(ev: Stored | Removed | Cleared, era: Era) -> Any:
    if isinstance(ev, Stored):
        return _struct("BlockStored", [(n, d, getattr(ev, n)) for n, d in _STORED], era)
    if isinstance(ev, Removed):
        return _struct("BlockRemoved", [(n, d, getattr(ev, n)) for n, d in _REMOVED], era)
    return ["AllBlocksCleared"] if era == "array" else {"type": "AllBlocksCleared"}


def batch(
    events: Sequence[Stored | Removed | Cleared],
    era: Era = "map",
    *,
    ts: float = 1_700_000_000.5,
    rank: int | None = None,
    event_era: Era | None = None,
) -> bytes:
    """A ``KVEventBatch`` payload; ``event_era`` encodes the events differently from the batch."""
    encoded = [event(e, event_era or era) for e in events]
    if era == "array":
        body: Any = [ts, encoded] if rank is None else [ts, encoded, rank]
    else:
        body = {"ts": ts, "events": encoded}
        if rank is not None:
            body["data_parallel_rank"] = rank
    return msgpack.packb(body, use_bin_type=True)


@dataclass
class Publisher:
    """vLLM's ``ZmqEventPublisher``: a PUB socket (bound, or connected in bind mode), numbered
    messages, a buffer of them, and the replay ROUTER serving ``[b"", start]`` requests."""

    ctx: zmq.asyncio.Context
    pub: zmq.asyncio.Socket
    topic: bytes = b""
    era: Era = "map"
    replay: zmq.asyncio.Socket | None = None
    seq: int = 0
    buffer: list[tuple[int, bytes]] = field(default_factory=list)
    replay_requests: list[int] = field(default_factory=list)

    async def send(
        self, events: Sequence[Stored | Removed | Cleared], *, lose: bool = False
    ) -> int:
        """Publish one batch (``lose``: numbered and buffered, never sent: a lost message)."""
        payload = batch(events, self.era)
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if not lose:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def subscribed(self, within: float = 5.0) -> None:
        """Wait until a subscriber's subscription arrived (messages before it are lost);
        unsubscriptions (a subscriber gone) are passed over."""
        async with asyncio.timeout(within):
            while (await self.pub.recv())[:1] != b"\x01":
                pass

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    async def serve_replay(self) -> None:
        assert self.replay is not None
        while True:
            frames = await self.replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            for seq, payload in self.buffer:
                if seq >= first:
                    await self.replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            await self.replay.send_multipart([client, b"", END_SEQ, b""])


@contextlib.asynccontextmanager
async def publisher(
    address: str,
    port: int,
    *,
    replay_port: int = 0,
    topic: str = "",
    era: Era = "map",
    connect: bool = False,
) -> AsyncIterator[Publisher]:
    """A publisher bound on ``address:port`` (or connected to it, ``connect``)."""
    ctx = zmq.asyncio.Context()
    # XPUB: on the wire the same as vLLM's PUB, and it tells when a subscriber is in
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not only the first
    if connect:
        pub.connect(f"tcp://{address}:{port}")
    else:
        pub.bind(f"tcp://{address}:{port}")
    replay = None
    if replay_port:
        replay = ctx.socket(zmq.ROUTER)
        replay.setsockopt(zmq.LINGER, 0)
        replay.bind(f"tcp://{address}:{replay_port}")
    p = Publisher(ctx, pub, topic.encode(), era, replay)
    task = asyncio.create_task(p.serve_replay()) if replay is not None else None
    try:
        yield p
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        ctx.destroy(linger=0)


async def eventually(check: Callable[[], bool], within: float = 5.0) -> None:
    """Wait until ``check()`` holds (AssertionError after ``within`` seconds)."""
    deadline = asyncio.get_running_loop().time() + within
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on ``address`` now (bound by zmq's own random-port search)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    try:
        return sock.bind_to_random_port(f"tcp://{address}", min_port=20000, max_port=60000)
    finally:
        sock.close(linger=0)
        ctx.term()


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "system",
    "user",
    "assistant",
    "answer",
    "haiku",
    "prompt",
    "cache",
    "block",
    "token",
    "server",
    "model",
    "request",
]


def build_tokenizer(directory: Path, *, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """A small byte-level BPE trained here, saved as ``directory/tokenizer.json`` with a
    ``tokenizer_config.json`` (its chat template) beside it; returns the tokenizer's path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(40)) for i in range(200)]
    special = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=special, show_progress=False)
    )
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    config: dict[str, Any] = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return path
