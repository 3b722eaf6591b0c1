"""vLLM's KV-cache events: the three event kinds, the batch, and both msgpack encodings.

vLLM (``vllm/distributed/kv_events.py``) declares the events as msgspec structs and encodes each
per-step ``KVEventBatch`` with ``msgspec.msgpack``:

- the batch is ``array_like``: ``[ts, [event, ...], data_parallel_rank]`` (``ts`` a float64 of
  wall time; the rank is omitted when None, and the publisher sets it, to 0 on a single rank);
- an event is a tagged union (``tag=True``, ``omit_defaults=True``). Up to v0.25 it was
  ``array_like`` too: ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind]``, trailing fields at
  their default omitted. Since vllm-project/vllm#42892 (v0.26) it is a map whose first key is
  ``"type"``: ``{"type": "BlockStored", "block_hashes": ..., ...}``, fields at their default
  (``None``) omitted unless they have no default (``lora_id``, ``medium``, ``lora_name``).

Block hashes are unsigned 64-bit integers, as vLLM sends them by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``: the low 8 bytes of the sha256 block hash). The
simulator's are its own chained hashes (not vLLM's sha256 values): a consumer must key blocks by
their token ids, never by the publisher's hash.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

MEDIUM_GPU = "GPU"
# vLLM's KVCacheSpecKind for a plain decoder's attention layers (one KV-cache group, index 0).
FULL_ATTENTION = "full_attention"
_U64 = (1 << 64) - 1

Encoding = Literal["map", "array"]
ENCODINGS: tuple[Encoding, ...] = ("map", "array")


def wire_hash(block_hash: int) -> int:
    """The simulator's signed 64-bit chained hash as vLLM's unsigned 64-bit wire value."""
    return block_hash & _U64


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks became cached, in chain order: ``parent`` is the hash of the block before the
    first one (None at the start of a prompt), ``token_ids`` their tokens, block after block."""

    block_hashes: tuple[int, ...]
    parent: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks were evicted (vLLM sends one event per evicted block)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The prefix cache was reset: every block this publisher announced is gone."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _stored_fields(ev: BlockStored) -> list[tuple[str, Any]]:
    # extra_keys: one entry per block, the keys vLLM folds into the block hash besides the
    # tokens; for a LoRA request the adapter's name (a 1-tuple), otherwise None.
    extra = (ev.lora_name,) if ev.lora_name is not None else None
    return [
        ("block_hashes", [wire_hash(h) for h in ev.block_hashes]),
        ("parent_block_hash", None if ev.parent is None else wire_hash(ev.parent)),
        ("token_ids", list(ev.token_ids)),
        ("block_size", ev.block_size),
        ("lora_id", ev.lora_id),
        ("medium", MEDIUM_GPU),
        ("lora_name", ev.lora_name),
        ("extra_keys", [extra] * len(ev.block_hashes)),
        ("group_idx", 0),
        ("kv_cache_spec_kind", FULL_ATTENTION),
        # kv_cache_spec_sliding_window: None (its default) for full attention, so omitted.
    ]


def _removed_fields(ev: BlockRemoved) -> list[tuple[str, Any]]:
    return [
        ("block_hashes", [wire_hash(h) for h in ev.block_hashes]),
        ("medium", MEDIUM_GPU),
        ("group_idx", 0),
    ]


def event_object(ev: KvEvent, encoding: Encoding) -> list[Any] | dict[str, Any]:
    """One event as msgspec would lay it out before packing."""
    tag = type(ev).__name__
    if isinstance(ev, BlockStored):
        fields = _stored_fields(ev)
    elif isinstance(ev, BlockRemoved):
        fields = _removed_fields(ev)
    else:
        fields = []
    if encoding == "map":
        return {"type": tag, **dict(fields)}
    return [tag, *(value for _, value in fields)]


def encode_batch(
    ts: float, events: Sequence[KvEvent], encoding: Encoding, data_parallel_rank: int = 0
) -> bytes:
    """A ``KVEventBatch`` payload: ``[ts, events, data_parallel_rank]`` in msgpack."""
    body = [float(ts), [event_object(ev, encoding) for ev in events], data_parallel_rank]
    return msgpack.packb(body, use_bin_type=True)
