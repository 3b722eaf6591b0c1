"""The director reads the request's InferenceObjective: priority replaces criticality."""

from __future__ import annotations

import pytest
from tests.support.pool import V1, model, objective, pod, pool
from tests.unit.test_director import PODS, completion, make_director

from endpoint_picker.director import OBJECTIVE_HEADER, criticality_of_priority
from endpoint_picker.errors import TooManyRequestsError
from endpoint_picker.types import Criticality


@pytest.mark.parametrize(
    ("priority", "criticality"),
    [(-100, "Sheddable"), (-1, "Sheddable"), (0, "Standard"), (1, "Critical"), (7, "Critical")],
)
def test_priority_maps_onto_criticality(priority: int, criticality: str) -> None:
    """Negative priorities are sheddable, zero is standard, positive ones critical."""
    assert criticality_of_priority(priority) is Criticality(criticality)


def test_objective_header_overrides_the_model_criticality() -> None:
    """A request naming an objective gets its priority's criticality; unknown names change
    nothing; the director asks the stream to collect the header."""
    director, _ = make_director(
        pool(), model("m", criticality="Critical"), objective("batch", priority=-1), *PODS
    )
    assert OBJECTIVE_HEADER in director.request_headers
    named = director.route(
        "r", "/v1/completions", completion("m"), None, {OBJECTIVE_HEADER: "batch"}
    )
    assert named.request.criticality is Criticality.SHEDDABLE
    unknown = director.route(
        "r", "/v1/completions", completion("m"), None, {OBJECTIVE_HEADER: "nope"}
    )
    assert unknown.request.criticality is Criticality.CRITICAL


def test_negative_priority_is_shed_when_saturated_in_a_v1_pool() -> None:
    """In a v1 pool (no InferenceModels) a negative-priority objective is shed under saturation;
    a positive one is served."""
    director, _ = make_director(
        pool(api=V1),
        objective("batch", priority=-1),
        objective("interactive", priority=10),
        pod("a", "127.0.0.2"),
        queue=50,
    )
    with pytest.raises(TooManyRequestsError):
        director.route("r", "/v1/completions", completion("any"), None, {OBJECTIVE_HEADER: "batch"})
    served = director.route(
        "r", "/v1/completions", completion("any"), None, {OBJECTIVE_HEADER: "interactive"}
    )
    assert served.endpoints
