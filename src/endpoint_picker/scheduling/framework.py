"""The scheduling framework's extension points: the protocols plugins implement.

A profile has filters (keep the endpoints that may serve), scorers (one score in [0, 1] per
endpoint) and a picker (choose, best first); a profile handler decides which profiles run and
which answers. Plugins only filter, score or pick: the loop that runs them (ordering,
clamping, weighting, timing, debug logs) is the scheduler's (``scheduler``), written once.
Everything is synchronous: scheduling is CPU work on the request path. Optional capabilities a
plugin may add: ``CandidateHints`` (endpoints it favours, for a sampled pool), ``Preparer``
(work off the event loop before scheduling), ``HintedFilter`` (a filter that asks for hints).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from endpoint_picker.requests import LLMRequest
from endpoint_picker.scheduling.placement import RingWalk
from endpoint_picker.types import EndpointState


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


@runtime_checkable
class CandidateHints(Protocol):
    """A scorer that can name the endpoints it favours for a request without looking at the
    pool, so that a sampled pool (``candidate-sampler``) keeps them among its candidates.

    ``ring`` places keys nobody holds yet (a new prefix, a new session): the scorer then
    prefers the first of the ring's endpoints that survives the filters, which is the same
    endpoint on every replica.
    """

    def preferred(self, request: LLMRequest, ring: RingWalk) -> Iterable[str]: ...


# Blocking work a plugin needs done off the event loop before it can score a request (the
# precise prefix scorer's tokenizing of a long prompt): run on a thread, it returns what to call
# back on the loop with its result.
OffLoopWork = Callable[[], Callable[[], None]]


@runtime_checkable
class Preparer(Protocol):
    """A plugin with work to do for a request before scheduling that is too slow for the event
    loop: ``prepare`` returns it (the director runs it on a thread, then schedules), or None
    when there is none (done inline, cached, or nothing to do)."""

    def prepare(self, request: LLMRequest) -> OffLoopWork | None: ...


@runtime_checkable
class HintedFilter(Protocol):
    """A filter that asks the scorers of its profile which endpoints they favour."""

    def use_hints(self, hinters: Iterable[CandidateHints]) -> None: ...


class SchedulerObserver(Protocol):
    """A sink for timings; the EPP's Prometheus metrics implement it."""

    def plugin_duration(
        self, extension_point: str, plugin_type: str, plugin_name: str, seconds: float
    ) -> None: ...

    def scheduler_duration(self, seconds: float) -> None: ...


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


def is_plugin_kind(plugin: object) -> tuple[bool, bool, bool]:
    """Which profile extension points ``plugin`` implements: (filter, scorer, picker)."""
    return isinstance(plugin, Filter), isinstance(plugin, Scorer), isinstance(plugin, Picker)
