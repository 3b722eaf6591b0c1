"""The guard around every background task the EPP owns (docs/architecture.md, principle 5), and
the set a process keeps them in: named, guarded, cancelled and awaited together on stop."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from typing import Any

import structlog

log = structlog.get_logger(__name__)

# A background loop before it runs: its name (in logs and ``asyncio`` task names) and coroutine.
NamedTask = tuple[str, Coroutine[Any, Any, None]]


async def guarded(name: str, coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro``; an error is logged with the task's name instead of vanishing with the
    task, and cancellation propagates."""
    try:
        await coro
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("background task failed", task=name)


class TaskSet:
    """The background loops one owner runs: each a named, guarded ``asyncio`` task."""

    def __init__(self) -> None:
        self._tasks: list[asyncio.Task[None]] = []

    def spawn(self, tasks: Iterable[NamedTask]) -> None:
        for name, coro in tasks:
            self._tasks.append(asyncio.create_task(guarded(name, coro), name=name))

    @property
    def names(self) -> list[str]:
        return [task.get_name() for task in self._tasks]

    async def cancel(self) -> None:
        """Cancel every task and wait until each has ended."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
