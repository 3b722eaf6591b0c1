"""Prefix hashing, the prefix index, the in-flight counter, the affinity and session plugins."""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
from typing import Any

import pytest
from tests.unit.scheduling.builders import endpoint

from endpoint_picker.exchange import Lifecycle
from endpoint_picker.requests import Api, LLMRequest
from endpoint_picker.scheduling.lifecycle import Finished, InFlight, Routed
from endpoint_picker.scheduling.plugins.affinity import (
    BoundedLoadFilter,
    InFlightLoadScorer,
    PrefixCacheScorer,
)
from endpoint_picker.scheduling.plugins.session import (
    SessionAffinityScorer,
    session_token,
    token_endpoint,
)
from endpoint_picker.scheduling.prefix import PrefixIndex, block_hashes, prompt_prefix_text


def completion(prompt: str, model: str = "m", rid: str = "r") -> LLMRequest:
    body: dict[str, Any] = {"model": model, "prompt": prompt}
    return LLMRequest(rid, Api.COMPLETIONS, model, b"", body, target_model=model)


def chat(messages: list[dict[str, str]], model: str = "m", rid: str = "r") -> LLMRequest:
    body: dict[str, Any] = {"model": model, "messages": messages}
    return LLMRequest(rid, Api.CHAT_COMPLETIONS, model, b"", body, target_model=model)


def test_hash_chains_share_exactly_the_common_prefix() -> None:
    """Two prompts share leading hashes as far as their full common blocks go, no further."""
    a = block_hashes("m", "x" * 100 + "A" * 100, 10, 100)
    b = block_hashes("m", "x" * 100 + "B" * 100, 10, 100)
    assert a[:10] == b[:10]
    assert all(x != y for x, y in zip(a[10:], b[10:], strict=True))


def test_hash_chains_are_seeded_by_the_model_and_truncated() -> None:
    """An adapter never shares entries with its base; only full blocks, at most max_blocks."""
    assert block_hashes("m", "x" * 100, 10, 100)[0] != block_hashes("lora", "x" * 100, 10, 100)[0]
    assert len(block_hashes("m", "x" * 105, 10, 100)) == 10
    assert len(block_hashes("m", "x" * 1000, 10, 7)) == 7
    assert block_hashes("m", "x" * 9, 10, 100) == ()


def test_hashes_are_stable_across_processes() -> None:
    """The chain is BLAKE2b, not Python's randomised hash: another process computes the same."""
    code = (
        "from endpoint_picker.scheduling.prefix import block_hashes;"
        "print(block_hashes('m', 'abcd' * 8, 16, 4))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        timeout=30,
    )
    assert other.stdout.strip() == str(block_hashes("m", "abcd" * 8, 16, 4))


