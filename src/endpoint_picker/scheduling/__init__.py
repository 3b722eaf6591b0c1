"""Scheduling: which endpoint(s) serve a request, and is the pool saturated.

The director calls ``build_scheduling`` once (from the config file, or the default profile)
and then, per request, ``SaturationDetector.is_saturated`` and ``Scheduler.schedule``::

    parts = build_scheduling(load_config(text), settings=s.scheduling,
                             staleness_threshold=s.scrape.staleness_threshold)
    result = parts.scheduler.schedule(request, candidates)   # result.endpoints, best first

Modules: ``framework`` (the plugins' protocols), ``scheduler`` (profile runner, scheduler),
``registry`` (plugin types),
``config`` (the YAML format), ``build`` (config -> parts), ``saturation``, ``plugins/``.
"""

from __future__ import annotations

from endpoint_picker.scheduling.build import (
    SchedulingComponents,
    build_scheduling,
    default_config,
    default_registry,
    describe,
    load_config,
)
from endpoint_picker.scheduling.config import EndpointPickerConfig
from endpoint_picker.scheduling.framework import (
    Filter,
    OffLoopWork,
    Picker,
    Preparer,
    ProfileHandler,
    SchedulerObserver,
    Scorer,
)
from endpoint_picker.scheduling.registry import Params, PluginContext, PluginRegistry
from endpoint_picker.scheduling.saturation import (
    PriorityRoomDetector,
    RoomDetector,
    RoomFinder,
    SaturationDetector,
    room_finder,
)
from endpoint_picker.scheduling.scheduler import Scheduler, SchedulerProfile, SchedulingResult

__all__ = [
    "EndpointPickerConfig",
    "Filter",
    "OffLoopWork",
    "Params",
    "Picker",
    "PluginContext",
    "PluginRegistry",
    "Preparer",
    "PriorityRoomDetector",
    "ProfileHandler",
    "RoomDetector",
    "RoomFinder",
    "SaturationDetector",
    "Scheduler",
    "SchedulerObserver",
    "SchedulerProfile",
    "SchedulingComponents",
    "SchedulingResult",
    "Scorer",
    "build_scheduling",
    "default_config",
    "default_registry",
    "describe",
    "load_config",
    "room_finder",
]
