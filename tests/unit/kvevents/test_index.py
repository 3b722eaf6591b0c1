"""The block index: chains of the EPP's own hashes from BlockStored, removal by engine hash,
adapters, extra keys, tiers, and the bounds."""

from __future__ import annotations

from array import array

from endpoint_picker.kvevents.index import BlockHasher, BlockIndex
from endpoint_picker.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4


def stored(
    hashes: list[int | bytes],
    parent: int | bytes | None,
    tokens: list[int],
    *,
    lora: str | None = None,
    medium: str | None = "GPU",
    extra: tuple[tuple[object, ...] | None, ...] | None = None,
    group: int | None = None,
) -> BlockStored:
    return BlockStored(tuple(hashes), parent, array("I", tokens), BS, lora, medium, extra, group)


def make(max_blocks: int = 1000, per_endpoint: int = 1000, seed: str = "") -> BlockIndex:
    return BlockIndex(BlockHasher(BS, seed), max_blocks=max_blocks,
                      max_blocks_per_endpoint=per_endpoint)  # fmt: skip


def prompt_keys(index: BlockIndex, tokens: list[int], adapter: str | None = None) -> list[int]:
    return index.hasher.chain(index.hasher.root(adapter), array("I", tokens))


PROMPT = list(range(1, 17))  # four blocks of four tokens


def test_the_longest_held_prefix_counts_across_chained_events() -> None:
    """A prompt stored in two events (the second chained on the first's last engine hash)
    matches the keys the scorer computes from the same tokens, block by block."""
    index = make()
    index.apply("a", [stored([b"e1", b"e2"], None, PROMPT[:8])])
    index.apply("a", [stored([b"e3"], b"e2", PROMPT[8:12])])
    index.apply("b", [stored([11], None, PROMPT[:4])])
    counts = index.longest_prefix(prompt_keys(index, PROMPT), ["a", "b", "c"])
    assert counts == {"a": 3, "b": 1, "c": 0}


def test_engine_hashes_do_not_matter_only_tokens_do() -> None:
    """Two servers with different vLLM seeds (different engine hashes) index the same keys."""
    index = make()
    index.apply("a", [stored([1, 2], None, PROMPT[:8])])
    index.apply("b", [stored([b"x", b"y"], None, PROMPT[:8])])
    assert index.longest_prefix(prompt_keys(index, PROMPT), ["a", "b"]) == {"a": 2, "b": 2}


def test_block_removed_uses_the_engine_hash_map() -> None:
    """Evicting the second block cuts the held prefix there; the map entry goes too."""
    index = make()
    index.apply("a", [stored([1, 2, 3], None, PROMPT[:12])])
    index.apply("a", [BlockRemoved((2,), "GPU", None)])
    assert index.longest_prefix(prompt_keys(index, PROMPT), ["a"]) == {"a": 1}
    assert index.size == 2
    index.apply("a", [BlockRemoved((2, 99), None, None)])  # again, and unknown: nothing
    assert index.size == 2


def test_a_chain_whose_parent_was_never_seen_is_skipped() -> None:
    """A BlockStored continuing a chain stored before the subscription cannot be keyed."""
    index = make()
    index.apply("a", [stored([5], 4, PROMPT[4:8])])
    assert index.size == 0
    assert index.orphans == 1


def test_all_blocks_cleared_drops_the_endpoint() -> None:
    """A prefix-cache reset leaves the endpoint holding nothing."""
    index = make()
    index.apply("a", [stored([1], None, PROMPT[:4]), AllBlocksCleared()])
    assert index.size == 0
    assert "a" not in index.endpoints


def test_adapter_blocks_root_their_chain_on_the_adapter_name() -> None:
    """A LoRA adapter's blocks match only requests for that adapter, never the base model."""
    index = make()
    index.apply("a", [stored([1, 2], None, PROMPT[:8], lora="sql-lora")])
    assert index.is_adapter("sql-lora")
    assert index.longest_prefix(prompt_keys(index, PROMPT, "sql-lora"), ["a"]) == {"a": 2}
    assert index.longest_prefix(prompt_keys(index, PROMPT), ["a"]) == {"a": 0}


def test_blocks_with_other_extra_keys_never_match_a_text_prompt() -> None:
    """A cache salt (or a multimodal input) in vLLM's extra keys taints the chain from there."""
    index = make()
    index.apply("a", [stored([1, 2], None, PROMPT[:8], extra=(None, ("salt",)))])
    assert index.longest_prefix(prompt_keys(index, PROMPT), ["a"]) == {"a": 1}
    index.apply("b", [stored([1], None, PROMPT[:4], lora="x", extra=(("x",),))])
    assert index.longest_prefix(prompt_keys(index, PROMPT, "x"), ["b"]) == {"b": 1}


def test_only_gpu_blocks_of_the_first_group_count() -> None:
    """CPU-offloaded blocks and other KV-cache groups do not make a prefill cheaper here."""
    index = make()
    index.apply("a", [stored([1], None, PROMPT[:4], medium="CPU")])
    index.apply("a", [stored([2], None, PROMPT[:4], group=1)])
    assert index.size == 0
    index.apply("a", [stored([3], None, PROMPT[:4], medium="gpu", group=0)])
    assert index.size == 1


def test_an_endpoint_keeps_at_most_its_cap_dropping_the_least_recently_stored() -> None:
    """Past max_blocks_per_endpoint the oldest stored block goes (and its engine hash)."""
    index = make(per_endpoint=2)
    index.apply("a", [stored([1, 2, 3], None, PROMPT[:12])])
    assert index.size == 2
    assert index.longest_prefix(prompt_keys(index, PROMPT), ["a"]) == {"a": 0}  # block 1 gone
    index.apply("a", [BlockRemoved((1,), None, None)])  # its engine hash was forgotten too
    assert index.size == 2


def test_the_total_cap_evicts_from_the_largest_endpoint() -> None:
    """Past max_blocks in all, the endpoint holding the most loses its oldest block."""
    index = make(max_blocks=3)
    index.apply("a", [stored([1, 2], None, PROMPT[:8])])
    index.apply("b", [stored([7, 8], None, [5, 5, 5, 5, 6, 6, 6, 6])])
    assert index.size == 3
    assert index.blocks_of("a") == 1
    assert index.blocks_of("b") == 2


def test_the_seed_changes_every_key() -> None:
    """hashSeed keys the EPP's hashes: two seeds share nothing."""
    assert BlockHasher(BS, "a").chain(0, array("I", PROMPT)) != BlockHasher(BS, "b").chain(
        0, array("I", PROMPT)
    )


def test_drop_forgets_an_endpoint_and_its_holders() -> None:
    """An endpoint that leaves takes its blocks with it; the others keep theirs."""
    index = make()
    index.apply("a", [stored([1], None, PROMPT[:4])])
    index.apply("b", [stored([1], None, PROMPT[:4])])
    index.drop("a")
    assert index.size == 1
    assert index.longest_prefix(prompt_keys(index, PROMPT), ["a", "b"]) == {"a": 0, "b": 1}


def test_events_of_another_block_size_are_skipped() -> None:
    """A server whose --block-size is not blockSize: its blocks cannot be keyed like the
    prompt's, so they are skipped (and logged once), never half-indexed."""
    index = make()
    event = BlockStored((1, 2), None, array("I", PROMPT[:4]), 2, None, None, None, None)
    index.apply("a", [event, event])
    assert index.size == 0
