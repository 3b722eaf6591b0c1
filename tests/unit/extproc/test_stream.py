"""Small rules of the stream state machine."""

from __future__ import annotations

import pytest
from tests.support.extproc import (
    body,
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
from endpoint_picker.extproc.stream import RequestStream, _safe_request_id
from endpoint_picker.scheduling import build_scheduling
from endpoint_picker.scheduling.lifecycle import Finished, Routed
from endpoint_picker.settings import SchedulingSettings


@pytest.mark.parametrize(
    ("raw", "kept"),
    [
        ("abc-123", "abc-123"),
        ("x" * 500, "x" * 128),
        ("bad\nline", ""),
        ("caf\u00e9", ""),
    ],
)
def test_request_ids_are_bounded_and_printable(raw: str, kept: str) -> None:
    """Client request ids are logged only when printable ASCII, and at most 128 characters."""
    assert _safe_request_id(raw) == kept


class Recorder:
    """A lifecycle listener that keeps the ids its events carry."""

    def __init__(self) -> None:
        self.routed: list[str] = []
        self.finished: list[str] = []

    def on_routed(self, event: Routed) -> None:
        self.routed.append(event.request.request_id)

    def on_finished(self, event: Finished) -> None:
        self.finished.append(event.request_id)


def test_events_carry_the_epps_own_ids_never_the_clients() -> None:
    """Two streams sending the same x-request-id get two ids of the EPP's own: the routed and
    finished events carry those (each stream's the same at both ends), the client's id none."""
    store = Datastore()
    store.apply(parse_pool_text(ONE_POD, "t"))
    parts = build_scheduling(
        None, settings=SchedulingSettings(), staleness_threshold=2.0, clock=lambda: 1.0
    )
    recorder = Recorder()
    director = Director(
        store, parts.scheduler, parts.saturation_detector, lifecycle=Lifecycle([recorder])
    )
    raw = json_body({"model": "m", "prompt": "hi"})
    for _ in range(2):
        stream = RequestStream(director)
        stream.handle(headers(extra={"x-request-id": "chosen-by-client"}))
        out = stream.handle(body(raw))
        assert lb_metadata(out[0]) == "127.0.0.2:8000"
        assert stream.request_id == "chosen-by-client"  # what its log lines show
        stream.handle(response_headers())
        stream.handle(response_body(b"{}"))
        stream.close()
    assert len(set(recorder.routed)) == 2
    assert recorder.finished == recorder.routed
    assert "chosen-by-client" not in recorder.routed
