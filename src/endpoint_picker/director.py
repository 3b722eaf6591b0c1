"""The director: from a parsed request to the endpoints that should serve it.

The steps, in order (the first failing one decides the status): the path (404 unless it is
an inference API, see ``requests.INFERENCE_PATHS``; checked on the headers, before any body is
buffered), parse (400), model lookup (404), traffic split (503 when every weight is zero), the
request's InferenceObjective (``x-gateway-inference-objective``: its priority replaces the
model's criticality, and its latency objective, when it has one, the model's; an unknown name
changes nothing),
candidates after the subset hint and without endpoints known to be unreachable (503) or
ejected by outlier detection (kept when every candidate is), load shedding of sheddable requests
(429), scheduling (503 when nothing is left). On the response side, ``responded`` tells the
outlier detector what each endpoint the request went through did.

With flow control on (the ``flowControl`` feature gate), admission replaces shedding: after the
InferenceObjective, a request the pool has no room for waits in its priority band (429 when the
band or the queue is full or it is evicted for a higher priority, 503 when it waits past its
TTL); candidates and scheduling then run when it is dispatched, among the candidates the
saturation detector says have room (all of them when none has).
"""

from __future__ import annotations

import functools
import itertools
import json
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

import orjson
import structlog

from endpoint_picker.datastore import InferenceModel, InferenceObjective, InferencePool
from endpoint_picker.datastore.health import without_excluded
from endpoint_picker.errors import (
    BadRequestError,
    ModelNotFoundError,
    PathNotFoundError,
    RequestError,
    ServiceUnavailableError,
    TooManyRequestsError,
    clip,
    kept,
)
from endpoint_picker.exchange import (
    Exchange,
    LocalAnswer,
    Outliers,
    ResponseSide,
)
from endpoint_picker.exchange import QueuedRoute as QueuedRoute  # what the director returns
from endpoint_picker.exchange import RoutingDecision as RoutingDecision
from endpoint_picker.flowcontrol import FlowController
from endpoint_picker.requests import (
    Api,
    LLMRequest,
    RequestIds,
    api_for_path,
    normalize_path,
    parse_request,
    priority_of,
)
from endpoint_picker.scheduling import SaturationDetector, SchedulingResult, room_finder
from endpoint_picker.scheduling.lifecycle import Lifecycle
from endpoint_picker.types import Criticality, EndpointState, ascii_int, parse_hostport

log = structlog.get_logger(__name__)

# The request header naming the request's InferenceObjective (the reference EPP's).
OBJECTIVE_HEADER = "x-gateway-inference-objective"
# Flow control: the request's fairness id (the reference EPP's header), and how long the client
# will wait (Envoy's header for the caller's expected timeout), which shortens the queue TTL.
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


def criticality_of_priority(priority: int) -> Criticality:
    """An InferenceObjective's priority as criticality: negative is Sheddable (shed when the
    pool is saturated, as the reference does), 0 (or unset) Standard, positive Critical."""
    if priority < 0:
        return Criticality.SHEDDABLE
    return Criticality.CRITICAL if priority > 0 else Criticality.STANDARD


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


_MODEL_KEY = re.compile(rb'"model"\s*:\s*')
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
# Each splice attempt parses the whole body once: past this many ``"model"`` keys (nested ones
# ahead of the top-level key: tool schemas, or a body built to make the rewrite quadratic) the
# body is re-serialised instead, one parse whatever its size.
_MAX_MODEL_SPLICES = 8


