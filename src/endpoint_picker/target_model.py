"""The request's model, for the director: the InferenceModel lookup (404 for an unknown model
the pool does not pass through), the traffic split over its target models (503 when every
weight is zero), the request's InferenceObjective (``x-gateway-inference-objective``: its
priority replaces the model's criticality, and its latency objective, when it has one, the
model's; an unknown name changes nothing), and the body rewrite to the chosen target model.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from dataclasses import replace
from typing import Protocol

import orjson
import structlog

from endpoint_picker.datastore import InferenceModel, InferenceObjective, InferencePool
from endpoint_picker.errors import (
    BadRequestError,
    ModelNotFoundError,
    ServiceUnavailableError,
    clip,
)
from endpoint_picker.requests import LLMRequest
from endpoint_picker.types import Criticality

log = structlog.get_logger(__name__)

# The request header naming the request's InferenceObjective (the reference EPP's).
OBJECTIVE_HEADER = "x-gateway-inference-objective"


def criticality_of_priority(priority: int) -> Criticality:
    """An InferenceObjective's priority as criticality: negative is Sheddable (shed when the
    pool is saturated, as the reference does), 0 (or unset) Standard, positive Critical."""
    if priority < 0:
        return Criticality.SHEDDABLE
    return Criticality.CRITICAL if priority > 0 else Criticality.STANDARD


class ModelReader(Protocol):
    """What the model steps read of the datastore (the director's ``PoolReader`` has it)."""

    @property
    def pool(self) -> InferencePool | None: ...

    def model(self, model_name: str) -> InferenceModel | None: ...

    def objective(self, name: str) -> InferenceObjective | None: ...


def resolve_model(
    reader: ModelReader,
    request: LLMRequest,
    allow_unknown: bool | None,
    rng: random.Random,
) -> LLMRequest:
    """The request with its target model (the split's pick), criticality and latency
    objective from its InferenceModel; 503 before the pool is loaded, 404 for a model the pool
    does not serve (``allow_unknown``, when set, overrides the pool's pass-through)."""
    pool = reader.pool
    if pool is None:
        raise ServiceUnavailableError("the pool is not loaded yet")
    model = reader.model(request.model)
    if model is None:
        allow = pool.passes_unknown_models if allow_unknown is None else allow_unknown
        if not allow:
            raise ModelNotFoundError(
                f"model {clip(request.model)!r} is not served by InferencePool {pool.name!r}"
            )
        # v1 pools have no InferenceModel API: everything is Standard there.
        crit = Criticality.STANDARD if pool.passes_unknown_models else Criticality.SHEDDABLE
        return replace(request, criticality=crit)
    return replace(
        request,
        target_model=split(model, rng),
        criticality=model.criticality,
        latency_objective=model.objective.per_output_token_p95 if model.objective else None,
    )


def apply_objective(reader: ModelReader, request: LLMRequest) -> LLMRequest:
    """The request under the InferenceObjective its header names (unchanged without one)."""
    name = request.headers.get(OBJECTIVE_HEADER)
    if not name:
        return request
    objective = reader.objective(name)
    if objective is None:
        log.debug("unknown InferenceObjective; the model's criticality stands", name=clip(name))
        return request
    # its latency objective replaces the model's; without one, the model's stands
    latency = objective.objective
    return replace(
        request,
        criticality=criticality_of_priority(objective.priority),
        priority=objective.priority,
        latency_objective=(latency.per_output_token_p95 if latency else request.latency_objective),
    )


def split(model: InferenceModel, rng: random.Random) -> str:
    """The traffic split: one target model by weight (the model itself without targets)."""
    if not model.target_models:
        return model.model_name
    weights = [t.weight for t in model.target_models]
    if not any(weights):
        raise ServiceUnavailableError(f"every target model of {model.model_name!r} has weight 0")
    (target,) = rng.choices(model.target_models, weights=weights)
    return target.name


_MODEL_KEY = re.compile(rb'"model"\s*:\s*')
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
# Each splice attempt parses the whole body once: past this many ``"model"`` keys (nested ones
# ahead of the top-level key: tool schemas, or a body built to make the rewrite quadratic) the
# body is re-serialised instead, one parse whatever its size.
MAX_MODEL_SPLICES = 8


def rewrite_model(raw: bytes, target_model: str) -> bytes:
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
    (``"model"`` spelled with escapes, or behind more than ``MAX_MODEL_SPLICES`` other
    ``"model"`` keys), and a body too deep for it is a 400.
    ``target_model`` must differ from the body's model (the director rewrites only then): a
    splice of a nested value equal to it would pass the check.
    """
    value = orjson.dumps(target_model)
    for key in itertools.islice(_MODEL_KEY.finditer(raw), MAX_MODEL_SPLICES):
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
