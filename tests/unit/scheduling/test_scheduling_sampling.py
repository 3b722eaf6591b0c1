"""Large pools: ``candidate-sampler``, the placement ring, and the scorers' hints that keep a
sampled pool's affinity (prefix, session, adapter) and its agreement across replicas."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Sequence

import pytest
from tests.unit.scheduling.builders import HEADER, build, endpoint
from tests.unit.scheduling.test_scheduling_prefix import completion, with_headers

from endpoint_picker.errors import ConfigError
from endpoint_picker.exchange import Lifecycle
from endpoint_picker.requests import LLMRequest
from endpoint_picker.scheduling import load_config
from endpoint_picker.scheduling.placement import PlacementRing, stable_hash
from endpoint_picker.scheduling.plugins.affinity import PrefixCacheScorer
from endpoint_picker.scheduling.plugins.filters import CandidateSampler
from endpoint_picker.scheduling.prefix import PrefixIndex
from endpoint_picker.types import EndpointState

HOSTS = [f"10.1.{i // 250}.{i % 250 + 1}:8000" for i in range(300)]


def test_ring_walks_distinct_endpoints_the_same_whatever_the_order_of_joining() -> None:
    """Two replicas that learned the pool in different orders (one all at once, one endpoint
    by endpoint) walk every key the same way; a walk never repeats an endpoint."""
    whole = PlacementRing()
    whole.update(frozenset(HOSTS))
    grown = PlacementRing()
    grown.update(frozenset(HOSTS[:280]))
    grown.walk(0, 1)  # built now: the last 20 join incrementally
    for i in range(280, 300):
        grown.update(frozenset(HOSTS[: i + 1]))
    for key in (stable_hash(f"k{i}") for i in range(500)):
        walk = whole.walk(key, 4)
        assert walk == grown.walk(key, 4)
        assert len(set(walk)) == 4
    assert len(whole.walk(5, 1000)) == len(HOSTS)
    assert whole.walk(5, 0) == []
    odd = {h for i, h in enumerate(HOSTS) if i % 2}
    among = whole.walk(5, 4, odd.__contains__)
    assert among == [h for h in whole.walk(5, len(HOSTS)) if h in odd][:4]


def test_ring_an_endpoint_leaving_moves_only_its_own_keys() -> None:
    ring = PlacementRing()
    ring.update(frozenset(HOSTS))
    keys = [stable_hash(f"prefix-{i}") for i in range(6000)]
    before = {k: ring.walk(k, 1)[0] for k in keys}
    gone = HOSTS[17]
    ring.update(frozenset(HOSTS) - {gone})
    moved = [k for k in keys if ring.walk(k, 1)[0] != before[k]]
    assert moved
    assert all(before[k] == gone for k in moved)
    assert all(gone not in ring.walk(k, 4) for k in keys[:200])


def test_ring_shares_keys_out_evenly_enough() -> None:
    """32 points per endpoint: no endpoint owns more than about twice its share of new keys."""
    ring = PlacementRing()
    ring.update(frozenset(HOSTS[:64]))
    owners = Counter(ring.walk(stable_hash(f"k{i}"), 1)[0] for i in range(64_000))
    assert len(owners) == 64
    assert max(owners.values()) < 2.0 * 1000
    assert min(owners.values()) > 0.4 * 1000


class _Hints:
    def __init__(self, hostports: Iterable[str]) -> None:
        self.hostports = tuple(hostports)
        self.asked = 0

    def preferred(self, request: LLMRequest, ring: PlacementRing) -> Iterable[str]:
        self.asked += 1
        return self.hostports


def _pool(count: int) -> list[EndpointState]:
    return [endpoint() for _ in range(count)]


def test_sampler_leaves_a_pool_within_the_threshold_whole() -> None:
    sampler = CandidateSampler(threshold=50, size=10, rng=random.Random(1))
    hints = _Hints(())
    sampler.use_hints([hints])
    pool = _pool(50)
    assert sampler.filter(completion("x"), pool) is pool
    assert hints.asked == 0


def test_sampler_keeps_a_random_sample_plus_the_hinted_endpoints_in_pool_order() -> None:
    sampler = CandidateSampler(threshold=50, size=10, rng=random.Random(1))
    pool = _pool(400)
    wanted = [pool[399].hostport, pool[3].hostport, "10.9.9.9:1"]  # the last is not a candidate
    sampler.use_hints([_Hints(wanted)])
    seen: Counter[str] = Counter()
    for _ in range(200):
        kept = sampler.filter(completion("x"), pool)
        assert pool[399] in kept
        assert pool[3] in kept
        assert 10 <= len(kept) <= 12
        order = [pool.index(e) for e in kept]
        assert order == sorted(order)
        seen.update(e.hostport for e in kept)
    assert len(seen) > 350  # the random part covers the pool over time


def test_sampler_follows_a_reordered_pool() -> None:
    """The hostport -> index map is rebuilt when the candidates change order or shrink."""
    sampler = CandidateSampler(threshold=5, size=2, rng=random.Random(2))
    pool = _pool(40)
    target = pool[20]
    sampler.use_hints([_Hints([target.hostport])])
    assert target in sampler.filter(completion("x"), pool)
    shuffled = pool[:]
    random.Random(3).shuffle(shuffled)
    assert target in sampler.filter(completion("x"), shuffled)
    assert target in sampler.filter(completion("x"), [e for e in pool if e is not pool[0]])


def test_leading_holders_names_the_deepest_holders_first() -> None:
    index = PrefixIndex()
    rng = random.Random(0)
    index.insert("a", [1, 2, 3], 100)
    index.insert("b", [1, 2], 100)
    index.insert("c", [1], 100)
    assert index.leading_holders([1, 2, 3, 4], 1, rng) == {"a"}
    assert index.leading_holders([1, 2, 3, 4], 2, rng) == {"a", "b"}
    assert index.leading_holders([1, 2, 3, 4], 16, rng) == {"a", "b", "c"}
    assert index.leading_holders([1, 2, 9], 1, rng) <= {"a", "b"}
    assert index.leading_holders([7], 16, rng) == set()
    assert index.leading_holders([], 16, rng) == set()


def test_leading_holders_finds_the_one_deep_holder_among_many_shallow_ones() -> None:
    """200 endpoints hold a shared system prompt (12 blocks), one also holds the rest of a
    conversation: that one is always named, whatever the random draw of the others."""
    index = PrefixIndex()
    for i in range(200):
        index.insert(f"shared-{i}", list(range(12)), 1000)
    index.insert("shared-7", list(range(12, 15)), 1000)
    for seed in range(200):
        named = index.leading_holders(list(range(16)), 16, random.Random(seed))
        assert "shared-7" in named
        assert len(named) == 16


def _large_pool(count: int, start: int = 0) -> list[EndpointState]:
    return [endpoint(f"pod-{i}", base=["m"]) for i in range(start, start + count)]


def _route(components: object, request: LLMRequest, pool: Sequence[EndpointState]) -> str:
    from endpoint_picker.scheduling import SchedulingComponents

    assert isinstance(components, SchedulingComponents)
    result = components.scheduler.schedule(request, pool)
    chosen = result.endpoints[0].hostport
    Lifecycle.of(components.subscribers).routed(request, chosen)
    return chosen


def test_default_profile_keeps_a_prefix_on_its_holder_in_a_large_pool() -> None:
    """1,000 endpoints, 64 sampled: a prefix first routed to an endpoint that is not its
    place on the ring (the only candidate then) keeps going there: the holder is named."""
    components = build(seed=5)
    pool = _large_pool(1000)
    hostports = frozenset(e.hostport for e in pool)
    Lifecycle.of(components.subscribers).endpoints_changed(hostports)
    prompt = "You are a careful assistant. " * 40
    ring = PlacementRing()
    ring.update(hostports)
    first = completion(prompt + "q0", rid="r0")
    placed = ring.walk(PrefixCacheScorer(64, 256, 1000).hashes(first)[0], 4)
    holder = next(e for e in pool if e.hostport not in placed)
    assert _route(components, first, [holder]) == holder.hostport
    for i in range(1, 30):
        assert _route(components, completion(prompt + f"q{i}", rid=f"r{i}"), pool) == (
            holder.hostport
        )
        Lifecycle.of(components.subscribers).finished(f"r{i}", True)


def test_replicas_agree_on_new_keys_among_a_part_of_the_pool() -> None:
    """Candidates narrowed by the director (a subset hint, endpoints with room) to 200 of
    1,000: still sampled, and the ring is walked among them, so two replicas agree."""
    one, two = build(seed=11), build(seed=12)
    pool = _large_pool(1000)
    for components in (one, two):
        Lifecycle.of(components.subscribers).endpoints_changed(e.hostport for e in pool)
    part = pool[300:500]
    for i in range(40):
        request = completion(f"another system prompt {i} " * 30, rid=f"q{i}")
        chosen = _route(one, request, part)
        assert chosen == _route(two, request, part[::-1])
        session = with_headers({"x-session-id": f"chat-{i}"}, rid=f"c{i}")
        assert _route(one, session, part) == _route(two, session, part[::-1])


def test_one_sampler_in_two_profiles_is_refused() -> None:
    """A sampler asks one profile's scorers; listed in two, which would it ask?"""
    text = (
        HEADER + "plugins:\n- type: candidate-sampler\n- type: queue-scorer\n"
        "- type: single-profile-handler\n"
        "schedulingProfiles:\n"
        "- name: a\n  plugins:\n  - pluginRef: candidate-sampler\n  - pluginRef: queue-scorer\n"
        "- name: b\n  plugins:\n  - pluginRef: candidate-sampler\n"
    )
    with pytest.raises(ConfigError, match="listed in two profiles"):
        load_config(text)


