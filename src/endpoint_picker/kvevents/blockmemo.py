"""The EPP's block hashes of recent prompts' token prefixes, so a prompt that shares its first
thousands of tokens with an earlier one (a system prompt) hashes only what follows.

The tokens are cut into segments of ``SEGMENT`` blocks; each full segment's block hashes are
kept (LRU, at most ``max_segments``), keyed by a keyed digest of the chain's root and every
token up to the segment's end, computed incrementally (one pass of BLAKE2b in C over the
tokens, against one Python-level hash per block). Keyed by a per-process secret: a client
cannot make two token prefixes share an entry.
"""

from __future__ import annotations

import os
from array import array
from collections import OrderedDict
from hashlib import blake2b

from endpoint_picker.kvevents.index import BlockHasher

SEGMENT = 16  # blocks a kept segment holds (256 tokens at vLLM's default block size)


class BlockMemo:
    """``chain`` as ``BlockHasher.chain`` (no taints), reusing segments hashed before."""

    __slots__ = ("_keyed", "_segments", "hasher", "max_segments")

    def __init__(self, hasher: BlockHasher, max_segments: int = 8192) -> None:
        self.hasher = hasher
        self.max_segments = max_segments
        self._keyed = blake2b(key=os.urandom(32), digest_size=16)
        self._segments: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._segments)

    def chain(self, root: int, tokens: array[int], max_blocks: int) -> list[int]:
        """The block hashes of ``tokens`` from ``root``, at most ``max_blocks``."""
        size = self.hasher.block_size
        blocks = min(len(tokens) // size, max_blocks)
        span = SEGMENT * size
        prefix = self._keyed.copy()
        prefix.update(root.to_bytes(8, "big"))
        out: list[int] = []
        segments = self._segments
        for first in range(0, blocks - SEGMENT + 1, SEGMENT):
            part = tokens[first * size : first * size + span]
            prefix.update(part.tobytes())
            name = prefix.copy().digest()
            kept = segments.get(name)
            if kept is None:
                kept = tuple(self.hasher.chain(out[-1] if out else root, part))
                segments[name] = kept
                if len(segments) > self.max_segments:
                    segments.popitem(last=False)
            else:
                segments.move_to_end(name)
            out.extend(kept)
        done = len(out)
        if done < blocks:
            out.extend(self.hasher.chain(out[-1] if out else root, tokens[done * size :],
                                         max_blocks=blocks - done))  # fmt: skip
        return out
