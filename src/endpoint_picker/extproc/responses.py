"""Builders of ext_proc ``ProcessingResponse`` messages."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from endpoint_picker.errors import ErrorCode
from endpoint_picker.extproc import wire

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
    )


def routing_mutation(
    destination: str, content_length: int | None, remove: Sequence[str]
) -> pb.HeaderMutation:
    """Set the destination header (and the forwarded body's length); drop client spoofs."""
    headers = [_header(wire.DESTINATION_ENDPOINT, destination)]
    if content_length is not None:
        headers.append(_header(wire.CONTENT_LENGTH, str(content_length)))
    return pb.HeaderMutation(set_headers=headers, remove_headers=list(remove))


def destination_metadata(destination: str) -> struct_pb2.Struct:
    """``{"envoy.lb": {"x-gateway-destination-endpoint": destination}}``: same as the header."""
    metadata = struct_pb2.Struct()
    metadata.update({wire.LB_NAMESPACE: {wire.DESTINATION_ENDPOINT: destination}})
    return metadata


def routed_request_headers(mutation: pb.HeaderMutation, destination: str) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)
        ),
        dynamic_metadata=destination_metadata(destination),
    )


def streamed_chunks(body: bytes, end_of_stream: bool) -> Iterator[tuple[bytes, bool]]:
    """Split ``body`` into chunks of at most MAX_STREAMED_CHUNK; only the last ends the stream."""
    view = memoryview(body)
    size = wire.MAX_STREAMED_CHUNK
    if len(view) <= size:
        yield body, end_of_stream
        return
    last = (len(view) - 1) // size * size
    for start in range(0, len(view), size):
        yield bytes(view[start : start + size]), end_of_stream and start == last


def streamed_request_body(chunk: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(
            response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(
                    streamed_response=pb.StreamedBodyResponse(
                        body=chunk, end_of_stream=end_of_stream
                    )
                )
            )
        )
    )


def streamed_response_body(chunk: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        response_body=pb.BodyResponse(
            response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(
                    streamed_response=pb.StreamedBodyResponse(
                        body=chunk, end_of_stream=end_of_stream
                    )
                )
            )
        )
    )


def routed_buffered_body(
    mutation: pb.HeaderMutation, destination: str, new_body: bytes | None
) -> pb.ProcessingResponse:
    """BUFFERED mode: routing header, optional body rewrite and metadata on the body response."""
    common = pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)
    if new_body is not None:
        common.body_mutation.body = new_body
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(response=common),
        dynamic_metadata=destination_metadata(destination),
    )


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


def immediate_error(code: ErrorCode, message: str) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=code.http_status),
            headers=pb.HeaderMutation(set_headers=[_header(wire.CONTENT_TYPE, "application/json")]),
            body=error_body(code, message),
            details=f"epp_{code.type_name}",
        )
    )
