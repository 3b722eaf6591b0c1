"""One request's way through the director, from its headers to its response's end.

The ext_proc stream (the edge) crosses the director at three points, as the reference's
request control does (headers, body, response): ``Director.on_headers`` opens an
``Exchange`` (the EPP's request id, the API of the path, what the gateway answers itself),
``Director.on_body`` routes it, and the response's headers, body and end go to the
``ResponseSide`` here, which runs what the response teaches: the endpoint Envoy could not
reach (marked unreachable), the outlier detector's verdict on each endpoint the request went
through, the session token naming the endpoint that served, the first body bytes (the request
left the server's queue), the usage in the body and the lifecycle's finished event. The
stream keeps only the protocol and its own metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import structlog

from endpoint_picker.datastore.health import FailureKind
from endpoint_picker.errors import RequestError
from endpoint_picker.requests import Api, LLMRequest, UsageReader
from endpoint_picker.scheduling.lifecycle import (
    Finished,
    LifecycleListener,
    PoolListener,
    Routed,
    StartListener,
    Subscribers,
)
from endpoint_picker.scheduling.plugins.session import SESSION_TOKEN_HEADER, session_token
from endpoint_picker.types import EndpointState

__all__ = ["SESSION_TOKEN_HEADER"]

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """Where a request goes and the body it goes with."""

    request: LLMRequest
    endpoints: tuple[str, ...]  # host:port, primary first
    body: bytes  # the bytes to forward: the original unless the model was rewritten
    probe: bool = False  # the first request to an endpoint back from an ejection

    @property
    def destination(self) -> str:
        return ",".join(self.endpoints)


@dataclass(frozen=True, slots=True)
class QueuedRoute:
    """A request waiting in flow control; ``future`` resolves to its ``RoutingDecision``."""

    request: LLMRequest
    future: asyncio.Future[RoutingDecision]


@dataclass(frozen=True, slots=True)
class LocalAnswer:
    """What the gateway answers itself, never a pod: its health (``GET /health``: ``ready``
    or not) or the pool's model list (``GET /v1/models``: ``models``)."""

    ready: bool = True
    models: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """What a response's headers tell the director: the endpoint Envoy says served it (its
    ``x-gateway-destination-endpoint-served``; "" without it), the status (0 when absent or not
    a number), the content type, and whether Envoy failed to reach the upstream."""

    served: str = ""
    status: int = 0
    content_type: str = ""
    upstream_failure: bool = False


class Exchange:
    """One request's state in the director; the stream holds it and hands it back."""

    __slots__ = (
        "api",
        "client_id",
        "decision",
        "done",
        "error",
        "headers",
        "headers_only",
        "id",
        "local",
        "path",
        "responded",
        "served",
        "started",
        "subset",
        "usage",
    )

    def __init__(
        self,
        request_id: str,
        client_id: str,
        path: str,
        subset: Sequence[str] | None,
        headers: dict[str, str],
        headers_only: bool,
    ) -> None:
        self.id = request_id  # the EPP's own: every table and event is keyed by it
        self.client_id = client_id  # the client's x-request-id: logs only
        self.path = path
        self.subset = subset
        self.headers = headers  # the request headers the scheduler reads
        self.headers_only = headers_only  # no body follows
        self.api: Api | None = None
        # What the director answers on the headers (read once the edge's own checks, the 431
        # of too many headers, have passed): an error, or a local answer; neither: route it.
        self.error: RequestError | None = None
        self.local: LocalAnswer | None = None
        self.decision: RoutingDecision | None = None  # set by the stream once routed
        self.served = ""  # the endpoint Envoy says served it ("" until the response says)
        self.responded = False  # the outlier detector has judged its endpoints
        self.started = False  # the response's first body bytes went by
        self.done = False  # its finished event was sent
        self.usage: UsageReader | None = None


_L = TypeVar("_L", LifecycleListener, PoolListener, StartListener)


class Lifecycle:
    """Sends the lifecycle events (``scheduling.lifecycle``) to their subscribers from where the
    director sees them happen: routed (``Director.route``), started and finished (the
    ``ResponseSide``), and the pool's changes. A failing listener is logged, never fatal."""

    __slots__ = ("_listeners", "_pool_listeners", "_start_listeners")

    def __init__(
        self,
        listeners: Sequence[LifecycleListener] = (),
        pool_listeners: Sequence[PoolListener] = (),
        start_listeners: Sequence[StartListener] = (),
    ) -> None:
        self._listeners = tuple(listeners)
        self._pool_listeners = tuple(pool_listeners)
        self._start_listeners = tuple(start_listeners)

    @classmethod
    def of(cls, subscribers: Subscribers) -> Lifecycle:
        return cls(subscribers.lifecycle, subscribers.pool, subscribers.start)

    def routed(self, request: LLMRequest, endpoint: str) -> None:
        event = Routed(request, endpoint)
        _each(self._listeners, lambda listener: listener.on_routed(event))

    def started(self, request_id: str) -> None:
        _each(self._start_listeners, lambda listener: listener.on_started(request_id))

    def finished(
        self,
        request_id: str,
        ok: bool,
        seconds: float | None = None,
        output_tokens: int | None = None,
    ) -> None:
        event = Finished(request_id, ok, seconds, output_tokens)
        _each(self._listeners, lambda listener: listener.on_finished(event))

    def endpoints_changed(self, hostports: Iterable[str]) -> None:
        live = frozenset(hostports)
        _each(self._pool_listeners, lambda listener: listener.on_endpoints(live))


