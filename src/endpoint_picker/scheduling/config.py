"""The ``EndpointPickerConfig`` file: parsed once by a safe YAML loader into frozen dataclasses.

The format is the reference EPP's, so its users' files work unchanged::

    apiVersion: inference.networking.x-k8s.io/v1alpha1
    kind: EndpointPickerConfig
    plugins:                       # every plugin instance; name defaults to type
    - type: queue-scorer
    - name: fast-detector
      type: utilization-detector
      parameters: {queueDepthThreshold: 3}
    schedulingProfiles:            # optional; without it one profile uses every plugin
    - name: default
      plugins:
      - pluginRef: queue-scorer
        weight: 2                  # scorers only; default 1
    featureGates: [flowControl]    # optional: queue requests while the pool is saturated
    flowControl: {...}             # optional: its limits and policies (flowcontrol/config.py)

This module checks the shape (keys, types, names, references) with exact paths; what a plugin
*is* (filter, scorer, picker, ...) and whether its parameters are right is checked when the
plugins are built (``build.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import yaml

from endpoint_picker import yamlsafe
from endpoint_picker.errors import ConfigError, clip
from endpoint_picker.flowcontrol import (
    FEATURE_GATE,
    FlowControlConfig,
    parse_feature_gates,
    parse_flow_control,
)
from endpoint_picker.scheduling.registry import finite_number

API_VERSION = "inference.networking.x-k8s.io/v1alpha1"
KIND = "EndpointPickerConfig"
_TOP_KEYS = ("apiVersion", "kind", "plugins", "schedulingProfiles", "featureGates", "flowControl")
_PLUGIN_KEYS = ("name", "type", "parameters")
_PROFILE_KEYS = ("name", "plugins")
_REF_KEYS = ("pluginRef", "weight")


@dataclass(frozen=True, slots=True)
class PluginSpec:
    """One entry of ``plugins``."""

    name: str
    type: str
    parameters: Mapping[str, object]


@dataclass(frozen=True, slots=True)
class ProfilePluginSpec:
    """One entry of a profile's ``plugins``; ``weight`` is None when not given."""

    plugin_ref: str
    weight: float | None = None


@dataclass(frozen=True, slots=True)
class ProfileSpec:
    name: str
    plugins: tuple[ProfilePluginSpec, ...]


@dataclass(frozen=True, slots=True)
class EndpointPickerConfig:
    """A parsed, shape-checked config. ``profiles`` is empty when the file declared none."""

    plugins: tuple[PluginSpec, ...]
    profiles: tuple[ProfileSpec, ...]
    source: str = "<config>"
    feature_gates: frozenset[str] = frozenset()
    # the flowControl section, or None when the flowControl feature gate is off
    flow_control: FlowControlConfig | None = None


DEFAULT_CONFIG_YAML = f"""\
apiVersion: {API_VERSION}
kind: {KIND}
plugins:
- type: candidate-sampler
- type: stale-metrics-filter
- type: bounded-load-filter
  parameters:
    factor: 1.3
    slack: 2
- type: prefix-cache-scorer
- type: session-affinity-scorer
- type: inflight-load-scorer
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: lora-affinity-scorer
- type: max-score-picker
- type: utilization-detector
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: candidate-sampler
  - pluginRef: stale-metrics-filter
  - pluginRef: bounded-load-filter
  - pluginRef: prefix-cache-scorer
    weight: 8
  - pluginRef: session-affinity-scorer
    weight: 2
  - pluginRef: inflight-load-scorer
    weight: 1
  - pluginRef: queue-scorer
    weight: 1
  - pluginRef: kv-cache-utilization-scorer
    weight: 1
  - pluginRef: lora-affinity-scorer
    weight: 4
  - pluginRef: max-score-picker
"""


def parse_config(text: str, source: str = "<config>") -> EndpointPickerConfig:
    """Parse YAML text and check its shape; raise ``ConfigError`` naming the field at fault."""
    try:
        doc = yaml.load(text, Loader=yamlsafe.Loader)  # a safe loader
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    except RecursionError as exc:
        raise ConfigError(f"{source}: not valid YAML: nested too deeply") from exc
    except yamlsafe.VALUE_ERRORS as exc:
        what = clip(f"{type(exc).__name__}: {exc}")
        raise ConfigError(f"{source}: not valid YAML: a value it cannot build ({what})") from exc
    if doc is None:
        doc = {}
    root = _mapping(doc, "", _TOP_KEYS, what="the config")
    api_version = root.get("apiVersion")
    if api_version != API_VERSION:
        raise ConfigError(f'must be "{API_VERSION}", got {api_version!r}', "apiVersion")
    if root.get("kind") != KIND:
        raise ConfigError(f'must be "{KIND}", got {root.get("kind")!r}', "kind")
    plugins = _parse_plugins(root.get("plugins"))
    profiles = _parse_profiles(root.get("schedulingProfiles"), {p.name for p in plugins})
    gates = parse_feature_gates(root.get("featureGates"))
    # The section is checked even with the gate off, so turning the gate on cannot fail later.
    flow_control = parse_flow_control(root.get("flowControl"))
    return EndpointPickerConfig(
        plugins,
        profiles,
        source,
        feature_gates=gates,
        flow_control=flow_control if FEATURE_GATE in gates else None,
    )


