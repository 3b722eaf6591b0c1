"""Property-based fuzzing of the request body parser: only ``BadRequestError`` ever escapes."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from endpoint_picker.errors import BadRequestError
from endpoint_picker.requests import Api, LLMRequest, parse_request

APIS = st.sampled_from(list(Api))

# JSON values: every scalar kind (big integers, unicode with control characters and
# surrogate-free astral planes, floats at the edges), nested lists and objects.
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
# Objects that look like requests: the fields the parser reads, of any type, plus noise.
REQUEST_KEYS = st.sampled_from(["model", "prompt", "messages", "input", "stream", "x"])
REQUEST_OBJECTS = st.dictionaries(REQUEST_KEYS | st.text(max_size=6), JSON_VALUES, max_size=6)


def check(api: Api, raw: bytes) -> LLMRequest | None:
    """Parse ``raw``; a ``BadRequestError`` is a fine answer, anything else fails the test."""
    try:
        request = parse_request("r", api, raw)
    except BadRequestError:
        return None
    assert isinstance(request.body, dict)
    assert isinstance(request.model, str)
    assert request.model
    assert request.model == request.target_model == request.body["model"]
    assert request.raw_body is raw
    return request


@given(APIS, st.binary(max_size=200))
def test_arbitrary_bytes(api: Api, raw: bytes) -> None:
    """Arbitrary bytes give a request or a BadRequestError, nothing else."""
    check(api, raw)


@given(APIS, JSON_VALUES)
def test_arbitrary_json_values(api: Api, value: Any) -> None:
    """Any JSON value (not just objects) gives a request or a BadRequestError."""
    check(api, json.dumps(value).encode())


@given(APIS, REQUEST_OBJECTS)
def test_request_shaped_objects(api: Api, body: dict[str, Any]) -> None:
    """Objects with the request fields of any type parse exactly when the API's rules hold."""
    request = check(api, json.dumps(body).encode())
    model = body.get("model")
    valid = isinstance(model, str) and model != ""
    if api is Api.COMPLETIONS:
        valid = valid and body.get("prompt") is not None
    elif api is Api.CHAT_COMPLETIONS:
        valid = valid and isinstance(body.get("messages"), list)
    elif api is Api.EMBEDDINGS:
        valid = valid and body.get("input") is not None
    assert (request is not None) == valid
    if request is not None:
        assert request.stream == (body.get("stream") is True)


@given(APIS, st.integers(min_value=1, max_value=20_000), st.sampled_from(["[", '{"a":']))
def test_deeply_nested(api: Api, depth: int, opener: str) -> None:
    """Nesting of any depth, closed or not, never escapes as RecursionError or anything else."""
    closer = "]" if opener == "[" else "}"
    inner = '{"model":"m","prompt":"p","messages":[],"input":"i"}'
    check(api, (opener * depth + inner + closer * depth).encode())
    check(api, (opener * depth).encode())
    check(api, f'{{"model":"m","prompt":{opener * depth}1{closer * depth}}}'.encode())


@given(APIS, st.text(max_size=60), st.sampled_from(["utf-8", "utf-16", "utf-32", "latin-1"]))
def test_text_in_other_encodings(api: Api, model: str, encoding: str) -> None:
    """A body in another encoding never escapes as a decode error."""
    body = json.dumps(
        {"model": model, "prompt": "p", "messages": [], "input": "i"}, ensure_ascii=False
    )
    check(api, body.encode(encoding, errors="replace"))
