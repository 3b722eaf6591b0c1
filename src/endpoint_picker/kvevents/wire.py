"""vLLM's KV-cache events as they arrive: ZeroMQ frames, msgpack batches, three event kinds.

What vLLM publishes (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``): every engine step
that changed the prefix cache sends one multipart message on a PUB socket,
``[topic, seq, payload]``: the topic as UTF-8 (``""`` by default; llm-d deployments set
``kv@<pod-ip>@<model>``), ``seq`` a counter from 0 as 8 bytes big-endian, and the payload a
msgspec msgpack ``KVEventBatch(ts, events, data_parallel_rank)`` whose events are

- ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window)``: full
  blocks just cached, ``token_ids`` being ``len(block_hashes) * block_size`` tokens chained on
  ``parent_block_hash`` (None for a prompt's first block);
- ``BlockRemoved(block_hashes, medium, group_idx)``: blocks evicted;
- ``AllBlocksCleared()``: the prefix cache was reset.

Two encodings exist, and this module reads both, each part by its own msgpack type: before
v0.26 the structs were ``array_like`` (a batch ``[ts, events, rank]``, an event
``["BlockStored", hashes, parent, ...]`` with trailing defaults omitted); since, they are maps
(``{"ts": ..., "events": [...]}``, an event ``{"type": "BlockStored", "block_hashes": ...}``,
fields equal to their defaults omitted). A block hash is an int (older vLLM's, or
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``: the low 64 bits of the sha256) or bytes (the sha256
digest, the default since vLLM hashes blocks as bytes); both are kept as they came, opaque.

Anything that does not fit raises ``KVEventsError`` naming what is wrong; an event of a kind
this module does not know (a later vLLM's) is skipped, counted in ``EventBatch.unknown``.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgpack

from endpoint_picker.errors import KVEventsError, clip

EngineHash = int | bytes  # a block hash as vLLM sent it: opaque, only compared
MAX_HASH_BYTES = 64  # sha256 is 32; anything longer is not a block hash
_U64 = 1 << 64
_I64_MIN = -(1 << 63)
TOKEN_ARRAY = "I" if array("I").itemsize == 4 else "L"  # token ids: unsigned 32-bit

BLOCK_STORED = "BlockStored"
BLOCK_REMOVED = "BlockRemoved"
ALL_BLOCKS_CLEARED = "AllBlocksCleared"

# Each struct's fields in declaration order: the positional (array_like) encoding's order.
_FIELDS: dict[str, tuple[str, ...]] = {
    BLOCK_STORED: (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    BLOCK_REMOVED: ("block_hashes", "medium", "group_idx"),
    ALL_BLOCKS_CLEARED: (),
}  # fmt: skip
_REQUIRED = {BLOCK_STORED: 4, BLOCK_REMOVED: 1, ALL_BLOCKS_CLEARED: 0}
_BATCH_FIELDS = ("ts", "events", "data_parallel_rank")


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: array[int]  # len(block_hashes) * block_size tokens
    block_size: int
    lora_name: str | None
    medium: str | None
    # per block: the extra keys vLLM hashed besides the tokens (LoRA name, cache salt,
    # multimodal hashes), None where there are none
    extra_keys: tuple[tuple[object, ...] | None, ...] | None
    group_idx: int | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[EngineHash, ...]
    medium: str | None
    group_idx: int | None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None
    unknown: int = 0  # events of a kind not known here, skipped


@dataclass(frozen=True, slots=True)
class Message:
    """One PUB message: its topic, sequence number and payload (not yet decoded)."""

    topic: str
    seq: int
    payload: bytes


def split_frames(frames: Sequence[bytes], max_bytes: int) -> Message:
    """``[topic, seq, payload]`` as published; ``KVEventsError`` for any other shape."""
    if len(frames) != 3:
        raise KVEventsError(f"a KV-events message has 3 frames, got {len(frames)}")
    topic, seq, payload = frames
    if len(seq) != 8:
        raise KVEventsError(f"the sequence frame is 8 bytes, got {len(seq)}")
    if len(payload) > max_bytes:
        raise KVEventsError(f"payload of {len(payload)} bytes is over the {max_bytes} limit")
    try:
        text = bytes(topic).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KVEventsError("the topic is not UTF-8") from exc
    return Message(text, int.from_bytes(seq, "big"), bytes(payload))


def decode_batch(payload: bytes) -> EventBatch:
    """A ``KVEventBatch`` in either encoding; ``KVEventsError`` when it is not one."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise KVEventsError(f"payload is not msgpack: {clip(str(exc))}") from exc
    fields = _fields(raw, _BATCH_FIELDS, "batch")
    ts = fields.get("ts")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise KVEventsError(f"batch.ts must be a number, got {_kind(ts)}")
    events = fields.get("events")
    if not isinstance(events, list):
        raise KVEventsError(f"batch.events must be an array, got {_kind(events)}")
    rank = _optional_int(fields.get("data_parallel_rank"), "batch.data_parallel_rank")
    decoded: list[Event] = []
    unknown = 0
    for i, item in enumerate(events):
        event = _event(item, f"events[{i}]")
        if event is None:
            unknown += 1
        else:
            decoded.append(event)
    return EventBatch(float(ts), tuple(decoded), rank, unknown)


