"""Request parsing: the API from the path, the 400 rules."""

from __future__ import annotations

import pytest

from endpoint_picker.errors import BadRequestError
from endpoint_picker.requests import Api, api_for_path, parse_request


@pytest.mark.parametrize(
    ("path", "api"),
    [
        ("/v1/completions", Api.COMPLETIONS),
        ("/v1/completions?x=1", Api.COMPLETIONS),
        ("/v1/chat/completions", Api.CHAT_COMPLETIONS),
        ("/v1/chat/completions/", Api.CHAT_COMPLETIONS),
        ("/v1/embeddings", Api.EMBEDDINGS),
        ("/v1/models", Api.MODELS),
        ("/health", Api.HEALTH),  # the gateway's own, answered by the EPP
        ("/health?ready=1", Api.HEALTH),
        ("/v1/rerank", Api.OTHER),  # opened with --extra-inference-path
        # a model server's admin API and anything unknown: not routed (None: a 404)
        ("/v1/load_lora_adapter", None),
        ("/v1/unload_lora_adapter", None),
        ("/metrics", None),
        ("/healthz", None),
        ("/v1/health", None),
        ("/", None),
        ("/v1/completions/../unload_lora_adapter", None),
        ("/v1//completions", None),
        ("/V1/COMPLETIONS", None),
    ],
)
def test_api_from_path(path: str, api: Api | None) -> None:
    """Only the inference APIs (and opened paths) route, by exact path without the query."""
    assert api_for_path(path, frozenset({"/v1/rerank"})) is api


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/completions", b"{not json", "not valid JSON"),
        ("/v1/completions", b"[1, 2]", "must be a JSON object"),
        ("/v1/completions", b'{"prompt": "hi"}', "no 'model' field"),
        ("/v1/completions", b'{"model": 7, "prompt": "hi"}', "non-empty string"),
        ("/v1/completions", b'{"model": "m"}', "needs a 'prompt'"),
        ("/v1/completions", b'{"model": "m", "prompt": null}', "needs a 'prompt'"),
        ("/v1/chat/completions", b'{"model": "m"}', "needs a 'messages'"),
        ("/v1/chat/completions", b'{"model": "m", "messages": "hi"}', "must be a list"),
        ("/v1/embeddings", b'{"model": "m"}', "needs an 'input'"),
    ],
)
def test_bad_requests(path: str, body: bytes, message: str) -> None:
    """Every malformed body is a 400 naming what is wrong."""
    with pytest.raises(BadRequestError, match=message):
        parse_request("id", api_for_path(path) or Api.OTHER, body)


def test_opened_paths_need_only_a_model() -> None:
    """Paths opened with --extra-inference-path pass with just a model."""
    request = parse_request("id", Api.OTHER, b'{"model": "m", "query": "x"}')
    assert (request.model, request.target_model, request.api) == ("m", "m", Api.OTHER)


def test_stream_flag_and_raw_bytes_kept() -> None:
    """The raw bytes are kept as received and the stream flag is read."""
    raw = b'{"model": "m", "prompt": "hi", "stream": true}'
    request = parse_request("id", Api.COMPLETIONS, raw)
    assert request.raw_body is raw
    assert request.stream
