"""What the EPP learns from its own traffic, as a small stream of facts (docs/architecture.md,
principle 11).

The director reports "request R was routed to endpoint E" once it has scheduled R, and the
ext_proc stream reports "R finished" when its response ends or its stream closes, whichever
comes first (exactly once per routed request: a stream that dies mid-response still finishes),
with how long it took end to end and how many tokens it generated (the latency objective's
inputs).
Plugins that remember (the prefix index, session mappings) and the in-flight counter subscribe
to these events (``Subscribers``; the director's ``exchange.Lifecycle`` sends them); the same
events could arrive from another worker or replica.

Events are small and carry no prompt: ``Routed`` holds the request object, from which a
subscriber computes what it needs (the prefix plugin keeps the hashes it computed while
scoring, so nothing is hashed twice).

Every event, and every table a subscriber keeps per request, is keyed by the EPP's own request
id (``LLMRequest.request_id``, one per ext_proc stream, unique across workers and replicas),
never by the client's ``x-request-id``: any client may send the same one on many requests.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

from endpoint_picker.requests import LLMRequest


@dataclass(frozen=True, slots=True)
class Routed:
    request: LLMRequest
    endpoint: str  # host:port of the primary pick


@dataclass(frozen=True, slots=True)
class Finished:
    request_id: str  # the EPP's own (LLMRequest.request_id), never the client's
    ok: bool  # a complete response (any status) rather than a stream that ended early
    # end to end, from the request's headers to the end of its response (or of its stream)
    seconds: float | None = None
    output_tokens: int | None = None  # the response's usage.completion_tokens, when it had one


@runtime_checkable
class LifecycleListener(Protocol):
    """Subscribes to request lifecycle events; must be cheap: it runs on the request path."""

    def on_routed(self, event: Routed) -> None: ...

    def on_finished(self, event: Finished) -> None: ...


@runtime_checkable
class StartListener(Protocol):
    """Told when a routed request's response brings its first body bytes (for a streamed
    completion, its first token): the server has taken it out of its waiting queue."""

    def on_started(self, request_id: str) -> None: ...


REQUESTS_REMEMBERED = 10_000  # per-request state a plugin keeps until routing or finish

_V = TypeVar("_V")


def remember(table: OrderedDict[str, _V], request_id: str, value: _V) -> None:
    """Keep ``value`` for a request until its routing or finish pops it; past
    ``REQUESTS_REMEMBERED`` the oldest is dropped (a request that never got that far)."""
    table[request_id] = value
    if len(table) > REQUESTS_REMEMBERED:
        table.popitem(last=False)


@runtime_checkable
class PoolListener(Protocol):
    """Told the pool's endpoints whenever they change, to forget endpoints that left."""

    def on_endpoints(self, hostports: frozenset[str]) -> None: ...


@dataclass(frozen=True, slots=True)
class Subscribers:
    """Who hears the events: the in-flight counter and the plugins that learn from traffic,
    collected by the scheduling build. The director's side sends the events to them
    (``exchange.Lifecycle``), where it sees them happen: nothing in this module calls a
    subscriber, so the plugins' own calls into it (``remember``, the in-flight counts) never
    meet a call coming back down from it."""

    lifecycle: tuple[LifecycleListener, ...] = ()
    pool: tuple[PoolListener, ...] = ()
    start: tuple[StartListener, ...] = ()


