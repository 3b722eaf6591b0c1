"""slo-aware-scorer and slo-saturation-detector: headroom against the objective, room left for
best-effort traffic, and saturation when no endpoint can meet the tightest objective."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from tests.unit.scheduling.builders import HEADER, build, clock, endpoint, request

from endpoint_picker.errors import ConfigError
from endpoint_picker.exchange import Lifecycle
from endpoint_picker.requests import LLMRequest
from endpoint_picker.scheduling import describe, load_config
from endpoint_picker.scheduling.latency import LatencyTracker
from endpoint_picker.scheduling.lifecycle import LifecycleListener, Routed
from endpoint_picker.scheduling.plugins import SloAwareScorer, SloSaturationDetector
from endpoint_picker.scheduling.saturation import UtilizationDetector
from endpoint_picker.types import EndpointState

OBJECTIVE = 0.05  # seconds per output token
_ids = itertools.count()


def critical(objective: float | None = OBJECTIVE, model: str = "crit") -> LLMRequest:
    return replace(request(model), request_id=f"q{next(_ids)}", latency_objective=objective)


def teach(
    listener: LifecycleListener,
    e: EndpointState,
    per_token: float,
    n: int = 10,
    objective: float | None = OBJECTIVE,
    model: str = "crit",
) -> None:
    """``n`` requests of ``model`` finished on ``e`` at ``per_token`` seconds per token."""
    lifecycle = Lifecycle([listener])
    for _ in range(n):
        req = critical(objective, model)
        lifecycle.routed(req, e.hostport)
        lifecycle.finished(req.request_id, True, per_token * 100, 100)


def test_objective_requests_score_predicted_headroom() -> None:
    """min(1, comfortable / predicted), comfortable = 80% of the objective: 1.0 with headroom,
    0.8 at the objective, and still falling past it (the least bad miss scores highest)."""
    fast, comfortable, at, past, far = (endpoint() for _ in range(5))
    scorer = SloAwareScorer(LatencyTracker(clock))  # headroom 0.2
    for e, per_token in ((fast, 0.01), (comfortable, 0.04), (at, 0.05), (past, 0.1), (far, 0.2)):
        teach(scorer, e, per_token)
    scores = scorer.score(critical(), [fast, comfortable, at, past, far])
    assert scores == pytest.approx([1.0, 1.0, 0.8, 0.4, 0.2])


def test_no_prediction_yet_is_no_evidence_against_an_endpoint() -> None:
    """With no samples anywhere every endpoint scores 1.0."""
    scorer = SloAwareScorer(LatencyTracker(clock))
    assert scorer.score(critical(), [endpoint(), endpoint()]) == [1.0, 1.0]


@pytest.mark.parametrize(
    ("per_token", "expected"),
    [
        (0.2, [0.0, 2 / 3, 1.0]),  # the objective missed: pressure 1
        (0.0375, [0.5, 5 / 6, 1.0]),  # halfway into the headroom: pressure 0.5
        (0.01, [1.0, 1.0, 1.0]),  # comfortably met: no pressure, no avoidance
    ],
)
def test_best_effort_requests_make_room_as_the_objective_needs(
    per_token: float, expected: list[float]
) -> None:
    """Without an objective: 1 - the endpoint's objective requests in flight relative to the
    busiest endpoint's x how close the objective is to being missed over the pool (its P95)."""
    busy, shared, free = endpoint(), endpoint(), endpoint()
    scorer = SloAwareScorer(LatencyTracker(clock), headroom=0.5)
    teach(scorer, free, per_token)  # the pool's P95: any endpoint's samples count
    assert scorer.score(critical(None), [busy, shared, free]) == [1.0, 1.0, 1.0]  # none in flight
    for e in (busy, busy, busy, shared):
        scorer.on_routed(Routed(critical(), e.hostport))
    scorer.on_routed(Routed(critical(None), free.hostport))  # best effort: not counted
    assert scorer.score(critical(None), [busy, shared, free]) == pytest.approx(expected)


def test_objective_traffic_is_routed_by_headroom_in_a_profile() -> None:
    """In a profile, objective requests go where the objective is met; others elsewhere."""
    parts = build(
        HEADER + "plugins:\n- type: slo-aware-scorer\n  parameters: {minSamples: 3}\n"
        "- type: max-score-picker\n"
    )
    fast, slow = endpoint("fast"), endpoint("slow")
    lifecycle = Lifecycle.of(parts.subscribers)
    for e, per_token in ((fast, 0.04), (slow, 0.2)):  # fast meets the objective, barely
        for _ in range(3):
            req = critical()
            lifecycle.routed(req, e.hostport)
            lifecycle.finished(req.request_id, True, per_token * 50, 50)
    picks = {parts.scheduler.schedule(critical(), [fast, slow]).endpoints[0] for _ in range(20)}
    assert picks == {fast}
    lifecycle.routed(critical(), fast.hostport)  # objective traffic runs short on fast
    best_effort = {
        parts.scheduler.schedule(critical(None), [fast, slow]).endpoints[0] for _ in range(20)
    }
    assert best_effort == {slow}


