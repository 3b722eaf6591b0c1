"""Flow control's step of the director (the ``flowControl`` feature gate): a request the pool
has room for, with nobody of its priority waiting, is scheduled now; any other waits in its
priority band (flow control replaces shedding: Sheddable requests wait too), keyed by its
fairness id, with a TTL the client's expected timeout may shorten.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from endpoint_picker.errors import RequestError, kept
from endpoint_picker.exchange import QueuedRoute, RoutingDecision
from endpoint_picker.flowcontrol import FlowController
from endpoint_picker.requests import LLMRequest, priority_of
from endpoint_picker.scheduling import RoomFinder
from endpoint_picker.types import EndpointState, ascii_int

# The request's fairness id (the reference EPP's header), and how long the client will wait
# (Envoy's header for the caller's expected timeout), which shortens the queue TTL.
# Behind the shipped Envoy configs it never arrives: Envoy strips x-envoy-* headers a client
# sends from outside before any filter runs, and its router sets this one on the upstream
# request only (after ext_proc) and only from a route timeout, which the shipped routes leave
# at 0 (generations run for minutes); there the band's TTL bounds a wait
# (tests/e2e/test_envoy_queue_timeout.py). It does arrive from a trusted hop that sets it (a
# mesh sidecar, a gateway treating its callers as internal).
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
TIMEOUT_HEADER = "x-envoy-expected-rq-timeout-ms"
# Past this (a day) the header is not read: no queue TTL is that long, so it shortens nothing.
MAX_CLIENT_TIMEOUT_MS = 24 * 3600 * 1000

# The director's candidates after a subset hint (raises a ``RequestError`` when none is left).
Candidates = Callable[[Sequence[str]], Sequence[EndpointState]]
# The director's scheduling of a request among the candidates with room (no shedding).
Schedule = Callable[[LLMRequest, Sequence[str] | None], RoutingDecision]


def admit(
    flow: FlowController[RoutingDecision],
    request: LLMRequest,
    subset: Sequence[str] | None,
    candidates: Candidates,
    with_room: RoomFinder,
    schedule: Schedule,
) -> RoutingDecision | QueuedRoute:
    """Schedule now when the pool has room and nobody of this priority waits; otherwise
    queue (the ``QueuedRoute``'s future raises the queue's 429 or 503 or scheduling's own)."""
    priority = priority_of(request)
    ready = None
    if subset is not None:  # only some endpoints will do: wait until one of them has room
        candidates(subset)  # no eligible endpoint: a 503 now, not after a wait
        ready = functools.partial(subset_has_room, candidates, with_room, subset, priority)
    if flow.admit_now(priority, ready):
        return schedule(request, subset)
    future = flow.enqueue(
        request.log_id,  # for its log lines only
        lambda: schedule(request, subset),
        priority=priority,
        flow_id=kept(request.headers.get(FAIRNESS_HEADER, "")),  # a client string, kept
        size=len(request.raw_body),
        timeout=client_timeout(request.headers.get(TIMEOUT_HEADER)),
        ready=ready,
    )
    return QueuedRoute(request, future)


def subset_has_room(
    candidates: Candidates, with_room: RoomFinder, subset: Sequence[str], priority: int
) -> bool:
    """Whether an endpoint of the subset hint, as the pool is now, has room for
    ``priority``; True when none is eligible any more, so that the dispatch answers it."""
    try:
        eligible = candidates(subset)
    except RequestError:
        return True
    return bool(with_room(eligible, priority))


def client_timeout(header: str | None) -> float | None:
    """``x-envoy-expected-rq-timeout-ms`` in seconds; None when absent, not ASCII digits or
    past a day (the band's TTL stands)."""
    millis = ascii_int(header, MAX_CLIENT_TIMEOUT_MS) if header else None
    return None if millis is None else millis / 1000
