"""The KV block manager: allocation, sharing, prefix caching, LRU eviction, usage."""

from __future__ import annotations

import pytest

from endpoint_picker_sim.kvcache import BlockManager
from endpoint_picker_sim.kvevents import AllBlocksCleared, BlockRemoved


def test_allocate_rounds_up_to_blocks_and_usage_follows() -> None:
    """17 tokens in 16-token blocks take 2 blocks; usage is referenced blocks over total."""
    bm = BlockManager(10, 16)
    table: list[int] = []
    assert bm.allocate(table, 17)
    assert len(table) == 2
    assert bm.usage() == pytest.approx(0.2)
    assert bm.allocate(table, 33)  # grows by one block
    assert len(table) == 3


def test_allocate_is_all_or_nothing() -> None:
    """A request that does not fit takes nothing."""
    bm = BlockManager(4, 16)
    a: list[int] = []
    assert bm.allocate(a, 48)
    b: list[int] = []
    assert not bm.allocate(b, 32)
    assert b == []
    assert bm.num_free == 1


def test_freed_cached_blocks_count_as_free_but_stay_findable() -> None:
    """After a request finishes, its hashed blocks are free (usage 0) and still hit."""
    bm = BlockManager(8, 16)
    table: list[int] = []
    bm.allocate(table, 40)
    bm.cache(table[0], 111)
    bm.cache(table[1], 222)
    bm.free(table)
    assert bm.usage() == 0.0
    assert bm.num_cached == 2
    assert len(bm.cached_prefix([111, 222, 333])) == 2


def test_prefix_blocks_are_shared_by_reference() -> None:
    """Two requests with the same prefix share its blocks; usage counts them once."""
    bm = BlockManager(8, 16)
    first: list[int] = []
    bm.allocate(first, 32)
    bm.cache(first[0], 1)
    bm.cache(first[1], 2)
    prefix = bm.cached_prefix([1, 2])
    second: list[int] = []
    assert bm.allocate(second, 48, prefix)
    assert second[:2] == first[:2]
    assert bm.usage() == pytest.approx(3 / 8)
    bm.free(first)
    assert bm.usage() == pytest.approx(3 / 8)  # still referenced by the second request
    bm.free(second)
    assert bm.usage() == 0.0


def test_reusing_a_freed_cached_block_takes_it_out_of_the_free_pool() -> None:
    """A cached, unreferenced prefix block counts against the free pool when reused."""
    bm = BlockManager(3, 16)
    a: list[int] = []
    bm.allocate(a, 16)
    bm.cache(a[0], 7)
    bm.free(a)
    b: list[int] = []
    # 3 blocks needed, one of them the cached prefix: fits exactly.
    assert bm.allocate(b, 48, bm.cached_prefix([7]))
    assert bm.num_free == 0


def test_eviction_is_least_recently_freed_and_empty_blocks_go_first() -> None:
    """New allocations take unhashed free blocks first, then the oldest cached ones."""
    bm = BlockManager(4, 16)
    old: list[int] = []
    bm.allocate(old, 16)
    bm.cache(old[0], 10)
    bm.free(old)
    new: list[int] = []
    bm.allocate(new, 16)
    bm.cache(new[0], 20)
    bm.free(new)
    grab: list[int] = []
    bm.allocate(grab, 32)  # the two never-used blocks
    assert bm.cached_prefix([10])
    assert bm.cached_prefix([20])
    more: list[int] = []
    bm.allocate(more, 16)  # evicts hash 10, freed longest ago
    assert bm.cached_prefix([10]) == []
    assert bm.cached_prefix([20]) != []


def test_tail_blocks_are_evicted_before_the_head_of_a_prompt() -> None:
    """Freeing tail-first keeps a shared system-prompt head cached longest."""
    bm = BlockManager(3, 16)
    table: list[int] = []
    bm.allocate(table, 48)
    for i, block in enumerate(table):
        bm.cache(block, 100 + i)
    bm.free(table)
    grab: list[int] = []
    bm.allocate(grab, 16)
    assert bm.cached_prefix([100, 101]) != []
    assert bm.cached_prefix([102]) == []


def test_duplicate_content_is_not_cached_twice() -> None:
    """A second block with already-cached content stays uncached, as in vLLM."""
    bm = BlockManager(4, 16)
    a: list[int] = []
    b: list[int] = []
    bm.allocate(a, 16)
    bm.allocate(b, 16)
    bm.cache(a[0], 5)
    bm.cache(b[0], 5)
    assert bm.num_cached == 1


def test_evictions_and_resets_are_recorded_as_kv_events() -> None:
    """With events on, evicting a cached block records BlockRemoved(hash); a reset is refused
    while a block is in use and records AllBlocksCleared once everything is free."""
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.events = []
    table: list[int] = []
    assert bm.allocate(table, 8)
    assert bm.cache(table[0], 11)
    assert not bm.cache(table[1], 11)  # that content is cached already: nothing new
    assert not bm.reset_prefix_cache()  # blocks in use
    bm.free(table)
    other: list[int] = []
    assert bm.allocate(other, 8)  # the empty block, then evicts the cached one
    assert bm.take_events() == [BlockRemoved((11,))]
    bm.free(other)
    assert bm.reset_prefix_cache()
    assert bm.take_events() == [AllBlocksCleared()]
    assert bm.num_cached == 0
