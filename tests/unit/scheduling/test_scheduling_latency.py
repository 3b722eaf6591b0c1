"""LatencyTracker: per-output-token latency from lifecycle events, windowed, fitted, purged."""

from __future__ import annotations

import itertools

import pytest

from endpoint_picker.requests import Api, LLMRequest
from endpoint_picker.scheduling.latency import Z_95, LatencyTracker, p95
from endpoint_picker.scheduling.lifecycle import Finished, Routed


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


_ids = itertools.count()


def routed(
    tracker: LatencyTracker, endpoint: str, model: str = "m", objective: float | None = None
) -> str:
    request_id = f"r{next(_ids)}"
    request = LLMRequest(
        request_id=request_id,
        api=Api.COMPLETIONS,
        model=model,
        raw_body=b"{}",
        body={},
        target_model=model,
        latency_objective=objective,
    )
    tracker.on_routed(Routed(request, endpoint))
    return request_id


def sample(
    tracker: LatencyTracker,
    endpoint: str,
    per_token: float,
    *,
    model: str = "m",
    tokens: int = 100,
    ok: bool = True,
) -> None:
    """One request routed to ``endpoint`` and finished at ``per_token`` seconds per token."""
    request_id = routed(tracker, endpoint, model)
    tracker.on_finished(Finished(request_id, ok, per_token * tokens, tokens))


def test_p95_interpolates_between_closest_ranks() -> None:
    """P95 of 1..21 is the 20th value; of two values, 95% of the way between them."""
    assert p95([float(v) for v in range(1, 22)]) == 20.0
    assert p95([0.0, 1.0]) == pytest.approx(0.95)
    assert p95([3.0]) == 3.0


def test_observed_p95_per_endpoint_and_model() -> None:
    """With enough samples the prediction is the observed P95 of that endpoint and model."""
    tracker = LatencyTracker(Clock(), min_samples=5)
    for value in (0.01, 0.02, 0.03, 0.04, 0.10):
        sample(tracker, "a", value)
    sample(tracker, "a", 0.5, model="other")
    assert tracker.samples("a", "m") == 5
    assert tracker.predict("a", "m", load=1) == pytest.approx(p95([0.01, 0.02, 0.03, 0.04, 0.10]))


@pytest.mark.parametrize(
    ("ok", "tokens", "seconds"),
    [(False, 100, 1.0), (True, 0, 1.0), (True, None, 1.0), (True, 100, None), (True, 100, 0.0)],
)
def test_failures_and_empty_responses_are_no_samples(
    ok: bool, tokens: int | None, seconds: float | None
) -> None:
    """A failed stream, zero or unknown output tokens, or no duration teach nothing."""
    tracker = LatencyTracker(Clock())
    request_id = routed(tracker, "a")
    tracker.on_finished(Finished(request_id, ok, seconds, tokens))
    assert tracker.samples("a", "m") == 0
    assert tracker.predict("a", "m", load=1) is None


def test_samples_leave_the_window_by_age_and_by_count() -> None:
    """Samples older than the window are forgotten; past max_samples the oldest go first."""
    clock = Clock()
    tracker = LatencyTracker(clock, window=30.0, max_samples=3, min_samples=1)
    sample(tracker, "a", 0.9)
    clock.now += 20
    for value in (0.01, 0.02):
        sample(tracker, "a", value)
    assert tracker.samples("a", "m") == 3
    clock.now += 15  # the first sample is 35 s old
    assert tracker.samples("a", "m") == 2
    assert tracker.predict("a", "m", load=1) == pytest.approx(p95([0.01, 0.02]))
    for value in (0.03, 0.04):
        sample(tracker, "a", value)
    assert tracker.samples("a", "m") == 3  # 0.01 left by count
    assert tracker.predict("a", "m", load=1) == pytest.approx(p95([0.02, 0.03, 0.04]))
    clock.now += 31
    assert tracker.samples("a", "m") == 0
    assert tracker.predict("a", "m", load=1) is None


def test_the_fit_predicts_from_load_where_there_are_no_samples_of_the_model() -> None:
    """Latency per token fitted against load: exact for a line, slope never negative."""
    tracker = LatencyTracker(Clock())
    # loads 1, 2, 3 (each request routed while the earlier ones are still in flight)
    ids = [routed(tracker, "a", "other") for _ in range(3)]
    for request_id, per_token in zip(ids, (0.02, 0.03, 0.04), strict=True):
        tracker.on_finished(Finished(request_id, True, per_token * 10, 10))
    assert tracker.predict("a", "m", load=5) == pytest.approx(0.06)  # 0.01 + 0.01 x load
    # faster under more load is noise: the slope is clamped to 0, the line is the mean
    flat = LatencyTracker(Clock())
    ids = [routed(flat, "b", "other") for _ in range(2)]
    for request_id, per_token in zip(ids, (0.04, 0.02), strict=True):
        flat.on_finished(Finished(request_id, True, per_token * 10, 10))
    spread = (0.01**2 * 2 / 1) ** 0.5  # the residuals' sample sd around the mean 0.03
    assert flat.predict("b", "m", load=9) == pytest.approx(0.03 + Z_95 * spread)