def detector(tracker: LatencyTracker, queue: float = 5) -> SloSaturationDetector:
    utilization = UtilizationDetector(queue_depth_threshold=queue, clock=clock)
    return SloSaturationDetector(tracker, utilization)


def test_detector_saturated_when_no_endpoint_meets_the_tightest_objective() -> None:
    """Saturated once every candidate is predicted past the tightest recent objective."""
    a, b = endpoint(), endpoint()
    found = detector(LatencyTracker(clock))
    teach(found, a, 0.2, objective=None)  # slow, but no objective traffic seen yet
    teach(found, b, 0.2, objective=None)
    assert not found.is_saturated([a, b])
    teach(found, a, 0.2, n=1, objective=0.5, model="loose")
    assert not found.is_saturated([a, b])  # 0.2 meets 0.5
    teach(found, a, 0.2, n=1, objective=OBJECTIVE)
    assert found.is_saturated([a, b])
    fresh = endpoint()
    teach(found, fresh, 0.01, objective=None)
    assert not found.is_saturated([a, b, fresh])  # one endpoint can meet it
    assert list(found.with_room([a, b, fresh])) == [fresh]  # flow control schedules there


def test_room_needs_both_the_thresholds_and_the_objective() -> None:
    """An endpoint predicted to meet the objective but over the queue threshold has no room,
    nor has one under the threshold predicted past the objective: together, saturated."""
    slow, queued = endpoint(queue=0), endpoint(queue=9)
    found = detector(LatencyTracker(clock), queue=3)
    teach(found, slow, 0.2, objective=OBJECTIVE)
    teach(found, queued, 0.01, objective=OBJECTIVE)
    assert found.is_saturated([slow, queued])
    assert not found.with_room([slow, queued])


def test_detector_keeps_the_utilization_thresholds() -> None:
    """A long queue everywhere is saturated with no latency data at all; none candidate too."""
    found = detector(LatencyTracker(clock), queue=3)
    assert found.is_saturated([endpoint(queue=9), endpoint(queue=4)])
    assert not found.is_saturated([endpoint(queue=9), endpoint(queue=1)])
    assert found.is_saturated([])


def test_plugins_are_registered_and_take_the_reference_parameter_style() -> None:
    """Both types build from config with camelCase parameters; the detector replaces the
    default one."""
    text = (
        HEADER + "plugins:\n"
        "- type: slo-aware-scorer\n"
        "  parameters: {windowSeconds: 10s, minSamples: 5, maxSamples: 100, headroom: 0.3}\n"
        "- type: slo-saturation-detector\n"
        "  parameters: {windowSeconds: 20, queueDepthThreshold: 3, kvCacheUtilThreshold: 0.5}\n"
    )
    summary = describe(load_config(text))
    assert "scorers: slo-aware-scorer (weight 1)" in summary
    assert "saturation detector: slo-saturation-detector" in summary
    parts = build(text)
    assert isinstance(parts.saturation_detector, SloSaturationDetector)


@pytest.mark.parametrize(
    ("plugin", "parameters", "path"),
    [
        ("slo-aware-scorer", "{windowSeconds: 0}", "windowSeconds"),
        ("slo-aware-scorer", "{windowSeconds: soon}", "windowSeconds"),
        ("slo-aware-scorer", "{minSamples: 0}", "minSamples"),
        ("slo-aware-scorer", "{headroom: 1.5}", "headroom"),
        ("slo-aware-scorer", "{objective: 50ms}", "objective"),
        ("slo-saturation-detector", "{maxSamples: 0}", "maxSamples"),
        ("slo-saturation-detector", "{queueDepthThreshold: -1}", "queueDepthThreshold"),
    ],
)
def test_bad_parameters_name_their_path(plugin: str, parameters: str, path: str) -> None:
    """Out-of-range, mistyped and unknown parameters are config errors at their exact path."""
    text = HEADER + f"plugins:\n- type: {plugin}\n  parameters: {parameters}\n"
    with pytest.raises(ConfigError, match=rf"plugins\[0\]\.parameters\.{path}"):
        load_config(text)
