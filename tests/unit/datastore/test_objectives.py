"""InferenceObjective (v1alpha2) in the pool file: decoded, kept per pool, bad fields named."""

from __future__ import annotations

import pytest
from tests.support.pool import model, objective, pod, pool, pool_yaml

from endpoint_picker.datastore import Datastore
from endpoint_picker.datastore.sources.file import parse_pool_text
from endpoint_picker.errors import ConfigError


def test_objectives_of_the_pool_are_kept_by_name() -> None:
    """Objectives whose poolRef names the pool (same namespace) count; unset priority is 0."""
    store = Datastore()
    store.apply(
        parse_pool_text(
            pool_yaml(
                pool(),
                model("m"),
                objective("batch", priority=-10),
                objective("default-class"),
                objective("other", pool_ref="elsewhere"),
                objective("foreign", namespace="prod"),
                pod("a", "127.0.0.2"),
            ),
            "t",
        )
    )
    batch = store.objective("batch")
    plain = store.objective("default-class")
    assert batch is not None
    assert batch.priority == -10
    assert plain is not None
    assert plain.priority == 0
    assert store.objective("other") is None
    assert store.objective("foreign") is None


@pytest.mark.parametrize(
    ("spec", "path"),
    [
        ({"poolRef": {"name": "pool"}, "priority": "high"}, "spec.priority"),
        ({"poolRef": {"name": "pool"}, "priority": True}, "spec.priority"),
        ({"priority": 1}, "spec.poolRef"),
    ],
)
def test_invalid_objective_names_the_field(spec: dict[str, object], path: str) -> None:
    """A bad InferenceObjective is refused with the document and field at fault."""
    doc = objective("bad")
    doc["spec"] = spec
    with pytest.raises(ConfigError, match=rf'InferenceObjective "bad"\): {path}'):
        parse_pool_text(pool_yaml(pool(), doc), "pool.yaml")
