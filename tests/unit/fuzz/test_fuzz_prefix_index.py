"""The prefix index against a naive reference: random inserts, evictions, purges, queries."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given
from hypothesis import strategies as st

from endpoint_picker.scheduling.prefix import PrefixIndex

ENDPOINTS = ["a", "b", "c", "d", "e"]
_hashes = st.lists(st.integers(0, 12), max_size=8)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.sampled_from(ENDPOINTS), _hashes, st.integers(1, 10)),
        st.tuples(st.just("purge"), st.frozensets(st.sampled_from(ENDPOINTS))),
    ),
    max_size=30,
)


def _leading(lru: OrderedDict[int, None] | None, hashes: list[int]) -> int:
    run = 0
    for h in hashes:
        if lru is None or h not in lru:
            break
        run += 1
    return run


@given(_ops, _hashes, st.lists(st.sampled_from([*ENDPOINTS, "x"]), unique=True))
def test_match_is_each_candidates_leading_run(
    ops: list[tuple[object, ...]], query: list[int], candidates: list[str]
) -> None:
    """``match`` gives, per candidate in order, how many of the query's leading blocks its LRU
    holds, whatever happened before (a candidate never inserted matches 0)."""
    index = PrefixIndex()
    reference: dict[str, OrderedDict[int, None]] = {}
    for op in ops:
        if op[0] == "insert":
            _, endpoint, hashes, capacity = op
            assert isinstance(endpoint, str)
            assert isinstance(hashes, list)
            assert isinstance(capacity, int)
            index.insert(endpoint, hashes, capacity)
            lru = reference.setdefault(endpoint, OrderedDict())
            for h in hashes:
                lru[h] = None
                lru.move_to_end(h)
            while len(lru) > capacity:
                lru.popitem(last=False)
        else:
            keep = op[1]
            assert isinstance(keep, frozenset)
            index.purge(keep)
            reference = {e: lru for e, lru in reference.items() if e in keep}
    expected = [_leading(reference.get(e), query) for e in candidates]
    assert index.match(query, candidates) == expected
    assert index.size == sum(len(lru) for lru in reference.values())
