"""Property-based fuzzing of the pool file loader: only ``ConfigError``, naming the spot."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from tests.unit.fuzz.yaml_strategies import (
    EXAMPLES,
    SCALARS,
    UNBUILDABLE_SCALARS,
    config_error,
    dump,
    mutate,
    raw_scalar_in,
    trees,
)

from endpoint_picker.datastore.decode import decode_documents
from endpoint_picker.datastore.pool import resolve_pool
from endpoint_picker.datastore.sources.file import parse_pool_bytes, parse_pool_text
from endpoint_picker.errors import ConfigError

SOURCE = "pool.yaml"
POOL_TEXT = (EXAMPLES / "pool.yaml").read_text()
POOL_DOCS = list(yaml.safe_load_all(POOL_TEXT))
KEYS = st.sampled_from(
    [
        "apiVersion",
        "kind",
        "metadata",
        "spec",
        "status",
        "name",
        "namespace",
        "labels",
        "annotations",
        "selector",
        "matchLabels",
        "targetPortNumber",
        "targetPorts",
        "number",
        "modelName",
        "criticality",
        "targetModels",
        "weight",
        "poolRef",
        "objective",
        "priority",
        "creationTimestamp",
        "podIP",
        "conditions",
        "type",
        "desiredAveragePerOutputTokenLatencyAtP95OverMultipleRequests",
    ]
)
KINDS = st.sampled_from(
    [
        ("inference.networking.x-k8s.io/v1alpha2", "InferencePool"),
        ("inference.networking.k8s.io/v1", "InferencePool"),
        ("inference.networking.x-k8s.io/v1alpha2", "InferenceModel"),
        ("inference.networking.x-k8s.io/v1alpha2", "InferenceObjective"),
        ("v1", "Pod"),
    ]
)


@st.composite
def typed_documents(draw: st.DrawFn) -> dict[Any, Any]:
    """A document of a known kind (so the decoder gets past ``kind``) with a random body."""
    api, kind = draw(KINDS)
    body = draw(st.dictionaries(KEYS, trees(KEYS), max_size=4))
    return {"apiVersion": api, "kind": kind, **body}


def check(text: str) -> None:
    """Load ``text`` as the pool file; a ``ConfigError`` that names where is a fine answer."""
    error = config_error(lambda: parse_pool_text(text, SOURCE))
    if error is None:
        # what the file source does next: it, too, raises ConfigError only
        config_error(lambda: resolve_pool(parse_pool_text(text, SOURCE), None))
        return
    assert error.path.startswith(SOURCE), error
    # the decoder names the field for every shape: its catch-all is never needed
    assert "unexpected content" not in str(error), error


@given(st.lists(trees(KEYS), max_size=3))
def test_random_documents(docs: list[Any]) -> None:
    """Random trees of mappings, lists and scalars load or fail with a ConfigError."""
    check(dump(docs))


@given(st.lists(typed_documents(), min_size=1, max_size=3))
def test_random_bodies_of_known_kinds(docs: list[Any]) -> None:
    """Documents of every known kind with random fields load or fail naming the field."""
    error = config_error(lambda: decode_documents(docs, SOURCE))
    assert error is None or error.path.startswith(f"{SOURCE} document "), error
    check(dump(docs))


@given(st.data())
def test_mutated_example(data: st.DataObject) -> None:
    """The shipped example with a key dropped, a value of another type, or an unknown key."""
    docs = list(POOL_DOCS)
    index = data.draw(st.integers(0, len(docs) - 1))
    docs[index] = mutate(docs[index], data, KEYS)
    check(dump(docs))


@given(st.data())
def test_raw_yaml_scalars_in_example(data: st.DataObject) -> None:
    """A value replaced by raw YAML (dates, huge ints, tags, aliases): ConfigError at worst."""
    check(raw_scalar_in(POOL_TEXT, data))


@given(st.binary(max_size=200))
def test_arbitrary_bytes(data: bytes) -> None:
    """Arbitrary bytes (not UTF-8, not YAML) fail with a ConfigError, never anything else."""
    error = config_error(lambda: parse_pool_bytes(data, SOURCE))
    assert error is None or error.path.startswith(SOURCE), error


@given(st.lists(SCALARS, min_size=1, max_size=3))
def test_scalar_documents(docs: list[Any]) -> None:
    """A document that is a bare scalar is a ConfigError naming the document."""
    if any(doc is not None for doc in docs):
        with pytest.raises(ConfigError, match="document"):
            parse_pool_text(dump(docs), SOURCE)


@pytest.mark.parametrize("value", UNBUILDABLE_SCALARS)
def test_yaml_values_pyyaml_cannot_build(value: str) -> None:
    """Regression: scalars PyYAML types but cannot build are a ConfigError."""
    text = POOL_TEXT.replace("targetPortNumber: 8000", f"targetPortNumber: {value}")
    with pytest.raises(ConfigError, match="a value it cannot build") as caught:
        parse_pool_text(text, SOURCE)
    assert caught.value.path == SOURCE


def test_name_too_long_to_print() -> None:
    """Regression: a 5,000-digit hex metadata.name is refused when loaded."""
    # it loaded, then quoting it raised ValueError, caught only as "unexpected content"
    text = POOL_TEXT.replace("name: vllm-llama3-8b\n", f"name: 0x{'f' * 5000}\n", 1)
    with pytest.raises(ConfigError, match="a value it cannot build"):
        parse_pool_text(text, SOURCE)
