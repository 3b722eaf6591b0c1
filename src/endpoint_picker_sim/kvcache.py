"""The KV cache block manager with automatic prefix caching, as vLLM v1 keeps it. Pure, no I/O.

Blocks hold ``block_size`` tokens. A full prompt block gets the chained hash of its content and
stays findable by that hash after its request finishes: a freed block with a hash is *cached*, and
is only evicted (least recently freed first) when a request needs a fresh block and no empty block
(one without a hash, nothing worth keeping) is left. Usage, as vLLM reports it, counts
cached-but-unreferenced blocks as free.

With ``events`` set to a list, the manager records what vLLM's block pool queues for KV-cache
events: ``BlockStored`` for each run of a request's blocks that became cached (``cache_run``,
given the request's token ids and adapter), ``BlockRemoved`` for each evicted block,
``AllBlocksCleared`` on a prefix-cache reset. A hash is cached in one block at most: a block
whose content another block already caches stays uncached and announces nothing (vLLM keeps
such duplicates, and may then announce one hash twice and remove it while a copy remains; the
simulator does not).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from endpoint_picker_sim.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


class BlockManager:
    """Reference-counted blocks, a hash -> block map, and an LRU pool of free blocks."""

    __slots__ = (
        "_block_hash",
        "_by_hash",
        "_cached_free",
        "_empty",
        "_ref",
        "block_size",
        "events",
        "num_blocks",
    )

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        # Free blocks without content, taken first (a stack: cheap, and small while idle).
        self._empty = list(range(num_blocks - 1, -1, -1))
        # Free blocks with cached content, least recently freed first: the eviction order.
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        # KV-cache events since the engine last took them; None: not recording.
        self.events: list[KvEvent] | None = None

    @property
    def num_free(self) -> int:
        """Blocks not referenced by any request (cached or empty)."""
        return len(self._empty) + len(self._cached_free)

    @property
    def num_cached(self) -> int:
        """Blocks findable by hash, referenced or not."""
        return len(self._by_hash)

    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: 1 - free/total, as a fraction."""
        return 1.0 - (len(self._empty) + len(self._cached_free)) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, hashes: Sequence[int]) -> list[int]:
        """The blocks holding the longest cached prefix of ``hashes`` (nothing is touched)."""
        out: list[int] = []
        by_hash = self._by_hash
        for h in hashes:
            block = by_hash.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def allocate(self, table: list[int], num_tokens: int, prefix: Sequence[int] = ()) -> bool:
        """Grow a request's block ``table`` to hold ``num_tokens``, taking ``prefix`` blocks first.

        All or nothing: returns False and changes nothing when the free pool is too small.
        """
        needed = self.blocks_for(num_tokens) - len(table) - len(prefix)
        ref = self._ref
        # Cached prefix blocks nobody references sit in the free pool; taking them shrinks it.
        reclaimed = sum(1 for b in prefix if ref[b] == 0)
        empty, cached_free = self._empty, self._cached_free
        if needed > len(empty) + len(cached_free) - reclaimed:
            return False
        for b in prefix:
            if ref[b] == 0:
                del cached_free[b]
            ref[b] += 1
            table.append(b)
        for _ in range(needed):
            if empty:
                b = empty.pop()
            else:
                # Evict the least recently freed cached block: its content is gone.
                b, _ = cached_free.popitem(last=False)
                old = self._block_hash[b]
                self._block_hash[b] = None
                if old is not None and self._by_hash.get(old) == b:
                    del self._by_hash[old]
                    if self.events is not None:
                        self.events.append(BlockRemoved((old,)))
            ref[b] = 1
            table.append(b)
        return True

    def cache(self, block: int, block_hash: int) -> bool:
        """Mark a full block as holding the content ``block_hash`` so later requests reuse it;
        True when it became cached (False: another block caches that content already)."""
        if self._block_hash[block] is None and block_hash not in self._by_hash:
            self._block_hash[block] = block_hash
            self._by_hash[block_hash] = block
            return True
        return False

    def cache_run(
        self,
        table: Sequence[int],
        hashes: Sequence[int],
        start: int,
        end: int,
        token_ids: Sequence[int] | None = None,
        lora_name: str | None = None,
        lora_id: int | None = None,
    ) -> None:
        """``cache`` blocks ``start..end-1`` of a request's ``table`` (``hashes`` and
        ``token_ids`` cover at least that far); recording events and given the token ids, one
        ``BlockStored`` per run of blocks that became cached, in the request's adapter."""
        events = self.events
        if events is None or token_ids is None:
            for k in range(start, end):
                self.cache(table[k], hashes[k])
            return
        bs = self.block_size
        run = start
        for k in range(start, end + 1):
            if k < end and self.cache(table[k], hashes[k]):
                continue
            if k > run:
                events.append(
                    BlockStored(
                        block_hashes=tuple(hashes[run:k]),
                        parent=hashes[run - 1] if run else None,
                        token_ids=tuple(token_ids[run * bs : k * bs]),
                        block_size=bs,
                        lora_id=lora_id,
                        lora_name=lora_name,
                    )
                )
            run = k + 1

    def cached_hashes(self) -> set[int]:
        """Every content hash cached now (what a KV-event subscriber should hold)."""
        return set(self._by_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, as vLLM's ``reset_prefix_cache``: refused (False) while any
        block is in use; on success an ``AllBlocksCleared`` event."""
        if any(self._ref):
            return False
        for b in self._by_hash.values():
            self._block_hash[b] = None
        self._by_hash.clear()
        self._empty.extend(self._cached_free)
        self._cached_free.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KvEvent]:
        """The events recorded since the last call (empty when not recording)."""
        events = self.events
        if not events:
            return []
        self.events = []
        return events

    def free(self, table: list[int]) -> None:
        """Release a request's blocks, tail first, so a prompt's shared head is evicted last."""
        ref = self._ref
        block_hash = self._block_hash
        for b in reversed(table):
            ref[b] -= 1
            if ref[b] == 0:
                if block_hash[b] is None:
                    self._empty.append(b)
                else:
                    self._cached_free[b] = None
        table.clear()
