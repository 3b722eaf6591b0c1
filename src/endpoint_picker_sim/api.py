"""The OpenAI wire format as vLLM speaks it: request parsing, error bodies, response bodies.

Pure functions over dicts; the aiohttp handlers in ``server`` stay thin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from endpoint_picker_sim.tokenizer import render_chat


class ApiError(Exception):
    """An error answered to the client with vLLM's error JSON."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type

    def body(self) -> bytes:
        """``{"error": {"message", "type", "param", "code"}}`` as vLLM returns it."""
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.err_type,
                    "param": None,
                    "code": self.status,
                }
            }
        )


ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    429: "TooManyRequestsError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


@dataclass(frozen=True, slots=True)
class Prompt:
    """A parsed generation request: either text or token ids, and its sampling limits."""

    model: str | None
    text: str | None
    token_ids: tuple[int, ...] | None
    max_tokens: int
    stream: bool
    include_usage: bool


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"Invalid JSON body: {exc}") from exc
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return data


def _max_tokens(data: dict[str, Any], keys: tuple[str, ...], default: int) -> int:
    for key in keys:
        value = data.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ApiError(400, f"{key} must be at least 1, got {value!r}.")
        return value
    return default


def _common(data: dict[str, Any]) -> tuple[str | None, bool, bool]:
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string.")
    stream = bool(data.get("stream", False))
    options = data.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object.")
    include_usage = bool(options and options.get("include_usage"))
    return model, stream, include_usage


def parse_completion(data: dict[str, Any], default_max_tokens: int) -> Prompt:
    """``POST /v1/completions``: one prompt, as a string or token ids."""
    model, stream, include_usage = _common(data)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    text: str | None = None
    ids: tuple[int, ...] | None = None
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "The decoder prompt cannot be empty")
        text = prompt
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        ids = tuple(prompt)
    elif prompt is None:
        raise ApiError(400, "Field required: prompt")
    else:
        raise ApiError(400, "prompt must be a string, a list of one string, or token ids.")
    max_tokens = _max_tokens(data, ("max_tokens",), default_max_tokens)
    return Prompt(model, text, ids, max_tokens, stream, include_usage)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ApiError(400, "Only text content parts are supported by the simulator.")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ApiError(400, "message content must be a string or a list of parts.")


def parse_chat(data: dict[str, Any], default_max_tokens: int) -> Prompt:
    """``POST /v1/chat/completions``: messages rendered through a chat template."""
    model, stream, include_usage = _common(data)
    messages = data.get("messages")
    if messages is None:
        raise ApiError(400, "Field required: messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list.")
    turns: list[tuple[str, str]] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, "each message needs a string role.")
        turns.append((message["role"], _content_text(message.get("content"))))
    keys = ("max_completion_tokens", "max_tokens")
    max_tokens = _max_tokens(data, keys, default_max_tokens)
    return Prompt(model, render_chat(turns), None, max_tokens, stream, include_usage)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The OpenAI usage object."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def response_body(
    chat: bool, rid: str, created: int, model: str, text: str, reason: str, use: dict[str, int]
) -> bytes:
    """A non-streaming response: a ``chat.completion`` or a ``text_completion``, worded as vLLM
    words them (a completion's ``prompt_logprobs`` sits in its choice, a chat's beside them)."""
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
    else:
        choice["text"] = text
    choice.update(logprobs=None, finish_reason=reason, stop_reason=None)
    response: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": use,
    }
    (response if chat else choice)["prompt_logprobs"] = None
    return orjson.dumps(response)


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
