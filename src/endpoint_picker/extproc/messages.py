"""Envoy's ext_proc messages as the stream reads and writes them: what it reads of a
``ProcessingRequest`` (header values, metadata strings, the subset hint, the facts of a
response's headers) and the builders of the ``ProcessingResponse`` it answers with.

Responses are built by setting fields on an empty message rather than with nested
constructors: with the upb backend that is several times faster, and these run a few times
per request.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from endpoint_picker.errors import ErrorCode
from endpoint_picker.exchange import ResponseHead
from endpoint_picker.extproc import wire
from endpoint_picker.types import ascii_int

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_METADATA_CACHE_LIMIT = 4096  # destinations are few (pool endpoints x fallbacks)
_metadata_cache: dict[str, struct_pb2.Struct] = {}


def _set_header(mutation: pb.HeaderMutation, key: str, value: bytes) -> None:
    option = mutation.set_headers.add()
    option.header.key = key
    option.header.raw_value = value
    option.append_action = _OVERWRITE


def _set_routing(
    common: pb.CommonResponse, destination: str, content_length: int | None, remove: Sequence[str]
) -> None:
    """The destination header (and the forwarded body's length); client spoofs dropped."""
    mutation = common.header_mutation
    _set_header(mutation, wire.DESTINATION_ENDPOINT, destination.encode())
    if content_length is not None:
        _set_header(mutation, wire.CONTENT_LENGTH, str(content_length).encode())
    if remove:
        mutation.remove_headers.extend(remove)
    common.clear_route_cache = True


def destination_metadata(destination: str) -> struct_pb2.Struct:
    """``{"envoy.lb": {"x-gateway-destination-endpoint": destination}}``: same as the header."""
    metadata = _metadata_cache.get(destination)
    if metadata is None:
        if len(_metadata_cache) >= _METADATA_CACHE_LIMIT:
            _metadata_cache.clear()
        metadata = struct_pb2.Struct()
        metadata.update({wire.LB_NAMESPACE: {wire.DESTINATION_ENDPOINT: destination}})
        _metadata_cache[destination] = metadata
    return metadata


def routed_request_headers(
    destination: str, content_length: int | None, remove: Sequence[str]
) -> pb.ProcessingResponse:
    """Full duplex: the headers response that routes the request."""
    response = pb.ProcessingResponse()
    _set_routing(response.request_headers.response, destination, content_length, remove)
    response.dynamic_metadata.CopyFrom(destination_metadata(destination))
    return response


def routed_buffered_body(
    destination: str, content_length: int, remove: Sequence[str], new_body: bytes | None
) -> pb.ProcessingResponse:
    """BUFFERED mode: routing header, optional body rewrite and metadata on the body response."""
    response = pb.ProcessingResponse()
    common = response.request_body.response
    _set_routing(common, destination, content_length, remove)
    if new_body is not None:
        common.body_mutation.body = new_body
    response.dynamic_metadata.CopyFrom(destination_metadata(destination))
    return response


def streamed_chunks(body: bytes, end_of_stream: bool) -> Iterator[tuple[bytes, bool]]:
    """Split ``body`` into chunks of at most MAX_STREAMED_CHUNK; only the last ends the stream."""
    size = wire.MAX_STREAMED_CHUNK
    if len(body) <= size:
        yield body, end_of_stream
        return
    view = memoryview(body)
    last = (len(view) - 1) // size * size
    for start in range(0, len(view), size):
        yield bytes(view[start : start + size]), end_of_stream and start == last


def _streamed_body(phase: str, chunk: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    response = pb.ProcessingResponse()
    streamed = getattr(response, phase).response.body_mutation.streamed_response
    streamed.body = chunk
    streamed.end_of_stream = end_of_stream
    return response


def streamed_request_body(chunk: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    return _streamed_body("request_body", chunk, end_of_stream)


def streamed_response_body(chunk: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    return _streamed_body("response_body", chunk, end_of_stream)


CONTINUE_REQUEST_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
CONTINUE_REQUEST_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
CONTINUE_REQUEST_TRAILERS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
CONTINUE_RESPONSE_BODY = pb.ProcessingResponse(response_body=pb.BodyResponse())
CONTINUE_RESPONSE_TRAILERS = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def error_body(code: ErrorCode, message: str) -> bytes:
    """The OpenAI-style error body every rejection carries."""
    return orjson.dumps(
        {"error": {"message": message, "type": code.type_name, "code": code.http_status}}
    )


def response_headers_with(key: str, value: str) -> pb.ProcessingResponse:
    """Continue the response, with one header set (the session token)."""
    response = pb.ProcessingResponse()
    _set_header(response.response_headers.response.header_mutation, key, value.encode())
    return response


def immediate_json(status: int, body: bytes, details: str) -> pb.ProcessingResponse:
    """An answer from the EPP itself (``GET /v1/models``): the request goes nowhere."""
    response = pb.ProcessingResponse()
    immediate = response.immediate_response
    immediate.status.code = status
    _set_header(immediate.headers, wire.CONTENT_TYPE, b"application/json")
    immediate.body = body
    immediate.details = details
    return response


def immediate_empty(status: int, details: str) -> pb.ProcessingResponse:
    """An answer from the EPP itself with no body (``GET /health``'s 200, as vLLM's)."""
    response = pb.ProcessingResponse()
    response.immediate_response.status.code = status
    response.immediate_response.details = details
    return response


def models_body(model_names: Sequence[str], owner: str) -> bytes:
    """The OpenAI ``GET /v1/models`` list."""
    return orjson.dumps(
        {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": owner}
                for name in model_names
            ],
        }
    )


def immediate_error(code: ErrorCode, message: str) -> pb.ProcessingResponse:
    response = pb.ProcessingResponse()
    immediate = response.immediate_response
    immediate.status.code = code.http_status
    _set_header(immediate.headers, wire.CONTENT_TYPE, b"application/json")
    immediate.body = error_body(code, message)
    immediate.details = f"epp_{code.type_name}"
    return response


# -- what the stream reads ------------------------------------------------------------------


def header_value(header: object) -> str:
    raw = getattr(header, "raw_value", b"")
    return raw.decode("utf-8", "replace") if raw else str(getattr(header, "value", ""))


def metadata_string(request: pb.ProcessingRequest, namespace: str, key: str) -> str | None:
    meta = request.metadata_context.filter_metadata
    if namespace not in meta:
        return None
    value = meta[namespace].fields.get(key)
    if value is None or value.WhichOneof("kind") != "string_value":
        return None
    return str(value.string_value)


def subset_hint(request: pb.ProcessingRequest) -> list[str] | None:
    """The subset hint as a list of entries, or None when Envoy sent none."""
    meta = request.metadata_context.filter_metadata
    if wire.SUBSET_HINT_NAMESPACE not in meta:
        return None
    value = meta[wire.SUBSET_HINT_NAMESPACE].fields.get(wire.SUBSET_HINT_KEY)
    if value is None:
        return None
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        # a non-string entry stays in the list as an invalid one: "no eligible endpoint",
        # not "empty hint"
        return [
            v.string_value if v.WhichOneof("kind") == "string_value" else "<not a string>"
            for v in value.list_value.values
        ]
    if kind == "string_value":  # tolerate "a,b" as a single string
        return [s for s in (p.strip() for p in value.string_value.split(",")) if s]
    return []


def response_head(message: pb.ProcessingRequest) -> ResponseHead:
    """What a response's headers tell the director (``exchange.ResponseHead``)."""
    served = metadata_string(message, wire.LB_NAMESPACE, wire.SERVED_ENDPOINT_KEY) or ""
    content_type, status, upstream_failure = "", 0, False
    for header in message.response_headers.headers.headers:
        key = header.key.lower()
        if key == wire.CONTENT_TYPE:
            content_type = header_value(header)
        elif key == ":status":
            status = ascii_int(header_value(header), 999) or 0
        elif key == wire.UPSTREAM_FAILURE_HEADER:
            upstream_failure = True
    return ResponseHead(served, status, content_type, upstream_failure)
