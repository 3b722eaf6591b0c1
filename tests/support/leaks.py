"""The no-leaked-tasks fixture, shared by the test folders that opt in from their conftest."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest


@pytest.fixture(autouse=True)
async def no_leaked_tasks() -> AsyncIterator[None]:
    """Fail a test that leaves tasks running on its loop (clients, loops, server handlers)."""
    yield
    await asyncio.sleep(0)
    current = asyncio.current_task()
    leaked = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    assert not leaked, f"leaked tasks: {leaked}"
