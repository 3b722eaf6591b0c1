"""The director's seam with the edge: headers, body and response, and the response-side steps
(unreachable endpoints, outlier verdicts, session tokens, finished events) run behind it."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from tests.support.extproc import (
    body,
    headers,
    json_body,
    response_body,
    response_headers,
)
from tests.support.pool import ONE_POD

from endpoint_picker.datastore import Datastore
from endpoint_picker.datastore.health import FailureKind
from endpoint_picker.datastore.sources.file import parse_pool_text
from endpoint_picker.director import Director, RoutingDecision
from endpoint_picker.errors import PathNotFoundError
from endpoint_picker.exchange import Lifecycle, ResponseHead
from endpoint_picker.extproc.stream import RequestStream
from endpoint_picker.scheduling import build_scheduling
from endpoint_picker.scheduling.lifecycle import Finished, Routed
from endpoint_picker.settings import SchedulingSettings

SEAM = {
    "request_headers",
    "on_headers",
    "on_body",
    "on_response_headers",
    "on_response_body",
    "on_finish",
}


class Outliers:
    """Records what the response side tells the outlier detector."""

    def __init__(self, probe: bool = False) -> None:
        self.log: list[tuple[str, str]] = []
        self.probe = probe

    def excluded(self) -> frozenset[str]:
        return frozenset()

    def routed(self, hostport: str) -> bool:
        return self.probe

    def succeeded(self, hostport: str) -> None:
        self.log.append(("ok", hostport))

    def failed(self, hostport: str, kind: FailureKind, ready: Collection[str]) -> bool:
        self.log.append((kind.name, hostport))
        return False

    def unanswered(self, hostport: str) -> None:
        self.log.append(("unanswered", hostport))


class Finishes:
    def __init__(self) -> None:
        self.events: list[Finished] = []

    def on_routed(self, event: Routed) -> None:
        pass

    def on_finished(self, event: Finished) -> None:
        self.events.append(event)


def build(**kwargs: Any) -> tuple[Director, Datastore]:
    store = Datastore()
    store.apply(parse_pool_text(ONE_POD, "t"))
    parts = build_scheduling(
        None, settings=SchedulingSettings(), staleness_threshold=2.0, clock=lambda: 1.0
    )
    return Director(store, parts.scheduler, parts.saturation_detector, **kwargs), store


class Seen:
    """A director proxy that records which of its members the stream touches."""

    def __init__(self, director: Director) -> None:
        self._director = director
        self.touched: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        self.touched.add(name)
        return getattr(self._director, name)


def test_the_stream_crosses_the_director_only_at_its_seam() -> None:
    """A routed request with a response, and a stream closed early, touch only the seam."""
    director, _ = build(session_tokens=True)
    seen = Seen(director)
    for finish in (True, False):
        stream = RequestStream(seen)  # type: ignore[arg-type]
        stream.handle(headers())
        stream.handle(body(json_body({"model": "m", "prompt": "hi"})))
        if finish:
            stream.handle(response_headers())
            stream.handle(response_body(b"{}"))
        stream.close()
    for path in ("/health", "/v1/models", "/nope"):
        RequestStream(seen).handle(headers(path, end_of_stream=True))  # type: ignore[arg-type]
    assert seen.touched <= SEAM
    assert {"on_headers", "on_body", "on_response_headers", "on_finish"} <= seen.touched


def test_on_headers_gives_each_request_an_id_of_its_own_and_answers_nothing_yet() -> None:
    """Two exchanges get two EPP ids; an unknown path's 404 is kept for the stream to raise
    after its own checks; /health and /v1/models are answered locally."""
    director, _ = build()
    a = director.on_headers("/v1/completions", "same", None, {}, False)
    b = director.on_headers("/v1/completions", "same", None, {}, False)
    assert a.id != b.id
    assert "same" not in (a.id, b.id)
    assert isinstance(director.on_headers("/nope", "", None, {}, False).error, PathNotFoundError)
    health = director.on_headers("/health", "", None, {}, True).local
    assert health is not None
    assert health.ready
    models = director.on_headers("/v1/models", "", None, {}, True).local
    assert models is not None
    assert models.models == ("m",)


def test_the_response_side_marks_judges_tokens_and_finishes_once() -> None:
    """An upstream connect failure marks the endpoint unreachable and is a CONNECT failure for
    the outlier detector; the session token names the endpoint; the finished event goes once."""
    outliers, finishes = Outliers(), Finishes()
    director, store = build(outliers=outliers, session_tokens=True, lifecycle=Lifecycle([finishes]))
    exchange = director.on_headers("/v1/completions", "", None, {}, False)
    decision = director.on_body(exchange, json_body({"model": "m", "prompt": "hi"}))
    assert isinstance(decision, RoutingDecision)
    exchange.decision = decision
    token = director.on_response_headers(exchange, ResponseHead("", 503, "application/json", True))
    assert token is not None
    assert outliers.log == [("CONNECT", "127.0.0.2:8000")]
    assert "127.0.0.2:8000" in store.unreachable
    assert director.on_finish(exchange, True, 0.5)
    assert not director.on_finish(exchange, False, 0.6)
    assert [(e.ok, e.seconds) for e in finishes.events] == [(True, 0.5)]


def test_a_probe_whose_stream_ends_before_its_response_is_unanswered() -> None:
    """A probe (first request to an endpoint back from ejection) closed before any response
    headers ends the probe without a verdict, and finishes not ok."""
    outliers = Outliers(probe=True)
    director, _ = build(outliers=outliers)
    exchange = director.on_headers("/v1/completions", "", None, {}, False)
    decision = director.on_body(exchange, json_body({"model": "m", "prompt": "hi"}))
    assert isinstance(decision, RoutingDecision)
    assert decision.probe
    exchange.decision = decision
    assert director.on_finish(exchange, False, 0.1)
    assert outliers.log == [("unanswered", "127.0.0.2:8000")]
