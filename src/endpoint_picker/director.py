"""The director: from a parsed request to the endpoints that should serve it.

The steps, in order (the first failing one decides the status): the path (404 unless it is
an inference API, see ``requests.INFERENCE_PATHS``; checked on the headers, before any body is
buffered), parse (400), model lookup (404), traffic split (503 when every weight is zero), the
request's InferenceObjective (``x-gateway-inference-objective``: its priority replaces the
model's criticality, and its latency objective, when it has one, the model's; an unknown name
changes nothing), the work scheduling plugins need done off the event loop first (the precise
prefix scorer tokenizing a long prompt: the request waits for a thread, ``prepared``),
candidates after the subset hint and without endpoints known to be unreachable (503) or
ejected by outlier detection (kept when every candidate is), load shedding of sheddable requests
(429), scheduling (503 when nothing is left). On the response side, ``responded`` tells the
outlier detector what each endpoint the request went through did.

With flow control on (the ``flowControl`` feature gate), admission replaces shedding: after the
InferenceObjective, a request the pool has no room for waits in its priority band (429 when the
band or the queue is full or it is evicted for a higher priority, 503 when it waits past its
TTL); candidates and scheduling then run when it is dispatched, among the candidates the
saturation detector says have room (all of them when none has).

The model steps (lookup, split, InferenceObjective, body rewrite) are in ``target_model``,
flow control's admission in ``admission``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from typing import Protocol

import structlog

from endpoint_picker.admission import FAIRNESS_HEADER as FAIRNESS_HEADER
from endpoint_picker.admission import MAX_CLIENT_TIMEOUT_MS as MAX_CLIENT_TIMEOUT_MS
from endpoint_picker.admission import TIMEOUT_HEADER as TIMEOUT_HEADER
from endpoint_picker.admission import admit
from endpoint_picker.datastore import InferenceModel, InferenceObjective, InferencePool
from endpoint_picker.datastore.health import without_excluded
from endpoint_picker.errors import (
    BadRequestError,
    PathNotFoundError,
    RequestError,
    ServiceUnavailableError,
    TooManyRequestsError,
    clip,
)
from endpoint_picker.exchange import (
    Exchange,
    Lifecycle,
    LocalAnswer,
    Outliers,
    ResponseHead,
    ResponseSide,
)
from endpoint_picker.exchange import QueuedRoute as QueuedRoute  # what the director returns
from endpoint_picker.exchange import RoutingDecision as RoutingDecision
from endpoint_picker.flowcontrol import FlowController
from endpoint_picker.prepared import after_work, run_inline
from endpoint_picker.requests import (
    Api,
    LLMRequest,
    RequestIds,
    api_for_path,
    normalize_path,
    parse_request,
    priority_of,
)
from endpoint_picker.scheduling import (
    OffLoopWork,
    Preparer,
    SaturationDetector,
    SchedulingResult,
    room_finder,
)
from endpoint_picker.target_model import OBJECTIVE_HEADER as OBJECTIVE_HEADER
from endpoint_picker.target_model import (
    apply_objective,
    resolve_model,
    rewrite_model,
)
from endpoint_picker.target_model import criticality_of_priority as criticality_of_priority
from endpoint_picker.types import Criticality, EndpointState, SubsetHint

log = structlog.get_logger(__name__)


class PoolReader(Protocol):
    """What the director reads of the datastore."""

    @property
    def pool(self) -> InferencePool | None: ...

    def model(self, model_name: str) -> InferenceModel | None: ...

    def objective(self, name: str) -> InferenceObjective | None: ...

    def model_names(self) -> tuple[str, ...]: ...

    def endpoint_states(self) -> tuple[EndpointState, ...]: ...

    def mark_unreachable(self, hostport: str, reason: str) -> None: ...


class RequestScheduler(Protocol):
    def schedule(
        self, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> SchedulingResult: ...


class Director:
    def __init__(
        self,
        pool: PoolReader,
        scheduler: RequestScheduler,
        saturation: SaturationDetector,
        *,
        allow_unknown_models: bool | None = None,
        extra_paths: Iterable[str] = (),
        rng: random.Random | None = None,
        lifecycle: Lifecycle | None = None,
        request_headers: Iterable[str] = (),
        session_tokens: bool = False,
        flow: FlowController[RoutingDecision] | None = None,
        ids: RequestIds | None = None,
        outliers: Outliers | None = None,
        preparers: Sequence[Preparer] = (),
    ) -> None:
        self._pool = pool
        self._preparers = tuple(preparers)
        self._ids = ids or RequestIds()
        self._outliers = outliers
        self._flow = flow
        if flow is not None:
            request_headers = (*request_headers, FAIRNESS_HEADER, TIMEOUT_HEADER)
        self._lifecycle = lifecycle or Lifecycle()
        self._request_headers = frozenset(h.lower() for h in request_headers) | {OBJECTIVE_HEADER}
        self._response = ResponseSide(pool, self._lifecycle, outliers, flow, session_tokens)
        self._extra_paths = frozenset(normalize_path(p) for p in extra_paths)
        self._scheduler = scheduler
        self._saturation = saturation
        self._with_room = room_finder(saturation)
        self._allow_unknown = allow_unknown_models
        self._rng = rng or random.Random()

    # -- the three crossings of the edge (headers, body, response; ``exchange``) --------------

    @property
    def request_headers(self) -> frozenset[str]:
        """The request headers the scheduler reads (lower-case); the stream collects these."""
        return self._request_headers

    def on_headers(
        self,
        path: str,
        client_id: str,
        subset: Sequence[str] | None,
        headers: dict[str, str],
        end_of_stream: bool,
    ) -> Exchange:
        """A request's headers: its exchange, with a request id of the EPP's own (what every
        table and event is keyed by; the client's ``x-request-id`` can be repeated by anyone:
        logs only) and the director's verdict on the headers, which the stream reads once its
        own checks pass: ``error`` (404: no inference API; 400: a model list with a body),
        ``local`` (the gateway's health, the model list), or neither (route it)."""
        exchange = Exchange(self._ids.new(), client_id, path, subset, headers, end_of_stream)
        try:
            api = exchange.api = self.resolve_api(path)
        except RequestError as exc:
            exchange.error = exc
            return exchange
        if api is Api.HEALTH:  # the gateway's health, whatever the method: never a pod's
            exchange.local = LocalAnswer(ready=self.has_ready_endpoint())
        elif api is Api.MODELS:
            models = self.list_models()
            if models is not None:
                exchange.local = LocalAnswer(models=tuple(models))
            elif not end_of_stream:
                exchange.error = BadRequestError("GET /v1/models takes no request body")
        return exchange

    def on_body(self, exchange: Exchange, raw_body: bytes) -> RoutingDecision | QueuedRoute:
        """Route the request with its whole body (or none, for headers only): through flow
        control when it is on, where a request that must wait comes back as a
        ``QueuedRoute`` whose future raises the queue's 429 or 503 or scheduling's own error.
        The stream sets ``exchange.decision`` once it is routed."""
        assert exchange.api is not None  # on_headers' error was answered instead
        if exchange.headers_only:
            return self._route_headers_only(
                exchange.id, exchange.api, exchange.path, exchange.subset, exchange.client_id
            )
        return self._route(
            exchange.id,
            exchange.api,
            raw_body,
            exchange.subset,
            exchange.headers,
            self._flow,
            exchange.client_id,
        )

    def on_response_headers(self, exchange: Exchange, head: ResponseHead) -> str | None:
        """The response's headers (``head``): the response side's steps
        (``exchange.ResponseSide.headers``); returns the session token the response carries,
        or None."""
        return self._response.headers(exchange, head)

    def on_response_body(self, exchange: Exchange, chunk: bytes) -> None:
        """A chunk of the response's body (read for usage; the first means started)."""
        self._response.body(exchange, chunk)

    def on_finish(self, exchange: Exchange, ok: bool, seconds: float) -> bool:
        """The response ended (``ok``) or the stream closed first, ``seconds`` after the
        headers: the finished event, once; True when this call sent it."""
        return self._response.finish(exchange, ok, seconds)

    # -- the steps, for those that route without a stream -----------------------------------

    def resolve_api(self, path: str) -> Api:
        """The API of ``path``; ``PathNotFoundError`` (404) for anything else."""
        api = api_for_path(path, self._extra_paths)
        if api is None:
            raise PathNotFoundError(
                f"{clip(normalize_path(path))} is not an inference API served by this gateway"
            )
        return api

    def list_models(self) -> list[str] | None:
        """The models clients may ask for (``GET /v1/models``), or None to ask a model server.

        The pool's InferenceModels are the public names (their split targets are internal);
        a pool without any (a v1 pool passing every model through) lets a server answer.
        """
        names = self._pool.model_names()
        return sorted(names) if names else None

    def has_ready_endpoint(self) -> bool:
        """Whether the pool has an endpoint to route to now (the gateway's ``GET /health``):
        loaded, with a Ready endpoint; a subset hint or a model may still narrow it to none."""
        return bool(self._pool.endpoint_states())

    def route(
        self,
        request_id: str,
        path: str,
        raw_body: bytes,
        subset: Sequence[str] | None,
        headers: Mapping[str, str] | None = None,
        client_request_id: str = "",
    ) -> RoutingDecision:
        """Route a request with a body now (flow control is not asked); raises a
        ``RequestError`` subclass. ``request_id`` is the EPP's own (an exchange's),
        ``client_request_id`` the client's, for logs."""
        api = self.resolve_api(path)
        outcome = self._route(
            request_id, api, raw_body, subset, headers, None, client_request_id, inline=True
        )
        assert isinstance(outcome, RoutingDecision)  # no flow control, nothing queues
        return outcome

    def _route(
        self,
        request_id: str,
        api: Api,
        raw_body: bytes,
        subset: Sequence[str] | None,
        headers: Mapping[str, str] | None,
        flow: FlowController[RoutingDecision] | None,
        client_request_id: str,
        *,
        inline: bool = False,
    ) -> RoutingDecision | QueuedRoute:
        request: LLMRequest | None = None
        try:
            request = parse_request(request_id, api, raw_body, headers, client_request_id)
            request = resolve_model(self._pool, request, self._allow_unknown, self._rng)
            request = apply_objective(self._pool, request)
            work = self._work(request)
            if work:
                if not inline:  # the stream waits while a thread does it
                    return after_work(request, work, partial(self._admit, request, subset, flow))
                run_inline(work)
            return self._admit(request, subset, flow)
        except RequestError as exc:
            if request is not None:
                exc.model, exc.target_model = request.model, request.target_model
            raise

    def _work(self, request: LLMRequest) -> list[OffLoopWork]:
        """What the preparer plugins need done off the event loop before scheduling."""
        return [w for p in self._preparers if (w := p.prepare(request)) is not None]

    def _admit(
        self,
        request: LLMRequest,
        subset: Sequence[str] | None,
        flow: FlowController[RoutingDecision] | None,
    ) -> RoutingDecision | QueuedRoute:
        try:
            if flow is None:
                return self._schedule(request, subset)
            return admit(
                flow,
                request,
                subset,
                self._candidates,
                self._with_room,
                partial(self._schedule, shed=False),
            )
        except RequestError as exc:
            exc.model, exc.target_model = request.model, request.target_model
            raise

    def route_headers_only(
        self,
        request_id: str,
        path: str,
        subset: Sequence[str] | None,
        client_request_id: str = "",
    ) -> RoutingDecision:
        """Route a request without a body (an extra path, or ``GET /v1/models`` when no
        InferenceModel lists the models) to any eligible endpoint."""
        api = self.resolve_api(path)
        return self._route_headers_only(request_id, api, path, subset, client_request_id)

    def _route_headers_only(
        self,
        request_id: str,
        api: Api,
        path: str,
        subset: Sequence[str] | None,
        client_request_id: str,
    ) -> RoutingDecision:
        if api not in (Api.OTHER, Api.MODELS):
            raise BadRequestError(f"{clip(normalize_path(path))} needs a JSON request body")
        request = LLMRequest(
            request_id=request_id,
            api=api,
            model="",
            raw_body=b"",
            body={},
            client_request_id=client_request_id,
        )
        return self._schedule(request, subset)

    def _candidates(self, subset: Sequence[str] | None) -> tuple[EndpointState, ...]:
        states = self._pool.endpoint_states()
        if not states:
            raise ServiceUnavailableError("no ready endpoint in the pool")
        if subset is None:
            return without_excluded(states, self._outliers)
        hint = SubsetHint.parse(subset)
        for entry in hint.malformed:
            log.warning("ignoring malformed subset hint entry", entry=clip(entry))
        chosen = hint.select(states)
        if not chosen:
            raise ServiceUnavailableError(
                "no eligible endpoint in the subset hint" if subset else "the subset hint is empty"
            )
        return without_excluded(chosen, self._outliers)

    def _schedule(
        self, request: LLMRequest, subset: Sequence[str] | None, *, shed: bool = True
    ) -> RoutingDecision:
        candidates = self._candidates(subset)
        if (
            shed
            and request.criticality is Criticality.SHEDDABLE
            and self._saturation.is_saturated(candidates)
        ):
            raise TooManyRequestsError(
                f"the pool is saturated; sheddable request for {clip(request.model)!r} dropped"
            )
        if not shed:  # flow control: only where there is room, so waiting stays in its queues
            room = self._with_room(candidates, priority_of(request))
            candidates = tuple(room) or candidates
        result = self._scheduler.schedule(request, candidates)
        if not result.endpoints:
            raise ServiceUnavailableError("no endpoint passed the scheduler's filters")
        body = request.raw_body
        if request.target_model != request.model:
            body = rewrite_model(request.raw_body, request.target_model)
        endpoints = tuple(s.hostport for s in result.endpoints)
        probe = self._outliers is not None and self._outliers.routed(endpoints[0])
        decision = RoutingDecision(request=request, endpoints=endpoints, body=body, probe=probe)
        self._lifecycle.routed(request, decision.endpoints[0])
        return decision
