"""Clocks for the engine: simulated seconds, and how late a wake-up came in wall seconds.

The engine never reads time itself; tests inject ``ManualClock`` and step instantly.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

# A sleep wakes later than asked: epoll rounds timeouts up to whole milliseconds (0.5 ms on
# average), the kernel adds wake-up latency (~0.3 ms on this VM) and the loop may be busy. The
# clock learns that overshoot and asks for that much less, centring wake-ups on the plan.
_INITIAL_OVERSHOOT_S = 0.0008
_MAX_OVERSHOOT_S = 0.0015
_LEARNING_RATE = 0.05


class Clock(Protocol):
    """Simulated time for one engine."""

    def now(self) -> float:
        """Simulated seconds since the clock started."""
        ...

    async def sleep_until(self, t: float) -> float:
        """Sleep until simulated time ``t``; return wake-up time minus plan, in wall seconds
        (negative when early)."""
        ...


class ScaledClock:
    """Wall time multiplied by ``time_scale`` (2.0 = the simulated GPU runs twice as fast)."""

    __slots__ = ("_origin", "_overshoot", "_scale")

    def __init__(self, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self._scale = time_scale
        self._origin = time.monotonic()
        self._overshoot = _INITIAL_OVERSHOOT_S

    def now(self) -> float:
        """Simulated seconds since the clock started."""
        return (time.monotonic() - self._origin) * self._scale

    def wall(self, t: float) -> float:
        """The monotonic wall time at which simulated time ``t`` happens."""
        return self._origin + t / self._scale

    async def sleep_until(self, t: float) -> float:
        """Sleep until about ``t`` (early by at most the timer granularity); always yields to
        the loop once, even when already late."""
        target = self._origin + t / self._scale
        start = time.monotonic()
        delay = target - start - self._overshoot
        if delay > 0:
            await asyncio.sleep(delay)
            woke = time.monotonic()
            seen = min(woke - start - delay, _MAX_OVERSHOOT_S)
            self._overshoot += _LEARNING_RATE * (seen - self._overshoot)
        else:
            await asyncio.sleep(0)
            woke = time.monotonic()
        return woke - target


class ManualClock:
    """A clock tests move by hand; sleeping jumps straight to the target time."""

    __slots__ = ("t",)

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def now(self) -> float:
        """The current manual time."""
        return self.t

    async def sleep_until(self, t: float) -> float:
        """Jump to ``t`` and yield once; always on time."""
        self.t = max(self.t, t)
        await asyncio.sleep(0)
        return 0.0
