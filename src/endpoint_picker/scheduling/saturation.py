"""Saturation detection: is every candidate endpoint too busy to take sheddable work?

The director asks before scheduling a Sheddable request and answers 429 when the pool is
saturated. Declared in the config's ``plugins`` list like the reference EPP's
``utilization-detector``, but not part of any profile.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

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


def room_finder(
    detector: SaturationDetector,
) -> Callable[[Sequence[EndpointState]], Sequence[EndpointState]]:
    """``detector.with_room``; for a detector without it, all candidates or none."""
    if isinstance(detector, RoomDetector):
        return detector.with_room

    def all_or_none(candidates: Sequence[EndpointState]) -> Sequence[EndpointState]:
        return () if detector.is_saturated(candidates) else candidates

    return all_or_none


class UtilizationDetector:
    """Saturated when every candidate has a long queue, a full KV cache or stale metrics.

    Stale metrics count as saturated because an endpoint we cannot see may be drowning; the
    staleness bound here (200 ms) is much tighter than the stale-metrics filter's, since
    shedding is for the pool's health, not for the one request. The queue counted is the
    scraped one plus the requests the EPP routed there since that scrape: a burst inside one
    scrape interval (or flow control releasing its queue) cannot all pass on one stale reading.

    ``runningRequestsThreshold`` (off unless set) also counts an endpoint running more requests
    than that (plus those routed since the scrape) as saturated: with flow control it keeps
    server batches below their maximum, so a Critical request finds a free slot and a short
    decode step rather than a full batch (a full batch's step time bounds its first token).
    """

    __slots__ = ("_clock", "_inflight", "_kv", "_queue", "_running", "_staleness")

    def __init__(
        self,
        *,
        queue_depth_threshold: float = 5,
        kv_cache_util_threshold: float = 0.8,
        metrics_staleness_threshold: float = 0.2,
        running_requests_threshold: float = math.inf,
        clock: Callable[[], float],
        inflight: InFlight | None = None,
    ) -> None:
        self._inflight = inflight or InFlight(clock)
        self._queue = queue_depth_threshold
        self._running = running_requests_threshold
        self._kv = kv_cache_util_threshold
        self._staleness = metrics_staleness_threshold
        self._clock = clock

    @classmethod
    def from_params(cls, name: str, params: Params, ctx: PluginContext) -> UtilizationDetector:
        return cls(
            queue_depth_threshold=params.number("queueDepthThreshold", 5, minimum=0),
            kv_cache_util_threshold=params.number("kvCacheUtilThreshold", 0.8, minimum=0),
            metrics_staleness_threshold=params.duration("metricsStalenessThreshold", 0.2),
            running_requests_threshold=params.number(
                "runningRequestsThreshold", math.inf, minimum=1
            ),
            clock=ctx.clock,
            inflight=ctx.inflight,
        )

    def is_saturated(self, candidates: Sequence[EndpointState]) -> bool:
        has_room = self._has_room()
        return not any(has_room(e) for e in candidates)

    def with_room(self, candidates: Sequence[EndpointState]) -> Sequence[EndpointState]:
        has_room = self._has_room()
        return [e for e in candidates if has_room(e)]

    def _has_room(self) -> Callable[[EndpointState], bool]:
        oldest = max(self._clock() - self._staleness, 1e-9)
        queue, kv, running = self._queue, self._kv, self._running
        routed_since = self._inflight.routed_since

        def has_room(e: EndpointState) -> bool:
            m = e.metrics
            if m.updated_at < oldest or m.kv_cache_usage > kv:
                return False
            since = routed_since(e.hostport, m.updated_at)
            return m.waiting_queue_size + since <= queue and m.running_requests + since <= running

        return has_room
