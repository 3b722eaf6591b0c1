"""The scheduling framework: extension-point protocols and the profile runner.

A profile runs its filters in order (stopping when no endpoint is left), sums the weighted,
clamped scores of its scorers, and hands the scores to its picker. Plugins only filter, score or
pick; ordering, clamping, weighting, timing and debug logs live here, written once.
Everything is synchronous: scheduling is CPU work on the request path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import structlog

from endpoint_picker.errors import InternalError
from endpoint_picker.requests import LLMRequest
from endpoint_picker.types import EndpointState

log = structlog.get_logger(__name__)

FILTER = "Filter"
SCORER = "Scorer"
PICKER = "Picker"


@runtime_checkable
class Filter(Protocol):
    """Keeps the endpoints that may serve the request (a subset, order preserved)."""

    def filter(
        self, request: LLMRequest, endpoints: Sequence[EndpointState]
    ) -> Sequence[EndpointState]: ...


@runtime_checkable
class Scorer(Protocol):
    """One score per endpoint, aligned with ``endpoints``: in [0, 1], higher is better."""

    def score(self, request: LLMRequest, endpoints: Sequence[EndpointState]) -> Sequence[float]: ...


@runtime_checkable
class Picker(Protocol):
    """Chooses up to N distinct endpoints from the scored ones, best first."""

    def pick(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], scores: Sequence[float]
    ) -> Sequence[EndpointState]: ...


class SchedulerObserver(Protocol):
    """A sink for timings; the EPP's Prometheus metrics implement it."""

    def plugin_duration(
        self, extension_point: str, plugin_type: str, plugin_name: str, seconds: float
    ) -> None: ...

    def scheduler_duration(self, seconds: float) -> None: ...


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

    @property
    def plugins(self) -> Mapping[str, Sequence[str]]:
        """Plugin names by extension point, in run order (for ``describe`` and tests)."""
        return {
            "filters": [ref.name for ref, _ in self._filters],
            "scorers": [f"{s.ref.name} (weight {s.weight:g})" for s in self._scorers],
            "picker": [self._picker_ref.name],
        }

    def run(
        self, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        """Filter, score and pick; an empty result when no endpoint survives the filters."""
        if self._timed:
            return self._run_timed(request, candidates)
        endpoints = candidates
        for _, flt in self._filters:
            endpoints = flt.filter(request, endpoints)
            if not endpoints:
                return self._nothing_left(request)
        totals = self._score(request, endpoints)
        picked = self._picker.pick(request, endpoints, totals)
        if self.debug:
            self._log_cycle(request, endpoints, totals, picked)
        return picked

    def _score(self, request: LLMRequest, endpoints: Sequence[EndpointState]) -> list[float]:
        totals = [0.0] * len(endpoints)
        for ws in self._scorers:
            totals = self._accumulate(ws, totals, ws.scorer.score(request, endpoints))
        return totals

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
        self, request: LLMRequest, candidates: Sequence[EndpointState]
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
        for ws in self._scorers:
            start = clock()
            scores = ws.scorer.score(request, endpoints)
            report(SCORER, ws.ref.type, ws.ref.name, clock() - start)
            totals = self._accumulate(ws, totals, scores)
        ref = self._picker_ref
        start = clock()
        picked = self._picker.pick(request, endpoints, totals)
        report(PICKER, ref.type, ref.name, clock() - start)
        if self.debug:
            self._log_cycle(request, endpoints, totals, picked)
        return picked

    def _nothing_left(self, request: LLMRequest) -> Sequence[EndpointState]:
        if self.debug:
            log.debug("filters left no endpoint", profile=self.name, request_id=request.request_id)
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
            request_id=request.request_id,
            scores={e.hostport: round(t, 4) for e, t in zip(endpoints, totals, strict=True)},
            picked=[e.hostport for e in picked],
        )


@runtime_checkable
class ProfileHandler(Protocol):
    """Decides which profiles run for a request, and which result answers it.

    ``pick_profiles`` is called until it returns nothing, with the results so far, so a handler
    can chain profiles (prefill, then decode); ``primary`` names the profile whose endpoints
    the request is routed to.
    """

    def pick_profiles(
        self,
        request: LLMRequest,
        profiles: Sequence[str],
        results: Mapping[str, Sequence[EndpointState]],
    ) -> Sequence[str]: ...

    def primary(
        self, request: LLMRequest, results: Mapping[str, Sequence[EndpointState]]
    ) -> str: ...


class Scheduler:
    """The profile runners and the handler that chooses among them."""

    __slots__ = ("_handler", "_names", "_observer", "_profiles")

    def __init__(
        self,
        profiles: Sequence[SchedulerProfile],
        handler: ProfileHandler,
        *,
        observer: SchedulerObserver | None = None,
    ) -> None:
        self._profiles = {p.name: p for p in profiles}
        self._names = tuple(self._profiles)
        self._handler = handler
        self._observer = observer

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
        results: dict[str, Sequence[EndpointState]] = {}
        while names := handler.pick_profiles(request, self._names, results):
            for name in names:
                results[name] = self._profiles[name].run(request, candidates)
        primary = handler.primary(request, results)
        result = SchedulingResult(tuple(results[primary]), primary)
        if observer is not None:
            observer.scheduler_duration(time.perf_counter() - start)
        return result


def is_plugin_kind(plugin: object) -> tuple[bool, bool, bool]:
    """Which profile extension points ``plugin`` implements: (filter, scorer, picker)."""
    return isinstance(plugin, Filter), isinstance(plugin, Scorer), isinstance(plugin, Picker)