def test_few_samples_blend_the_observation_with_the_fit() -> None:
    """Below min_samples the observed P95 weighs n / min_samples, the fit the rest."""
    tracker = LatencyTracker(Clock(), min_samples=4)
    for _ in range(3):
        sample(tracker, "a", 0.02, model="other")
    sample(tracker, "a", 0.06)  # one sample of m: weight 1/4
    fitted = (3 * 0.02 + 0.06) / 4 + Z_95 * (3 * 0.01**2 + 0.03**2) ** 0.5 / 3**0.5
    assert tracker.predict("a", "m", load=1) == pytest.approx(0.25 * 0.06 + 0.75 * fitted)


def test_the_observation_moves_along_the_slope_to_todays_load() -> None:
    """An observed P95 met at load 1 is predicted higher at load 5, by the fitted slope."""
    tracker = LatencyTracker(Clock(), min_samples=1)
    ids = [routed(tracker, "a", "other") for _ in range(3)]  # loads 1, 2, 3
    for request_id, per_token in zip(ids, (0.02, 0.03, 0.04), strict=True):
        tracker.on_finished(Finished(request_id, True, per_token * 10, 10))
    sample(tracker, "a", 0.02)  # m at load 1
    assert tracker.predict("a", "m", load=1) == pytest.approx(0.02)
    assert tracker.predict("a", "m", load=5) == pytest.approx(0.02 + 4 * 0.01)


def test_an_endpoint_without_samples_uses_the_pool_line() -> None:
    """A new endpoint is predicted from every endpoint's samples; nothing anywhere: None."""
    tracker = LatencyTracker(Clock())
    assert tracker.predict("new", "m", load=1) is None
    for _ in range(4):
        sample(tracker, "a", 0.03)
    assert tracker.predict("new", "m", load=1) == pytest.approx(0.03)


def test_endpoints_that_leave_are_forgotten() -> None:
    """Purged endpoints lose their samples; requests in flight there still finish cleanly."""
    tracker = LatencyTracker(Clock(), min_samples=1)
    sample(tracker, "a", 0.5)
    sample(tracker, "b", 0.01)
    in_flight = routed(tracker, "a")
    tracker.on_endpoints(frozenset({"b"}))
    assert tracker.samples("a", "m") == 0
    assert tracker.predict("a", "m", load=1) != pytest.approx(0.5)  # the pool line now
    tracker.on_finished(Finished(in_flight, True, 1.0, 10))
    assert tracker.load("a") == 0
    assert tracker.samples("b", "m") == 1


def test_load_and_objective_load_follow_requests_in_flight() -> None:
    """Load counts every request in flight; objective load counts those with an objective."""
    tracker = LatencyTracker(Clock())
    assert tracker.objective_load("a") == 0
    first = routed(tracker, "a", "crit", objective=0.05)
    routed(tracker, "a", "crit", objective=0.05)
    routed(tracker, "b", "crit", objective=0.05)
    routed(tracker, "b")
    assert (tracker.load("a"), tracker.load("b")) == (2, 2)
    assert (tracker.objective_load("a"), tracker.objective_load("b")) == (2, 1)
    tracker.on_finished(Finished(first, False))
    assert tracker.objective_load("a") == 1
    assert tracker.load("a") == 1


def test_the_most_demanding_objective_seen_in_the_window() -> None:
    """The tightest objective routed within the window, with its model; it ages out."""
    clock = Clock()
    tracker = LatencyTracker(clock, window=10.0)
    assert tracker.most_demanding() is None
    routed(tracker, "a", "tight", objective=0.02)
    clock.now += 6
    routed(tracker, "a", "loose", objective=0.08)
    routed(tracker, "a", "none")
    assert tracker.most_demanding() == ("tight", 0.02)
    clock.now += 5
    assert tracker.most_demanding() == ("loose", 0.08)


def test_the_pools_observed_p95_outlives_its_endpoints() -> None:
    """observed(model) is the P95 over every endpoint's samples; it keeps those of endpoints
    that left until they age out of the window."""
    clock = Clock()
    tracker = LatencyTracker(clock, window=10.0)
    assert tracker.observed("m") is None
    for value in (0.01, 0.02):
        sample(tracker, "a", value)
    sample(tracker, "b", 0.03)
    sample(tracker, "b", 0.5, model="other")
    assert tracker.observed("m") == pytest.approx(p95([0.01, 0.02, 0.03]))
    tracker.on_endpoints(frozenset({"b"}))
    assert tracker.observed("m") == pytest.approx(p95([0.01, 0.02, 0.03]))
    clock.now += 11
    assert tracker.observed("m") is None
