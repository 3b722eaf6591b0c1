"""Built-in filters."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from endpoint_picker.requests import LLMRequest
from endpoint_picker.scheduling.registry import Params, PluginContext
from endpoint_picker.types import EndpointState


class StaleMetricsFilter:
    """Drops endpoints whose metrics are older than a threshold, unless that would drop them all.

    Scores computed from stale metrics mislead the scorers, but an endpoint we know little
    about still beats no endpoint at all: when nothing fresh is left, everything stays (fail
    open). Never-scraped endpoints (``updated_at == 0``) count as stale.
    """

    __slots__ = ("_clock", "_threshold")

    def __init__(self, threshold: float, clock: Callable[[], float]) -> None:
        self._threshold = threshold
        self._clock = clock

    @classmethod
    def from_params(cls, name: str, params: Params, ctx: PluginContext) -> StaleMetricsFilter:
        return cls(params.duration("stalenessThreshold", ctx.staleness_threshold), ctx.clock)

    def filter(
        self, request: LLMRequest, endpoints: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        # Fresh means updated_at >= oldest; updated_at == 0 fails this for any sane clock.
        oldest = max(self._clock() - self._threshold, 1e-9)
        fresh = [e for e in endpoints if e.metrics.updated_at >= oldest]
        return fresh or endpoints
