"""From a parsed config to running parts: plugins built, sorted by extension point, checked.

The rules, like the reference EPP's: every profile has exactly one picker (``max-score-picker``
is added when it has none); scorers weigh 1 unless told; at most one saturation detector
(``utilization-detector`` by default) and one profile handler (``single-profile-handler`` by
default, which needs exactly one profile); a config without ``schedulingProfiles`` gets one
profile, ``default``, with every filter, scorer and picker it declares, in order.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog

from endpoint_picker.errors import ConfigError
from endpoint_picker.kvevents.subscriber import KVEventsHub
from endpoint_picker.scheduling.config import (
    DEFAULT_CONFIG_YAML,
    EndpointPickerConfig,
    ProfilePluginSpec,
    ProfileSpec,
    parse_config,
)
from endpoint_picker.scheduling.framework import (
    CandidateHints,
    Filter,
    HintedFilter,
    Picker,
    Preparer,
    ProfileHandler,
    SchedulerObserver,
    Scorer,
)
from endpoint_picker.scheduling.lifecycle import (
    InFlight,
    LifecycleListener,
    PoolListener,
    StartListener,
    Subscribers,
)
from endpoint_picker.scheduling.plugins import SingleProfileHandler, register_builtins
from endpoint_picker.scheduling.plugins.precise import SHARED_KEY as KV_EVENTS
from endpoint_picker.scheduling.predictor import LatencyPredictor
from endpoint_picker.scheduling.registry import PluginContext, PluginRegistry
from endpoint_picker.scheduling.saturation import SaturationDetector
from endpoint_picker.scheduling.scheduler import (
    CycleRecord,
    PluginRef,
    Scheduler,
    SchedulerProfile,
    WeightedScorer,
)
from endpoint_picker.settings import SchedulingSettings, ScrapeSettings

DEFAULT_PICKER = "max-score-picker"
DEFAULT_DETECTOR = "utilization-detector"
# With flow control on, a held band waits in the EPP rather than getting 429: the default judges
# by predicted latency, so Critical keeps its latency under overload with no threshold to set.
# Without it a held Sheddable request is refused, and the reference's thresholds refuse only
# when the servers really are full.
DEFAULT_FLOW_CONTROL_DETECTOR = "predicted-latency-detector"
DEFAULT_HANDLER = "single-profile-handler"
DEFAULT_PROFILE = "default"

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulingComponents:
    """What the director needs: the scheduler, the saturation detector, and the subscribers
    of the lifecycle events (the plugins that learn from traffic, the in-flight counter),
    which the director's ``exchange.Lifecycle`` sends them."""

    scheduler: Scheduler
    saturation_detector: SaturationDetector
    subscribers: Subscribers = field(default_factory=Subscribers)
    inflight: InFlight = field(default_factory=InFlight)
    # request headers some plugin reads (session ids), and whether responses carry a session
    # token: the ext_proc stream collects and sets these
    request_headers: frozenset[str] = frozenset()
    session_tokens: bool = False
    # the latency predictor of the predicted-latency plugins, when configured (status page)
    latency_predictor: LatencyPredictor | None = None
    # plugins with work to do off the event loop before scheduling (tokenizing a prompt)
    preparers: tuple[Preparer, ...] = ()
    # the KV-cache event subscriptions of precise-prefix-cache-scorer: the app runs them
    kv_events: KVEventsHub | None = None


def default_registry() -> PluginRegistry:
    """A fresh registry holding the built-in plugin types; add your own before building."""
    registry = PluginRegistry()
    register_builtins(registry)
    return registry


def default_config() -> EndpointPickerConfig:
    """The config used when no file is given (also ``deploy/examples/scheduler-config.yaml``)."""
    return parse_config(DEFAULT_CONFIG_YAML, "<default>")


def load_config(
    text: str | None, source: str = "<config>", *, registry: PluginRegistry | None = None
) -> EndpointPickerConfig:
    """Parse and fully validate a config (plugins built once, then dropped); None: the default.

    For ``epp validate``: it catches everything ``build_scheduling`` would, with default
    settings.
    """
    config = default_config() if text is None else parse_config(text, source)
    _build(config, _dry_context(), registry or default_registry(), None)
    return config


def build_scheduling(
    config: EndpointPickerConfig | None,
    *,
    settings: SchedulingSettings,
    staleness_threshold: float,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
    registry: PluginRegistry | None = None,
    observer: SchedulerObserver | None = None,
    record: Callable[[CycleRecord], object] | None = None,
    inflight: InFlight | None = None,
) -> SchedulingComponents:
    """Build the scheduler and saturation detector; raise ``ConfigError`` with the field's path.

    ``record`` receives every routed cycle (the status page's recent decisions; see
    ``Scheduler``). ``inflight``: the in-flight counter every plugin reads (a worker of
    several passes a ``SharedInFlight``); a fresh ``InFlight`` when None."""
    context = PluginContext(
        settings=settings,
        staleness_threshold=staleness_threshold,
        clock=clock,
        rng=rng if rng is not None else random.Random(),
        inflight=inflight if inflight is not None else InFlight(clock),
        observer=observer,
    )
    built = _build(
        config or default_config(), context, registry or default_registry(), observer, record
    )
    return built.components


