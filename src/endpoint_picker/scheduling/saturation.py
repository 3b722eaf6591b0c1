"""Saturation detection: is every candidate endpoint too busy to take sheddable work?

The director asks before scheduling a Sheddable request and answers 429 when the pool is
saturated. Declared in the config's ``plugins`` list like the reference EPP's
``utilization-detector``, but not part of any profile.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from endpoint_picker.errors import ConfigError
from endpoint_picker.scheduling.lifecycle import InFlight
from endpoint_picker.scheduling.registry import Params, PluginContext
from endpoint_picker.types import EndpointState


@runtime_checkable
class SaturationDetector(Protocol):
    def is_saturated(self, candidates: Sequence[EndpointState]) -> bool:
        """True when no candidate has room; an empty candidate list is saturated."""
        ...


@runtime_checkable
class RoomDetector(Protocol):
    """A detector that can also say which candidates have room (the built-in ones do)."""

    def with_room(self, candidates: Sequence[EndpointState]) -> Sequence[EndpointState]:
        """The candidates that have room, in order (empty exactly when ``is_saturated``).
        Flow control schedules its requests among these, so that waiting happens in the
        EPP's priority queues rather than in a server's first-come queue."""
        ...


@runtime_checkable
class PriorityRoomDetector(Protocol):
    """A detector whose room depends on the request's priority (``utilization-detector`` with
    ``criticalRunningRequestsThreshold``): Critical work may fill what lower priorities may not."""

    def with_room_for(
        self, candidates: Sequence[EndpointState], priority: int
    ) -> Sequence[EndpointState]:
        """The candidates with room for a request of ``priority`` (positive: Critical)."""
        ...


RoomFinder = Callable[[Sequence[EndpointState], int], Sequence[EndpointState]]


def room_finder(detector: SaturationDetector) -> RoomFinder:
    """(candidates, priority) -> the candidates with room: ``with_room_for``, else
    ``with_room``, else all candidates or none."""
    if isinstance(detector, PriorityRoomDetector):
        return detector.with_room_for
    if isinstance(detector, RoomDetector):
        with_room = detector.with_room
        return lambda candidates, _priority: with_room(candidates)

    def all_or_none(candidates: Sequence[EndpointState], _priority: int) -> Sequence[EndpointState]:
        return () if detector.is_saturated(candidates) else candidates

    return all_or_none


class UtilizationDetector:
    """Saturated when every candidate has a long queue, a full KV cache or stale metrics.

    Stale metrics count as saturated because an endpoint we cannot see may be drowning; the
    staleness bound here (200 ms) is much tighter than the stale-metrics filter's, since
    shedding is for the pool's health, not for the one request. The queue counted is the
    scraped one plus the requests the EPP routed there since that scrape and that have not
    started yet (no response bytes: still queued, or in their prefill): a burst inside one
    scrape interval (or flow control releasing its queue) cannot all pass on one stale reading,
    and once they start there is room again without waiting for the next scrape. Starts and
    finishes of requests routed before the scrape do not shorten the scraped queue: measured,
    that let lower-priority requests into server queues ahead of later Critical ones (a
    request prefilling at the scrape is running, not waiting, and its first token then looked
    like a queue draining; on a server whose prefills are the bottleneck a finish frees a slot
    nobody takes sooner). A finish does shorten the batch:

    ``runningRequestsThreshold`` (off unless set) also counts an endpoint running more requests
    than that (plus those routed since the scrape, minus those finished since) as saturated:
    with flow control it keeps server batches below their maximum, so that decode steps stay
    short. A decode step's time grows with the batch's KV context, and a first token needs at
    least one step, so a full batch bounds every new request's TTFT from below.
    ``criticalRunningRequestsThreshold`` (default: the same) is the bound for Critical requests
    (flow control's positive priorities): set higher, it keeps the batches short with
    lower-priority work and leaves the difference to Critical requests, which then find short
    steps and a free slot.
    """

    __slots__ = (
        "_clock", "_critical_running", "_inflight", "_kv", "_queue", "_running", "_staleness",
    )  # fmt: skip

    def __init__(
        self,
        *,
        queue_depth_threshold: float = 5,
        kv_cache_util_threshold: float = 0.8,
        metrics_staleness_threshold: float = 0.2,
        running_requests_threshold: float = math.inf,
        critical_running_requests_threshold: float | None = None,
        clock: Callable[[], float],
        inflight: InFlight | None = None,
    ) -> None:
        self._inflight = inflight or InFlight(clock)
        self._queue = queue_depth_threshold
        self._running = running_requests_threshold
        self._critical_running = (
            running_requests_threshold
            if critical_running_requests_threshold is None
            else critical_running_requests_threshold
        )
        self._kv = kv_cache_util_threshold
        self._staleness = metrics_staleness_threshold
        self._clock = clock

    @classmethod
    def from_params(cls, name: str, params: Params, ctx: PluginContext) -> UtilizationDetector:
        running = params.number("runningRequestsThreshold", math.inf, minimum=1)
        critical = params.number("criticalRunningRequestsThreshold", running, minimum=1)
        if critical < running:
            raise ConfigError(
                f"must be at least runningRequestsThreshold ({running:g}): Critical requests "
                f"never get less room than the others, got {critical:g}",
                params.path("criticalRunningRequestsThreshold"),
            )
        return cls(
            queue_depth_threshold=params.number("queueDepthThreshold", 5, minimum=0),
            kv_cache_util_threshold=params.number("kvCacheUtilThreshold", 0.8, minimum=0),
            metrics_staleness_threshold=params.duration("metricsStalenessThreshold", 0.2),
            running_requests_threshold=running,
            critical_running_requests_threshold=critical,
            clock=ctx.clock,
            inflight=ctx.inflight,
        )

    def is_saturated(self, candidates: Sequence[EndpointState]) -> bool:
        has_room = self._has_room()
        return not any(has_room(e) for e in candidates)

    def with_room(self, candidates: Sequence[EndpointState]) -> Sequence[EndpointState]:
        return self.with_room_for(candidates, 0)

    def with_room_for(
        self, candidates: Sequence[EndpointState], priority: int
    ) -> Sequence[EndpointState]:
        has_room = self._has_room(critical=priority > 0)
        return [e for e in candidates if has_room(e)]

    def _has_room(self, critical: bool = False) -> Callable[[EndpointState], bool]:
        oldest = max(self._clock() - self._staleness, 1e-9)
        queue, kv = self._queue, self._kv
        running = self._critical_running if critical else self._running
        inflight = self._inflight

        def has_room(e: EndpointState) -> bool:
            m = e.metrics
            if m.updated_at < oldest or m.kv_cache_usage > kv:
                return False
            hostport, scraped = e.hostport, m.updated_at
            routed = inflight.routed_since(hostport, scraped)
            unstarted = max(0, routed - inflight.started_since(hostport, scraped))
            if m.waiting_queue_size + unstarted > queue:
                return False  # the queue: plus what was sent since and has not started
            # the batch: plus what was sent since, minus what ended since
            return (
                m.running_requests + routed - inflight.finished_since(hostport, scraped) <= running
            )

        return has_room
