"""The scheduler: the profile runner, and the scheduler that runs the profiles a handler picks.

A profile runs its filters in order (stopping when no endpoint is left), sums the weighted,
clamped scores of its scorers, and hands the scores to its picker. Plugins (``framework``'s
protocols) only filter, score or pick; ordering, clamping, weighting, timing and debug logs
live here, written once.

With a ``record`` sink the scheduler hands every routed cycle to it as one small tuple
(``CycleRecord``), for the status page's recent decisions; nothing is converted or copied on
the request path: the reader does that when someone looks. One cycle per ``SCORES_INTERVAL``
also keeps its scores (``SchedulerProfile.last``: the endpoints that passed the filters and the
running sums of the weighted scores, lists the cycle builds anyway); the others run exactly as
without a sink. Keeping the scores of every cycle of a busy pool slowed the cycles that follow
(``benchmarks/bench_scheduling.py --record``: +8-13% a cycle over 256 endpoints).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import structlog

from endpoint_picker.errors import InternalError
from endpoint_picker.requests import LLMRequest
from endpoint_picker.scheduling.framework import (
    Filter,
    Picker,
    ProfileHandler,
    SchedulerObserver,
    Scorer,
)
from endpoint_picker.types import EndpointState

log = structlog.get_logger(__name__)

SCORES_INTERVAL = 0.02  # seconds: a record keeps the scores of at most 50 cycles a second
FILTER = "Filter"
SCORER = "Scorer"
PICKER = "Picker"


# One profile run's scores: the endpoints that passed the filters, and the running sums of the
# weighted, clamped scores (an all-zero list, then one list per scorer in run order: the last
# is the total, and consecutive differences are each scorer's share).
CycleScores = tuple[Sequence[EndpointState], list[list[float]]]
# A routed cycle, as handed to the scheduler's ``record`` sink: (wall-clock time, request id,
# model, target model, candidates before the filters, the primary profile, the endpoints it
# chose (best first), its CycleScores).
CycleRecord = tuple[
    float, str, str, str, int, "SchedulerProfile", tuple[EndpointState, ...], CycleScores | None
]


@dataclass(frozen=True, slots=True)
class SchedulingResult:
    """What one scheduling cycle chose: the primary profile's endpoints, best first.

    ``endpoints`` is empty when the filters removed every candidate.
    """

    endpoints: tuple[EndpointState, ...]
    profile: str


@dataclass(frozen=True, slots=True)
class PluginRef:
    """A built plugin with the identity the observer and logs report."""

    name: str
    type: str
    plugin: object


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    ref: PluginRef
    scorer: Scorer
    weight: float


def _nothing_observed(
    extension_point: str, plugin_type: str, plugin_name: str, seconds: float
) -> None:
    return None


class SchedulerProfile:
    """Runs one profile's filters, scorers and picker for a request."""

    __slots__ = (
        "_filters",
        "_picker",
        "_picker_ref",
        "_plugin_duration",
        "_scorers",
        "_timed",
        "debug",
        "last",
        "name",
    )

    def __init__(
        self,
        name: str,
        filters: Sequence[tuple[PluginRef, Filter]],
        scorers: Sequence[WeightedScorer],
        picker: tuple[PluginRef, Picker],
        *,
        observer: SchedulerObserver | None = None,
        debug: bool = False,
    ) -> None:
        self.name = name
        self._filters = tuple(filters)
        # A zero weight cannot change the sum: skip the scorer rather than run it.
        self._scorers = tuple(s for s in scorers if s.weight > 0)
        self._picker_ref, self._picker = picker
        self._timed = observer is not None
        self._plugin_duration: Callable[[str, str, str, float], None] = (
            observer.plugin_duration if observer is not None else _nothing_observed
        )
        self.debug = debug
        self.last: CycleScores | None = None  # of the last cycle run with ``keep``

    @property
    def scorer_weights(self) -> tuple[tuple[str, float], ...]:
        """(scorer name, weight) in run order: the order of ``last``'s running sums."""
        return tuple((s.ref.name, s.weight) for s in self._scorers)

    @property
    def plugins(self) -> Mapping[str, Sequence[str]]:
        """Plugin names by extension point, in run order (for ``describe`` and tests)."""
        return {
            "filters": [ref.name for ref, _ in self._filters],
            "scorers": [f"{s.ref.name} (weight {s.weight:g})" for s in self._scorers],
            "picker": [self._picker_ref.name],
        }

    def run(
        self, request: LLMRequest, candidates: Sequence[EndpointState], keep: bool = False
    ) -> Sequence[EndpointState]:
        """Filter, score and pick; an empty result when no endpoint survives the filters.

        ``keep``: keep this cycle's scores in ``last`` (None when the filters leave nothing).
        """
        if self._timed:
            return self._run_timed(request, candidates, keep)
        endpoints = candidates
        for _, flt in self._filters:
            endpoints = flt.filter(request, endpoints)
            if not endpoints:
                return self._nothing_left(request)
        totals = self._score_kept(request, endpoints) if keep else self._score(request, endpoints)
        picked = self._picker.pick(request, endpoints, totals)
        if self.debug:
            self._log_cycle(request, endpoints, totals, picked)
        return picked

    def _score(self, request: LLMRequest, endpoints: Sequence[EndpointState]) -> list[float]:
        totals = [0.0] * len(endpoints)
        for ws in self._scorers:
            totals = self._accumulate(ws, totals, ws.scorer.score(request, endpoints))
        return totals

    def _score_kept(self, request: LLMRequest, endpoints: Sequence[EndpointState]) -> list[float]:
        """``_score``, keeping the running sums in ``last`` (see ``CycleScores``)."""
        sums = [[0.0] * len(endpoints)]
        for ws in self._scorers:
            sums.append(self._accumulate(ws, sums[-1], ws.scorer.score(request, endpoints)))
        self.last = (endpoints, sums)
        return sums[-1]

    @staticmethod
    def _accumulate(
        ws: WeightedScorer, totals: list[float], scores: Sequence[float]
    ) -> list[float]:
        """``totals + weight * clamp(scores)``; clamped here so no scorer outweighs the others."""
        if len(scores) != len(totals):
            raise InternalError(
                f"scorer {ws.ref.name!r} returned {len(scores)} scores for {len(totals)} endpoints"
            )
        w = ws.weight
        # One comprehension, no calls: this is the hottest loop of a cycle. NaN counts as 0.
        return [
            t + w * (1.0 if s > 1.0 else s if s > 0.0 else 0.0)
            for t, s in zip(totals, scores, strict=False)
        ]

    def _run_timed(
        self, request: LLMRequest, candidates: Sequence[EndpointState], keep: bool
    ) -> Sequence[EndpointState]:
        clock = time.perf_counter
        report = self._plugin_duration
        endpoints = candidates
        for ref, flt in self._filters:
            start = clock()
            endpoints = flt.filter(request, endpoints)
            report(FILTER, ref.type, ref.name, clock() - start)
            if not endpoints:
                return self._nothing_left(request)
        totals = [0.0] * len(endpoints)
        sums = [totals] if keep else None
        for ws in self._scorers:
            start = clock()
            scores = ws.scorer.score(request, endpoints)
            report(SCORER, ws.ref.type, ws.ref.name, clock() - start)
            totals = self._accumulate(ws, totals, scores)
            if sums is not None:
                sums.append(totals)
        ref = self._picker_ref
        start = clock()
        picked = self._picker.pick(request, endpoints, totals)
        report(PICKER, ref.type, ref.name, clock() - start)
        if sums is not None:
            self.last = (endpoints, sums)
        if self.debug:
            self._log_cycle(request, endpoints, totals, picked)
        return picked

    def _nothing_left(self, request: LLMRequest) -> Sequence[EndpointState]:
        self.last = None
        if self.debug:
            log.debug("filters left no endpoint", profile=self.name, request_id=request.log_id)
        return ()

    def _log_cycle(
        self,
        request: LLMRequest,
        endpoints: Sequence[EndpointState],
        totals: Sequence[float],
        picked: Sequence[EndpointState],
    ) -> None:
        log.debug(
            "scheduled",
            profile=self.name,
            request_id=request.log_id,
            scores={e.hostport: round(t, 4) for e, t in zip(endpoints, totals, strict=True)},
            picked=[e.hostport for e in picked],
        )


