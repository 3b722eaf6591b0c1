"""The ``flowControl`` section of the EndpointPickerConfig, checked with exact paths.

::

    featureGates: [flowControl]          # off without this gate, whatever the section says
    flowControl:
      maxRequests: 5000                  # queued requests, all bands together (0: no limit)
      maxBytes: 1Gi                      # their bodies' bytes, all bands together (0: no limit)
      defaultRequestTTL: 30s             # how long a request may wait before a 503
      defaultPriorityBand:               # the limits and policies of bands not listed below
        maxRequests: 1000
        maxBytes: 256Mi
        fairnessPolicy: round-robin      # or global-fifo
        orderingPolicy: fcfs             # or edf (earliest deadline first)
      priorityBands:
      - priority: 1                      # Critical models (0 Standard, -1 Sheddable) or an
        maxRequests: 2000                # InferenceObjective's priority
        requestTTL: 60s

A band exists for every priority a request arrives with; ``priorityBands`` only changes the
limits and policies of the ones it names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TypeVar

from endpoint_picker.errors import ConfigError
from endpoint_picker.settings import parse_duration

FEATURE_GATE = "flowControl"
_E = TypeVar("_E", bound=StrEnum)


class FairnessPolicy(StrEnum):
    """Which flow of a band goes next."""

    ROUND_ROBIN = "round-robin"  # each flow with a waiting request in turn
    GLOBAL_FIFO = "global-fifo"  # the flow whose next request has waited longest


class OrderingPolicy(StrEnum):
    """Which request of a flow goes next."""

    FCFS = "fcfs"  # first come, first served
    EDF = "edf"  # earliest deadline first (a client's shorter timeout moves it forward)


@dataclass(frozen=True, slots=True)
class BandConfig:
    """One priority band's limits and policies; ``request_ttl`` None: the default TTL."""

    max_requests: int = 1000  # 0: no limit
    max_bytes: int = 256 * 1024 * 1024  # 0: no limit
    fairness: FairnessPolicy = FairnessPolicy.ROUND_ROBIN
    ordering: OrderingPolicy = OrderingPolicy.FCFS
    request_ttl: float | None = None


@dataclass(frozen=True, slots=True)
class FlowControlConfig:
    max_requests: int = 5000
    max_bytes: int = 1024 * 1024 * 1024
    default_ttl: float = 30.0
    default_band: BandConfig = field(default_factory=BandConfig)
    bands: Mapping[int, BandConfig] = field(default_factory=dict)  # by priority

    def band(self, priority: int) -> BandConfig:
        return self.bands.get(priority, self.default_band)

    def ttl(self, priority: int) -> float:
        ttl = self.band(priority).request_ttl
        return self.default_ttl if ttl is None else ttl


_TOP_KEYS = ("maxRequests", "maxBytes", "defaultRequestTTL", "defaultPriorityBand",
             "priorityBands")  # fmt: skip
_BAND_KEYS = ("maxRequests", "maxBytes", "fairnessPolicy", "orderingPolicy", "requestTTL")
# ASCII digits, no more than int() reads (a string of 5,000 digits would raise ValueError)
_BYTES = re.compile(r"([0-9]{1,30})(Ki|Mi|Gi|Ti|k|M|G|T)?")
_UNITS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}  # fmt: skip


def parse_flow_control(raw: object, path: str = "flowControl") -> FlowControlConfig:
    """The section as parsed YAML (None: every default); ``ConfigError`` names the field."""
    if raw is None:
        return FlowControlConfig()
    section = _mapping(raw, path, _TOP_KEYS)
    defaults = FlowControlConfig()
    default_band = _band(
        section.get("defaultPriorityBand"), f"{path}.defaultPriorityBand", BandConfig()
    )
    bands: dict[int, BandConfig] = {}
    for i, item in enumerate(_list(section.get("priorityBands"), f"{path}.priorityBands")):
        band_path = f"{path}.priorityBands[{i}]"
        entry = _mapping(item, band_path, ("priority", *_BAND_KEYS))
        priority = entry.get("priority")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ConfigError("must be an integer", f"{band_path}.priority")
        if priority in bands:
            raise ConfigError(f"priority {priority} has a band already", f"{band_path}.priority")
        band_fields = {k: v for k, v in entry.items() if k != "priority"}
        bands[priority] = _band(band_fields, band_path, default_band)
    return FlowControlConfig(
        max_requests=_count(
            section.get("maxRequests"), f"{path}.maxRequests", defaults.max_requests
        ),
        max_bytes=_bytes(section.get("maxBytes"), f"{path}.maxBytes", defaults.max_bytes),
        default_ttl=_ttl(
            section.get("defaultRequestTTL"), f"{path}.defaultRequestTTL", defaults.default_ttl
        ),
        default_band=default_band,
        bands=bands,
    )


def parse_feature_gates(raw: object, path: str = "featureGates") -> frozenset[str]:
    gates = _list(raw, path)
    known = (FEATURE_GATE,)
    for i, gate in enumerate(gates):
        if gate not in known:
            raise ConfigError(
                f"unknown feature gate {gate!r} (known: {', '.join(known)})", f"{path}[{i}]"
            )
    return frozenset(str(g) for g in gates)


def _band(raw: object, path: str, base: BandConfig) -> BandConfig:
    if raw is None:
        return base
    entry = _mapping(raw, path, _BAND_KEYS)
    ttl = entry.get("requestTTL")
    return replace(
        base,
        max_requests=_count(entry.get("maxRequests"), f"{path}.maxRequests", base.max_requests),
        max_bytes=_bytes(entry.get("maxBytes"), f"{path}.maxBytes", base.max_bytes),
        fairness=_enum(entry.get("fairnessPolicy"), f"{path}.fairnessPolicy", base.fairness),
        ordering=_enum(entry.get("orderingPolicy"), f"{path}.orderingPolicy", base.ordering),
        request_ttl=base.request_ttl if ttl is None else _ttl(ttl, f"{path}.requestTTL", 0.0),
    )


def _count(value: object, path: str, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"must be a whole number >= 0 (0: no limit), got {value!r}", path)
    return value


def _bytes(value: object, path: str, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    match = _BYTES.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise ConfigError(
            f"must be bytes >= 0, a whole number or a quantity like 256Mi or 1G, got {value!r}",
            path,
        )
    return int(match.group(1)) * _UNITS[match.group(2)]


def _ttl(value: object, path: str, default: float) -> float:
    if value is None:
        return default
    try:
        seconds = parse_duration(value) if isinstance(value, str) else None
    except ConfigError:
        seconds = None
    if seconds is None or seconds <= 0:
        raise ConfigError(f"must be a positive duration like 30s or 1m, got {value!r}", path)
    return seconds


def _enum(value: object, path: str, default: _E) -> _E:
    if value is None:
        return default
    kind = type(default)
    try:
        if not isinstance(value, str):
            raise ValueError(value)
        return kind(value)
    except ValueError:
        known = ", ".join(m.value for m in kind)
        raise ConfigError(f"must be one of {known}, got {value!r}", path) from None


def _mapping(value: object, path: str, keys: Sequence[str]) -> Mapping[str, object]:
    if not isinstance(value, dict):
        raise ConfigError(f"must be a mapping, got {type(value).__name__}", path)
    for key in value:
        if key not in keys:
            raise ConfigError(f"unknown field (known: {', '.join(keys)})", f"{path}.{key}")
    return value


def _list(value: object, path: str) -> Sequence[object]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(f"must be a list, got {type(value).__name__}", path)
    return value