class InFlight:
    """The EPP's own count of requests in flight per endpoint: fresher than any scrape.

    Counted from routing to the finish event, so a burst that arrives within one scrape
    interval is seen at once. Each request is remembered with its endpoint, so a finish (or a
    second one) can never decrement the wrong endpoint or go below zero. It also remembers
    when requests were routed to each endpoint, which of them started there (their first
    response bytes) and when requests finished there, so that a scrape's queue and batch can
    be brought up to date with what happened after it (``routed_since``, ``started_since``,
    ``finished_since``).
    """

    __slots__ = (
        "_by_request", "_clock", "_counts", "_finished", "_recent", "_routed_at", "_started",
    )  # fmt: skip

    RECENT_LIMIT = 1024  # times kept per endpoint and table (more than any scrape interval sees)

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._by_request: dict[str, str] = {}
        self._routed_at: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._recent: dict[str, deque[float]] = {}
        self._started: dict[str, deque[float]] = {}
        self._finished: dict[str, deque[float]] = {}

    def count(self, hostport: str) -> int:
        return self._counts.get(hostport, 0)

    @property
    def total(self) -> int:
        return len(self._by_request)

    def routed_since(self, hostport: str, since: float) -> int:
        """How many requests were routed to ``hostport`` at or after ``since`` (monotonic).

        Callers ask with non-decreasing ``since`` per endpoint (a scrape's timestamp), so
        older entries are dropped as they are passed.
        """
        return _count_since(self._recent.get(hostport), since)

    def started_since(self, hostport: str, since: float) -> int:
        """How many of the requests routed to ``hostport`` at or after ``since`` have started
        (first response bytes); the same contract as ``routed_since``.

        Only those routed after ``since``: a start of an older request says nothing certain
        about a queue scraped at ``since`` (it may have been prefilling then, which vLLM counts
        as running, or its first token may have been on the way).
        """
        routed = self._started.get(hostport)
        if not routed:
            return 0
        if min(routed) < since:  # a handful: the starts of requests routed since a scrape
            routed = self._started[hostport] = deque(
                (at for at in routed if at >= since), maxlen=self.RECENT_LIMIT
            )
        return len(routed)

    def finished_since(self, hostport: str, since: float) -> int:
        """How many requests routed to ``hostport`` finished at or after ``since``; the same
        contract as ``routed_since``."""
        return _count_since(self._finished.get(hostport), since)

    def on_routed(self, event: Routed) -> None:
        request_id = event.request.request_id
        previous = self._by_request.get(request_id)
        if previous is not None:  # the same request routed again while in flight: move it
            self._decrement(previous)
        self._by_request[request_id] = event.endpoint
        self._counts[event.endpoint] = self._counts.get(event.endpoint, 0) + 1
        self._routed_at[request_id] = self._append(self._recent, event.endpoint, self._clock())

    def on_started(self, request_id: str) -> None:
        routed_at = self._routed_at.pop(request_id, None)  # at most once per routing
        endpoint = self._by_request.get(request_id)
        if routed_at is None or endpoint is None or endpoint not in self._recent:
            return  # unknown, started already, or on an endpoint that left the pool
        self._append(self._started, endpoint, routed_at)  # when it was routed, not started

    def on_finished(self, event: Finished) -> None:
        endpoint = self._by_request.pop(event.request_id, None)
        self._routed_at.pop(event.request_id, None)
        if endpoint is not None:
            self._decrement(endpoint)
            if endpoint in self._recent:  # not for an endpoint that left the pool
                self._append(self._finished, endpoint, self._clock())

    def _append(self, table: dict[str, deque[float]], endpoint: str, at: float) -> float:
        times = table.get(endpoint)
        if times is None:
            times = table[endpoint] = deque(maxlen=self.RECENT_LIMIT)
        times.append(at)
        return at

    def on_endpoints(self, hostports: frozenset[str]) -> None:
        # Requests on an endpoint that left still finish through their streams; keep them.
        for gone in self._recent.keys() - hostports:
            del self._recent[gone]
        for table in (self._started, self._finished):
            for gone in table.keys() - hostports:
                del table[gone]

    def _decrement(self, endpoint: str) -> None:
        left = self._counts.get(endpoint, 0) - 1
        if left > 0:
            self._counts[endpoint] = left
        else:
            self._counts.pop(endpoint, None)


def _count_since(times: deque[float] | None, since: float) -> int:
    """Entries at or after ``since``; older ones are dropped (``since`` never decreases)."""
    if not times:
        return 0
    while times and times[0] < since:
        times.popleft()
    return len(times)


@runtime_checkable
class PeerCounts(Protocol):
    """The other worker processes' in-flight counts (``epp serve --workers``), and where this
    worker publishes its own; both are plain memory reads and writes (no I/O, no lock)."""

    def others(self, hostport: str) -> int: ...

    def publish(self, hostport: str, count: int) -> None: ...


class SharedInFlight(InFlight):
    """``InFlight`` for one worker of several: its own exact count plus the other workers'.

    Every change of an own count is published at once, so another worker's next pick sees
    it; ``total`` and the ``*_since`` counts stay this worker's own (the status page sums the
    table, and the counts bring a scrape up to date with what this worker sent, saw start and
    saw finish after it).
    """

    __slots__ = ("_peers",)

    def __init__(self, peers: PeerCounts, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(clock)
        self._peers = peers

    def count(self, hostport: str) -> int:
        return self._counts.get(hostport, 0) + self._peers.others(hostport)

    @property
    def own_counts(self) -> dict[str, int]:
        """This worker's counts per endpoint (a copy): a new slot map rewrites the row."""
        return dict(self._counts)

    def on_routed(self, event: Routed) -> None:
        previous = self._by_request.get(event.request.request_id)
        super().on_routed(event)
        if previous is not None and previous != event.endpoint:
            self._peers.publish(previous, self._counts.get(previous, 0))
        self._peers.publish(event.endpoint, self._counts.get(event.endpoint, 0))

    def on_finished(self, event: Finished) -> None:
        endpoint = self._by_request.get(event.request_id)
        super().on_finished(event)
        if endpoint is not None:
            self._peers.publish(endpoint, self._counts.get(endpoint, 0))
