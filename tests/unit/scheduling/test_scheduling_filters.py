"""The stale-metrics filter and the utilization saturation detector."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from tests.unit.scheduling.builders import clock, endpoint, request

from endpoint_picker.scheduling import room_finder
from endpoint_picker.scheduling.plugins import StaleMetricsFilter, UtilizationDetector
from endpoint_picker.types import EndpointState


def names(eps: object) -> list[str]:
    return [e.endpoint.pod_name for e in eps]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("ages", "kept"),
    [
        ([0.0, 1.9, 2.5], ["e0", "e1"]),  # older than 2 s is dropped
        ([2.0], ["e0"]),  # exactly at the threshold is still fresh
        ([3.0, None], ["e0", "e1"]),  # nothing fresh: fail open, all stay
        ([None, 0.5], ["e1"]),  # never scraped counts as stale
        ([], []),
    ],
)
def test_stale_metrics_filter(ages: list[float | None], kept: list[str]) -> None:
    """Stale endpoints are dropped unless no fresh one is left (then all stay)."""
    eps = [endpoint(f"e{i}", age=a) for i, a in enumerate(ages)]
    assert names(StaleMetricsFilter(2.0, clock).filter(request(), eps)) == kept


DETECTOR = UtilizationDetector(clock=clock)


def ok(**overrides: object) -> EndpointState:
    fields: dict[str, object] = {"queue": 1, "kv": 0.2, "age": 0.05}
    fields.update(overrides)
    return endpoint(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("candidates", "saturated"),
    [
        ([ok()], False),
        ([ok(queue=5)], False),  # at the threshold: not over it
        ([ok(queue=6)], True),
        ([ok(kv=0.8)], False),
        ([ok(kv=0.81)], True),
        ([ok(age=0.3)], True),  # metrics older than 200 ms
        ([ok(age=None)], True),  # never scraped
        ([ok(queue=9), ok(kv=0.95), ok(age=1.0)], True),  # every one saturated
        ([ok(queue=9), ok(), ok(age=1.0)], False),  # one with room is enough
        ([], True),  # no candidates: saturated
    ],
)
def test_utilization_detector(candidates: list[EndpointState], saturated: bool) -> None:
    """The pool is saturated only when every candidate is over a threshold or stale."""
    assert DETECTOR.is_saturated(candidates) is saturated
    assert (not DETECTOR.with_room(candidates)) is saturated


def test_with_room_keeps_exactly_the_unsaturated_candidates_in_order() -> None:
    """Flow control schedules among these: a long queue, a full cache or stale metrics is out."""
    first, long_queue, full, stale, second = ok(), ok(queue=9), ok(kv=0.95), ok(age=1.0), ok()
    roomy = DETECTOR.with_room([first, long_queue, full, stale, second])
    assert [e.hostport for e in roomy] == [first.hostport, second.hostport]


def test_utilization_detector_thresholds_are_configurable() -> None:
    """Custom thresholds replace the defaults."""
    strict = UtilizationDetector(
        queue_depth_threshold=0,
        kv_cache_util_threshold=0.1,
        metrics_staleness_threshold=5.0,
        clock=clock,
    )
    assert strict.is_saturated([ok(queue=1, kv=0.0, age=0.0)])
    assert not strict.is_saturated([ok(queue=0, kv=0.05, age=4.0)])


def test_a_detector_without_with_room_gives_all_candidates_or_none() -> None:
    """A custom detector with only is_saturated still works under flow control."""

    class OnlySaturation:
        def __init__(self, saturated: bool) -> None:
            self.saturated = saturated

        def is_saturated(self, candidates: Sequence[EndpointState]) -> bool:
            return self.saturated

    candidates = [ok(), ok(queue=9)]
    assert list(room_finder(OnlySaturation(False))(candidates, 0)) == candidates
    assert not room_finder(OnlySaturation(True))(candidates, 0)
    assert room_finder(DETECTOR)(candidates, 0) == [candidates[0]]


def test_running_requests_threshold_keeps_room_below_a_full_batch() -> None:
    """Off by default; set, an endpoint running more than it (plus requests routed there since
    the scrape) has no room, so flow control holds requests back before batches are full."""
    busy, light = endpoint(running=40, queue=0), endpoint(running=10, queue=0)
    assert DETECTOR.with_room([busy, light]) == [busy, light]
    capped = UtilizationDetector(running_requests_threshold=32, clock=clock)
    assert capped.with_room([busy, light]) == [light]
    assert capped.is_saturated([busy])
