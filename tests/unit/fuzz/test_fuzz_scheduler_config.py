"""Property-based fuzzing of the scheduler config loader, its plugin parameters and its
``featureGates``/``flowControl`` sections: only ``ConfigError``, naming the field."""

from __future__ import annotations

import math
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

from endpoint_picker.errors import ConfigError
from endpoint_picker.flowcontrol import parse_flow_control
from endpoint_picker.scheduling import default_registry, load_config
from endpoint_picker.scheduling.config import API_VERSION, KIND
from endpoint_picker.scheduling.registry import Params

EXAMPLE_TEXTS = {
    path.name: path.read_text() for path in sorted(EXAMPLES.glob("scheduler-config*.yaml"))
}
# Each built-in plugin type with the parameters it reads.
PARAMETERS = {
    "candidate-sampler": ["threshold", "size"],
    "stale-metrics-filter": ["stalenessThreshold"],
    "bounded-load-filter": ["factor", "slack", "smoothing", "burstFactor"],
    "bounded-share-filter": ["slack", "window"],
    "prefix-cache-scorer": ["blockSizeTokens", "maxPrefixBlocksToMatch", "lruCapacityPerServer"],
    "session-affinity-scorer": ["sessionHeader", "maxSessions"],
    "inflight-load-scorer": [],
    "queue-scorer": [],
    "kv-cache-utilization-scorer": [],
    "lora-affinity-scorer": [],
    "running-requests-size-scorer": [],
    "max-score-picker": ["maxNumOfEndpoints"],
    "random-picker": ["maxNumOfEndpoints"],
    "weighted-random-picker": ["maxNumOfEndpoints"],
    "utilization-detector": [
        "queueDepthThreshold",
        "kvCacheUtilThreshold",
        "metricsStalenessThreshold",
    ],
    "single-profile-handler": [],
    "slo-aware-scorer": ["windowSeconds", "maxSamples", "minSamples", "headroom"],
    "slo-saturation-detector": [
        "windowSeconds",
        "maxSamples",
        "minSamples",
        "queueDepthThreshold",
        "kvCacheUtilThreshold",
        "metricsStalenessThreshold",
    ],
    "predicted-latency-scorer": [
        "tpotWeight",
        "othersWeight",
        "placementSlack",
        "headOfLineWait",
        "decodeWeight",
    ],
    "precise-prefix-cache-scorer": [
        "tokenProcessorConfig",
        "kvEventsConfig",
        "indexerConfig",
        "maxPrefixBlocks",
        "inlineBytes",
        "maxPendingTokenize",
        "maxCachedBlocks",
    ],
    "predicted-latency-detector": [
        "factor",
        "criticalFactor",
        "metricsStalenessThreshold",
        "queueDepthThreshold",
        "kvCacheUtilThreshold",
    ],
}
FLOW_KEYS = [
    "maxRequests", "maxBytes", "defaultRequestTTL", "defaultPriorityBand",
    "priorityBands", "priority", "fairnessPolicy", "orderingPolicy", "requestTTL",
]  # fmt: skip
KEYS = st.sampled_from(
    [
        "apiVersion",
        "kind",
        "plugins",
        "schedulingProfiles",
        "featureGates",
        "flowControl",
        "name",
        "type",
        "parameters",
        "pluginRef",
        "weight",
        *FLOW_KEYS,
        *{key for keys in PARAMETERS.values() for key in keys},
    ]
)
# Values a parameter or a flow-control field may be given: numbers at the edges (NaN, the
# infinities, integers past the largest float), durations, quantities, and anything else.
# Numbers at the edges: NaN, the infinities, integers past the largest float, negatives.
EDGE_NUMBERS = st.sampled_from(
    [float("nan"), float("inf"), -float("inf"), 10**400, -(10**400), 2**63, 0, -1, 1.5, 0.0]
) | st.floats() | st.integers()  # fmt: skip
PARAM_VALUES = (
    EDGE_NUMBERS
    | st.sampled_from(
        [
            "200ms",
            "0s",
            "-1s",
            "1e3s",
            "9" * 400 + "h",
            "1Gi",
            "7Ti",
            "9" * 400,
            "9" * 5000 + "Gi",
            "fcfs",
            "edf",
            "round-robin",
            "global-fifo",
            "x-session-id",
            "",
            [],
            {},
        ]
    )
    | SCALARS
    | trees(KEYS)
)


