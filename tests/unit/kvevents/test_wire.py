"""Decoding vLLM's KV-event messages: both encodings, int and bytes hashes, and every malformed
shape refused with a clear error."""

from __future__ import annotations

from array import array

import msgpack
import pytest
from tests.support.kvevents import Cleared, Removed, Stored, batch

from endpoint_picker.errors import KVEventsError
from endpoint_picker.kvevents.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    split_frames,
)

SHA = bytes(range(32))  # a sha256-sized block hash, as vLLM sends by default
EVENTS = [
    Stored([SHA, 2**64 - 1], None, list(range(8)), lora_name="ad", extra_keys=[["ad"], None]),
    Stored([-5], SHA, [9, 9, 9, 9], medium=None),
    Removed([SHA, -5]),
    Cleared(),
]
EXPECTED = (
    BlockStored((SHA, 2**64 - 1), None, array("I", range(8)), 4, "ad", "GPU",
                (("ad",), None), None),
    BlockStored((-5,), SHA, array("I", [9, 9, 9, 9]), 4, None, None, None, None),
    BlockRemoved((SHA, -5), "GPU", None),
    AllBlocksCleared(),
)  # fmt: skip


@pytest.mark.parametrize(
    ("era", "event_era"),
    [("map", None), ("array", None), ("array", "map"), ("map", "array")],
)
def test_both_encodings_decode_to_the_same_events(era: str, event_era: str | None) -> None:
    """Maps keyed "type" (v0.26 on), tagged positional arrays (before), and mixes of them."""
    decoded = decode_batch(batch(EVENTS, era, rank=1, event_era=event_era))  # type: ignore[arg-type]
    assert decoded.events == EXPECTED
    assert decoded.ts == 1_700_000_000.5
    assert decoded.data_parallel_rank == 1


def test_old_positional_events_without_trailing_fields_decode() -> None:
    """vLLM 0.9's BlockStored had five fields (no medium, lora_name): still read."""
    payload = msgpack.packb([1.0, [["BlockStored", [7], None, [1, 2], 2, None]]])
    (event,) = decode_batch(payload).events
    assert event == BlockStored((7,), None, array("I", [1, 2]), 2, None, None, None, None)


def test_an_unknown_event_type_is_skipped_and_counted() -> None:
    """A later vLLM's new event kind does not cost the batch its known events."""
    events = [{"type": "BlockMoved", "x": 1}, ["Future", 1], {"type": "AllBlocksCleared"}]
    payload = msgpack.packb({"ts": 1.0, "events": events})
    decoded = decode_batch(payload)
    assert decoded.events == (AllBlocksCleared(),)
    assert decoded.unknown == 2


def _stored(**fields: object) -> bytes:
    base: dict[str, object] = {
        "type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
        "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": None, "lora_name": None,
    }  # fmt: skip
    base.update(fields)
    return msgpack.packb({"ts": 1.0, "events": [base]}, use_bin_type=True)


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        (b"\xc1", "not msgpack"),
        (b"\x92\x01", "not msgpack"),  # truncated
        (msgpack.packb("text"), "a batch is an array or a map"),
        (msgpack.packb({"ts": "now", "events": []}), "batch.ts must be a number"),
        (msgpack.packb([1.0, {}]), "batch.events must be an array"),
        (msgpack.packb([1.0, [], "zero"]), "data_parallel_rank must be an integer"),
        (msgpack.packb([1.0, [7]]), "an event is an array or a map"),
        (msgpack.packb([1.0, [[1, 2]]]), "starts with its type name"),
        (msgpack.packb([1.0, [{"kind": "BlockStored"}]]), "names its type under 'type'"),
        (msgpack.packb([1.0, [["BlockStored", [1]]]]), "needs 4 fields, got 1"),
        (_stored(block_hashes=None), "block_hashes must be an array"),
        (_stored(block_hashes=[True]), "a block hash is an integer or 1-64 bytes"),
        (_stored(block_hashes=[b""]), "a block hash is an integer or 1-64 bytes"),
        (_stored(block_hashes=[b"x" * 65]), "a block hash is an integer or 1-64 bytes"),
        (_stored(block_hashes=[1.5]), "a block hash is an integer or 1-64 bytes"),
        (_stored(parent_block_hash=1.5), "parent_block_hash"),
        (_stored(token_ids=[1, -2]), "token ids (0 to 2^32-1)"),
        (_stored(token_ids=[1, "a"]), "token ids (0 to 2^32-1)"),
        (_stored(token_ids=[1, 2, 3]), "3 token ids for 1 blocks of 2 tokens"),
        (_stored(block_size=0), "block_size must be a positive integer"),
        (_stored(medium=3), "medium must be a string or nil"),
        (_stored(extra_keys=[None, None]), "one entry per block"),
        (_stored(extra_keys=["salt"]), "an entry is an array or nil"),
        (_stored(group_idx="g"), "group_idx must be an integer"),
        (msgpack.packb([1.0, [{"type": "BlockRemoved"}]]), "no 'block_hashes'"),
        (b"\x91" * 100_000, "not msgpack"),  # nested past the unpacker's stack
    ],
)
def test_malformed_payloads_are_refused_with_what_is_wrong(payload: bytes, error: str) -> None:
    """Every malformed batch raises KVEventsError naming the fault, never anything else."""
    with pytest.raises(KVEventsError, match=error.replace("(", r"\(").replace(")", r"\)")
                       .replace("^", r"\^")):  # fmt: skip
        decode_batch(payload)


@pytest.mark.parametrize(
    ("frames", "error"),
    [
        ([b"", b"\0" * 8], "3 frames, got 2"),
        ([b"", b"\0" * 8, b"", b""], "3 frames, got 4"),
        ([b"", b"\0" * 7, b"x"], "8 bytes, got 7"),
        ([b"\xff", b"\0" * 8, b"x"], "not UTF-8"),
        ([b"", b"\0" * 8, b"x" * 2000], "over the 1024 limit"),
    ],
)
def test_malformed_frames_are_refused(frames: list[bytes], error: str) -> None:
    """The multipart framing is [topic, 8-byte seq, payload], the payload bounded."""
    with pytest.raises(KVEventsError, match=error):
        split_frames(frames, 1024)


def test_frames_give_topic_and_big_endian_sequence() -> None:
    """vLLM's seq is an unsigned 8-byte big-endian counter; the topic UTF-8."""
    message = split_frames([b"kv@10.0.0.1@m", (258).to_bytes(8, "big"), b"p"], 1024)
    assert (message.topic, message.seq, message.payload) == ("kv@10.0.0.1@m", 258, b"p")
