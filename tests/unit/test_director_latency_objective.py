"""The director carries the latency objective onto the request and reports what it needs."""

from __future__ import annotations

from tests.support.pool import model, objective, pool
from tests.unit.test_director import PODS, completion, make_director

from endpoint_picker.datastore.decode import OBJECTIVE_P95_KEY
from endpoint_picker.director import OBJECTIVE_HEADER
from endpoint_picker.exchange import Lifecycle
from endpoint_picker.scheduling.lifecycle import Finished, Routed
from endpoint_picker.types import Criticality


def _objective(doc: dict[str, object], value: str) -> dict[str, object]:
    spec = doc["spec"]
    assert isinstance(spec, dict)
    spec["objective"] = {OBJECTIVE_P95_KEY: value}
    return doc


def test_the_models_objective_rides_on_the_request() -> None:
    """A model's objective is on its requests (and makes them Critical); others have none."""
    director, _ = make_director(
        pool(), _objective(model("chat"), "40ms"), model("batch", criticality="Sheddable"), *PODS
    )
    chat = director.route("r1", "/v1/completions", completion("chat"), None).request
    assert chat.latency_objective == 0.04
    assert chat.criticality is Criticality.CRITICAL
    batch = director.route("r2", "/v1/completions", completion("batch"), None).request
    assert batch.latency_objective is None


def test_an_inference_objectives_objective_replaces_the_models() -> None:
    """The header's InferenceObjective brings its own objective; without one the model's stays."""
    director, _ = make_director(
        pool(),
        _objective(model("chat"), "40ms"),
        _objective(objective("premium"), "20ms"),
        objective("plain", priority=0),
        *PODS,
    )

    def routed(name: str) -> float | None:
        raw = completion("chat")
        return director.route(
            "r", "/v1/completions", raw, None, {OBJECTIVE_HEADER: name}
        ).request.latency_objective

    assert routed("premium") == 0.02
    assert routed("plain") == 0.04


class Recorder:
    def __init__(self) -> None:
        self.finished: list[Finished] = []

    def on_routed(self, event: Routed) -> None:
        return None

    def on_finished(self, event: Finished) -> None:
        self.finished.append(event)


def test_finished_reports_duration_and_output_tokens() -> None:
    """``finished`` passes the end-to-end seconds and output tokens on to the listeners."""
    recorder = Recorder()
    lifecycle = Lifecycle([recorder])
    lifecycle.finished("r1", True, 2.5, 120)
    lifecycle.finished("r2", False, 0.1)
    assert recorder.finished == [Finished("r1", True, 2.5, 120), Finished("r2", False, 0.1, None)]