def check(text: str) -> None:
    """Load ``text`` as a scheduler config: it loads, or fails with a ``ConfigError`` that
    names the field at fault (only broken YAML is about no field)."""
    error = config_error(lambda: load_config(text, "config.yaml"))
    if error is not None and "not valid YAML" not in str(error):
        assert error.path, error


@given(trees(KEYS))
def test_random_documents(doc: Any) -> None:
    """Random trees of mappings, lists and scalars load or fail with a ConfigError."""
    check(dump([doc]))


@given(st.sampled_from(sorted(EXAMPLE_TEXTS)), st.data())
def test_mutated_examples(name: str, data: st.DataObject) -> None:
    """A shipped example with a key dropped, a value of another type, or an unknown key."""
    doc = yaml.safe_load(EXAMPLE_TEXTS[name])
    check(dump([mutate(doc, data, KEYS)]))


@given(st.sampled_from(sorted(EXAMPLE_TEXTS)), st.data())
def test_raw_yaml_scalars_in_examples(name: str, data: st.DataObject) -> None:
    """A value replaced by raw YAML (dates, huge ints, tags, aliases): ConfigError at worst."""
    check(raw_scalar_in(EXAMPLE_TEXTS[name], data))


@st.composite
def plugin_configs(draw: st.DrawFn) -> dict[str, Any]:
    """A config whose plugins are real types with their own parameters, of any value."""
    plugins = []
    for plugin_type in draw(st.lists(st.sampled_from(sorted(PARAMETERS)), max_size=3)):
        keys = st.sampled_from(PARAMETERS[plugin_type]) if PARAMETERS[plugin_type] else KEYS
        params = draw(st.dictionaries(keys, PARAM_VALUES, max_size=3))
        plugins.append({"type": plugin_type, "parameters": params})
    return {"apiVersion": API_VERSION, "kind": KIND, "plugins": plugins}


@given(plugin_configs())
def test_plugin_parameters(doc: dict[str, Any]) -> None:
    """Plugin parameters of any value build, or fail with a ConfigError naming them."""
    check(dump([doc]))


SCORERS = [name for name in PARAMETERS if name.endswith("-scorer")]


@given(
    st.lists(
        st.tuples(st.sampled_from(SCORERS), EDGE_NUMBERS),
        min_size=1,
        max_size=3,
        unique_by=lambda t: t[0],
    )
)
def test_profile_weights(weights: list[tuple[str, Any]]) -> None:
    """Scorer weights of any number load finite and >= 0, or fail naming the weight."""
    doc = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "plugins": [{"type": scorer} for scorer, _ in weights],
        "schedulingProfiles": [
            {"name": "p", "plugins": [{"pluginRef": s, "weight": w} for s, w in weights]}
        ],
    }
    text = dump([doc])
    error = config_error(lambda: load_config(text))
    if error is None:
        (profile,) = load_config(text).profiles
        for ref in profile.plugins:
            assert ref.weight is not None
            assert 0 <= ref.weight < math.inf
    else:
        assert error.path.endswith(".weight"), error


@st.composite
def flow_sections(draw: st.DrawFn) -> dict[str, Any]:
    band_keys = st.sampled_from(["priority", *FLOW_KEYS[5:]])
    band = st.dictionaries(band_keys, PARAM_VALUES, max_size=4)
    section = draw(st.dictionaries(st.sampled_from(FLOW_KEYS[:3]), PARAM_VALUES, max_size=3))
    if draw(st.booleans()):
        section["defaultPriorityBand"] = draw(band)
    if draw(st.booleans()):
        section["priorityBands"] = draw(st.lists(band, max_size=3))
    return section


@given(flow_sections(), st.sampled_from([None, [], ["flowControl"], ["other"], "flowControl"]))
def test_flow_control_sections(section: dict[str, Any], gates: Any) -> None:
    """featureGates/flowControl of any shape: sane limits, or a ConfigError naming the field."""
    doc = {"apiVersion": API_VERSION, "kind": KIND, "featureGates": gates, "flowControl": section}
    check(dump([doc]))
    error = config_error(lambda: parse_flow_control(section))
    if error is None:
        flow = parse_flow_control(section)
        for band in (flow.default_band, *flow.bands.values()):
            assert band.max_requests >= 0
            assert band.max_bytes >= 0
            assert band.request_ttl is None or band.request_ttl > 0
        assert flow.max_requests >= 0
        assert flow.max_bytes >= 0
        assert flow.default_ttl > 0
    else:
        assert error.path.startswith("flowControl"), error


