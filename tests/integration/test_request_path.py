"""How many of our modules one routed request crosses, and which calls which
(``tests/support/crossing.py``): the count stays within its budget and no call goes back up."""

from __future__ import annotations

import pytest
from tests.support.crossing import calls_back_up, crossing

from endpoint_picker.settings import EXT_PROC_SERVERS

# The modules whose code one routed request runs on the h2 stack (docs/architecture.md, "The
# request path"); grpcio's core takes the h2 modules' place and crosses fewer.
MAX_MODULES = 27


@pytest.mark.parametrize("stack", EXT_PROC_SERVERS)
async def test_a_routed_request_crosses_few_modules_and_never_calls_back_up(stack: str) -> None:
    """A routed request runs code in at most MAX_MODULES of our modules, and no module it
    calls calls it back (a plugin calling into the module that calls it, say)."""
    entered, edges = await crossing(stack)
    assert "endpoint_picker.director" in entered  # the request was routed, not refused
    assert len(entered) <= MAX_MODULES, sorted(entered)
    assert calls_back_up(edges) == set()


def test_calls_back_up_finds_a_cycle_and_only_it() -> None:
    """The cycle finder names the calls of a cycle, not the calls down into or out of it."""
    edges = {("a", "b"), ("b", "c"), ("c", "b"), ("c", "d")}
    assert calls_back_up(edges) == {("b", "c"), ("c", "b")}
