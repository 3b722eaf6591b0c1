"""The profile runner and scheduler: ordering, clamping, weighting, timing."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from tests.unit.scheduling.builders import build, endpoint, request

from endpoint_picker.errors import InternalError
from endpoint_picker.requests import LLMRequest
from endpoint_picker.scheduling import Scheduler, SchedulerProfile
from endpoint_picker.scheduling.plugins import SingleProfileHandler
from endpoint_picker.scheduling.scheduler import PluginRef, WeightedScorer
from endpoint_picker.types import EndpointState


class FixedScorer:
    """Returns the scores it was given, whatever the endpoints."""

    def __init__(self, scores: Sequence[float]) -> None:
        self.scores = list(scores)

    def score(self, request: LLMRequest, endpoints: Sequence[EndpointState]) -> Sequence[float]:
        return self.scores


class RecordingPicker:
    """Records the totals it saw and picks the first endpoint."""

    def __init__(self) -> None:
        self.totals: list[float] = []

    def pick(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], scores: Sequence[float]
    ) -> Sequence[EndpointState]:
        self.totals = list(scores)
        return endpoints[:1]


class DropFilter:
    """Drops the endpoints named in ``names`` and records what it saw."""

    def __init__(self, *names: str) -> None:
        self.names = set(names)
        self.seen: list[str] | None = None

    def filter(
        self, request: LLMRequest, endpoints: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        self.seen = [e.endpoint.pod_name for e in endpoints]
        return [e for e in endpoints if e.endpoint.pod_name not in self.names]


def ref(name: str) -> PluginRef:
    return PluginRef(name, f"{name}-type", None)


def profile(
    scorers: Sequence[tuple[Sequence[float], float]] = (),
    filters: Sequence[DropFilter] = (),
    picker: RecordingPicker | None = None,
    observer: RecordingObserver | None = None,
) -> tuple[SchedulerProfile, RecordingPicker]:
    picker = picker or RecordingPicker()
    weighted = [WeightedScorer(ref(f"s{i}"), FixedScorer(s), w) for i, (s, w) in enumerate(scorers)]
    prof = SchedulerProfile(
        "p",
        [(ref(f"f{i}"), f) for i, f in enumerate(filters)],
        weighted,
        (ref("picker"), picker),
        observer=observer,
    )
    return prof, picker


class RecordingObserver:
    def __init__(self) -> None:
        self.plugins: list[tuple[str, str, str]] = []
        self.cycles: list[float] = []

    def plugin_duration(
        self, extension_point: str, plugin_type: str, plugin_name: str, seconds: float
    ) -> None:
        assert seconds >= 0
        self.plugins.append((extension_point, plugin_type, plugin_name))

    def scheduler_duration(self, seconds: float) -> None:
        self.cycles.append(seconds)


def test_runner_clamps_out_of_range_scores() -> None:
    """A scorer's 1.7 counts as 1 and its -0.3 as 0."""
    prof, picker = profile(scorers=[([1.7, -0.3, 0.5], 1.0)])
    prof.run(request(), [endpoint(), endpoint(), endpoint()])
    assert picker.totals == [1.0, 0.0, 0.5]


def test_runner_weights_and_sums_scores() -> None:
    """Totals are the weighted sum of the (clamped) scores."""
    prof, picker = profile(scorers=[([1.0, 0.5], 2.0), ([0.0, 1.0], 3.0), ([9.0, 9.0], 0.0)])
    prof.run(request(), [endpoint(), endpoint()])
    assert picker.totals == pytest.approx([2.0, 4.0])


def test_filters_run_in_order_and_stop_when_empty() -> None:
    """Each filter sees what the previous one left; none runs after one empties the list."""
    first, second, third = DropFilter("a"), DropFilter("b"), DropFilter()
    prof, picker = profile(filters=[first, second, third])
    result = prof.run(request(), [endpoint("a"), endpoint("b")])
    assert first.seen == ["a", "b"]
    assert second.seen == ["b"]
    assert third.seen is None
    assert result == ()
    assert picker.totals == []


def test_scorer_returning_wrong_length_is_an_internal_error() -> None:
    """A scorer whose scores do not line up with the endpoints fails loudly, not silently."""
    prof, _ = profile(scorers=[([1.0], 1.0)])
    with pytest.raises(InternalError, match="returned 1 scores for 2 endpoints"):
        prof.run(request(), [endpoint(), endpoint()])


def test_observer_receives_every_plugin_timing() -> None:
    """With an observer, every filter, scorer and picker run and the whole cycle are timed."""
    observer = RecordingObserver()
    prof, _ = profile(scorers=[([1.0], 1.0)], filters=[DropFilter()], observer=observer)
    scheduler = Scheduler([prof], SingleProfileHandler(), observer=observer)
    result = scheduler.schedule(request(), [endpoint("x")])
    assert [e.endpoint.pod_name for e in result.endpoints] == ["x"]
    assert observer.plugins == [
        ("Filter", "f0-type", "f0"),
        ("Scorer", "s0-type", "s0"),
        ("Picker", "picker-type", "picker"),
    ]
    assert len(observer.cycles) == 1


def test_default_scheduler_prefers_the_idle_endpoint() -> None:
    """The default profile routes to the endpoint with the short queue and free KV cache."""
    parts = build()
    busy = [endpoint(queue=8, kv=0.9) for _ in range(5)]
    idle = endpoint("idle", queue=0, kv=0.1)
    result = parts.scheduler.schedule(request(), [*busy, idle, *busy])
    assert result.profile == "default"
    assert [e.endpoint.pod_name for e in result.endpoints] == ["idle"]


def test_default_scheduler_returns_fallbacks_best_first() -> None:
    """With fallbacks configured the result holds 1 + N distinct endpoints, best first."""
    parts = build(fallbacks=2)
    eps = [endpoint(f"q{q}", queue=q) for q in (4, 0, 8, 2, 6)]
    result = parts.scheduler.schedule(request(), eps)
    assert [e.endpoint.pod_name for e in result.endpoints] == ["q0", "q2", "q4"]


def test_default_scheduler_with_no_candidates_returns_nothing() -> None:
    """No candidates: an empty result (the director answers 503), not an exception."""
    result = build().scheduler.schedule(request(), [])
    assert result.endpoints == ()
    assert result.profile == "default"


def test_record_sink_gets_each_routed_cycle_with_its_running_sums() -> None:
    """The record sink gets the request's ids, the picks and one running sum per scorer; a
    cycle whose filters leave nothing is not recorded."""
    records: list[tuple[object, ...]] = []
    prof, _ = profile(scorers=[([0.5, 1.0], 2.0), ([1.0, 0.25], 4.0)], filters=[DropFilter("gone")])
    scheduler = Scheduler([prof], SingleProfileHandler(), record=records.append)
    eps = [endpoint("a"), endpoint("b")]
    scheduler.schedule(request("m"), eps)
    scheduler.schedule(request("m"), [endpoint("gone")])  # nothing left: not a decision
    ((_, request_id, model, target, candidates, recorded, picked, cycle),) = records
    assert (request_id, model, target, candidates, recorded) == ("req-1", "m", "m", 2, prof)
    assert [e.endpoint.pod_name for e in picked] == ["a"]
    assert cycle == (eps, [[0.0, 0.0], [1.0, 2.0], [5.0, 3.0]])
    assert prof.scorer_weights == (("s0", 2.0), ("s1", 4.0))
