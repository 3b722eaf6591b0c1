"""The seed's latency objective in scheduling: ``slo-aware-scorer`` and ``slo-saturation-detector``.

An InferenceModel (or InferenceObjective) may carry an objective: the P95 of each request's
latency per output token, over a recent window. Both plugins read a ``LatencyTracker`` fed by
the lifecycle events (each plugin keeps its own, so either works alone; with both declared every
sample is recorded twice, a few microseconds).

- A request **with** an objective scores each endpoint by its predicted P95 against a
  comfortable level, ``(1 - headroom) x objective``: ``min(1, comfortable / predicted)``, so
  1.0 with comfortable headroom, ``1 - headroom`` at the objective, and still falling past it:
  when no endpoint can meet the objective the request goes where it misses least (a score
  flat at 0 past the objective left it to the other scorers, which spread it over every
  endpoint). An endpoint with no prediction yet scores 1.0 (nothing says it is slow).
- A request **without** one scores each endpoint ``1 - (count / most) x pressure``: ``count``
  is the objective requests in flight on the endpoint, ``most`` the largest such count over the
  candidates, ``pressure`` how close the tightest objective routed within the window is to
  being missed over the whole pool: that model's observed P95, from 0 at the comfortable level
  to 1 at the objective. Scaling by the busiest endpoint (not by the share of all objective
  requests) keeps the spread the same whatever the number of endpoints. Best-effort traffic
  then makes room where objective traffic runs, as much as the objective needs, so the batches
  those requests share stay small (decode steps grow with the batch); while every objective is
  met comfortably it goes wherever the other scorers send it.
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

DEFAULT_HEADROOM = 0.2  # comfortable: within 80% of the objective


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

    __slots__ = ("_headroom_share",)

    def __init__(self, tracker: LatencyTracker, headroom: float = DEFAULT_HEADROOM) -> None:
        super().__init__(tracker)
        self._headroom_share = headroom

    @classmethod
    def from_params(cls, name: str, params: Params, ctx: PluginContext) -> SloAwareScorer:
        tracker = tracker_from_params(params, ctx)
        return cls(tracker, params.number("headroom", DEFAULT_HEADROOM, minimum=0.01, maximum=0.99))

    def score(self, request: LLMRequest, endpoints: Sequence[EndpointState]) -> Sequence[float]:
        hostports = [e.hostport for e in endpoints]
        objective = request.latency_objective
        if objective is not None:
            return self._headroom_scores(request.target_model, objective, hostports)
        pressure = self._pressure()
        counts = [self.tracker.objective_load(h) for h in hostports] if pressure > 0.0 else []
        top = max(counts, default=0)
        if not top:
            return [1.0] * len(hostports)
        scale = pressure / top
        return [1.0 - c * scale for c in counts]

    def _headroom_scores(self, model: str, objective: float, hostports: list[str]) -> list[float]:
        """For one more ``model`` request on each endpoint: ``min(1, comfortable / predicted)``
        with comfortable = ``(1 - headroom) x objective``: 1.0 with headroom, ``1 - headroom``
        at the objective, still falling past it (1.0 where there is no prediction)."""
        comfortable = (1.0 - self._headroom_share) * objective
        return [
            1.0 if p is None or p <= 0 else min(1.0, comfortable / p)
            for p in self.tracker.predict_next(model, hostports)
        ]

    def _pressure(self) -> float:
        """How close the tightest recent objective is to being missed over the pool: 0 while
        its observed P95 is comfortable (or unknown), rising to 1 at the objective."""
        demanding = self.tracker.most_demanding()
        if demanding is None:
            return 0.0
        model, objective = demanding
        observed = self.tracker.observed(model)
        if observed is None:
            return 0.0
        span = self._headroom_share * objective
        return min(1.0, max(0.0, (observed - objective + span) / span))


class SloSaturationDetector(_Tracking):
    """Saturated when no candidate both passes ``utilization-detector``'s thresholds and is
    predicted to meet the tightest objective seen within the window."""

    __slots__ = ("_utilization",)

    def __init__(self, tracker: LatencyTracker, utilization: UtilizationDetector) -> None:
        super().__init__(tracker)
        self._utilization = utilization

    @classmethod
    def from_params(cls, name: str, params: Params, ctx: PluginContext) -> SloSaturationDetector:
        tracker = tracker_from_params(params, ctx)
        return cls(tracker, UtilizationDetector.from_params(name, params, ctx))

    def is_saturated(self, candidates: Sequence[EndpointState]) -> bool:
        return not self.with_room(candidates)

    def with_room(self, candidates: Sequence[EndpointState]) -> Sequence[EndpointState]:
        """The candidates with room by the thresholds and, while an objective is recent, not
        predicted past it (no prediction yet counts as room)."""
        roomy = self._utilization.with_room(candidates)
        demanding = self.tracker.most_demanding()
        if demanding is None or not roomy:
            return roomy
        model, objective = demanding
        predicted = self.tracker.predict_next(model, [e.hostport for e in roomy])
        return [e for e, p in zip(roomy, predicted, strict=True) if p is None or p <= objective]
