"""The lone EPP's pool file and the ext_proc messages the benchmarks send it."""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from endpoint_picker.bench.lone import FULL_DUPLEX, body, headers, pool_text
from endpoint_picker.datastore import Datastore
from endpoint_picker.datastore.sources.file import parse_pool_text


def test_pool_text_is_a_pool_the_epp_reads() -> None:
    """Every address a Ready endpoint on the port; the model with its split and criticality."""
    store = Datastore()
    text = pool_text(["127.0.0.2", "127.0.0.3"], "m", port=8001, criticality="Critical",
                     targets={"m-a": 1, "m-b": 3})  # fmt: skip
    store.apply(parse_pool_text(text, "test"))
    assert sorted(e.hostport for e in store.endpoints) == ["127.0.0.2:8001", "127.0.0.3:8001"]
    assert "criticality: Critical" in text
    assert "m-b" in text


def test_headers_announce_full_duplex_and_carry_extras() -> None:
    """The request headers say full duplex both ways, as the shipped Envoy configs do."""
    message = headers("/v1/chat/completions", extra={"x-request-id": "r1"})
    values = {h.key: h.raw_value for h in message.request_headers.headers.headers}
    assert values[":path"] == b"/v1/chat/completions"
    assert values["x-request-id"] == b"r1"
    assert message.protocol_config.request_body_mode == FULL_DUPLEX
    assert message.protocol_config.response_body_mode == FULL_DUPLEX
    assert body(b"{}") == pb.ProcessingRequest(
        request_body=pb.HttpBody(body=b"{}", end_of_stream=True)
    )
