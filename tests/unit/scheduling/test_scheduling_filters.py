"""The stale-metrics filter and the utilization saturation detector."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
from tests.unit.scheduling.builders import NOW, clock, endpoint, request

from endpoint_picker.scheduling import room_finder
from endpoint_picker.scheduling.lifecycle import Finished, InFlight, Routed
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


def test_a_scraped_reading_is_brought_up_to_date_by_routes_starts_and_finishes() -> None:
    """After a scrape, a request routed to an endpoint joins its queue until it starts (first
    response bytes) and its batch until it finishes: room comes back as the EPP's own requests
    start or end, not at the next scrape. Starts and finishes of requests routed before the
    scrape never shorten the scraped queue (one may have been prefilling, which is running);
    their finishes do shorten the batch."""
    now = [NOW - 1.0]
    inflight = InFlight(lambda: now[0])
    detector = UtilizationDetector(
        queue_depth_threshold=0, running_requests_threshold=4, clock=clock, inflight=inflight
    )

    def route(request_id: str, to: EndpointState) -> None:
        inflight.on_routed(Routed(replace(request(), request_id=request_id), to.hostport))

    def with_room(*candidates: EndpointState) -> list[str]:
        return names(detector.with_room(candidates))

    idle = endpoint("idle", queue=0, running=2, age=0.05)  # scraped at NOW - 0.05
    queued = endpoint("queued", queue=1, running=2, age=0.05)
    full = endpoint("full", queue=0, running=5, age=0.05)  # a batch over the cap of 4
    for request_id, to in (("i-old", idle), ("q-old", queued), ("f-old", full)):
        route(request_id, to)  # before the scrape: already in its reading
    now[0] = NOW - 0.04
    assert with_room(idle, queued, full) == ["idle"]
    route("i-new", idle)
    assert with_room(idle) == []  # it waits there now
    inflight.on_started("i-old")
    inflight.on_finished(Finished("i-old", ok=True))
    assert with_room(idle) == []  # older requests say nothing about the queue
    inflight.on_started("i-new")
    assert with_room(idle) == ["idle"]  # it left the queue
    inflight.on_started("q-old")
    assert with_room(queued) == []  # the scraped queue stays until the next scrape
    inflight.on_finished(Finished("f-old", ok=True))  # the batch is back to 4
    assert with_room(full) == ["full"]
    route("f-new", full)
    inflight.on_started("f-new")
    assert with_room(full) == []  # out of the queue, but in the batch: 5 again
    inflight.on_finished(Finished("f-new", ok=True))
    inflight.on_finished(Finished("f-new", ok=True))  # a second finish counts nothing
    inflight.on_started("unknown")  # a request this EPP never routed counts nothing
    assert with_room(full) == ["full"]
    assert inflight.finished_since(full.hostport, full.metrics.updated_at) == 2
    assert inflight.started_since(idle.hostport, idle.metrics.updated_at) == 1


def test_starts_count_once_and_only_on_endpoints_in_the_pool() -> None:
    """A request id reused by two streams starts once; requests on an endpoint that left the
    pool (and came back) neither start nor finish there in the counts, and no table is
    recreated for an endpoint that is gone."""
    inflight = InFlight(lambda: NOW)

    def route(request_id: str, hostport: str) -> None:
        inflight.on_routed(Routed(replace(request(), request_id=request_id), hostport))

    route("dup", "10.0.0.1:8000")
    route("dup", "10.0.0.2:8000")  # the same x-request-id on a second stream
    inflight.on_started("dup")
    inflight.on_started("dup")
    assert inflight.started_since("10.0.0.2:8000", NOW) == 1
    for request_id in ("a", "b"):
        route(request_id, "10.0.0.3:8000")
    inflight.on_endpoints(frozenset({"10.0.0.1:8000", "10.0.0.2:8000"}))  # .3 left
    inflight.on_started("a")
    inflight.on_finished(Finished("b", ok=True))
    assert inflight.started_since("10.0.0.3:8000", NOW) == 0
    assert inflight.finished_since("10.0.0.3:8000", NOW) == 0
    assert inflight.count("10.0.0.3:8000") == 1  # "a" is still in flight there