def _rewrite_model(raw: bytes, target_model: str) -> bytes:
    """The body with only the top-level ``model`` value replaced, every other byte kept.

    The value is spliced into the raw bytes. In a valid JSON body a ``"model"`` key match
    always ends with a whole key token (a quote inside a string is escaped, so a match that
    starts inside a key, ``"\\"model": ...``, ends with that key) followed by a value, so a
    splice changes exactly one string value; parsing the result once tells whether it
    was the top-level one (a nested ``"model"``, in a tool schema say, leaves the top-level
    value as it was). Only the top-level value is compared, never the whole document, so a
    body nested as deeply as the parser accepts cannot exhaust the recursion limit.
    Re-serialising instead would reformat the body, and orjson would turn integers past 64 bits
    into floats; the standard library is the fallback for bodies the splice cannot handle
    (``"model"`` spelled with escapes, or behind more than ``_MAX_MODEL_SPLICES`` other
    ``"model"`` keys), and a body too deep for it is a 400.
    ``target_model`` must differ from the body's model (the director rewrites only then): a
    splice of a nested value equal to it would pass the check.
    """
    value = orjson.dumps(target_model)
    for key in itertools.islice(_MODEL_KEY.finditer(raw), _MAX_MODEL_SPLICES):
        string = _JSON_STRING.match(raw, key.end())
        if string is None:
            continue
        candidate = raw[: string.start()] + value + raw[string.end() :]
        try:
            if orjson.loads(candidate).get("model") == target_model:
                return candidate
        except orjson.JSONDecodeError:
            continue
    try:
        body = json.loads(raw)
        body["model"] = target_model
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    except RecursionError as exc:
        raise BadRequestError("request body is nested too deeply to rewrite its model") from exc


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
    ) -> None:
        self._pool = pool
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

    def on_response_headers(
        self,
        exchange: Exchange,
        served: str,
        status: int,
        upstream_failure: bool,
        content_type: str,
    ) -> str | None:
        """The response's headers, from ``served`` (Envoy's
        ``x-gateway-destination-endpoint-served``; "" without it), with ``status``: the
        response side's steps (``exchange.ResponseSide.headers``); returns the session token
        the response carries, or None."""
        return self._response.headers(exchange, served, status, upstream_failure, content_type)

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

    def finished(
        self,
        request_id: str,
        ok: bool,
        seconds: float | None = None,
        output_tokens: int | None = None,
    ) -> None:
        """A routed request's response ended (``ok``) or its stream closed first: once each,
        after ``seconds`` end to end, with the response's ``output_tokens`` when it had usage."""
        self._response.finished(request_id, ok, seconds, output_tokens)

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
        outcome = self._route(request_id, api, raw_body, subset, headers, None, client_request_id)
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
    ) -> RoutingDecision | QueuedRoute:
        request: LLMRequest | None = None
        try:
            request = parse_request(request_id, api, raw_body, headers, client_request_id)
            request = self._apply_objective(self._resolve_model(request))
            if flow is None:
                return self._schedule(request, subset)
            return self._admit(flow, request, subset)
        except RequestError as exc:
            if request is not None:
                exc.model, exc.target_model = request.model, request.target_model
            raise

    def _admit(
        self,
        flow: FlowController[RoutingDecision],
        request: LLMRequest,
        subset: Sequence[str] | None,
    ) -> RoutingDecision | QueuedRoute:
        """Flow control's step: schedule now when the pool has room and nobody of this priority
        waits; otherwise queue (flow control replaces shedding: Sheddable requests wait too)."""
        priority = priority_of(request)
        ready = None
        if subset is not None:  # only some endpoints will do: wait until one of them has room
            self._candidates(subset)  # no eligible endpoint: a 503 now, not after a wait
            ready = functools.partial(self._subset_has_room, subset, priority)
        if flow.admit_now(priority, ready):
            return self._schedule(request, subset, shed=False)
        future = flow.enqueue(
            request.log_id,  # for its log lines only
            lambda: self._schedule(request, subset, shed=False),
            priority=priority,
            flow_id=kept(request.headers.get(FAIRNESS_HEADER, "")),  # a client string, kept
            size=len(request.raw_body),
            timeout=_client_timeout(request.headers.get(TIMEOUT_HEADER)),
            ready=ready,
        )
        return QueuedRoute(request, future)

    def _subset_has_room(self, subset: Sequence[str], priority: int) -> bool:
        """Whether an endpoint of the subset hint, as the pool is now, has room for
        ``priority``; True when none is eligible any more, so that the dispatch answers it."""
        try:
            candidates = self._candidates(subset)
        except RequestError:
            return True
        return bool(self._with_room(candidates, priority))

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

    def _resolve_model(self, request: LLMRequest) -> LLMRequest:
        pool = self._pool.pool
        if pool is None:
            raise ServiceUnavailableError("the pool is not loaded yet")
        model = self._pool.model(request.model)
        if model is None:
            allow = (
                pool.passes_unknown_models if self._allow_unknown is None else self._allow_unknown
            )
            if not allow:
                raise ModelNotFoundError(
                    f"model {clip(request.model)!r} is not served by InferencePool {pool.name!r}"
                )
            # v1 pools have no InferenceModel API: everything is Standard there.
            crit = Criticality.STANDARD if pool.passes_unknown_models else Criticality.SHEDDABLE
            return replace(request, criticality=crit)
        return replace(
            request,
            target_model=self._split(model),
            criticality=model.criticality,
            latency_objective=model.objective.per_output_token_p95 if model.objective else None,
        )

    def _apply_objective(self, request: LLMRequest) -> LLMRequest:
        name = request.headers.get(OBJECTIVE_HEADER)
        if not name:
            return request
        objective = self._pool.objective(name)
        if objective is None:
            log.debug("unknown InferenceObjective; the model's criticality stands", name=clip(name))
            return request
        # its latency objective replaces the model's; without one, the model's stands
        latency = objective.objective
        return replace(
            request,
            criticality=criticality_of_priority(objective.priority),
            priority=objective.priority,
            latency_objective=(
                latency.per_output_token_p95 if latency else request.latency_objective
            ),
        )

    def _split(self, model: InferenceModel) -> str:
        if not model.target_models:
            return model.model_name
        weights = [t.weight for t in model.target_models]
        if not any(weights):
            raise ServiceUnavailableError(
                f"every target model of {model.model_name!r} has weight 0"
            )
        (target,) = self._rng.choices(model.target_models, weights=weights)
        return target.name

    def _candidates(self, subset: Sequence[str] | None) -> tuple[EndpointState, ...]:
        states = self._pool.endpoint_states()
        if not states:
            raise ServiceUnavailableError("no ready endpoint in the pool")
        if subset is None:
            return without_excluded(states, self._outliers)
        wanted_hostports: set[tuple[str, int]] = set()
        wanted_hosts: set[str] = set()
        for entry in subset:
            try:
                host, port = parse_hostport(entry)
            except ValueError:
                log.warning("ignoring malformed subset hint entry", entry=clip(entry))
                continue
            if port is None:
                wanted_hosts.add(host)
            else:
                wanted_hostports.add((host, port))
        chosen = tuple(
            s
            for s in states
            if s.endpoint.address in wanted_hosts
            or (s.endpoint.address, s.endpoint.port) in wanted_hostports
        )
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
            body = _rewrite_model(request.raw_body, request.target_model)
        endpoints = tuple(s.hostport for s in result.endpoints)
        probe = self._outliers is not None and self._outliers.routed(endpoints[0])
        decision = RoutingDecision(request=request, endpoints=endpoints, body=body, probe=probe)
        self._lifecycle.routed(request, decision.endpoints[0])
        return decision


def _client_timeout(header: str | None) -> float | None:
    """``x-envoy-expected-rq-timeout-ms`` in seconds; None when absent, not ASCII digits or
    past a day (the band's TTL stands)."""
    millis = ascii_int(header, MAX_CLIENT_TIMEOUT_MS) if header else None
    return None if millis is None else millis / 1000
