"""The OpenAI-style request body, parsed once into an immutable request object."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from endpoint_picker.errors import BadRequestError
from endpoint_picker.types import Criticality


class Api(StrEnum):
    COMPLETIONS = "completions"
    CHAT_COMPLETIONS = "chat_completions"
    OTHER = "other"


_PATH_APIS = {
    "/v1/completions": Api.COMPLETIONS,
    "/v1/chat/completions": Api.CHAT_COMPLETIONS,
}


def api_for_path(path: str) -> Api:
    """The API a ``:path`` addresses; the query string does not count."""
    return _PATH_APIS.get(path.partition("?")[0].rstrip("/") or "/", Api.OTHER)


@dataclass(frozen=True, slots=True)
class LLMRequest:
    """One inference request, as the director and the scheduler see it.

    ``body`` is the parsed JSON (read it, never mutate it); ``raw_body`` the bytes received.
    ``target_model`` is the model the request is sent as, after any traffic split.
    """

    request_id: str
    api: Api
    model: str
    raw_body: bytes
    body: dict[str, Any] = field(repr=False)
    target_model: str = ""
    criticality: Criticality = Criticality.STANDARD
    stream: bool = False

    @property
    def prompt_text(self) -> str:
        """The prompt as one string (for prefix-aware routing); never logged."""
        if self.api is Api.COMPLETIONS:
            prompt = self.body.get("prompt")
            return prompt if isinstance(prompt, str) else orjson.dumps(prompt).decode()
        if self.api is Api.CHAT_COMPLETIONS:
            return orjson.dumps(self.body.get("messages")).decode()
        return ""


def parse_request(request_id: str, path: str, raw_body: bytes) -> LLMRequest:
    """Parse and validate a request body for ``path``; raise ``BadRequestError``."""
    api = api_for_path(path)
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
    return LLMRequest(
        request_id=request_id,
        api=api,
        model=model,
        raw_body=raw_body,
        body=body,
        target_model=model,
        stream=body.get("stream") is True,
    )