def test_two_replicas_place_new_prefixes_and_sessions_alike_in_a_large_pool() -> None:
    """Separately built schedulers (different random sources, the pool listed in different
    orders) send each new prefix and each new session to the same endpoint."""
    one, two = build(seed=1), build(seed=2)
    pool = _large_pool(600)
    reordered = pool[::-1]
    for components in (one, two):
        Lifecycle.of(components.subscribers).endpoints_changed(e.hostport for e in pool)
    spread = set()
    for i in range(40):
        request = completion(f"new system prompt {i} " * 30, rid=f"p{i}")
        a, b = _route(one, request, pool), _route(two, request, reordered)
        assert a == b
        spread.add(a)
        session = with_headers({"x-session-id": f"conversation-{i}"}, rid=f"s{i}")
        assert _route(one, session, pool) == _route(two, session, reordered)
    assert len(spread) > 30  # different prefixes, different places


def test_an_adapter_goes_back_where_it_was_sent_in_a_large_pool() -> None:
    """Only a few endpoints of 500 run the adapter: the random sample would usually miss them,
    the adapter's recent endpoints do not."""
    components = build(seed=9)
    pool = [
        endpoint(f"lora-{i}", active=["sql-lora"], max_lora=2, base=["base"])
        if i % 100 == 7
        else endpoint(f"plain-{i}", max_lora=2, active=["a", "b"], base=["base"])
        for i in range(500)
    ]
    Lifecycle.of(components.subscribers).endpoints_changed(e.hostport for e in pool)
    holders = {e.hostport for e in pool if "sql-lora" in e.metrics.active_adapters}
    landed = []
    for i in range(40):
        request = completion(f"question {i}", model="sql-lora", rid=f"l{i}")
        landed.append(_route(components, request, pool))
        Lifecycle.of(components.subscribers).finished(f"l{i}", True)
    assert sum(h in holders for h in landed[5:]) == len(landed) - 5


def test_unique_prompts_spread_over_a_large_pool() -> None:
    """No hot spot: 3,000 requests with unique prompts, none finishing, over 1,000 endpoints
    leave no endpoint far above the mean of 3."""
    components = build(seed=3)
    pool = _large_pool(1000)
    Lifecycle.of(components.subscribers).endpoints_changed(e.hostport for e in pool)
    counts = Counter(
        _route(components, completion(f"unique prompt {i} " * 20, rid=f"u{i}"), pool)
        for i in range(3000)
    )
    assert max(counts.values()) <= 8
    assert len(counts) > 900