def test_chat_layout_keeps_roles_and_turns_extend_the_previous_prompt() -> None:
    """A chat's next turn starts with the previous turn's whole prompt, roles included."""
    turn1 = [{"role": "system", "content": "S" * 300}, {"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "x"}]
    first = prompt_prefix_text(chat(turn1), 10_000)
    second = prompt_prefix_text(chat(turn2), 10_000)
    assert second.startswith(first)
    as_user = [{"role": "user", "content": "S" * 300}, {"role": "user", "content": "hi"}]
    assert prompt_prefix_text(chat(as_user), 10_000) != first


def test_index_matches_leading_runs_and_evicts_lru() -> None:
    """Matches count leading blocks only; past capacity the least recently used go."""
    index = PrefixIndex()
    index.insert("a", [1, 2, 3], capacity=10)
    index.insert("b", [1, 9], capacity=10)
    assert index.match([1, 2, 3, 4], ["a", "b", "c"]) == [3, 1, 0]
    assert index.match([7, 1], ["a", "b"]) == [0, 0]
    index.insert("a", [4, 5, 6, 7, 8, 10, 11, 12], capacity=10)  # 11 entries: 1 is evicted
    assert index.match([1, 2, 3], ["a"]) == [0]
    assert index.size == 10 + 2


def test_index_purges_endpoints_that_left() -> None:
    """Endpoints that leave the pool are forgotten, with their hash holders."""
    index = PrefixIndex()
    index.insert("a", [1, 2], capacity=10)
    index.insert("b", [1, 2], capacity=10)
    index.purge(frozenset({"b"}))
    assert index.match([1, 2], ["a", "b"]) == [0, 2]
    index.purge(frozenset())
    assert index.size == 0
    assert index.match([1], ["b"]) == [0]


def test_index_memory_is_bounded_by_capacity() -> None:
    """However many prompts pass, each endpoint holds at most its capacity."""
    index = PrefixIndex()
    rng = random.Random(1)
    for _ in range(200):
        index.insert("a", [rng.getrandbits(64) for _ in range(50)], capacity=500)
    assert index.size == 500


def test_inflight_counts_never_leak_or_go_negative() -> None:
    """Routed then finished returns to zero; a second finish or an unknown id changes nothing."""
    inflight = InFlight()
    lifecycle = Lifecycle([inflight])
    lifecycle.routed(completion("x", rid="1"), "a")
    lifecycle.routed(completion("x", rid="2"), "a")
    lifecycle.routed(completion("x", rid="3"), "b")
    assert (inflight.count("a"), inflight.count("b")) == (2, 1)
    lifecycle.finished("1", ok=True)
    lifecycle.finished("1", ok=False)
    lifecycle.finished("unknown", ok=False)
    assert (inflight.count("a"), inflight.count("b"), inflight.total) == (1, 1, 2)
    lifecycle.finished("2", ok=False)
    lifecycle.finished("3", ok=True)
    assert inflight.total == 0
    assert inflight.count("a") == 0


def test_a_failing_listener_does_not_stop_the_others() -> None:
    """One listener raising is logged; the in-flight counter still counts."""

    class Broken:
        def on_routed(self, event: Routed) -> None:
            raise RuntimeError("boom")

        def on_finished(self, event: Finished) -> None:
            raise RuntimeError("boom")

    inflight = InFlight()
    Lifecycle([Broken(), inflight]).routed(completion("x"), "a")
    assert inflight.count("a") == 1


def test_prefix_scorer_learns_from_routing() -> None:
    """After a request is routed to an endpoint, the same prefix scores 1 there, 0 elsewhere."""
    scorer = PrefixCacheScorer(block_tokens=4, max_blocks=64, lru_capacity=1000, placement=False)
    a, b = endpoint(), endpoint()
    prompt = "system prompt " * 20
    first = completion(prompt + "question one", rid="1")
    assert scorer.score(first, [a, b]) == [0.0, 0.0]
    scorer.on_routed(Routed(first, a.hostport))
    second = completion(prompt + "another question", rid="2")
    scores = scorer.score(second, [a, b])
    assert scores[0] > 0.8
    assert scores[1] == 0.0
    other_model = completion(prompt, model="lora", rid="3")
    assert scorer.score(other_model, [a, b]) == [0.0, 0.0]


def test_prefix_scorer_forgets_endpoints_that_left() -> None:
    """on_endpoints purges the index of endpoints no longer in the pool."""
    scorer = PrefixCacheScorer(block_tokens=4, max_blocks=64, lru_capacity=1000, placement=False)
    a = endpoint()
    request = completion("p" * 400, rid="1")
    scorer.score(request, [a])
    scorer.on_routed(Routed(request, a.hostport))
    scorer.on_endpoints(frozenset())
    assert scorer.index.size == 0


def load_of(inflight: InFlight, hostport: str, n: int) -> None:
    for i in range(n):
        inflight.on_routed(Routed(completion("x", rid=f"{hostport}-{i}"), hostport))


@pytest.mark.parametrize(
    ("loads", "kept"),
    [
        ((0, 0, 0, 0), {0, 1, 2, 3}),
        ((2, 0, 0, 0), {0, 1, 2, 3}),  # within the slack of 2
        ((3, 0, 0, 0), {1, 2, 3}),  # past min + slack and past 1.25 x mean
        ((10, 8, 8, 8), {0, 1, 2, 3}),  # 10 <= 1.25 x 8.5
        ((20, 8, 8, 8), {1, 2, 3}),
    ],
)
def test_bounded_load_filter(loads: tuple[int, ...], kept: set[int]) -> None:
    """Only endpoints within max(1.25 x mean, min + 2) of the pool's load stay."""
    inflight = InFlight()
    endpoints = [endpoint() for _ in loads]
    for e, n in zip(endpoints, loads, strict=True):
        load_of(inflight, e.hostport, n)
    out = BoundedLoadFilter(1.25, 2, inflight).filter(completion("x"), endpoints)
    assert {endpoints.index(e) for e in out} == kept


def test_bounded_load_filter_counts_server_reported_load() -> None:
    """A server busy with other replicas' traffic counts by its own running + waiting."""
    inflight = InFlight()
    busy, idle = endpoint(running=6, queue=4), endpoint()
    assert BoundedLoadFilter(1.25, 2, inflight).filter(completion("x"), [busy, idle]) == [idle]


class _Loads:
    """Sets each endpoint's in-flight count to a value, through routed and finished events."""

    def __init__(self, inflight: InFlight) -> None:
        self._inflight = inflight
        self._ids: dict[str, list[str]] = {}
        self._next = 0

    def set(self, hostport: str, n: int) -> None:
        ids = self._ids.setdefault(hostport, [])
        while len(ids) < n:
            self._next += 1
            ids.append(f"{hostport}-{self._next}")
            self._inflight.on_routed(Routed(completion("x", rid=ids[-1]), hostport))
        while len(ids) > n:
            self._inflight.on_finished(Finished(ids.pop(), ok=True))


def _smoothed(
    tau: float, now: list[float], even: int
) -> tuple[BoundedLoadFilter, InFlight, _Loads, list[Any]]:
    """A smoothed filter over 4 endpoints that has seen each of them at load ``even``."""
    inflight = InFlight()
    bounded = BoundedLoadFilter(1.25, 2, inflight, smoothing=tau, clock=lambda: now[0])
    loads, endpoints = _Loads(inflight), [endpoint() for _ in range(4)]
    for e in endpoints:
        loads.set(e.hostport, even)
    bounded.filter(completion("x"), endpoints)
    return bounded, inflight, loads, endpoints


def test_smoothed_bound_ignores_a_short_swing() -> None:
    """Steady even load, then one endpoint jumps for a moment: with smoothing it stays a
    candidate (its average barely moved), where the instantaneous bound drops it."""
    now = [0.0]
    bounded, inflight, loads, endpoints = _smoothed(3.0, now, 8)
    for step in range(1, 30):  # 3 s of even load, a pick every 0.1 s
        now[0] = step * 0.1
        assert len(bounded.filter(completion("x"), endpoints)) == 4
    loads.set(endpoints[0].hostport, 13)  # past max(1.25 x 9.25, 8 + 2) now
    now[0] += 0.1
    assert bounded.filter(completion("x"), endpoints) == endpoints
    instant = BoundedLoadFilter(1.25, 2, inflight)
    assert endpoints[0] not in instant.filter(completion("x"), endpoints)


def test_smoothed_bound_catches_a_sustained_hot_spot() -> None:
    """The same jump held for about the smoothing time crosses the bound on the average."""
    now = [0.0]
    bounded, _, loads, endpoints = _smoothed(1.0, now, 8)
    loads.set(endpoints[0].hostport, 14)
    kept_after = None
    for step in range(1, 50):
        now[0] = step * 0.1
        if endpoints[0] not in bounded.filter(completion("x"), endpoints):
            kept_after = now[0]
            break
    # the average (8 -> 14, time constant 1 s) passes 1.25 x the mean after about 0.7 s
    assert kept_after is not None
    assert 0.5 < kept_after < 3.0


def test_smoothed_bound_still_caps_a_burst() -> None:
    """A sudden burst past burstFactor x mean is cut at once, before the average moves."""
    now = [0.0]
    bounded, _, loads, endpoints = _smoothed(10.0, now, 4)
    loads.set(endpoints[0].hostport, 15)  # 15 > 2 x 6.75 and > 4 + 2
    now[0] = 0.01
    assert bounded.filter(completion("x"), endpoints) == endpoints[1:]


def test_smoothed_averages_are_forgotten_for_endpoints_that_left() -> None:
    """The table of averages stays bounded by the endpoints picked over the last minute."""
    now = [0.0]
    bounded, _, _, _ = _smoothed(1.0, now, 0)
    others = [endpoint() for _ in range(2)]
    for i in range(BoundedLoadFilter._PRUNE_EVERY):
        now[0] = 61.0 + i * 1e-3
        bounded.filter(completion("x"), others)
    assert set(bounded._averages) == {e.hostport for e in others}


def test_inflight_scorer_spreads_a_burst() -> None:
    """Between scrapes, each routed request makes its endpoint score lower for the next."""
    inflight = InFlight()
    endpoints = [endpoint() for _ in range(3)]
    load_of(inflight, endpoints[0].hostport, 2)
    load_of(inflight, endpoints[1].hostport, 1)
    assert InFlightLoadScorer(inflight).score(completion("x"), endpoints) == [0.0, 0.5, 1.0]


def test_a_prompt_nested_past_the_serialiser_gets_no_prefix_and_no_error() -> None:
    """A prompt nested 1,000 levels deep scores 0 everywhere instead of failing the request."""
    deep: Any = []
    for _ in range(1000):
        deep = [deep]
    request = LLMRequest("r", Api.COMPLETIONS, "m", b"", {"prompt": deep}, target_model="m")
    scorer = PrefixCacheScorer(block_tokens=4, max_blocks=64, lru_capacity=1000, placement=False)
    assert scorer.score(request, [endpoint()]) == [0.0]


def with_headers(headers: dict[str, str], rid: str = "r") -> LLMRequest:
    return LLMRequest(rid, Api.COMPLETIONS, "m", b"", {"prompt": "x"}, "m", headers=headers)


def test_session_tokens_round_trip_and_foreign_tokens_are_ignored() -> None:
    """A token names its endpoint; garbage, oversized or non-ASCII tokens name nothing."""
    assert token_endpoint(session_token("10.0.0.7:8000")) == "10.0.0.7:8000"
    assert token_endpoint(session_token("[fd00::1]:8000")) == "[fd00::1]:8000"
    for junk in ("", "%%%", "x" * 200, "é"):
        assert token_endpoint(junk) is None


def test_session_scorer_prefers_the_token_then_the_remembered_session() -> None:
    """The token's endpoint scores 1; a session id follows where it last went; else all 0."""
    scorer = SessionAffinityScorer("x-session-id", max_sessions=10, placement=False)
    a, b = endpoint(), endpoint()
    token = {"x-session-token": session_token(b.hostport)}
    assert scorer.score(with_headers(token), [a, b]) == [0.0, 1.0]
    assert scorer.score(with_headers({"x-session-id": "s1"}), [a, b]) == [0.0, 0.0]
    scorer.on_routed(Routed(with_headers({"x-session-id": "s1"}), a.hostport))
    assert scorer.score(with_headers({"x-session-id": "s1"}), [a, b]) == [1.0, 0.0]
    gone = endpoint()
    scorer.on_routed(Routed(with_headers({"x-session-id": "s2"}), gone.hostport))
    assert scorer.score(with_headers({"x-session-id": "s2"}), [a, b]) == [0.0, 0.0]


def test_session_memory_is_bounded() -> None:
    """Past maxSessions the least recently routed sessions are forgotten."""
    scorer = SessionAffinityScorer("x-session-id", max_sessions=2, placement=False)
    a = endpoint()
    for session in ("s1", "s2", "s3"):
        scorer.on_routed(Routed(with_headers({"x-session-id": session}), a.hostport))
    assert scorer.score(with_headers({"x-session-id": "s1"}), [a]) == [0.0]
    assert scorer.score(with_headers({"x-session-id": "s3"}), [a]) == [1.0]


def test_prefix_lru_capacity_follows_the_routed_endpoints_kv_cache() -> None:
    """An endpoint reporting its KV cache (num_gpu_blocks x block_size tokens) gets an LRU of
    that many prefix blocks; one reporting nothing keeps ``lruCapacityPerServer``."""
    scorer = PrefixCacheScorer(block_tokens=4, max_blocks=64, lru_capacity=1000, placement=False)
    small = endpoint()
    small = dataclasses.replace(  # 8 tokens of KV cache: 2 blocks of 4 tokens
        small, metrics=dataclasses.replace(small.metrics, num_gpu_blocks=2, block_size=4)
    )
    unknown = endpoint()
    for i in range(3):
        for target in (small, unknown):
            request = completion(f"{i}" * 64, rid=f"{target.hostport}-{i}")  # 4 blocks each
            scorer.score(request, [small, unknown])
            scorer.on_routed(Routed(request, target.hostport))
    assert scorer.index.size == 2 + 12