def describe(config: EndpointPickerConfig | None, *, registry: PluginRegistry | None = None) -> str:
    """A short human summary of what a config builds (printed by ``epp validate``)."""
    config = config or default_config()
    built = _build(config, _dry_context(), registry or default_registry(), None)
    lines = [f"scheduler config {config.source}:"]
    for profile in built.components.scheduler.profiles.values():
        lines.append(f"  profile {profile.name!r}:")
        for point, names in profile.plugins.items():
            lines.append(f"    {point}: {', '.join(names) or '-'}")
    lines.append(f"  saturation detector: {built.detector}; profile handler: {built.handler}")
    flow = config.flow_control
    if flow is None:
        lines.append("  flow control: off (saturated pools shed Sheddable requests with 429)")
    else:
        bands = ", ".join(f"{p}" for p in sorted(flow.bands, reverse=True)) or "none"
        lines.append(
            f"  flow control: on (queue limit {flow.max_requests or 'none'} requests, "
            f"{flow.max_bytes or 'no'} bytes; TTL {flow.default_ttl:g}s; configured bands: "
            f"{bands}; other priorities: {flow.default_band.max_requests or 'no limit'} "
            f"requests, {flow.default_band.fairness}, {flow.default_band.ordering})"
        )
    return "\n".join(lines)


def _dry_context() -> PluginContext:
    return PluginContext(
        settings=SchedulingSettings(),
        staleness_threshold=ScrapeSettings().staleness_threshold,
        clock=time.monotonic,
        rng=random.Random(0),
    )


@dataclass(frozen=True, slots=True)
class _Built:
    """A declared plugin, with the profile extension points it implements."""

    ref: PluginRef
    filter: Filter | None
    scorer: Scorer | None
    picker: Picker | None

    @property
    def in_profiles(self) -> bool:
        return self.filter is not None or self.scorer is not None or self.picker is not None


@dataclass(frozen=True, slots=True)
class _Assembly:
    components: SchedulingComponents
    detector: str  # plugin names, for describe()
    handler: str


def _build(
    config: EndpointPickerConfig,
    context: PluginContext,
    registry: PluginRegistry,
    observer: SchedulerObserver | None,
    record: Callable[[CycleRecord], object] | None = None,
) -> _Assembly:
    built: dict[str, _Built] = {}
    detectors: list[tuple[str, SaturationDetector]] = []
    handlers: list[tuple[str, ProfileHandler]] = []
    for i, spec in enumerate(config.plugins):
        path = f"plugins[{i}]"
        plugin = registry.create(spec.type, spec.name, spec.parameters, context, path=path)
        entry = _Built(
            PluginRef(spec.name, spec.type, plugin),
            plugin if isinstance(plugin, Filter) else None,
            plugin if isinstance(plugin, Scorer) else None,
            plugin if isinstance(plugin, Picker) else None,
        )
        is_detector = isinstance(plugin, SaturationDetector)
        is_handler = isinstance(plugin, ProfileHandler)
        if not (entry.in_profiles or is_detector or is_handler):
            raise ConfigError(
                f'plugin type "{spec.type}" implements no extension point '
                "(filter, scorer, picker, saturation detector or profile handler)",
                f"{path}.type",
            )
        if isinstance(plugin, SaturationDetector):
            _at_most_one(detectors, "saturation detector", path)
            detectors.append((spec.name, plugin))
        if isinstance(plugin, ProfileHandler):
            _at_most_one(handlers, "profile handler", path)
            handlers.append((spec.name, plugin))
        built[spec.name] = entry

    profile_specs = config.profiles or (_implicit_profile(built),)
    implicit = not config.profiles
    debug = _debug_enabled()
    hinted: set[str] = set()  # filters that ask their profile's scorers (one profile each)
    profiles = [
        _build_profile(
            spec, i, built, registry, context, observer, debug=debug, implicit=implicit,
            hinted=hinted,
        )
        for i, spec in enumerate(profile_specs)
    ]  # fmt: skip

    handler_name = DEFAULT_HANDLER
    if handlers:
        handler_name, handler = handlers[0]
        if isinstance(handler, SingleProfileHandler) and len(profiles) != 1:
            raise ConfigError(
                f'"{handler_name}" runs exactly one profile; {len(profiles)} are configured',
                "schedulingProfiles",
            )
    elif len(profiles) == 1:
        handler = SingleProfileHandler()
    else:
        raise ConfigError(
            f"{len(profiles)} profiles need a profile handler plugin to choose among them",
            "schedulingProfiles",
        )
    default = DEFAULT_DETECTOR if config.flow_control is None else DEFAULT_FLOW_CONTROL_DETECTOR
    detector_name, detector = (
        detectors[0]
        if detectors
        else (default, registry.create(default, default, {}, context, path="<default>"))
    )
    if not isinstance(detector, SaturationDetector):  # a replaced built-in gone wrong
        raise ConfigError(f'"{default}" is not a saturation detector', "<default>")
    scheduler = Scheduler(profiles, handler, observer=observer, record=record)
    plugins = [entry.ref.plugin for entry in built.values()]
    plugins += context.shared.values()  # shared state listens once, however many plugins use it
    subscribers = Subscribers(
        (context.inflight, *(p for p in plugins if isinstance(p, LifecycleListener))),
        (context.inflight, *(p for p in plugins if isinstance(p, PoolListener))),
        (context.inflight, *(p for p in plugins if isinstance(p, StartListener))),
    )
    components = SchedulingComponents(
        scheduler,
        detector,
        subscribers,
        context.inflight,
        request_headers=frozenset(
            h for p in plugins for h in getattr(p, "request_headers", frozenset())
        ),
        session_tokens=any(getattr(p, "issues_session_tokens", False) for p in plugins),
        latency_predictor=next(
            (
                predictor
                for p in context.shared.values()
                if isinstance(predictor := getattr(p, "predictor", None), LatencyPredictor)
            ),
            None,
        ),
        preparers=tuple(
            entry.ref.plugin
            for entry in built.values()
            if isinstance(entry.ref.plugin, Preparer) and _in_a_profile(entry.ref.name, profiles)
        ),
        kv_events=hub if isinstance(hub := context.shared.get(KV_EVENTS), KVEventsHub) else None,
    )
    return _Assembly(components, detector_name, handler_name)


