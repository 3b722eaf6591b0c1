"""Process-wide admission limits of the ext_proc server: buffered body bytes and open streams.

``--max-request-body-size`` bounds one body; these bound all of them together, so many streams
each holding a large body cannot exhaust memory. Both are plain integers, not locks: every
ext_proc stream runs on the one event loop, and nothing awaits between a check and its update.
One instance of each is built by the composition root and shared by every stream.
"""

from __future__ import annotations

# What a request is told when the body budget is full (a 429: it may be retried).
BUDGET_FULL = "the endpoint picker is holding too many request bodies; retry later"


class BodyBudget:
    """Bytes of request bodies held before routing, summed over every stream, against a limit.

    A stream reserves each chunk before keeping it and releases what it reserved when the body
    is routed, refused or the stream ends. A limit of 0 means no limit.
    """

    __slots__ = ("_reserved", "limit")

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"the body budget must not be negative: {limit}")
        self.limit = limit
        self._reserved = 0

    @property
    def reserved(self) -> int:
        return self._reserved

    def try_reserve(self, size: int) -> bool:
        """Take ``size`` bytes if they fit; False (nothing taken) when the budget is full."""
        if self.limit and self._reserved + size > self.limit:
            return False
        self._reserved += size
        return True

    def release(self, size: int) -> None:
        self._reserved -= size


class StreamSlots:
    """Open ext_proc streams against ``--max-concurrent-streams`` (0: no limit)."""

    __slots__ = ("_open", "accepted", "limit")

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"the stream limit must not be negative: {limit}")
        self.limit = limit
        self._open = 0
        self.accepted = 0  # streams let in since the start (a worker's turnover counts them)

    @property
    def open(self) -> int:
        return self._open

    def try_acquire(self) -> bool:
        if self.limit and self._open >= self.limit:
            return False
        self._open += 1
        self.accepted += 1
        return True

    def release(self) -> None:
        self._open -= 1
