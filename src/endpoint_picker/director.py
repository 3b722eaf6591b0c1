"""The director: from a parsed request to the endpoints that should serve it.

The steps, in order (the first failing one decides the status): parse (400), model lookup
(404), traffic split (503 when every weight is zero), candidates after the subset hint (503),
load shedding of sheddable requests (429), scheduling (503 when nothing is left).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import orjson
import structlog

from endpoint_picker.datastore import InferenceModel, InferencePool
from endpoint_picker.errors import (
    BadRequestError,
    ModelNotFoundError,
    RequestError,
    ServiceUnavailableError,
    TooManyRequestsError,
)
from endpoint_picker.requests import Api, LLMRequest, api_for_path, parse_request
from endpoint_picker.scheduling import SaturationDetector, SchedulingResult
from endpoint_picker.types import Criticality, EndpointState, parse_hostport

log = structlog.get_logger(__name__)


class PoolReader(Protocol):
    """What the director reads of the datastore."""

    @property
    def pool(self) -> InferencePool | None: ...

    def model(self, model_name: str) -> InferenceModel | None: ...

    def endpoint_states(self) -> tuple[EndpointState, ...]: ...


class RequestScheduler(Protocol):
    def schedule(
        self, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> SchedulingResult: ...


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """Where a request goes and the body it goes with."""

    request: LLMRequest
    endpoints: tuple[str, ...]  # host:port, primary first
    body: bytes  # the bytes to forward: the original unless the model was rewritten

    @property
    def destination(self) -> str:
        return ",".join(self.endpoints)


_MODEL_KEY = re.compile(rb'"model"\s*:\s*')
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


def _rewrite_model(raw: bytes, parsed: dict[str, Any], target_model: str) -> bytes:
    """The body with only the top-level ``model`` value replaced, every other byte kept.

    The value is spliced into the raw bytes and the result checked by parsing it once: a
    ``"model"`` key nested deeper (a tool schema, say) fails the check and the next is tried.
    Re-serialising instead would reformat the body, and orjson would turn integers past
    64 bits into floats; the standard library is the fallback for bodies the splice cannot
    handle.
    """
    expected = {**parsed, "model": target_model}
    value = orjson.dumps(target_model)
    for key in _MODEL_KEY.finditer(raw):
        string = _JSON_STRING.match(raw, key.end())
        if string is None:
            continue
        candidate = raw[: string.start()] + value + raw[string.end() :]
        try:
            if orjson.loads(candidate) == expected:
                return candidate
        except orjson.JSONDecodeError:
            continue
    body = json.loads(raw)
    body["model"] = target_model
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


class Director:
    def __init__(
        self,
        pool: PoolReader,
        scheduler: RequestScheduler,
        saturation: SaturationDetector,
        *,
        allow_unknown_models: bool | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._pool = pool
        self._scheduler = scheduler
        self._saturation = saturation
        self._allow_unknown = allow_unknown_models
        self._rng = rng or random.Random()

    def route(
        self, request_id: str, path: str, raw_body: bytes, subset: Sequence[str] | None
    ) -> RoutingDecision:
        """Route a request with a body; raises a ``RequestError`` subclass."""
        request: LLMRequest | None = None
        try:
            request = parse_request(request_id, path, raw_body)
            request = self._resolve_model(request)
            return self._schedule(request, subset)
        except RequestError as exc:
            if request is not None:
                exc.model, exc.target_model = request.model, request.target_model
            raise

    def route_headers_only(
        self, request_id: str, path: str, subset: Sequence[str] | None
    ) -> RoutingDecision:
        """Route a request without a body (e.g. ``GET /v1/models``) to any eligible endpoint."""
        api = api_for_path(path)
        if api is not Api.OTHER:
            raise BadRequestError(f"{path.partition('?')[0]} needs a JSON request body")
        request = LLMRequest(request_id=request_id, api=Api.OTHER, model="", raw_body=b"", body={})
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
                    f"model {request.model!r} is not served by InferencePool {pool.name!r}"
                )
            # v1 pools have no InferenceModel API: everything is Standard there.
            crit = Criticality.STANDARD if pool.passes_unknown_models else Criticality.SHEDDABLE
            return replace(request, criticality=crit)
        return replace(request, target_model=self._split(model), criticality=model.criticality)

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
            return states
        wanted_hostports: set[tuple[str, int]] = set()
        wanted_hosts: set[str] = set()
        for entry in subset:
            try:
                host, port = parse_hostport(entry)
            except ValueError:
                log.warning("ignoring malformed subset hint entry", entry=entry[:100])
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
        return chosen

    def _schedule(self, request: LLMRequest, subset: Sequence[str] | None) -> RoutingDecision:
        candidates = self._candidates(subset)
        if request.criticality is Criticality.SHEDDABLE and self._saturation.is_saturated(
            candidates
        ):
            raise TooManyRequestsError(
                f"the pool is saturated; sheddable request for {request.model!r} dropped"
            )
        result = self._scheduler.schedule(request, candidates)
        if not result.endpoints:
            raise ServiceUnavailableError("no endpoint passed the scheduler's filters")
        body = request.raw_body
        if request.target_model != request.model:
            body = _rewrite_model(request.raw_body, request.body, request.target_model)
        return RoutingDecision(
            request=request,
            endpoints=tuple(s.hostport for s in result.endpoints),
            body=body,
        )
