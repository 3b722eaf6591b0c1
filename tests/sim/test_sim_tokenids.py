"""The approximate tokenizer's stand-in token ids."""

from __future__ import annotations

import random
import zlib

import pytest

from endpoint_picker_sim import tokenids
from endpoint_picker_sim.tokenids import ApproxTokenIds, approx_token_ids


def test_ids_are_the_crc32_of_each_4_character_chunk() -> None:
    """Token i is characters 4i..4i+3 (the last chunk may be shorter), its id their CRC-32."""
    assert approx_token_ids("abcdefghé") == [zlib.crc32(b"abcd"), zlib.crc32(b"efgh"),
                                              zlib.crc32("é".encode())]  # fmt: skip
    assert approx_token_ids("") == []


def test_the_piece_cache_changes_nothing_and_stays_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Encoding through the 64-character piece cache gives exactly approx_token_ids, for texts
    of any length and alphabet, and the cache never holds more than its bound."""
    monkeypatch.setattr(tokenids, "_PIECES_KEPT", 8)
    rng = random.Random(5)
    ids = ApproxTokenIds()
    shared = "".join(rng.choice("ab é\\n") for _ in range(300))
    for n in range(40):
        text = shared + "".join(rng.choice("xyzé ") for _ in range(rng.randrange(200)))
        assert ids.encode(text, chat=False) == approx_token_ids(text), n
        assert len(ids._pieces) <= 8
    assert ids.extend("abc", approx_token_ids("abc"), " the") == approx_token_ids("abc the")
    assert ids.extend(None, [1, 2], " the") == [1, 2, zlib.crc32(b" the")]
