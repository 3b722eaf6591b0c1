"""The plugin registry: kebab-case type names to factories, injected rather than global.

A factory receives the plugin's name, a ``Params`` reader over its ``parameters`` mapping and a
``PluginContext`` (settings, clock, random source). It reads every parameter up front, so the
built plugin has nothing left to decide per request; ``Params`` reports bad values and unknown
keys with their exact config path.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Self

from endpoint_picker.errors import ConfigError
from endpoint_picker.scheduling.lifecycle import InFlight
from endpoint_picker.settings import SchedulingSettings, parse_duration

_TYPE_NAME = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")


@dataclass(frozen=True, slots=True)
class PluginContext:
    """What plugins may depend on besides their parameters."""

    settings: SchedulingSettings
    staleness_threshold: float  # seconds; the scrape staleness threshold
    clock: Callable[[], float]  # monotonic seconds, comparable with MetricsSnapshot.updated_at
    rng: random.Random
    # the EPP's own count of requests in flight per endpoint, shared by every plugin
    inflight: InFlight = field(default_factory=InFlight)
    # the EPP's metrics, for plugins that report more than their timing (None in tests)
    observer: object | None = None
    # state plugins of one build share (the latency predictor of ``predicted-latency-*``); a
    # value that is a lifecycle, start or pool listener is subscribed once by the build
    shared: dict[str, object] = field(default_factory=dict)

    @property
    def max_endpoints(self) -> int:
        """How many endpoints a picker returns by default: the primary plus the fallbacks."""
        return 1 + self.settings.max_fallback_endpoints


class Params:
    """Typed reads of one plugin's ``parameters``, each error naming its path."""

    __slots__ = ("_path", "_raw", "_read")

    def __init__(self, raw: Mapping[str, object], path: str) -> None:
        self._raw = raw
        self._path = path
        self._read: set[str] = set()

    def path(self, key: str) -> str:
        return f"{self._path}.{key}"

    def _get(self, key: str) -> object:
        self._read.add(key)
        return self._raw.get(key)

    def number(
        self,
        key: str,
        default: float,
        *,
        minimum: float | None = None,
        maximum: float | None = None,
    ) -> float:
        """A real number (YAML int or float), within the bounds given."""
        value = self._get(key)
        if value is None:
            return default
        bounds = _bounds_text(minimum, maximum)
        number = finite_number(value)
        if (
            number is None
            or (minimum is not None and number < minimum)
            or (maximum is not None and number > maximum)
        ):
            raise ConfigError(f"must be a number{bounds}, got {value!r}", self.path(key))
        return number

    def integer(self, key: str, default: int, *, minimum: int | None = None) -> int:
        """A whole number (a float with no fraction, like ``2.0``, is accepted)."""
        value = self._get(key)
        if value is None:
            return default
        bounds = _bounds_text(minimum, None)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"must be an integer{bounds}, got {value!r}", self.path(key))
        if minimum is not None and value < minimum:
            raise ConfigError(f"must be an integer{bounds}, got {value!r}", self.path(key))
        return value

    def string(self, key: str, default: str) -> str:
        """A non-empty string."""
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, str) or not value:
            raise ConfigError(f"must be a non-empty string, got {value!r}", self.path(key))
        return value

    def text(self, key: str, default: str = "") -> str:
        """A string that may be empty (``topicFilter: ""``: every topic)."""
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise ConfigError(f"must be a string, got {value!r}", self.path(key))
        return value

    def boolean(self, key: str, default: bool) -> bool:
        """``true`` or ``false`` (YAML booleans only, not strings or numbers)."""
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(f"must be true or false, got {value!r}", self.path(key))
        return value

    def duration(self, key: str, default: float) -> float:
        """Seconds, from a Go duration string (``200ms``) or a number of seconds."""
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, str):
            try:
                seconds = parse_duration(value)
            except ConfigError as exc:
                raise ConfigError(str(exc), self.path(key)) from exc
        elif (number := finite_number(value)) is not None:
            seconds = number
        else:
            raise ConfigError(
                f"must be a duration such as 200ms or a number of seconds, got {value!r}",
                self.path(key),
            )
        if seconds < 0:
            raise ConfigError(f"must not be negative, got {value!r}", self.path(key))
        if math.isinf(seconds):  # "999...9h": more digits than a float holds
            raise ConfigError(f"must be finite, got {value!r}", self.path(key))
        return seconds

    def section(self, key: str) -> Params:
        """A nested mapping's reader (``kvEventsConfig``), its errors under its own path; call
        its ``finish`` too."""
        value = self._get(key)
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"must be a mapping, got {value!r}", self.path(key))
        return Params(value, self.path(key))

    def finish(self) -> None:
        """Raise on the first key no read asked for (a typo would otherwise pass silently)."""
        for key in self._raw:
            if key not in self._read:
                known = ", ".join(sorted(self._read)) or "none"
                raise ConfigError(f"unknown parameter (known: {known})", self.path(key))


def finite_number(value: object) -> float | None:
    """``value`` as a finite float; None for a non-number, NaN, the infinities and integers
    past the largest float (YAML reads ``.nan``, ``.inf`` and integers of any length)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _bounds_text(minimum: float | None, maximum: float | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum:g}, {maximum:g}]"
    if minimum is not None:
        return f" >= {minimum:g}"
    if maximum is not None:
        return f" <= {maximum:g}"
    return ""


PluginFactory = Callable[[str, Params, PluginContext], object]


class NoParams:
    """A plugin that takes no parameters: its factory builds it as it is (any key given is
    reported as unknown, as for every plugin)."""

    __slots__ = ()

    @classmethod
    def from_params(cls, name: str, params: Params, ctx: PluginContext) -> Self:
        return cls()


"""Builds one plugin from its name, parameters and context."""


class PluginRegistry:
    """Plugin factories by type name; build one per composition root, pass it in."""

    __slots__ = ("_factories",)

    def __init__(self) -> None:
        self._factories: dict[str, PluginFactory] = {}

    def register(self, type_name: str, factory: PluginFactory, *, replace: bool = False) -> None:
        """Add a plugin type; ``replace=True`` swaps out an existing one (a built-in, say)."""
        if not _TYPE_NAME.fullmatch(type_name):
            raise ValueError(f"plugin type names are kebab-case, got {type_name!r}")
        if type_name in self._factories and not replace:
            raise ValueError(f"plugin type {type_name!r} is already registered")
        self._factories[type_name] = factory

    def __contains__(self, type_name: object) -> bool:
        return type_name in self._factories

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._factories))

    def create(
        self,
        type_name: str,
        name: str,
        parameters: Mapping[str, object],
        context: PluginContext,
        *,
        path: str,
    ) -> object:
        """Build one plugin; ``path`` is where its entry sits in the config (``plugins[2]``)."""
        factory = self._factories.get(type_name)
        if factory is None:
            raise ConfigError(
                f'unknown plugin type "{type_name}" (known: {", ".join(self)})', f"{path}.type"
            )
        params = Params(parameters, f"{path}.parameters")
        plugin = factory(name, params, context)
        params.finish()
        return plugin
