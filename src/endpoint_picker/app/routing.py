"""What routes in a process that routes (one EPP, a worker): the scheduler from its config,
the director over it, outlier ejection and the flow-control gate. A workers' parent builds none
of it; it only checks the config, so that a bad file fails before any worker starts."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from endpoint_picker.datastore import Datastore
from endpoint_picker.datastore.health import OutlierDetector, without_excluded
from endpoint_picker.director import Director, RoutingDecision
from endpoint_picker.errors import ConfigError
from endpoint_picker.exchange import Lifecycle
from endpoint_picker.flowcontrol import FlowController
from endpoint_picker.scheduling import (
    SchedulingComponents,
    build_scheduling,
    load_config,
    room_finder,
)
from endpoint_picker.scheduling.config import EndpointPickerConfig
from endpoint_picker.scheduling.lifecycle import InFlight
from endpoint_picker.settings import Settings
from endpoint_picker.status import DecisionLog
from endpoint_picker.telemetry.metrics import EppMetrics
from endpoint_picker.telemetry.tasks import NamedTask


def scheduling_config(settings: Settings) -> EndpointPickerConfig | None:
    """The scheduler config file, validated; None without one (the default config)."""
    config_path = settings.scheduling.config_file
    if config_path is None:
        return None
    try:
        text = config_path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", str(config_path)) from exc
    config = load_config(text, str(config_path))
    if settings.server.workers > 1:
        for i, spec in enumerate(config.plugins):
            events = spec.parameters.get("kvEventsConfig")
            if isinstance(events, dict) and events.get("zmqEndpoint"):
                raise ConfigError(
                    "binds one socket every pod connects to, which N worker processes cannot "
                    "share: run --workers 1, or subscribe to each pod (no zmqEndpoint)",
                    f"{config_path}: plugins[{i}].parameters.kvEventsConfig.zmqEndpoint",
                )
    return config


@dataclass(frozen=True, slots=True)
class Routing:
    """The director and what the root and the status page read beside it."""

    director: Director
    components: SchedulingComponents
    inflight: InFlight  # the EPP's own in-flight count (tests, status)
    flow: FlowController[RoutingDecision] | None  # with the flowControl gate
    outliers: OutlierDetector | None  # ejects endpoints on their responses; per process

    def tasks(self) -> list[NamedTask]:
        tasks: list[NamedTask] = []
        if self.flow is not None:
            tasks.append(("flow-control-dispatch", self.flow.run()))
        if self.components.kv_events is not None:  # each routing process subscribes itself
            tasks.append(("kv-events", self.components.kv_events.run()))
        return tasks

    def close(self) -> None:
        if self.flow is not None:  # whatever still waits gets its 503 now
            self.flow.close()


def build_routing(
    settings: Settings,
    datastore: Datastore,
    metrics: EppMetrics,
    decisions: DecisionLog,
    *,
    clock: Callable[[], float],
    rng: random.Random,
    inflight: InFlight | None,  # a worker's: its row of the machine-wide table
) -> Routing:
    """Build the scheduler and the director; ``ConfigError`` for a bad config file."""
    config = scheduling_config(settings)
    components = build_scheduling(
        config,
        settings=settings.scheduling,
        staleness_threshold=settings.scrape.staleness_threshold,
        clock=clock,
        rng=rng,
        observer=metrics,
        record=decisions.record,
        inflight=inflight,
    )
    lifecycle = Lifecycle.of(components.subscribers)
    outliers = None
    if settings.outliers.enabled:
        detector = outliers = OutlierDetector(settings.outliers, clock=clock, observer=metrics)
        metrics.track_ejections(detector.ejected)
        datastore.on_endpoints_changed(
            lambda endpoints: detector.endpoints_changed(e.hostport for e in endpoints)
        )
    flow = None
    if config is not None and config.flow_control is not None:
        room = room_finder(components.saturation_detector)
        flow = FlowController[RoutingDecision](
            config.flow_control,
            # an ejected pod's last metrics (idle, often) are no room: judge without it
            lambda priority: (
                not room(without_excluded(datastore.endpoint_states(), outliers), priority)
            ),
            clock=clock,
            observer=metrics,
        )
    # plugins that remember endpoints (the prefix index) forget the ones that leave
    datastore.on_endpoints_changed(
        lambda endpoints: lifecycle.endpoints_changed(e.hostport for e in endpoints)
    )
    hub = components.kv_events
    if hub is not None:  # each process that routes subscribes on its own
        datastore.on_endpoints_changed(hub.set_endpoints)
        hub.set_endpoints(datastore.endpoints)
    director = Director(
        datastore,
        components.scheduler,
        components.saturation_detector,
        allow_unknown_models=settings.pool.allow_unknown_models,
        extra_paths=settings.server.extra_inference_paths,
        rng=rng,
        lifecycle=lifecycle,
        request_headers=components.request_headers,
        session_tokens=components.session_tokens,
        flow=flow,
        outliers=outliers,
        preparers=components.preparers,
    )
    return Routing(director, components, components.inflight, flow, outliers)
