"""The guard around every background task the EPP owns (docs/architecture.md, principle 5)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import structlog

log = structlog.get_logger(__name__)


async def guarded(name: str, coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro``; an error is logged with the task's name instead of vanishing with the
    task, and cancellation propagates."""
    try:
        await coro
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("background task failed", task=name)