def _parse_plugins(raw: object) -> tuple[PluginSpec, ...]:
    items = _list(raw, "plugins")
    specs: list[PluginSpec] = []
    first_at: dict[str, int] = {}
    for i, item in enumerate(items):
        path = f"plugins[{i}]"
        entry = _mapping(item, path, _PLUGIN_KEYS, what="a plugin")
        type_name = _string(entry.get("type"), f"{path}.type")
        name = type_name if entry.get("name") is None else _string(entry["name"], f"{path}.name")
        if name in first_at:
            raise ConfigError(
                f'duplicate plugin name "{name}" (first at plugins[{first_at[name]}])',
                f"{path}.name",
            )
        first_at[name] = i
        params = entry.get("parameters")
        params_map = {} if params is None else _mapping(params, f"{path}.parameters", None)
        specs.append(PluginSpec(name, type_name, MappingProxyType(dict(params_map))))
    return tuple(specs)


def _parse_profiles(raw: object, declared: set[str]) -> tuple[ProfileSpec, ...]:
    items = _list(raw, "schedulingProfiles")
    profiles: list[ProfileSpec] = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        path = f"schedulingProfiles[{i}]"
        entry = _mapping(item, path, _PROFILE_KEYS, what="a profile")
        name = _string(entry.get("name"), f"{path}.name")
        if name in seen:
            raise ConfigError(f'duplicate profile name "{name}"', f"{path}.name")
        seen.add(name)
        refs = _list(entry.get("plugins"), f"{path}.plugins")
        if not refs:
            raise ConfigError("a profile needs at least one plugin", f"{path}.plugins")
        profiles.append(ProfileSpec(name, _parse_refs(refs, f"{path}.plugins", declared)))
    return tuple(profiles)


def _parse_refs(
    refs: Sequence[object], path: str, declared: set[str]
) -> tuple[ProfilePluginSpec, ...]:
    specs: list[ProfilePluginSpec] = []
    used: set[str] = set()
    for j, item in enumerate(refs):
        ref_path = f"{path}[{j}]"
        entry = _mapping(item, ref_path, _REF_KEYS, what="a profile plugin")
        ref = _string(entry.get("pluginRef"), f"{ref_path}.pluginRef")
        if ref not in declared:
            known = ", ".join(f'"{n}"' for n in sorted(declared)) or "none"
            raise ConfigError(
                f'unknown plugin "{ref}" (declared in plugins: {known})', f"{ref_path}.pluginRef"
            )
        if ref in used:
            raise ConfigError(f'plugin "{ref}" is already in this profile', f"{ref_path}.pluginRef")
        used.add(ref)
        weight = entry.get("weight")
        number = finite_number(weight)  # NaN or an infinity would turn every total into NaN
        if weight is not None and (number is None or number < 0):
            raise ConfigError("must be a number >= 0", f"{ref_path}.weight")
        specs.append(ProfilePluginSpec(ref, number))
    return tuple(specs)


def _mapping(
    value: object, path: str, keys: Sequence[str] | None, *, what: str = "this"
) -> Mapping[str, object]:
    if not isinstance(value, dict):
        raise ConfigError(f"{what} must be a mapping, got {_kind(value)}", path or "<root>")
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(f"keys must be strings, got {key!r}", path or "<root>")
        if keys is not None and key not in keys:
            raise ConfigError(f"unknown field (known: {', '.join(keys)})", _join(path, key))
    return value


def _list(value: object, path: str) -> Sequence[object]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(f"must be a list, got {_kind(value)}", path)
    return value


def _string(value: object, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError("must be a non-empty string", path)
    return value


def _join(path: str, key: str) -> str:
    key = key or '""'  # an empty key still names a spot
    return f"{path}.{key}" if path else key


def _kind(value: object) -> str:
    return "nothing" if value is None else type(value).__name__