class Scheduler:
    """The profile runners and the handler that chooses among them."""

    __slots__ = (
        "_handler",
        "_names",
        "_observer",
        "_profiles",
        "_record",
        "_scores_due",
        "_scores_interval",
    )

    def __init__(
        self,
        profiles: Sequence[SchedulerProfile],
        handler: ProfileHandler,
        *,
        observer: SchedulerObserver | None = None,
        record: Callable[[CycleRecord], object] | None = None,
        scores_interval: float = SCORES_INTERVAL,
    ) -> None:
        """``record``: called with every cycle that routes (a ``CycleRecord``) on the request
        path, so it must be as cheap as a bounded deque's ``append``. Its scores are None but
        for one cycle per ``scores_interval`` seconds: only that cycle keeps them."""
        self._profiles = {p.name: p for p in profiles}
        self._names = tuple(self._profiles)
        self._handler = handler
        self._observer = observer
        self._record = record
        self._scores_interval = scores_interval
        self._scores_due = 0.0

    @property
    def profiles(self) -> Mapping[str, SchedulerProfile]:
        return self._profiles

    @property
    def handler(self) -> ProfileHandler:
        return self._handler

    def schedule(
        self, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> SchedulingResult:
        """Run the profiles the handler picks; return the primary profile's endpoints."""
        observer = self._observer
        start = time.perf_counter() if observer is not None else 0.0
        handler = self._handler
        record = self._record
        when = time.time() if record is not None else 0.0
        keep = record is not None and when >= self._scores_due  # this cycle keeps its scores
        results: dict[str, Sequence[EndpointState]] = {}
        while names := handler.pick_profiles(request, self._names, results):
            for name in names:
                results[name] = self._profiles[name].run(request, candidates, keep)
        primary = handler.primary(request, results)
        result = SchedulingResult(tuple(results[primary]), primary)
        if record is not None and result.endpoints:
            profile = self._profiles[primary]
            scores = None
            if keep:
                self._scores_due = when + self._scores_interval
                scores = profile.last
            record(
                (when, request.log_id, request.model, request.target_model,
                 len(candidates), profile, result.endpoints, scores)
            )  # fmt: skip
        if observer is not None:
            observer.scheduler_duration(time.perf_counter() - start)
        return result