@given(PARAM_VALUES, st.sampled_from([(None, None), (0.0, None), (1.0, None), (0.01, 1.0)]))
def test_params_number_within_bounds(value: Any, bounds: tuple[float | None, float | None]) -> None:
    """A number a plugin accepts is finite and within its bounds; else a ConfigError."""
    minimum, maximum = bounds
    params = Params({"x": value}, "plugins[0].parameters")
    error = config_error(lambda: params.number("x", 1.0, minimum=minimum, maximum=maximum))
    if error is None:
        number = params.number("x", 1.0, minimum=minimum, maximum=maximum)
        assert math.isfinite(number)
        assert minimum is None or number >= minimum
        assert maximum is None or number <= maximum
    else:
        assert error.path == "plugins[0].parameters.x"


@given(PARAM_VALUES)
def test_params_duration_finite(value: Any) -> None:
    """A duration a plugin accepts is a finite number of seconds >= 0; else a ConfigError."""
    params = Params({"x": value}, "plugins[0].parameters")
    error = config_error(lambda: params.duration("x", 1.0))
    if error is None:
        seconds = params.duration("x", 1.0)
        assert math.isfinite(seconds)
        assert seconds >= 0
    else:
        assert error.path == "plugins[0].parameters.x"


def test_registry_knows_every_fuzzed_type() -> None:
    """The parameter table above covers every built-in plugin type (a new one joins it)."""
    assert set(default_registry()) == set(PARAMETERS)


@pytest.mark.parametrize("value", UNBUILDABLE_SCALARS)
def test_yaml_values_pyyaml_cannot_build(value: str) -> None:
    """Regression: scalars PyYAML types but cannot build are a ConfigError."""
    with pytest.raises(ConfigError, match="not valid YAML: a value it cannot build"):
        load_config(f"apiVersion: {value}\n", "config.yaml")


@pytest.mark.parametrize("field", ["slack", "factor"])
def test_integers_too_long_to_print(field: str) -> None:
    """Regression: a 5,000-digit hex integer is refused when loaded."""
    # it loaded (no digit limit in base 16), then the message quoting it raised ValueError
    text = (
        f"apiVersion: {API_VERSION}\nkind: {KIND}\n"
        f"plugins: [{{type: bounded-load-filter, parameters: {{{field}: -0x{'f' * 5000}}}}}]\n"
    )
    with pytest.raises(ConfigError, match="a value it cannot build"):
        load_config(text)


@pytest.mark.parametrize("opener", ["[", "{a: "])
def test_deeply_nested_yaml(opener: str) -> None:
    """Regression: YAML nested past the recursion limit escaped as RecursionError."""
    closer = "]" if opener == "[" else "}"
    with pytest.raises(ConfigError):
        load_config(opener * 5000 + "1" + closer * 5000, "config.yaml")


@pytest.mark.parametrize("weight", [".nan", ".inf", "1" + "0" * 400])
def test_profile_weight_must_be_finite(weight: str) -> None:
    """Regression: NaN, infinite and past-float weights are a ConfigError."""
    # NaN and inf were accepted (every total becomes NaN); 10**400 raised OverflowError
    text = (
        f"apiVersion: {API_VERSION}\nkind: {KIND}\nplugins: [{{type: queue-scorer}}]\n"
        "schedulingProfiles: [{name: p, plugins: [{pluginRef: queue-scorer, weight: "
        f"{weight}}}]}}]\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(text)
    assert caught.value.path == "schedulingProfiles[0].plugins[0].weight"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 10**400])
def test_params_numbers_must_be_finite(value: float) -> None:
    """Regression: NaN, infinities and past-float integers are a ConfigError."""
    # NaN passed every bound (factor: .nan was accepted); 10**400 raised OverflowError
    params = Params({"x": value}, "plugins[0].parameters")
    with pytest.raises(ConfigError, match="must be a number"):
        params.number("x", 1.0, minimum=1.0)
    with pytest.raises(ConfigError):
        params.duration("x", 1.0)


def test_flow_control_quantity_of_many_digits() -> None:
    """Regression: maxBytes given as a string of 5,000 digits escaped as ValueError."""
    with pytest.raises(ConfigError) as caught:
        parse_flow_control({"maxBytes": "9" * 5000})
    assert caught.value.path == "flowControl.maxBytes"


def test_empty_key_at_the_root_is_named() -> None:
    """Regression: an empty key at the top level gave an error with an empty path."""
    with pytest.raises(ConfigError) as caught:
        load_config('"": 1\n')
    assert caught.value.path == '""'
