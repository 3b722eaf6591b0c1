"""``epp serve --workers N``: one parent process and N worker processes on one ext_proc port.

```
            parent (App with Routers)                       worker i (App with WorkerRole)
  pool file / Kubernetes ─▶ PublishingDatastore ─┐        ┌─▶ Datastore ─▶ director, scheduler,
  scrapers (once for all) ───────────────────────┤ frames │   flow control, ext_proc (SO_REUSEPORT)
  health port, metrics port + status page        └────────┘   SharedInFlight ──▶ row i of the
  (merges the workers' expositions and decisions)              in-flight table (shared memory)
```

The parent publishes the pool and each metrics snapshot to every worker over a socketpair
(``fanout``, ``messages``); in-flight counts per endpoint are summed from a shared table with a
row per worker (``table``); ``/metrics`` is one view (``merge``); ``supervisor`` restarts a
worker that dies, turns a worker over at ``--worker-max-requests`` (its successor serving
before it drains) and drains them all on SIGTERM. Prefix indexes and session maps stay per
worker: they agree through deterministic placement (``scheduling.placement``).
"""

from __future__ import annotations

from endpoint_picker.app import App
from endpoint_picker.settings import Settings
from endpoint_picker.workers.fanout import PublishingDatastore
from endpoint_picker.workers.pool import WorkerPool


def build_parent(settings: Settings) -> App:
    """The parent of ``settings.server.workers`` workers: an ``App`` that routes through them."""
    pool = WorkerPool(settings, settings.server.workers)
    datastore = PublishingDatastore(settings.pool.pool_name, pool.publisher)
    app = App(settings, datastore=datastore, health=pool.health, routers=pool)
    app.metrics.registry.register(pool)
    return app


__all__ = ["WorkerPool", "build_parent"]
