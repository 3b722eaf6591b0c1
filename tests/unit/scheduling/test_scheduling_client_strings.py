"""What the scheduler's plugins remember from a client's strings (session ids, unknown model
and adapter names) is cut where it is kept, and still works as a key."""

from __future__ import annotations

import sys

from tests.unit.scheduling.builders import endpoint
from tests.unit.scheduling.test_scheduling_latency import Clock, sample
from tests.unit.scheduling.test_scheduling_prefix import with_headers

from endpoint_picker.requests import Api, LLMRequest
from endpoint_picker.scheduling.latency import MAX_MODELS, LatencyTracker
from endpoint_picker.scheduling.lifecycle import Routed
from endpoint_picker.scheduling.plugins.scorers import LoraAffinityScorer
from endpoint_picker.scheduling.plugins.session import SessionAffinityScorer

MB = 1024 * 1024


class NoRing:
    """The LoRA scorer never walks the ring."""

    def walk(self, key: int, count: int) -> list[str]:
        raise AssertionError("not walked")


def key_bytes(keys: object) -> int:
    """Bytes of the string keys (or the strings in tuple keys) of a table."""
    total = 0
    for key in keys:  # type: ignore[attr-defined]
        for part in key if isinstance(key, tuple) else (key,):
            total += sys.getsizeof(part)
    return total


def test_megabyte_session_ids_are_kept_cut_and_still_follow_their_session() -> None:
    """100 sessions with 1 MB ids leave the session map under 50 KB of keys; each long id
    still finds its endpoint, and two ids that differ past the cut stay two sessions."""
    scorer = SessionAffinityScorer("x-session-id", max_sessions=1000, placement=False)
    a, b = endpoint(), endpoint()
    for i in range(100):
        target = a if i % 2 else b
        session = "s" * MB + str(i)  # the difference after the first megabyte
        scorer.on_routed(Routed(with_headers({"x-session-id": session}), target.hostport))
    assert key_bytes(scorer._sessions) < 50_000
    assert scorer.score(with_headers({"x-session-id": "s" * MB + "7"}), [a, b]) == [1.0, 0.0]
    assert scorer.score(with_headers({"x-session-id": "s" * MB + "8"}), [a, b]) == [0.0, 1.0]


def test_a_megabyte_adapter_name_is_kept_cut_and_still_preferred() -> None:
    """An unknown model's 1 MB name, routed 20 times under 20 names, leaves the LoRA scorer's
    tables small; the same name is preferred where it went."""
    scorer = LoraAffinityScorer()
    ep = endpoint(max_lora=4)
    for i in range(20):
        name = f"{i}" + "a" * MB
        request = LLMRequest(f"r{i}", Api.COMPLETIONS, name, b"{}", {}, name)
        scorer.score(request, [ep])
        scorer.on_routed(Routed(request, ep.hostport))
    assert key_bytes(scorer._recent) < 20_000
    again = LLMRequest("r99", Api.COMPLETIONS, "7" + "a" * MB, b"{}", {}, "7" + "a" * MB)
    assert tuple(scorer.preferred(again, NoRing())) == (ep.hostport,)


def test_latency_windows_of_made_up_models_are_bounded_in_number_and_size() -> None:
    """MAX_MODELS + 200 distinct 64 KB model names each finishing once leave at most MAX_MODELS
    models with windows, keys cut; a model tracked before keeps its prediction."""
    tracker = LatencyTracker(Clock(), min_samples=1)
    sample(tracker, "a", 0.02, model="m")
    for i in range(MAX_MODELS + 200):
        sample(tracker, "a", 0.05, model=f"{i}" + "x" * 65536)
    assert len({model for _, model in tracker._tails}) <= MAX_MODELS
    assert key_bytes(tracker._tails) < 2 * MAX_MODELS * 1000
    assert tracker.predict("a", "m", load=1) == 0.02
