"""The app's wiring of precise-prefix-cache-scorer's subscriptions."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
from tests.support.extproc import make_settings
from tests.support.pool import pod, pool, pool_yaml

from endpoint_picker.app import App
from endpoint_picker.app.routing import scheduling_config
from endpoint_picker.errors import ConfigError
from endpoint_picker.roles import WorkerRole
from endpoint_picker.scheduling.lifecycle import InFlight
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


CONNECT = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-scorer
"""


async def test_each_worker_subscribes_on_its_own_to_the_pool_its_parent_sends(
    tmp_path: Path,
) -> None:
    """A worker runs its own kv-events task, and the pool state its parent installs in its
    datastore is what it subscribes to (as a single EPP does with its own pool)."""
    settings = make_settings(tmp_path, pool_yaml(pool(), pod("p1", "127.0.0.2")))
    config = tmp_path / "config.yaml"
    config.write_text(CONNECT)
    settings = replace(settings, scheduling=replace(settings.scheduling, config_file=config))
    single = App(settings)
    worker = App(settings, worker=WorkerRole(InFlight(), tls=None, client_ca=None))
    try:
        await single.start()
        assert "kv-events" in single.task_names
        await worker.start()
        assert worker.task_names == ["kv-events"]
        routing = worker._parts.routing
        assert routing is not None
        assert routing.components.kv_events is not None
        hub = routing.components.kv_events
        assert hub._pods == frozenset()
        assert single.datastore.state is not None
        worker.datastore.install(single.datastore.state)  # what the parent sends
        assert hub._pods == frozenset({"127.0.0.2"})
        await asyncio.sleep(0.05)  # its task runs: one subscription, to that pod
        assert list(hub._subscriptions) == ["127.0.0.2"]
    finally:
        await worker.stop(drain_timeout=0)
        await single.stop(drain_timeout=0)
