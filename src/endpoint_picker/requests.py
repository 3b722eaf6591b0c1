"""The OpenAI-style bodies: a request's, parsed once into an immutable request object, and the
token ``usage`` a response reports (read from whole JSON bodies and SSE streams, chunk by chunk
as they pass: never delaying a chunk, never holding more than it must).

The usage reader is at the end of this module."""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any

import orjson

from endpoint_picker.errors import BadRequestError
from endpoint_picker.types import Criticality


class Api(StrEnum):
    COMPLETIONS = "completions"
    CHAT_COMPLETIONS = "chat_completions"
    EMBEDDINGS = "embeddings"
    MODELS = "models"  # GET /v1/models: answered by the EPP, never a model server's admin API
    HEALTH = "health"  # GET/HEAD /health: the gateway's own health, answered by the EPP
    OTHER = "other"  # a path the operator opened with --extra-inference-path


# The only paths routed to a model server by default: the OpenAI inference APIs. A model
# server's other paths (/v1/load_lora_adapter, /v1/unload_lora_adapter, /metrics, /health,
# ...) are its admin surface and must never be reachable through the gateway.
INFERENCE_PATHS = {
    "/v1/completions": Api.COMPLETIONS,
    "/v1/chat/completions": Api.CHAT_COMPLETIONS,
    "/v1/embeddings": Api.EMBEDDINGS,
}
MODELS_PATH = "/v1/models"
# What vLLM's and guidellm's clients probe: 200 while the pool has a ready endpoint, else 503.
# Answered by the EPP from the pool it routes by; a pod's own /health stays unreachable.
HEALTH_PATH = "/health"


def normalize_path(path: str) -> str:
    """The path as matched: no query string, no trailing slash; nothing else is forgiven."""
    return path.partition("?")[0].rstrip("/") or "/"


def api_for_path(path: str, extra_paths: frozenset[str] = frozenset()) -> Api | None:
    """The API ``path`` addresses, or None when the EPP does not route it (a 404)."""
    normalized = normalize_path(path)
    api = INFERENCE_PATHS.get(normalized)
    if api is not None:
        return api
    if normalized == MODELS_PATH:
        return Api.MODELS
    if normalized == HEALTH_PATH:
        return Api.HEALTH
    return Api.OTHER if normalized in extra_paths else None


@dataclass(frozen=True, slots=True)
class LLMRequest:
    """One inference request, as the director and the scheduler see it.

    ``body`` is the parsed JSON (read it, never mutate it); ``raw_body`` the bytes received.
    ``target_model`` is the model the request is sent as, after any traffic split.
    ``request_id`` is the EPP's own id (``RequestIds``): it keys every table the EPP keeps
    and every lifecycle event. ``client_request_id`` is the client's ``x-request-id``, which
    any client may repeat or invent: it is only shown (logs, the status page, ``log_id``).
    """

    request_id: str
    api: Api
    model: str
    raw_body: bytes
    body: dict[str, Any] = field(repr=False)
    target_model: str = ""
    criticality: Criticality = Criticality.STANDARD
    # the model's (or the request's InferenceObjective's) latency objective: seconds per output
    # token at P95 (e2e latency / output tokens); None without one
    latency_objective: float | None = None
    # the request's InferenceObjective's priority; None: the criticality's (see priority_of)
    priority: int | None = None
    stream: bool = False
    # the request headers the scheduler asked for (session ids, tokens), lower-case names
    headers: Mapping[str, str] = field(default_factory=dict)
    client_request_id: str = ""  # for logs only, never a key

    @property
    def log_id(self) -> str:
        """The id logs and the status page show: the client's, else the EPP's own."""
        return self.client_request_id or self.request_id

    @property
    def prompt_text(self) -> str:
        """The prompt as one string (for prefix-aware routing); never logged."""
        if self.api is Api.COMPLETIONS:
            prompt = self.body.get("prompt")
            return prompt if isinstance(prompt, str) else orjson.dumps(prompt).decode()
        if self.api is Api.CHAT_COMPLETIONS:
            return orjson.dumps(self.body.get("messages")).decode()
        return ""


class RequestIds:
    """The EPP's own request ids, one per ext_proc stream: a random prefix per process (so
    that ids from other workers or replicas, docs/architecture.md principle 11, never collide) and a
    counter. Cheaper than a uuid4, and no client can choose or repeat one."""

    __slots__ = ("_counter", "_prefix")

    def __init__(self, prefix: str | None = None) -> None:
        self._prefix = secrets.token_hex(6) + "-" if prefix is None else prefix
        self._counter = itertools.count(1)

    def new(self) -> str:
        return f"{self._prefix}{next(self._counter)}"


