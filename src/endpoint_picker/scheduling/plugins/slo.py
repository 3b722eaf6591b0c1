"""The seed's latency objective in scheduling: ``slo-aware-scorer`` and ``slo-saturation-detector``.

An InferenceModel (or InferenceObjective) may carry an objective: the P95 of each request's
latency per output token, over a recent window. Both plugins read a ``LatencyTracker`` fed by
the lifecycle events (each plugin keeps its own, so either works alone; with both declared every
sample is recorded twice, a few microseconds).

- A request **with** an objective scores each endpoint by its predicted headroom: 1.0 while the
  predicted P95 is at most ``(1 - headroom) x objective``, falling linearly to 0 at the
  objective and beyond. An endpoint with no prediction yet scores 1.0 (nothing says it is slow).
- A request **without** one scores each endpoint ``1 - its share of the objective traffic in
  flight``: best-effort traffic fills the endpoints that objective traffic is not using, so the
  batches that objective requests share stay small (decode steps grow with the batch).
- The detector says "saturated" when the utilization thresholds do, or when no candidate is
  predicted to meet the tightest objective routed within the window; the director then sheds
  Sheddable requests.
"""

from __future__ import annotations

from collections.abc import Sequence

from endpoint_picker.errors import ConfigError
from endpoint_picker.requests import LLMRequest
from endpoint_picker.scheduling.latency import LatencyTracker
from endpoint_picker.scheduling.lifecycle import Finished, Routed
from endpoint_picker.scheduling.registry import Params, PluginContext
from endpoint_picker.scheduling.saturation import UtilizationDetector
from endpoint_picker.types import EndpointState


def tracker_from_params(params: Params, ctx: PluginContext) -> LatencyTracker:
    """A tracker from the parameters both SLO plugins share."""
    window = params.duration("windowSeconds", 30.0)
    if window <= 0:
        raise ConfigError("must be a duration > 0", params.path("windowSeconds"))
    return LatencyTracker(
        ctx.clock,
        window=window,
        max_samples=params.integer("maxSamples", 512, minimum=1),
        min_samples=params.integer("minSamples", 10, minimum=1),
    )


class _Tracking:
    """Forwards the lifecycle and pool events to the plugin's tracker."""

    __slots__ = ("tracker",)

    def __init__(self, tracker: LatencyTracker) -> None:
        self.tracker = tracker

    def on_routed(self, event: Routed) -> None:
        self.tracker.on_routed(event)

    def on_finished(self, event: Finished) -> None:
        self.tracker.on_finished(event)

    def on_endpoints(self, hostports: frozenset[str]) -> None:
        self.tracker.on_endpoints(hostports)


class SloAwareScorer(_Tracking):
    """Headroom against the request's objective; for best-effort requests, room left by it."""

    __slots__ = ("_headroom",)

    def __init__(self, tracker: LatencyTracker, headroom: float = 0.5) -> None:
        super().__init__(tracker)
        self._headroom = headroom

    @classmethod
    def from_params(cls, name: str, params: Params, ctx: PluginContext) -> SloAwareScorer:
        tracker = tracker_from_params(params, ctx)
        return cls(tracker, params.number("headroom", 0.5, minimum=0.01, maximum=1.0))

    def score(self, request: LLMRequest, endpoints: Sequence[EndpointState]) -> Sequence[float]:
        tracker = self.tracker
        objective = request.latency_objective
        if objective is None:
            return [1.0 - tracker.objective_share(e.hostport) for e in endpoints]
        span = self._headroom * objective
        predicted = tracker.predict_next(request.target_model, [e.hostport for e in endpoints])
        return [1.0 if p is None else min(1.0, max(0.0, (objective - p) / span)) for p in predicted]


class SloSaturationDetector(_Tracking):
    """``utilization-detector``'s thresholds, or no candidate predicted to meet the tightest
    objective seen within the window."""

    __slots__ = ("_utilization",)

    def __init__(self, tracker: LatencyTracker, utilization: UtilizationDetector) -> None:
        super().__init__(tracker)
        self._utilization = utilization

    @classmethod
    def from_params(cls, name: str, params: Params, ctx: PluginContext) -> SloSaturationDetector:
        tracker = tracker_from_params(params, ctx)
        return cls(tracker, UtilizationDetector.from_params(name, params, ctx))

    def is_saturated(self, candidates: Sequence[EndpointState]) -> bool:
        if self._utilization.is_saturated(candidates):
            return True
        tracker = self.tracker
        demanding = tracker.most_demanding()
        if demanding is None:
            return False
        model, objective = demanding
        predicted = tracker.predict_next(model, [e.hostport for e in candidates])
        return all(p is not None and p > objective for p in predicted)
