"""Deterministic placement: rendezvous hashing, and the scorers that place new prefixes and
sessions with it so separate replicas agree."""

from __future__ import annotations

import random

from tests.unit.scheduling.builders import endpoint
from tests.unit.scheduling.test_scheduling_prefix import completion, with_headers

from endpoint_picker.scheduling.placement import Placement, RecentShares, stable_hash
from endpoint_picker.scheduling.plugins.affinity import PrefixCacheScorer
from endpoint_picker.scheduling.plugins.session import SessionAffinityScorer

HOSTS = [f"10.0.0.{i}:8000" for i in range(1, 9)]


def test_pick_ignores_the_order_of_the_endpoints() -> None:
    """Two replicas listing the pool in different orders choose the same endpoint."""
    placement = Placement()
    shuffled = HOSTS[:]
    random.Random(7).shuffle(shuffled)
    for key in range(200):
        assert HOSTS[placement.pick(key, HOSTS)] == shuffled[placement.pick(key, shuffled)]


def test_an_endpoint_leaving_moves_only_its_own_keys() -> None:
    """Consistency: removing one of 8 endpoints moves exactly the keys it won, about 1/8."""
    placement = Placement()
    keys = [stable_hash(f"prefix-{i}") for i in range(4000)]
    before = {k: HOSTS[placement.pick(k, HOSTS)] for k in keys}
    fewer = [h for h in HOSTS if h != HOSTS[3]]
    moved = [k for k in keys if fewer[placement.pick(k, fewer)] != before[k]]
    assert all(before[k] == HOSTS[3] for k in moved)
    assert 0.09 < len(moved) / len(keys) < 0.16


def test_keys_spread_evenly() -> None:
    placement = Placement()
    counts = dict.fromkeys(HOSTS, 0)
    for i in range(8000):
        counts[HOSTS[placement.pick(stable_hash(f"k{i}"), HOSTS)]] += 1
    assert max(counts.values()) < 1.15 * min(counts.values())


def test_stable_hash_is_fixed() -> None:
    """Not Python's salted hash: the value is the same in every process, forever."""
    # BLAKE2b-64 of the UTF-8 text, read little-endian
    assert stable_hash("session-1") == 0xACE763D42CBD49AE


def test_two_prefix_scorers_place_a_new_prefix_on_the_same_endpoint() -> None:
    """Separate scorers (as in two replicas) send a prefix nobody holds to the same endpoint;
    once an endpoint holds it, matching takes over as before."""
    first, second = PrefixCacheScorer(4, 64, 1000), PrefixCacheScorer(4, 64, 1000)
    pool = [endpoint() for _ in range(6)]
    for i in range(20):
        request = completion(f"system prompt number {i} " * 10, rid=f"r{i}")
        a, b = first.score(request, pool), second.score(request, list(reversed(pool)))
        assert sorted(a) == [0.0] * 5 + [1.0]
        assert a == list(reversed(b))
    off = PrefixCacheScorer(4, 64, 1000, placement=False)
    assert off.score(completion("fresh " * 10), pool) == [0.0] * 6


def test_two_session_scorers_start_a_new_session_on_the_same_endpoint() -> None:
    first = SessionAffinityScorer("x-session-id", 10)
    second = SessionAffinityScorer("x-session-id", 10)
    pool = [endpoint() for _ in range(5)]
    picks = set()
    for i in range(30):
        request = with_headers({"x-session-id": f"conversation-{i}"})
        a, b = first.score(request, pool), second.score(request, pool)
        assert a == b
        assert sorted(a) == [0.0] * 4 + [1.0]
        picks.add(a.index(1.0))
    assert len(picks) > 1  # different sessions spread
    assert first.score(with_headers({}), pool) == [0.0] * 5  # no session: no preference


def test_place_is_rendezvous_over_the_candidates_or_the_first_of_a_ring_walk_among_them() -> None:
    """``Placement.place``, the one rule the prefix and session scorers share: without a ring
    walk, the key's rendezvous pick over the candidates; with one, the first endpoint of the walk
    that is a candidate, and none when no endpoint of the walk is."""
    placement = Placement()
    candidates = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
    key = stable_hash("a system prompt")
    assert placement.place(key, None, candidates) == placement.pick(key, candidates)
    walk = ["10.0.0.9:8000", "10.0.0.3:8000", "10.0.0.1:8000"]
    assert placement.place(key, walk, candidates) == 2
    assert placement.place(key, ["10.0.0.9:8000"], candidates) is None


def _spread(shares: RecentShares | None, keys: int, hostports: list[str]) -> float:
    """Max over mean of the prefixes each endpoint gets when ``keys`` new prefixes are placed
    by rendezvous hashing (bounded by ``shares`` when given)."""
    placement = Placement()
    counts = dict.fromkeys(hostports, 0)
    for key in range(keys):
        key_hash = stable_hash(f"prefix {key}")
        eligible = shares.eligible(hostports) if shares else list(range(len(hostports)))
        chosen = hostports[eligible[placement.pick(key_hash, [hostports[i] for i in eligible])]]
        counts[chosen] += 1
        if shares:
            shares.add(chosen)
    return max(counts.values()) / (keys / len(hostports))


def test_placed_shares_bound_the_spread_that_hashing_alone_leaves() -> None:
    """64 new prefixes over 4 endpoints: hashing alone leaves one endpoint a fifth or more
    above the mean (the multinomial spread); bounded by the shares placed, slack and one prefix."""
    hostports = [f"10.0.0.{i}:8000" for i in range(4)]
    assert _spread(None, 64, hostports) >= 1.2
    assert _spread(RecentShares(slack=0.1), 64, hostports) <= 1.1 + 1 / 16  # 18 of 16


def test_placed_shares_decay_and_forget_endpoints_that_left() -> None:
    """Old placements fade (a prefix placed long ago no longer holds an endpoint back), and an
    endpoint that left the pool is forgotten (one float per endpoint in the pool)."""
    shares = RecentShares(slack=0.0, decay=0.5)
    for _ in range(10):
        shares.add("a:1")
    assert shares.eligible(["a:1", "b:1"]) == [1]
    for _ in range(3):
        shares.add("b:1")
    assert shares.eligible(["a:1", "b:1"]) == [0]  # a's ten faded below b's recent three
    shares.purge(frozenset({"a:1"}))  # b left: its count is forgotten, so a new b starts free
    assert shares.eligible(["a:1", "b:1"]) == [0, 1]
    for _ in range(2000):  # 2**2000 overflows a float: the growing unit must be rescaled
        shares.add("b:1")
    for _ in range(3):
        shares.add("a:1")
    assert shares.eligible(["a:1", "b:1"]) == [1]  # a's last three outweigh b's decayed 2000
