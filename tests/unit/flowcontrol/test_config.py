"""The ``featureGates`` and ``flowControl`` sections of the EndpointPickerConfig."""

from __future__ import annotations

from pathlib import Path

import pytest

from endpoint_picker.errors import ConfigError
from endpoint_picker.flowcontrol import FairnessPolicy, OrderingPolicy
from endpoint_picker.scheduling import describe, load_config
from endpoint_picker.scheduling.config import parse_config

HEAD = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"


def test_gate_off_means_no_flow_control_even_with_a_section() -> None:
    config = parse_config(HEAD + "flowControl: {maxRequests: 10}\n")
    assert config.flow_control is None


def test_full_section_parses() -> None:
    config = parse_config(
        HEAD
        + """featureGates: [flowControl]
flowControl:
  maxRequests: 100
  maxBytes: 64Mi
  defaultRequestTTL: 1m
  defaultPriorityBand: {maxRequests: 10, fairnessPolicy: global-fifo}
  priorityBands:
  - priority: 1
    maxBytes: 1G
    orderingPolicy: edf
    requestTTL: 5s
"""
    )
    fc = config.flow_control
    assert fc is not None
    assert (fc.max_requests, fc.max_bytes, fc.default_ttl) == (100, 64 * 2**20, 60.0)
    assert fc.band(0).max_requests == 10
    assert fc.band(0).fairness is FairnessPolicy.GLOBAL_FIFO
    critical = fc.band(1)
    assert critical.max_requests == 10  # inherited from defaultPriorityBand
    assert (critical.max_bytes, critical.ordering) == (10**9, OrderingPolicy.EDF)
    assert (fc.ttl(1), fc.ttl(0), fc.ttl(-1)) == (5.0, 60.0, 60.0)


def test_gate_alone_gives_the_defaults() -> None:
    fc = parse_config(HEAD + "featureGates: [flowControl]\n").flow_control
    assert fc is not None
    assert (fc.max_requests, fc.default_ttl) == (5000, 30.0)


@pytest.mark.parametrize(
    ("section", "path"),
    [
        ("featureGates: [flowKontrol]", "featureGates[0]"),
        ("featureGates: flowControl", "featureGates"),
        ("flowControl: {maxRequest: 3}", "flowControl.maxRequest"),
        ("flowControl: {maxRequests: -1}", "flowControl.maxRequests"),
        ("flowControl: {maxBytes: 12XB}", "flowControl.maxBytes"),
        ("flowControl: {defaultRequestTTL: 0s}", "flowControl.defaultRequestTTL"),
        ("flowControl: {defaultRequestTTL: soon}", "flowControl.defaultRequestTTL"),
        ("flowControl: {defaultPriorityBand: {fairnessPolicy: lottery}}",
         "flowControl.defaultPriorityBand.fairnessPolicy"),
        ("flowControl: {priorityBands: [{maxRequests: 1}]}",
         "flowControl.priorityBands[0].priority"),
        ("flowControl: {priorityBands: [{priority: 1}, {priority: 1}]}",
         "flowControl.priorityBands[1].priority"),
        ("flowControl: {priorityBands: [{priority: 1, orderingPolicy: lifo}]}",
         "flowControl.priorityBands[0].orderingPolicy"),
        ("flowControl: []", "flowControl"),
    ],
)  # fmt: skip
def test_errors_name_the_field(section: str, path: str) -> None:
    """Checked even with the gate off, so turning the gate on later cannot fail."""
    with pytest.raises(ConfigError) as info:
        parse_config(HEAD + section + "\n")
    assert info.value.path == path


def test_the_shipped_flow_control_example_builds() -> None:
    """deploy/examples/scheduler-config-flow-control.yaml validates, builds, and turns flow
    control on with its Sheddable band, admitted by predicted latency (no detector named)."""
    path = Path(__file__).parents[3] / "deploy" / "examples" / "scheduler-config-flow-control.yaml"
    config = load_config(path.read_text(), str(path))
    assert config.flow_control is not None
    assert config.flow_control.band(-1).max_requests == 200
    assert config.flow_control.ttl(-1) == 10.0
    assert "flow control: on" in describe(config)
    assert "saturation detector: predicted-latency-detector" in describe(config)
