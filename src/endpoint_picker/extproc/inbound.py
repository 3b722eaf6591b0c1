"""What the stream reads of Envoy's ``ProcessingRequest`` messages: header values, metadata
strings, the subset hint, the facts of a response's headers."""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from endpoint_picker.extproc import wire
from endpoint_picker.types import ascii_int


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


def response_head(message: pb.ProcessingRequest) -> tuple[str, int, str, bool]:
    """A response's headers as (the endpoint Envoy says served it, or ""; the status, 0 when
    absent or not a number; the content type; whether Envoy failed to reach the upstream)."""
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
    return served, status, content_type, upstream_failure
