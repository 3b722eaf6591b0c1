"""Waiting in a test for state that has no event to await: poll it, within a bound."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(check: Callable[[], bool], within: float = 5.0) -> None:
    """Poll ``check`` every 10 ms until it holds; fail the test after ``within`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"not true within {within} s")
        await asyncio.sleep(0.01)