def _in_a_profile(name: str, profiles: Sequence[SchedulerProfile]) -> bool:
    """Whether a profile runs the scorer ``name`` with a weight (its preparing is then due)."""
    return any(scorer == name for p in profiles for scorer, _ in p.scorer_weights)


def _at_most_one(found: Sequence[tuple[str, object]], what: str, path: str) -> None:
    if found:
        raise ConfigError(f'a second {what} ("{found[0][0]}" is the first); keep one', path)


def _implicit_profile(built: dict[str, _Built]) -> ProfileSpec:
    refs = tuple(ProfilePluginSpec(name) for name, b in built.items() if b.in_profiles)
    return ProfileSpec(DEFAULT_PROFILE, refs)


def _build_profile(
    spec: ProfileSpec,
    index: int,
    built: dict[str, _Built],
    registry: PluginRegistry,
    context: PluginContext,
    observer: SchedulerObserver | None,
    *,
    debug: bool,
    implicit: bool,
    hinted: set[str],
) -> SchedulerProfile:
    base = "schedulingProfiles" if implicit else f"schedulingProfiles[{index}]"
    filters: list[tuple[PluginRef, Filter]] = []
    scorers: list[WeightedScorer] = []
    pickers: list[tuple[PluginRef, Picker]] = []
    for j, item in enumerate(spec.plugins):
        path = base if implicit else f"{base}.plugins[{j}]"
        b = built[item.plugin_ref]
        if not b.in_profiles:
            raise ConfigError(
                f'plugin "{item.plugin_ref}" ({b.ref.type}) is not a filter, scorer or picker; '
                "it works without being listed in a profile",
                f"{path}.pluginRef",
            )
        if item.weight is not None and b.scorer is None:
            raise ConfigError(
                f'only scorers take a weight; "{item.plugin_ref}" is not one', f"{path}.weight"
            )
        if b.filter is not None:
            filters.append((b.ref, b.filter))
        if b.scorer is not None:
            weight = 1.0 if item.weight is None else item.weight
            scorers.append(WeightedScorer(b.ref, b.scorer, weight))
        if b.picker is not None:
            if pickers:
                raise ConfigError(
                    f'a profile has one picker; "{pickers[0][0].name}" and '
                    f'"{item.plugin_ref}" are both pickers',
                    path if implicit else f"{path}.pluginRef",
                )
            pickers.append((b.ref, b.picker))
    if not pickers:
        picker = registry.create(DEFAULT_PICKER, DEFAULT_PICKER, {}, context, path="<default>")
        if not isinstance(picker, Picker):
            raise ConfigError(f'"{DEFAULT_PICKER}" is not a picker', "<default>")
        pickers.append((PluginRef(DEFAULT_PICKER, DEFAULT_PICKER, picker), picker))
    hinters = [s.scorer for s in scorers if s.weight > 0 and isinstance(s.scorer, CandidateHints)]
    for ref, flt in filters:
        if isinstance(flt, HintedFilter):
            if ref.name in hinted:  # it asks one profile's scorers: which would it ask?
                raise ConfigError(
                    f'"{ref.name}" ({ref.type}) is listed in two profiles; declare one per profile',
                    base,
                )
            hinted.add(ref.name)
            flt.use_hints(hinters)
    return SchedulerProfile(spec.name, filters, scorers, pickers[0], observer=observer, debug=debug)


def _debug_enabled() -> bool:
    """Whether debug logs would be emitted, decided once at build (the hot path never asks).

    Configure logging before building the scheduler.
    """
    bound = log.bind()
    is_enabled_for = getattr(bound, "is_enabled_for", None)
    if callable(is_enabled_for):
        return bool(is_enabled_for(logging.DEBUG))
    is_enabled = getattr(bound, "isEnabledFor", None)
    return bool(is_enabled(logging.DEBUG)) if callable(is_enabled) else True
