"""The ext_proc stream as the synchronous state machine it is: ProcessingRequests in,
ProcessingResponses out, no server and no socket."""

from __future__ import annotations

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from tests.support.extproc import (
    BUFFERED,
    body,
    error_of,
    header_map,
    headers,
    json_body,
    lb_metadata,
    response_body,
    response_headers,
)
from tests.support.pool import ONE_POD

from endpoint_picker.datastore import Datastore
from endpoint_picker.datastore.sources.file import parse_pool_text
from endpoint_picker.director import Director
from endpoint_picker.exchange import Lifecycle
from endpoint_picker.extproc.limits import BodyBudget
from endpoint_picker.extproc.stream import RequestStream
from endpoint_picker.scheduling import build_scheduling
from endpoint_picker.settings import SchedulingSettings

REQUEST = json_body({"model": "m", "prompt": "hi"})


def director(*, session_tokens: bool = False) -> Director:
    store = Datastore()
    store.apply(parse_pool_text(ONE_POD, "t"))
    parts = build_scheduling(
        None, settings=SchedulingSettings(), staleness_threshold=2.0, clock=lambda: 1.0
    )
    return Director(
        store,
        parts.scheduler,
        parts.saturation_detector,
        lifecycle=Lifecycle.of(parts.subscribers),
        session_tokens=session_tokens,
    )


def kinds(out: list[pb.ProcessingResponse]) -> list[str]:
    return [str(r.WhichOneof("response")) for r in out]


def test_full_duplex_answers_the_headers_with_the_route_once_the_body_has_ended() -> None:
    """Full duplex: nothing on the headers or a middle chunk; on end_of_stream the routed
    headers (destination, content-length) and the body streamed back; the response passes."""
    stream = RequestStream(director())
    assert stream.handle(headers()) == []
    assert stream.handle(body(REQUEST[:5], end_of_stream=False)) == []
    out = stream.handle(body(REQUEST[5:]))
    assert kinds(out) == ["request_headers", "request_body"]
    assert lb_metadata(out[0]) == "127.0.0.2:8000"
    mutation = out[0].request_headers.response.header_mutation
    assert header_map(mutation)["content-length"] == str(len(REQUEST))
    streamed = out[1].request_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (REQUEST, True)
    assert kinds(stream.handle(response_headers())) == ["response_headers"]
    out = stream.handle(response_body(b"{}"))
    assert out[0].response_body.response.body_mutation.streamed_response.body == b"{}"
    assert not stream.finished
    stream.close()


def test_buffered_continues_the_headers_and_routes_on_the_body() -> None:
    """BUFFERED: the headers continue at once; the body's answer carries the route."""
    stream = RequestStream(director())
    out = stream.handle(headers(request_mode=BUFFERED))
    assert kinds(out) == ["request_headers"]
    assert not out[0].request_headers.response.HasField("header_mutation")
    out = stream.handle(body(REQUEST))
    assert kinds(out) == ["request_body"]
    assert lb_metadata(out[0]) == "127.0.0.2:8000"
    stream.close()


def test_a_path_that_is_no_inference_api_is_a_404_before_any_body() -> None:
    """An unknown path ends the stream with a JSON 404 on the headers."""
    stream = RequestStream(director())
    (out,) = stream.handle(headers("/admin"))
    assert error_of(out)[0] == 404
    assert stream.finished


def test_a_spoofed_destination_header_is_removed_from_the_routed_request() -> None:
    """A client's x-gateway-destination-endpoint-* header is removed, never forwarded."""
    stream = RequestStream(director())
    stream.handle(headers(extra={"x-gateway-destination-endpoint-fallback": "1.2.3.4:80"}))
    out = stream.handle(body(REQUEST))
    removed = out[0].request_headers.response.header_mutation.remove_headers
    assert list(removed) == ["x-gateway-destination-endpoint-fallback"]
    stream.close()


@pytest.mark.parametrize(("max_body", "budget", "status"), [(4, 0, 413), (1 << 20, 4, 429)])
def test_a_body_past_its_limit_or_the_budget_is_refused_and_holds_nothing(
    max_body: int, budget: int, status: int
) -> None:
    """A body over --max-request-body-size is a 413; one that does not fit the shared budget a
    429; either way the budget is left as it was."""
    shared = BodyBudget(budget)
    stream = RequestStream(director(), max_body_bytes=max_body, budget=shared)
    stream.handle(headers())
    (out,) = stream.handle(body(REQUEST))
    assert error_of(out)[0] == status
    assert stream.finished
    assert shared.reserved == 0


def test_close_gives_back_a_body_still_buffered() -> None:
    """A stream closed mid-body releases what it held of the shared budget."""
    shared = BodyBudget(1 << 20)
    stream = RequestStream(director(), budget=shared)
    stream.handle(headers())
    stream.handle(body(REQUEST, end_of_stream=False))
    assert shared.reserved == len(REQUEST)
    stream.close()
    assert shared.reserved == 0


def test_with_session_affinity_the_response_names_the_endpoint_that_served() -> None:
    """With a session-affinity plugin on, the response headers carry x-session-token."""
    stream = RequestStream(director(session_tokens=True))
    stream.handle(headers())
    stream.handle(body(REQUEST))
    (out,) = stream.handle(response_headers(served="127.0.0.2:8000"))
    mutation = out.response_headers.response.header_mutation
    assert "x-session-token" in header_map(mutation)
    stream.close()
