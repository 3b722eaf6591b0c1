"""How many ``endpoint_picker`` modules one routed request crosses, and which calls which.

Run: PYTHONPATH=src python -m tests.support.crossing [h2|grpcio]

An in-process EPP (default settings, two pods) serves one warm-up request, then one more under
``sys.setprofile``: every function entered in an ``endpoint_picker`` module during that request
(headers, body, response headers, response body; the gRPC client's own code is not ours) counts
its module once, and every call from one of our modules into another is listed as an edge, so
that a call back up the layers shows: ``calls_back_up`` lists every call whose callee (directly
or through others) calls its caller again, as a plugin calling the module that calls it would.
Background loops are slowed out of the way (pool-file reload hourly, no scraping).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

from tests.support.extproc import (
    completion,
    make_settings,
    response_body,
    response_headers,
    running_app,
)
from tests.support.pool import model, pod, pool, pool_yaml

MESSAGES = [
    *completion("m", "hi"),
    response_headers(),
    response_body(b'{"usage":{"prompt_tokens":1,"completion_tokens":2}}'),
]


async def crossing(stack: str) -> tuple[Counter[str], set[tuple[str, str]]]:
    tmp = Path(tempfile.mkdtemp())
    pods = (pod("a", "127.0.0.2"), pod("b", "127.0.0.3"))
    settings = make_settings(tmp, pool_yaml(pool(), model("m"), *pods))
    settings = replace(
        settings,
        pool=replace(settings.pool, reload_poll_interval=3600.0),
        server=replace(settings.server, ext_proc_server=stack),
    )
    entered: Counter[str] = Counter()
    edges: set[tuple[str, str]] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        name = frame.f_globals.get("__name__", "")
        if not name.startswith("endpoint_picker"):
            return
        entered[name] += 1
        back = frame.f_back
        caller = back.f_globals.get("__name__", "") if back is not None else ""
        if caller.startswith("endpoint_picker") and caller != name:
            edges.add((caller, name))

    async with running_app(settings) as (_app, client):
        await client.exchange(MESSAGES)  # warm up: first-use imports and caches
        sys.setprofile(profile)
        try:
            await client.exchange(MESSAGES)
        finally:
            sys.setprofile(None)
    return entered, edges


def calls_back_up(edges: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """The calls ``caller -> callee`` where ``callee`` reaches ``caller`` again: a cycle."""
    calls: dict[str, set[str]] = {}
    for caller, callee in edges:
        calls.setdefault(caller, set()).add(callee)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = {start}, [start]
        while todo:
            for nxt in calls.get(todo.pop(), ()):
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    return {(caller, callee) for caller, callee in edges if reaches(callee, caller)}


def main() -> None:
    stack = sys.argv[1] if len(sys.argv) > 1 else "h2"
    entered, edges = asyncio.run(crossing(stack))
    print(f"{stack}: one routed request crosses {len(entered)} modules")
    for name, calls in sorted(entered.items()):
        print(f"  {calls:5d} calls  {name}")
    print("calls between modules:")
    for caller, callee in sorted(edges):
        print(f"  {caller} -> {callee}")
    back = calls_back_up(edges)
    print(f"calls back up: {len(back) or 'none'}")
    for caller, callee in sorted(back):
        print(f"  {caller} -> {callee}")


if __name__ == "__main__":
    main()
