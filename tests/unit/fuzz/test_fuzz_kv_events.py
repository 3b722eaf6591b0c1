"""Property-based fuzzing of the KV-event decoder and the index it feeds: whatever a publisher
sends, the decoder returns a batch or raises KVEventsError, and applying any decoded batch
keeps the index within its bounds."""

from __future__ import annotations

import contextlib
from typing import Any

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from endpoint_picker.errors import KVEventsError
from endpoint_picker.kvevents.index import BlockHasher, BlockIndex
from endpoint_picker.kvevents.wire import decode_batch

leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
    st.text(max_size=5), st.binary(max_size=40),
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
)  # fmt: skip
KEYS = st.sampled_from(["type", "block_hashes", "token_ids", "ts", "events"])
values = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(KEYS, inner, max_size=5),
    max_leaves=40,
)


def stored_event(draw: Any) -> list[Any]:
    blocks = draw(st.integers(0, 3))
    size = draw(st.sampled_from([2, 2, 2, 1]))  # mostly the index's; another is skipped
    return [
        "BlockStored",
        [draw(st.integers(0, 5)) for _ in range(blocks)],
        draw(st.none() | st.integers(0, 5)),
        [draw(st.integers(0, 3)) for _ in range(blocks * size)],
        size,
        None,
        draw(st.sampled_from([None, "GPU", "CPU"])),
        draw(st.sampled_from([None, "a"])),
    ]


@st.composite
def batches(draw: Any) -> bytes:
    """Mostly well-formed batches of small, colliding hashes and tokens."""
    events = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.integers(0, 2))
        if kind == 0:
            events.append(stored_event(draw))
        elif kind == 1:
            events.append(["BlockRemoved", [draw(st.integers(0, 5))], None])
        else:
            events.append(["AllBlocksCleared"])
    return msgpack.packb([1.0, events])


@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_kv_events_error(payload: bytes) -> None:
    """Random bytes never raise anything but KVEventsError."""
    with contextlib.suppress(KVEventsError):
        decode_batch(payload)


@given(values)
def test_any_msgpack_value_decodes_or_raises_kv_events_error(value: object) -> None:
    """Any msgpack structure never raises anything but KVEventsError."""
    with contextlib.suppress(KVEventsError):
        decode_batch(msgpack.packb(value))


@settings(max_examples=200)
@given(st.lists(st.tuples(st.sampled_from("abc"), batches()), max_size=8))
def test_the_index_stays_within_its_bounds_and_consistent(feeds: list[tuple[str, bytes]]) -> None:
    """Any sequence of batches leaves the index's size equal to what its endpoints hold,
    within both caps."""
    index = BlockIndex(BlockHasher(2), max_blocks=6, max_blocks_per_endpoint=4)
    for endpoint, payload in feeds:
        index.apply(endpoint, decode_batch(payload).events)
        held = sum(index.blocks_of(e) for e in "abc")
        assert index.size == held <= 6
        assert all(index.blocks_of(e) <= 4 for e in "abc")
