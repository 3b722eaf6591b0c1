"""The EndpointPickerConfig format: validation paths, defaults, registry injection."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from tests.unit.scheduling.builders import HEADER, build, clock, endpoint, request

from endpoint_picker.errors import ConfigError
from endpoint_picker.requests import LLMRequest
from endpoint_picker.scheduling import (
    Params,
    PluginContext,
    build_scheduling,
    default_config,
    default_registry,
    describe,
    load_config,
    room_finder,
)
from endpoint_picker.settings import SchedulingSettings
from endpoint_picker.types import EndpointState

EXAMPLE = Path(__file__).parents[3] / "deploy" / "examples" / "scheduler-config.yaml"


def cfg(body: str) -> str:
    return HEADER + body


BAD_CONFIGS = [
    ("[]", "<root>", "the config must be a mapping, got list"),
    ("apiVersion: v1\nkind: EndpointPickerConfig\n", "apiVersion", "must be"),
    (HEADER.replace("EndpointPickerConfig", "Other"), "kind", 'must be "EndpointPickerConfig"'),
    (cfg("pluginz: []\n"), "pluginz", "unknown field"),
    (cfg("plugins: {}\n"), "plugins", "must be a list, got dict"),
    (cfg("plugins:\n- name: x\n"), "plugins[0].type", "must be a non-empty string"),
    (
        cfg("plugins:\n- type: queue-scorer\n- type: foo\n"),
        "plugins[1].type",
        'unknown plugin type "foo" (known: bounded-load-filter, bounded-share-filter, '
        "candidate-sampler, inflight-load-scorer,",
    ),
    (
        cfg("plugins:\n- type: queue-scorer\n- type: queue-scorer\n"),
        "plugins[1].name",
        'duplicate plugin name "queue-scorer" (first at plugins[0])',
    ),
    (cfg("plugins:\n- type: queue-scorer\n  weight: 2\n"), "plugins[0].weight", "unknown field"),
    (
        cfg("plugins:\n- type: queue-scorer\n  parameters: [1]\n"),
        "plugins[0].parameters",
        "must be a mapping",
    ),
    (
        cfg("plugins:\n- type: queue-scorer\n  parameters: {threshold: 3}\n"),
        "plugins[0].parameters.threshold",
        "unknown parameter (known: none)",
    ),
    (
        cfg("plugins:\n- type: max-score-picker\n  parameters: {maxNumOfEndpoints: two}\n"),
        "plugins[0].parameters.maxNumOfEndpoints",
        "must be an integer >= 1, got 'two'",
    ),
    (
        cfg("plugins:\n- type: max-score-picker\n  parameters: {maxNumOfEndpoints: 0}\n"),
        "plugins[0].parameters.maxNumOfEndpoints",
        "must be an integer >= 1, got 0",
    ),
    (
        cfg("plugins:\n- type: utilization-detector\n  parameters: {queueDepthThresold: 3}\n"),
        "plugins[0].parameters.queueDepthThresold",
        "unknown parameter (known: criticalRunningRequestsThreshold, kvCacheUtilThreshold",
    ),
    (
        cfg("plugins:\n- type: utilization-detector\n  parameters: {kvCacheUtilThreshold: yes}\n"),
        "plugins[0].parameters.kvCacheUtilThreshold",
        "must be a number >= 0, got True",
    ),
    (
        cfg(
            "plugins:\n- type: utilization-detector\n"
            "  parameters: {metricsStalenessThreshold: 5 parsecs}\n"
        ),
        "plugins[0].parameters.metricsStalenessThreshold",
        "invalid duration",
    ),
    (
        cfg("plugins:\n- type: stale-metrics-filter\n  parameters: {stalenessThreshold: [1]}\n"),
        "plugins[0].parameters.stalenessThreshold",
        "must be a duration",
    ),
    (
        cfg(
            "plugins:\n- type: queue-scorer\n"
            "schedulingProfiles:\n- name: p\n  plugins:\n  - pluginRef: queue-scorer\n"
            "  - pluginRef: nope\n"
        ),
        "schedulingProfiles[0].plugins[1].pluginRef",
        'unknown plugin "nope" (declared in plugins: "queue-scorer")',
    ),
    (
        cfg(
            "plugins:\n- type: queue-scorer\n- type: kv-cache-utilization-scorer\n"
            "- type: lora-affinity-scorer\n"
            "schedulingProfiles:\n- name: p\n  plugins:\n  - pluginRef: queue-scorer\n"
            "  - pluginRef: kv-cache-utilization-scorer\n"
            "  - pluginRef: lora-affinity-scorer\n    weight: -1\n"
        ),
        "schedulingProfiles[0].plugins[2].weight",
        "must be a number >= 0",
    ),
    (
        cfg(
            "plugins:\n- type: queue-scorer\n"
            "schedulingProfiles:\n- name: p\n  plugins:\n  - pluginRef: queue-scorer\n"
            "    weight: heavy\n"
        ),
        "schedulingProfiles[0].plugins[0].weight",
        "must be a number >= 0",
    ),
    (
        cfg(
            "plugins:\n- type: queue-scorer\n"
            "schedulingProfiles:\n- name: p\n  plugins:\n  - pluginRef: queue-scorer\n"
            "  - pluginRef: queue-scorer\n"
        ),
        "schedulingProfiles[0].plugins[1].pluginRef",
        "already in this profile",
    ),
    (
        cfg(
            "plugins:\n- type: queue-scorer\nschedulingProfiles:\n"
            "- name: p\n  plugins:\n  - pluginRef: queue-scorer\n"
            "- name: p\n  plugins:\n  - pluginRef: queue-scorer\n"
        ),
        "schedulingProfiles[1].name",
        'duplicate profile name "p"',
    ),
    (
        cfg("plugins:\n- type: queue-scorer\nschedulingProfiles:\n- name: p\n  plugins: []\n"),
        "schedulingProfiles[0].plugins",
        "at least one plugin",
    ),
    (
        cfg(
            "plugins:\n- type: max-score-picker\n- type: random-picker\n"
            "schedulingProfiles:\n- name: p\n  plugins:\n  - pluginRef: max-score-picker\n"
            "  - pluginRef: random-picker\n"
        ),
        "schedulingProfiles[0].plugins[1].pluginRef",
        'a profile has one picker; "max-score-picker" and "random-picker" are both pickers',
    ),
    (
        cfg(
            "plugins:\n- type: max-score-picker\n- type: random-picker\n"
        ),  # implicit profile with two pickers
        "schedulingProfiles",
        "a profile has one picker",
    ),
    (
        cfg(
            "plugins:\n- type: max-score-picker\n"
            "schedulingProfiles:\n- name: p\n  plugins:\n  - pluginRef: max-score-picker\n"
            "    weight: 1\n"
        ),
        "schedulingProfiles[0].plugins[0].weight",
        "only scorers take a weight",
    ),
    (
        cfg(
            "plugins:\n- type: utilization-detector\n"
            "schedulingProfiles:\n- name: p\n  plugins:\n  - pluginRef: utilization-detector\n"
        ),
        "schedulingProfiles[0].plugins[0].pluginRef",
        "is not a filter, scorer or picker",
    ),
    (
        cfg(
            "plugins:\n- type: utilization-detector\n- name: second\n  type: utilization-detector\n"
        ),
        "plugins[1]",
        "a second saturation detector",
    ),
    (
        cfg(
            "plugins:\n- type: queue-scorer\nschedulingProfiles:\n"
            "- name: a\n  plugins:\n  - pluginRef: queue-scorer\n"
            "- name: b\n  plugins:\n  - pluginRef: queue-scorer\n"
        ),
        "schedulingProfiles",
        "2 profiles need a profile handler",
    ),
    (
        cfg(
            "plugins:\n- type: queue-scorer\n- type: single-profile-handler\nschedulingProfiles:\n"
            "- name: a\n  plugins:\n  - pluginRef: queue-scorer\n"
            "- name: b\n  plugins:\n  - pluginRef: queue-scorer\n"
        ),
        "schedulingProfiles",
        "runs exactly one profile; 2 are configured",
    ),
    ("plugins: [\n", "", "not valid YAML"),
]


@pytest.mark.parametrize(("text", "path", "message"), BAD_CONFIGS)
def test_bad_configs_name_the_field(text: str, path: str, message: str) -> None:
    """Each invalid config raises ConfigError with the exact path of the field at fault."""
    with pytest.raises(ConfigError) as caught:
        load_config(text, "sched.yaml")
    assert caught.value.path == path
    assert message in str(caught.value)


def test_weight_error_reads_like_the_docs() -> None:
    """The full message is "<path>: <reason>", the form users grep for."""
    text = cfg(
        "plugins:\n- type: queue-scorer\n"
        "schedulingProfiles:\n- name: p\n  plugins:\n  - pluginRef: queue-scorer\n    weight: -2\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(text)
    assert str(caught.value) == "schedulingProfiles[0].plugins[0].weight: must be a number >= 0"


def test_no_file_gives_the_default_profile() -> None:
    """Without a file: sampler, stale and load filters, prefix x8 and the tie-breakers, picker,
    detector."""
    assert load_config(None) == default_config()
    summary = describe(None)
    assert "filters: candidate-sampler, stale-metrics-filter, bounded-load-filter" in summary
    assert (
        "scorers: prefix-cache-scorer (weight 8), session-affinity-scorer (weight 2), "
        "inflight-load-scorer (weight 1), queue-scorer (weight 1), "
        "kv-cache-utilization-scorer (weight 1), lora-affinity-scorer (weight 4)"
    ) in summary
    assert "picker: max-score-picker" in summary
    assert "saturation detector: utilization-detector" in summary


def test_example_file_is_the_default() -> None:
    """deploy/examples/scheduler-config.yaml validates and builds the same profile as no file."""
    example = load_config(EXAMPLE.read_text(), str(EXAMPLE))
    assert example.plugins == default_config().plugins
    assert example.profiles == default_config().profiles


def test_missing_picker_defaults_to_max_score_and_weight_to_one() -> None:
    """A profile with no picker gets max-score-picker; a scorer with no weight weighs 1."""
    text = cfg(
        "plugins:\n- type: queue-scorer\n"
        "schedulingProfiles:\n- name: only\n  plugins:\n  - pluginRef: queue-scorer\n"
    )
    summary = describe(load_config(text))
    assert "scorers: queue-scorer (weight 1)" in summary
    assert "picker: max-score-picker" in summary
    assert "profile 'only'" in summary


def test_no_profiles_means_one_profile_with_every_plugin() -> None:
    """Without schedulingProfiles, a "default" profile uses every declared profile plugin."""
    text = cfg(
        "plugins:\n- type: stale-metrics-filter\n- type: running-requests-size-scorer\n"
        "- type: weighted-random-picker\n- type: utilization-detector\n"
        "- type: single-profile-handler\n"
    )
    summary = describe(load_config(text))
    assert "profile 'default'" in summary
    assert "filters: stale-metrics-filter" in summary
    assert "scorers: running-requests-size-scorer (weight 1)" in summary
    assert "picker: weighted-random-picker" in summary


def test_parameters_reach_the_plugins() -> None:
    """maxNumOfEndpoints overrides the fallback setting; detector thresholds apply."""
    parts = build(
        cfg(
            "plugins:\n- type: queue-scorer\n- type: max-score-picker\n"
            "  parameters: {maxNumOfEndpoints: 3}\n"
            "- type: utilization-detector\n"
            "  parameters: {queueDepthThreshold: 1, metricsStalenessThreshold: 2s}\n"
        ),
        fallbacks=0,
    )
    eps = [endpoint(queue=q, age=1.0) for q in (0, 1, 2, 3)]
    assert len(parts.scheduler.schedule(request(), eps).endpoints) == 3
    assert not parts.saturation_detector.is_saturated(eps[:2])
    assert parts.saturation_detector.is_saturated(eps[2:])


def test_critical_running_threshold_gives_critical_requests_more_room() -> None:
    """criticalRunningRequestsThreshold: an endpoint full for Standard work still has room for
    Critical work; it may not be below runningRequestsThreshold (an error naming its path)."""
    parts = build(
        cfg(
            "plugins:\n- type: queue-scorer\n- type: max-score-picker\n"
            "- type: utilization-detector\n"
            "  parameters: {queueDepthThreshold: 0, runningRequestsThreshold: 32,\n"
            "               criticalRunningRequestsThreshold: 48}\n"
        )
    )
    busy, full = endpoint(running=40, queue=0), endpoint(running=60, queue=0)
    room = room_finder(parts.saturation_detector)
    assert room([busy, full], 1) == [busy]
    assert room([busy, full], 0) == []
    assert room([busy, full], -1) == []
    with pytest.raises(ConfigError) as caught:
        build(
            cfg(
                "plugins:\n- type: utilization-detector\n"
                "  parameters: {runningRequestsThreshold: 32,\n"
                "               criticalRunningRequestsThreshold: 8}\n"
            )
        )
    assert caught.value.path == "plugins[0].parameters.criticalRunningRequestsThreshold"
    assert "must be at least runningRequestsThreshold (32)" in str(caught.value)


class PreferNamed:
    """A custom scorer: 1.0 for the endpoint with the configured pod name."""

    def __init__(self, pod: str) -> None:
        self.pod = pod

    @classmethod
    def from_params(cls, name: str, params: Params, ctx: PluginContext) -> PreferNamed:
        return cls(str(params.number("podIndex", 0, minimum=0)))

    def score(self, request: LLMRequest, endpoints: Sequence[EndpointState]) -> Sequence[float]:
        return [1.0 if e.endpoint.pod_name == f"pod{self.pod}" else 0.0 for e in endpoints]


def test_custom_plugin_type_registered_and_used() -> None:
    """A plugin type registered on an injected registry is validated, built and run."""
    registry = default_registry()
    registry.register("prefer-named-scorer", PreferNamed.from_params)
    text = cfg(
        "plugins:\n- type: prefer-named-scorer\n  parameters: {podIndex: 2}\n"
        "schedulingProfiles:\n- name: p\n  plugins:\n  - pluginRef: prefer-named-scorer\n"
    )
    config = load_config(text, registry=registry)
    parts = build_scheduling(
        config,
        settings=SchedulingSettings(),
        staleness_threshold=2.0,
        clock=clock,
        rng=random.Random(0),
        registry=registry,
    )
    eps = [endpoint(f"pod{i}.0") for i in range(4)]
    assert [e.endpoint.pod_name for e in parts.scheduler.schedule(request(), eps).endpoints] == [
        "pod2.0"
    ]
    with pytest.raises(ConfigError, match='unknown plugin type "prefer-named-scorer"'):
        load_config(text)  # the default registry does not know it: registries are not global


def test_registry_rejects_bad_and_duplicate_type_names() -> None:
    """Type names are kebab-case and registered once unless replace=True."""
    registry = default_registry()
    with pytest.raises(ValueError, match="kebab-case"):
        registry.register("PreferNamed", PreferNamed.from_params)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("queue-scorer", PreferNamed.from_params)
    registry.register("queue-scorer", PreferNamed.from_params, replace=True)


def test_plugin_without_extension_point_is_rejected() -> None:
    """A factory that builds something that is neither filter, scorer nor picker is an error."""
    registry = default_registry()
    registry.register("useless", lambda name, params, ctx: object())
    with pytest.raises(ConfigError) as caught:
        load_config(cfg("plugins:\n- type: useless\n"), registry=registry)
    assert caught.value.path == "plugins[0].type"