def _event(item: object, where: str) -> Event | None:
    if isinstance(item, list):  # tagged positional: [tag, field, field, ...]
        if not item or not isinstance(item[0], str):
            raise KVEventsError(f"{where}: a positional event starts with its type name")
        tag, values = item[0], item[1:]
        names = _FIELDS.get(tag)
        if names is None:
            return None
        if len(values) < _REQUIRED[tag]:
            raise KVEventsError(
                f"{where} ({tag}): needs {_REQUIRED[tag]} fields, got {len(values)}"
            )
        fields: Mapping[str, object] = dict(zip(names, values, strict=False))
    elif isinstance(item, dict):  # a map keyed by field name, its type under "type"
        named = item.get("type")
        if not isinstance(named, str):
            raise KVEventsError(f"{where}: a map event names its type under 'type'")
        tag = named
        if tag not in _FIELDS:
            return None
        fields = item
        for name in _FIELDS[tag][: _REQUIRED[tag]]:
            if name not in fields:
                raise KVEventsError(f"{where} ({tag}): no '{name}'")
    else:
        raise KVEventsError(f"{where}: an event is an array or a map, got {_kind(item)}")
    where = f"{where} ({tag})"
    if tag == BLOCK_STORED:
        return _stored(fields, where)
    if tag == BLOCK_REMOVED:
        return BlockRemoved(
            _hashes(fields.get("block_hashes"), where),
            _optional_str(fields.get("medium"), f"{where}.medium"),
            _optional_int(fields.get("group_idx"), f"{where}.group_idx"),
        )
    return AllBlocksCleared()


def _stored(fields: Mapping[str, object], where: str) -> BlockStored:
    hashes = _hashes(fields.get("block_hashes"), where)
    parent_raw = fields.get("parent_block_hash")
    parent = None if parent_raw is None else _hash(parent_raw, f"{where}.parent_block_hash")
    size = fields.get("block_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise KVEventsError(f"{where}.block_size must be a positive integer, got {_kind(size)}")
    raw_tokens = fields.get("token_ids")
    if not isinstance(raw_tokens, list):
        raise KVEventsError(f"{where}.token_ids must be an array, got {_kind(raw_tokens)}")
    try:
        tokens = array(TOKEN_ARRAY, raw_tokens)
    except (TypeError, OverflowError) as exc:
        raise KVEventsError(f"{where}.token_ids must be token ids (0 to 2^32-1)") from exc
    if len(tokens) != len(hashes) * size:
        raise KVEventsError(
            f"{where}: {len(tokens)} token ids for {len(hashes)} blocks of {size} tokens"
        )
    extra = fields.get("extra_keys")
    extra_keys: tuple[tuple[object, ...] | None, ...] | None = None
    if extra is not None:
        if not isinstance(extra, list) or len(extra) != len(hashes):
            raise KVEventsError(f"{where}.extra_keys must be an array, one entry per block")
        extra_keys = tuple(None if e is None else _extra(e, where) for e in extra)
    return BlockStored(
        hashes,
        parent,
        tokens,
        size,
        _optional_str(fields.get("lora_name"), f"{where}.lora_name"),
        _optional_str(fields.get("medium"), f"{where}.medium"),
        extra_keys,
        _optional_int(fields.get("group_idx"), f"{where}.group_idx"),
    )


def _extra(entry: object, where: str) -> tuple[object, ...]:
    if not isinstance(entry, list):
        raise KVEventsError(f"{where}.extra_keys: an entry is an array or nil")
    return tuple(tuple(e) if isinstance(e, list) else e for e in entry)


def _fields(raw: object, names: tuple[str, ...], what: str) -> Mapping[str, object]:
    if isinstance(raw, list):
        return dict(zip(names, raw, strict=False))
    if isinstance(raw, dict):
        return raw
    raise KVEventsError(f"a {what} is an array or a map, got {_kind(raw)}")


def _hashes(raw: object, where: str) -> tuple[EngineHash, ...]:
    if not isinstance(raw, list):
        raise KVEventsError(f"{where}.block_hashes must be an array, got {_kind(raw)}")
    return tuple(_hash(h, f"{where}.block_hashes") for h in raw)


def _hash(raw: object, where: str) -> EngineHash:
    if isinstance(raw, bytes) and 0 < len(raw) <= MAX_HASH_BYTES:
        return raw
    if isinstance(raw, int) and not isinstance(raw, bool) and _I64_MIN <= raw < _U64:
        return raw
    raise KVEventsError(f"{where}: a block hash is an integer or 1-64 bytes, got {_kind(raw)}")


def _optional_int(raw: object, where: str) -> int | None:
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise KVEventsError(f"{where} must be an integer or nil, got {_kind(raw)}")
    return raw


def _optional_str(raw: object, where: str) -> str | None:
    if raw is None or isinstance(raw, str):
        return raw
    raise KVEventsError(f"{where} must be a string or nil, got {_kind(raw)}")


def _kind(value: object) -> str:
    return "nil" if value is None else type(value).__name__
