"""The app's wiring of precise-prefix-cache-scorer's subscriptions."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from endpoint_picker.app.routing import scheduling_config
from endpoint_picker.errors import ConfigError
from endpoint_picker.settings import SchedulingSettings, ServerSettings, Settings

BIND = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-scorer
  parameters:
    kvEventsConfig: {zmqEndpoint: "tcp://*:5557", discoverPods: false}
"""


def test_bind_mode_needs_one_process_and_says_so_before_any_worker_starts(tmp_path: Path) -> None:
    """N workers cannot all bind zmqEndpoint: the config is refused where the parent reads it,
    naming the field; one process takes it."""
    path = tmp_path / "config.yaml"
    path.write_text(BIND)
    one = Settings(scheduling=SchedulingSettings(config_file=path))
    assert scheduling_config(one) is not None
    two = replace(one, server=replace(ServerSettings(), workers=2))
    with pytest.raises(ConfigError, match=r"plugins\[0\]\.parameters\.kvEventsConfig\.zmqEndpoint"):
        scheduling_config(two)