def _each(listeners: Sequence[_L], call: Callable[[_L], None]) -> None:
    """``call`` every listener; one that raises is logged and the others still run."""
    for listener in listeners:
        try:
            call(listener)
        except Exception:
            log.exception("lifecycle listener failed", listener=type(listener).__name__)


class PoolHealth(Protocol):
    """What the response side reads and marks of the pool."""

    def endpoint_states(self) -> tuple[EndpointState, ...]: ...

    def mark_unreachable(self, hostport: str, reason: str) -> None: ...


class Outliers(Protocol):
    """Passive health from responses (``datastore.health.OutlierDetector``)."""

    def excluded(self) -> frozenset[str]: ...

    def routed(self, hostport: str) -> bool: ...

    def succeeded(self, hostport: str) -> None: ...

    def failed(self, hostport: str, kind: FailureKind, ready: Collection[str]) -> bool: ...

    def unanswered(self, hostport: str) -> None: ...


class Kick(Protocol):
    def kick(self) -> None: ...


class ResponseSide:
    """The response-side steps the director runs on a routed request's exchange."""

    def __init__(
        self,
        pool: PoolHealth,
        lifecycle: Lifecycle,
        outliers: Outliers | None,
        flow: Kick | None,
        session_tokens: bool,
    ) -> None:
        self._pool = pool
        self._lifecycle = lifecycle
        self._outliers = outliers
        self._flow = flow  # a request leaving a server's queue may let a waiting one in
        self._session_tokens = session_tokens

    def headers(self, exchange: Exchange, head: ResponseHead) -> str | None:
        """The response's headers: the session token to add (None: add nothing)."""
        served, status, upstream_failure = head.served, head.status, head.upstream_failure
        if served:
            exchange.served = served
        exchange.usage = UsageReader(head.content_type)
        decision = exchange.decision
        if decision is None:
            return None
        if upstream_failure:
            # Envoy could not connect where the EPP sent it: a dead pod, known before a scrape.
            failed = exchange.served or decision.endpoints[0]
            self._pool.mark_unreachable(failed, "envoy: upstream connect failure")
        if not exchange.responded:
            exchange.responded = True  # judge each endpoint it went through, once
            self.responded(decision, exchange.served, status, upstream_failure)
        if self._session_tokens:
            # the reference's session contract: the token names the endpoint that served
            return session_token(exchange.served or decision.endpoints[0])
        return None

    def body(self, exchange: Exchange, chunk: bytes) -> None:
        """A chunk of the response's body: read for usage; the first bytes mean the server is
        working on it, so it no longer waits in that server's queue."""
        if exchange.usage is None:
            exchange.usage = UsageReader()
        exchange.usage.feed(chunk)
        if not exchange.started and chunk and exchange.decision is not None:
            exchange.started = True
            self.started(exchange.decision.request.request_id)

    def finish(self, exchange: Exchange, ok: bool, seconds: float) -> bool:
        """The response ended (``ok``) or the stream closed first: the finished event, once,
        for a routed request; True when this call sent it. A stream that closes before its
        response headers gives no verdict on the endpoint, but a probe ends."""
        decision = exchange.decision
        if decision is None:
            return False
        if not ok and not exchange.responded and decision.probe and self._outliers is not None:
            self._outliers.unanswered(decision.endpoints[0])
        if exchange.done:
            return False
        exchange.done = True
        usage = exchange.usage.finish() if ok and exchange.usage is not None else None
        output_tokens = usage.completion_tokens if usage is not None else None
        self._lifecycle.finished(decision.request.request_id, ok, seconds, output_tokens)
        if self._flow is not None:
            self._flow.kick()
        return True

    def started(self, request_id: str) -> None:
        self._lifecycle.started(request_id)
        if self._flow is not None:
            self._flow.kick()

    def responded(
        self, decision: RoutingDecision, served: str, status: int, connect_failure: bool
    ) -> None:
        """A routed request's response headers came back (the server's, or Envoy's own reply
        for a reset or a refused connection) with ``status``, from ``served`` (Envoy's
        ``x-gateway-destination-endpoint-served``; "" without it: the first endpoint).
        Envoy's retries walk the EPP's list in order, so the endpoints named before the one
        that served each failed an attempt (a reset or refused connection Envoy retried)."""
        outliers = self._outliers
        if outliers is None or not 100 <= status <= 599:
            return
        endpoints = decision.endpoints
        index = endpoints.index(served) if served in endpoints else 0
        ready: Collection[str] = ()
        if index or status >= 500:
            ready = {s.hostport for s in self._pool.endpoint_states()}
        for failed in endpoints[:index]:
            outliers.failed(failed, FailureKind.RETRIED, ready)
        if status < 500:
            outliers.succeeded(endpoints[index])
        else:
            kind = FailureKind.CONNECT if connect_failure else FailureKind.STATUS_5XX
            outliers.failed(endpoints[index], kind, ready)
