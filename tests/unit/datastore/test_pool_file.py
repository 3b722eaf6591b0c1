"""The pool file: decoding, validation paths, pool resolution and endpoints."""

from __future__ import annotations

import pytest
from tests.support.pool import V1, model, pod, pool, pool_yaml

from endpoint_picker.datastore.pool import resolve_pool
from endpoint_picker.datastore.sources.file import parse_pool_text
from endpoint_picker.errors import ConfigError
from endpoint_picker.types import Criticality


def resolve(*docs: dict[str, object], pool_name: str | None = None):  # type: ignore[no-untyped-def]
    return resolve_pool(parse_pool_text(pool_yaml(*docs), "pool.yaml"), pool_name)


def test_v1alpha2_pool_models_and_ready_endpoints() -> None:
    """Ready matching pods become endpoints; models keep criticality and splits."""
    state = resolve(
        pool(port=8000),
        model("chat", criticality="Critical", targets={"chat-v1": 80, "chat-v2": 20}),
        model("base"),
        pod("a", "127.0.0.2"),
        pod("b", "127.0.0.3", ready=False),
        pod("c", "127.0.0.4", labels={"app": "other"}),
        pod("d", "127.0.0.5", namespace="elsewhere"),
    )
    assert [e.hostport for e in state.endpoints] == ["127.0.0.2:8000"]
    assert state.models["chat"].criticality is Criticality.CRITICAL
    assert [(t.name, t.weight) for t in state.models["chat"].target_models] == [
        ("chat-v1", 80),
        ("chat-v2", 20),
    ]
    assert state.models["base"].criticality is Criticality.STANDARD


def test_v1_pool_every_port_is_an_endpoint_and_ipv6_is_bracketed() -> None:
    """A v1 pool with two target ports makes two endpoints per pod; IPv6 gets brackets."""
    state = resolve(pool(api=V1, ports=[8000, 8001]), pod("a", "fd00::2"))
    assert [e.hostport for e in state.endpoints] == ["[fd00::2]:8000", "[fd00::2]:8001"]
    assert state.pool.passes_unknown_models


def test_older_model_wins_a_name_conflict() -> None:
    """Of two InferenceModels with one modelName, the older creationTimestamp wins."""
    state = resolve(
        pool(),
        model("m", name="new", criticality="Sheddable", created="2025-02-01T00:00:00Z"),
        model("m", name="old", criticality="Critical", created="2025-01-01T00:00:00Z"),
    )
    assert state.models["m"].name == "old"


def test_file_order_breaks_ties_without_timestamps() -> None:
    """Without timestamps the first in the file wins."""
    state = resolve(pool(), model("m", name="first"), model("m", name="second"))
    assert state.models["m"].name == "first"


def test_models_of_other_pools_or_namespaces_do_not_count() -> None:
    """Only InferenceModels referencing the served pool in its namespace are served."""
    state = resolve(
        pool(),
        model("theirs", pool_ref="other"),
        model("foreign", namespace="x"),
        model("ours"),
    )
    assert list(state.models) == ["ours"]


@pytest.mark.parametrize(
    ("docs", "pool_name", "message"),
    [
        ((pool("a"), pool("b")), None, "several InferencePools (default/a, default/b)"),
        ((pool("a"),), "zzz", "InferencePool 'zzz' not found"),
        ((pod("x", "127.0.0.2"),), None, "no InferencePool found"),
    ],
)
def test_pool_selection_errors(
    docs: tuple[dict[str, object], ...], pool_name: str | None, message: str
) -> None:
    """Pool selection fails clearly: several without a name, an unknown name, none."""
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(*docs, pool_name=pool_name)


def test_named_pool_is_chosen_among_several() -> None:
    """--pool-name picks one of several pools."""
    assert resolve(pool("a"), pool("b"), pool_name="b").pool.name == "b"


def _bad_model_weight() -> dict[str, object]:
    doc = model("m", targets={"x": 1, "y": 2})
    doc["spec"]["targetModels"][1]["weight"] = -3  # type: ignore[index]
    return doc


@pytest.mark.parametrize(
    ("doc", "path"),
    [
        (
            model("m", criticality="Urgent"),
            'pool.yaml document 2 (InferenceModel "m"): spec.criticality',
        ),
        (
            _bad_model_weight(),
            'pool.yaml document 2 (InferenceModel "m"): spec.targetModels[1].weight',
        ),
        ({"apiVersion": "v1", "kind": "Service"}, "pool.yaml document 2: kind"),
        (pod("p", "not-an-ip"), 'pool.yaml document 2 (Pod "p"): status.podIP'),
        (
            {**pool("q"), "spec": {"selector": {"app": "x"}, "targetPortNumber": 70000}},
            'pool.yaml document 2 (InferencePool "q"): spec.targetPortNumber',
        ),
        (
            {**model("m"), "spec": {"modelName": "m"}},
            'pool.yaml document 2 (InferenceModel "m"): spec.poolRef',
        ),
    ],
)
def test_invalid_documents_name_the_field(doc: dict[str, object], path: str) -> None:
    """Every decoding error names the document and the field path at fault."""
    with pytest.raises(ConfigError) as info:
        parse_pool_text(pool_yaml(pool(), doc), "pool.yaml")
    assert info.value.path == path


def test_invalid_yaml_names_line_and_column() -> None:
    """A YAML syntax error names the line and column."""
    with pytest.raises(ConfigError, match=r"pool\.yaml:2:\d+: invalid YAML"):
        parse_pool_text("a: b\n  c: : d\n", "pool.yaml")


@pytest.mark.parametrize(
    ("first", "second", "winner"),
    [
        ("2025-01-01T10:00:00+05:00", "2025-01-01T06:00:00Z", "first"),  # 05:00Z is older
        ("2025-01-01T00:00:00.5Z", "2025-01-01T00:00:00.25Z", "second"),
        (None, "2025-01-01T00:00:00Z", "second"),  # a known age beats an unknown one
    ],
)
def test_creation_timestamps_compare_as_times(
    first: str | None, second: str | None, winner: str
) -> None:
    """Offsets and fractions compare as instants; a model without a timestamp loses."""
    state = resolve(
        pool(), model("m", name="first", created=first), model("m", name="second", created=second)
    )
    assert state.models["m"].name == winner


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kind: [Pod]\napiVersion: v1\n", "apiVersion and kind must be strings"),
        ("- 1\n- 2\n", "must be a mapping"),
    ],
)
def test_odd_shapes_are_config_errors(text: str, message: str) -> None:
    """Shapes the decoder never expected are ConfigErrors, never tracebacks."""
    with pytest.raises(ConfigError, match=message):
        parse_pool_text(text, "pool.yaml")


def test_bad_timestamp_names_the_field() -> None:
    """An unparsable creationTimestamp names its field."""
    with pytest.raises(ConfigError) as info:
        parse_pool_text(pool_yaml(pool(), model("m", created="yesterday")), "pool.yaml")
    assert info.value.path.endswith("metadata.creationTimestamp")
