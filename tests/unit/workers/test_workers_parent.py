"""The parent of ``--workers``: wired to route nothing itself."""

from __future__ import annotations

import time
from pathlib import Path

from tests.support.extproc import make_settings
from tests.support.pool import pod, pool, pool_yaml

from endpoint_picker.app import App
from endpoint_picker.workers import build_parent


async def test_the_parent_scrapes_unsliced_and_one_process_sliced(tmp_path: Path) -> None:
    """No pick shares a workers' parent's loop: its scrape steps never wait at the gate. One
    process routes where it scrapes: its steps are sliced."""
    settings = make_settings(tmp_path, pool_yaml(pool(), pod("p1", "127.0.0.2")))
    for app, admitted in ((build_parent(settings), True), (App(settings), False)):
        gate = app._scraper.gate
        assert gate.admit()
        started = time.perf_counter()
        while time.perf_counter() - started < 0.002:  # an iteration's share, long gone
            pass
        assert gate.admit() is admitted
        await app.stop()  # never started: closes what construction opened (the shared table)
