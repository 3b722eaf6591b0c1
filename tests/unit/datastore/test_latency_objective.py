"""The API proposal's latency objective on InferenceModel and InferenceObjective: decoded from
the pool file and from Kubernetes alike, bad values named by path, implicitly Critical."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from tests.support.deploy import DEPLOY, kustomize
from tests.support.pool import model, objective, pod, pool, pool_yaml
from tests.unit.datastore.test_kubernetes_source import BASE, eventually, running
from tests.unit.test_deploy import crd_schema

from endpoint_picker.datastore import Datastore
from endpoint_picker.datastore.decode import OBJECTIVE_P95_KEY
from endpoint_picker.datastore.objects import Objective
from endpoint_picker.datastore.sources.file import parse_pool_text
from endpoint_picker.errors import ConfigError
from endpoint_picker.types import Criticality

GROUP = "inference.networking.x-k8s.io"


def with_objective(doc: dict[str, Any], value: object) -> dict[str, Any]:
    doc["spec"]["objective"] = value
    return doc


def loaded(*docs: dict[str, Any]) -> Datastore:
    store = Datastore()
    store.apply(parse_pool_text(pool_yaml(pool(), *docs, pod("a", "127.0.0.2")), "t"))
    return store


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("50ms", 0.05), ("1s", 1.0), ("1m30s", 90.0), ("250us", 0.00025), ("0.5s", 0.5)],
)
def test_objective_is_a_go_duration(value: str, seconds: float) -> None:
    """The objective's duration decodes to seconds (Go units, compound durations)."""
    store = loaded(with_objective(model("m"), {OBJECTIVE_P95_KEY: value}))
    found = store.model("m")
    assert found is not None
    assert found.objective == Objective(pytest.approx(seconds))


@pytest.mark.parametrize(
    ("value", "path", "message"),
    [
        ("fast", "spec.objective", "must be a mapping"),
        ({}, f"spec.objective.{OBJECTIVE_P95_KEY}", "is required"),
        ({OBJECTIVE_P95_KEY: 50}, f"spec.objective.{OBJECTIVE_P95_KEY}", "is required"),
        ({OBJECTIVE_P95_KEY: "50"}, f"spec.objective.{OBJECTIVE_P95_KEY}", "invalid duration"),
        (
            {OBJECTIVE_P95_KEY: "0ms"},
            f"spec.objective.{OBJECTIVE_P95_KEY}",
            "must be a duration > 0",
        ),
        ({OBJECTIVE_P95_KEY: "0"}, f"spec.objective.{OBJECTIVE_P95_KEY}", "must be a duration > 0"),
        (
            {OBJECTIVE_P95_KEY: "50ms", "desiredP99": "1s"},
            "spec.objective.desiredP99",
            "unknown field",
        ),
    ],
)
def test_bad_objectives_name_the_field(value: object, path: str, message: str) -> None:
    """Each bad objective is refused with the document and the exact field at fault."""
    with pytest.raises(ConfigError, match=rf'InferenceModel "m"\): {path}: {message}'):
        loaded(with_objective(model("m"), value))


def test_the_same_checks_apply_to_inference_objectives() -> None:
    """An InferenceObjective's objective is decoded, and refused, like a model's."""
    with pytest.raises(ConfigError, match=r'InferenceObjective "o"\): spec.objective.x: unknown'):
        loaded(with_objective(objective("o"), {OBJECTIVE_P95_KEY: "50ms", "x": 1}))
    store = loaded(with_objective(objective("o", priority=-1), {OBJECTIVE_P95_KEY: "20ms"}))
    found = store.objective("o")
    assert found is not None
    assert found.objective == Objective(pytest.approx(0.02))
    assert found.priority == -1


@pytest.mark.parametrize(
    ("criticality", "has_objective", "expected"),
    [
        (None, True, Criticality.CRITICAL),
        (None, False, Criticality.STANDARD),
        ("Standard", True, Criticality.STANDARD),
        ("Sheddable", True, Criticality.SHEDDABLE),
    ],
)
def test_an_objective_without_a_criticality_is_critical(
    criticality: str | None, has_objective: bool, expected: Criticality
) -> None:
    """The seed's rule: an objective makes the model Critical, unless a criticality is given."""
    doc = model("m", criticality=criticality)
    if has_objective:
        with_objective(doc, {OBJECTIVE_P95_KEY: "50ms"})
    found = loaded(doc).model("m")
    assert found is not None
    assert found.criticality is expected


@pytest.mark.parametrize(
    ("priority", "has_objective", "expected"),
    [(None, True, 1), (None, False, 0), (0, True, 0), (-3, True, -3)],
)
def test_an_objective_without_a_priority_has_priority_one(
    priority: int | None, has_objective: bool, expected: int
) -> None:
    """The same rule on InferenceObjective: unset priority with an objective is 1 (Critical)."""
    doc = objective("o", priority=priority)
    if has_objective:
        with_objective(doc, {OBJECTIVE_P95_KEY: "50ms"})
    found = loaded(doc).objective("o")
    assert found is not None
    assert found.priority == expected


async def test_kubernetes_objects_carry_the_objective(tmp_path: Path) -> None:
    """The Kubernetes source decodes the objective through the same decoder."""
    chat = with_objective(model("chat"), {OBJECTIVE_P95_KEY: "40ms"})
    async with running(tmp_path, [*BASE, chat]) as r:
        await asyncio.wait_for(r.source.synced.wait(), 2)
        found = r.store.model("chat")
        assert found is not None
        assert found.objective == Objective(pytest.approx(0.04))
        assert found.criticality is Criticality.CRITICAL
        r.api.put(with_objective(model("chat"), {OBJECTIVE_P95_KEY: "80ms"}))
        await eventually(
            lambda: getattr(r.store.model("chat"), "objective", None) == Objective(0.08)
        )


@pytest.mark.parametrize(
    ("kind", "plural"),
    [("InferenceModel", "inferencemodels"), ("InferenceObjective", "inferenceobjectives")],
)
def test_crds_accept_durations_and_refuse_other_shapes(kind: str, plural: str) -> None:
    """The CRDs take the objective as a Go duration string and nothing else."""
    schema = crd_schema(kustomize(DEPLOY / "crds"), GROUP, plural, "v1alpha2")
    doc = model("m") if kind == "InferenceModel" else objective("o")
    for good in ("50ms", "1m30s", "1.5s", "250us"):
        jsonschema.validate(with_objective(doc, {OBJECTIVE_P95_KEY: good}), schema)
    for bad in (
        {OBJECTIVE_P95_KEY: "50"},
        {OBJECTIVE_P95_KEY: "fast"},
        {OBJECTIVE_P95_KEY: 50},
        {},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(with_objective(doc, bad), schema)