def parse_request(
    request_id: str,
    api: Api,
    raw_body: bytes,
    headers: Mapping[str, str] | None = None,
    client_request_id: str = "",
) -> LLMRequest:
    """Parse and validate a request body for ``api``; raise ``BadRequestError``."""
    if api is Api.HEALTH:  # answered on its headers; routing it would reach a pod's /health
        raise BadRequestError(f"{HEALTH_PATH} is answered by the gateway itself, never routed")
    try:
        body = orjson.loads(raw_body)
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequestError("request body must be a JSON object")
    if "model" not in body:
        raise BadRequestError("request body has no 'model' field")
    model = body["model"]
    if not isinstance(model, str) or not model:
        raise BadRequestError("'model' must be a non-empty string")
    if api is Api.COMPLETIONS and body.get("prompt") is None:
        raise BadRequestError("/v1/completions needs a 'prompt' field")
    if api is Api.CHAT_COMPLETIONS:
        messages = body.get("messages")
        if messages is None:
            raise BadRequestError("/v1/chat/completions needs a 'messages' field")
        if not isinstance(messages, list):
            raise BadRequestError("'messages' must be a list")
    if api is Api.EMBEDDINGS and body.get("input") is None:
        raise BadRequestError("/v1/embeddings needs an 'input' field")
    return LLMRequest(
        request_id=request_id,
        api=api,
        model=model,
        raw_body=raw_body,
        body=body,
        target_model=model,
        stream=body.get("stream") is True,
        headers=headers or {},
        client_request_id=client_request_id,
    )


# Criticality as a flow-control priority, where no InferenceObjective gives one.
_CRITICALITY_PRIORITY = {Criticality.CRITICAL: 1, Criticality.STANDARD: 0,
                         Criticality.SHEDDABLE: -1}  # fmt: skip


def priority_of(request: LLMRequest) -> int:
    """The request's flow-control priority: its InferenceObjective's, else its criticality's
    (Critical 1, Standard 0, Sheddable -1: negative is sheddable either way)."""
    if request.priority is not None:
        return request.priority
    return _CRITICALITY_PRIORITY[request.criticality]


# -- the usage a response reports ---------------------------------------------------------------

_MAX_JSON_BODY = 8 * 1024 * 1024  # past this a JSON body is not kept for usage
_MAX_SSE_LINE = 1024 * 1024  # an event line longer than this is dropped unread
# No request uses more tokens than its model's context window; the longest offered today is
# 10M tokens (Llama 4 Scout). 2**26 (67M) leaves room for growth, while a larger count is a
# model-server bug that would swamp the token histograms' sums.
MAX_TOKENS = 2**26


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


class _Invalid(Enum):
    """A usage report that is there but not a plausible count."""

    USAGE = "invalid"


_INVALID = _Invalid.USAGE


def _count(value: object) -> int | None:
    # ``type(...) is int``: JSON ``true`` decodes to a bool, which isinstance calls an int.
    return value if type(value) is int and 0 <= value <= MAX_TOKENS else None


def _usage_of(obj: object) -> Usage | _Invalid | None:
    """The object's usage; ``None`` when it reports none, ``_INVALID`` when it reports junk."""
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if usage is None:
        return None
    if not isinstance(usage, dict):
        return _INVALID
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if prompt is None or completion is None:  # e.g. embeddings report no completion tokens
        return None
    prompt_count, completion_count = _count(prompt), _count(completion)
    if prompt_count is None or completion_count is None:
        return _INVALID
    return Usage(prompt_count, completion_count)


class UsageReader:
    """Accumulates what it needs of one response body to find its usage.

    The last usage report wins (streams with continuous usage repeat a growing one); when it
    is not a plausible count, ``usage`` is ``None`` and ``invalid`` is set.
    """

    def __init__(self, content_type: str = "") -> None:
        self.sse = "text/event-stream" in content_type.lower()
        self.usage: Usage | None = None
        self.invalid = False
        self.body_bytes = 0
        self._pending = bytearray()
        self._overflow = False

    def feed(self, chunk: bytes) -> None:
        self.body_bytes += len(chunk)
        if self.sse:
            self._feed_sse(chunk)
        elif not self._overflow:
            if len(self._pending) + len(chunk) > _MAX_JSON_BODY:
                self._overflow = True
                self._pending.clear()
            else:
                self._pending += chunk

    def _feed_sse(self, chunk: bytes) -> None:
        self._pending += chunk
        end = self._pending.rfind(b"\n")
        if end < 0:
            if len(self._pending) > _MAX_SSE_LINE:  # not SSE as we know it: stop holding it
                self._pending.clear()
            return
        complete = bytes(self._pending[: end + 1])
        del self._pending[: end + 1]
        if b'"usage"' not in complete:
            return
        for line in complete.splitlines():
            if line.startswith(b"data:") and b'"usage"' in line:
                try:
                    found = _usage_of(orjson.loads(line[5:]))
                except orjson.JSONDecodeError:
                    continue
                if found is not None:
                    self._take(found)

    def _take(self, found: Usage | _Invalid | None) -> None:
        self.invalid = found is _INVALID
        self.usage = found if isinstance(found, Usage) else None

    def finish(self) -> Usage | None:
        """Call at end of stream; returns the usage found, if any."""
        if self.sse:
            if self._pending:
                self._feed_sse(b"\n")
        elif self._pending and not self._overflow:
            try:
                self._take(_usage_of(orjson.loads(self._pending)))
            except orjson.JSONDecodeError:
                self.usage = None
            self._pending.clear()
        return self.usage
