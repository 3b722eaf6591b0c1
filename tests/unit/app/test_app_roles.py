"""The app's roles: each starts its own parts and tasks, and stops cleanly started or not."""

from __future__ import annotations

from pathlib import Path

from tests.support.extproc import make_settings
from tests.support.pool import pod, pool, pool_yaml

from endpoint_picker.app import App
from endpoint_picker.roles import WorkerRole
from endpoint_picker.scheduling.lifecycle import InFlight


def _pool_text() -> str:
    return pool_yaml(pool(), pod("p1", "127.0.0.2"))


async def test_one_epp_serves_three_ports_and_watches_its_pool_file(tmp_path: Path) -> None:
    """A single process binds ext_proc, health and metrics, scrapes, and runs the file watch."""
    app = App(make_settings(tmp_path, _pool_text()))
    try:
        ports = await app.start()
        assert ports.ext_proc
        assert ports.health
        assert ports.metrics
        assert app.task_names == ["pool-file-watch"]
        assert app._scraper is not None
        assert app._scraper.endpoints() == ["127.0.0.2:8000"]
        assert app.ready()
        assert app.director is not None
    finally:
        await app.stop(drain_timeout=0)
    assert app.task_names == []
    assert not app.ready()


async def test_a_worker_routes_only_and_listens_after_its_parents_state(tmp_path: Path) -> None:
    """A worker binds only ext_proc (SO_REUSEPORT), after its ``before_listen``; it reads no
    pool, scrapes nothing and serves neither the health nor the metrics port."""
    seen: list[bool] = []
    app: App

    async def before_listen() -> None:
        seen.append(app._ext_server is None and app.director is not None)

    role = WorkerRole(InFlight(), tls=None, client_ca=None, before_listen=before_listen)
    app = App(make_settings(tmp_path, _pool_text()), worker=role)
    try:
        ports = await app.start()
        assert seen == [True]
        assert ports.ext_proc
        assert (ports.health, ports.metrics) == (0, 0)
        assert app._scraper is None
        assert app.kubernetes is None
        assert app.note() is None
        assert app.datastore.pool is None  # its parent sends it
        assert app.task_names == []
        assert app.inflight is role.inflight
    finally:
        await app.stop(drain_timeout=0)


async def test_every_role_stops_cleanly_without_having_started(tmp_path: Path) -> None:
    """``stop`` after a failed or missing ``start`` (``epp serve``'s finally) closes each part
    that exists and touches none that does not."""
    settings = make_settings(tmp_path, _pool_text())
    worker = WorkerRole(InFlight(), tls=None, client_ca=None)
    for app in (App(settings), App(settings, worker=worker)):
        await app.stop(drain_timeout=0)
        assert app.task_names == []
        assert app.flow is None
        assert app.director is None
