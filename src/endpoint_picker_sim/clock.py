"""Clocks for the engine: simulated seconds, and how late a wake-up came in wall seconds.

The engine never reads time itself; tests inject ``ManualClock`` and step instantly.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

# epoll rounds timeouts *up* to whole milliseconds, so a sleep lands 0-1 ms late on average
# 0.5 ms. Aiming half a millisecond early centres the error on zero instead.
_EPOLL_ROUNDING_S = 0.0005


class Clock(Protocol):
    """Simulated time for one engine."""

    def now(self) -> float:
        """Simulated seconds since the clock started."""
        ...

    async def sleep_until(self, t: float) -> float:
        """Sleep until simulated time ``t``; return how late the wake-up was, in wall seconds."""
        ...


class ScaledClock:
    """Wall time multiplied by ``time_scale`` (2.0 = the simulated GPU runs twice as fast)."""

    __slots__ = ("_origin", "_scale")

    def __init__(self, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self._scale = time_scale
        self._origin = time.monotonic()

    def now(self) -> float:
        """Simulated seconds since the clock started."""
        return (time.monotonic() - self._origin) * self._scale

    def wall(self, t: float) -> float:
        """The monotonic wall time at which simulated time ``t`` happens."""
        return self._origin + t / self._scale

    async def sleep_until(self, t: float) -> float:
        """Sleep until ``t``; always yields to the loop once, even when already late."""
        target = self._origin + t / self._scale
        delay = target - time.monotonic() - _EPOLL_ROUNDING_S
        await asyncio.sleep(delay if delay > 0 else 0)
        late = time.monotonic() - target
        return late if late > 0 else 0.0


class ManualClock:
    """A clock tests move by hand; sleeping jumps straight to the target time."""

    __slots__ = ("t",)

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def now(self) -> float:
        """The current manual time."""
        return self.t

    async def sleep_until(self, t: float) -> float:
        """Jump to ``t`` and yield once; never late."""
        self.t = max(self.t, t)
        await asyncio.sleep(0)
        return 0.0
