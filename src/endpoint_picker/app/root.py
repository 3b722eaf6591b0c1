"""The composition root: builds every part from ``Settings`` and runs them as one app.

Nothing below this module constructs its own dependencies; everything is passed in here.
``App`` builds the parts (``roles.Parts``), starts those of its role (``roles.Single``,
``Parent`` or ``Worker``), runs the role's background loops as named, guarded tasks, and on stop
drains and closes every part in the order that keeps probes and Envoy informed:

```
 parts                 one EPP   workers' parent   worker   module
 pool source+scrapers     x            x         (parent)   app.pool, app.sources
 routing (director)       x       (checks config)    x      app.routing
 ext_proc port            x       (Routers: workers) x      app.grpc_ports / workers
 health port              x            x                    app.grpc_ports
 metrics port + status    x            x                    app.metrics_port
```

With ``epp serve --workers N`` (N > 1) the same app runs in two roles (``endpoint_picker.workers``
builds them): the parent keeps the pool source, the scrapers, the health port and the metrics
port and hands routing to its ``Routers`` (the worker processes); each worker (``WorkerRole``,
both in ``roles``) routes only: its datastore is fed by the parent, its ext_proc port is
shared by SO_REUSEPORT.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import prometheus_client
import structlog

from endpoint_picker.app.grpc_ports import ExtProcPort, HealthPort
from endpoint_picker.app.metrics_port import MetricsPort
from endpoint_picker.app.roles import (
    BoundPorts,
    FeedParts,
    Parent,
    Parts,
    Role,
    Single,
    Worker,
)
from endpoint_picker.datastore import Datastore
from endpoint_picker.datastore.health import OutlierDetector
from endpoint_picker.director import Director, RoutingDecision
from endpoint_picker.extproc.server import ExtProcServer, HealthState
from endpoint_picker.flowcontrol import FlowController
from endpoint_picker.metrics.scraper import ScrapeManager
from endpoint_picker.roles import Routers, WorkerRole
from endpoint_picker.scheduling.lifecycle import InFlight
from endpoint_picker.settings import Settings
from endpoint_picker.status import DecisionLog
from endpoint_picker.telemetry.metrics import EppMetrics, PoolStats
from endpoint_picker.telemetry.tasks import TaskSet

if TYPE_CHECKING:  # imported when used: only a Kubernetes deployment loads the client
    from endpoint_picker.datastore.sources.kubernetes import KubernetesSource, LeaderElector

log = structlog.get_logger(__name__)


class App:
    """One EPP process: datastore, sources, scrapers, scheduler, director and servers."""

    def __init__(
        self,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        datastore: Datastore | None = None,
        health: HealthState | None = None,
        routers: Routers | None = None,
        worker: WorkerRole | None = None,
        before_listen: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self._role: Role = (
            Worker(worker, before_listen)
            if worker is not None
            else Parent(routers)
            if routers is not None
            else Single(before_listen)
        )
        self.datastore = datastore or Datastore(settings.pool.pool_name)
        # The reference EPP (Go client) exports no *_created series; dashboards expect none.
        prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
        self.metrics = EppMetrics(self._pool_stats, self.datastore.is_configured_model)
        self.health = health or HealthState()
        self.decisions = DecisionLog()
        self.ports = BoundPorts(0, 0, 0)
        self._tasks = TaskSet()
        self._stopping = asyncio.Event()
        self._draining = False
        feed = self._role.feed(
            FeedParts(
                settings, self.datastore, self.metrics, self.health, clock, lambda: self._draining
            )
        )
        self._parts = Parts(
            settings=settings,
            clock=clock,
            rng=rng or random.Random(),
            datastore=self.datastore,
            metrics=self.metrics,
            health=self.health,
            decisions=self.decisions,
            status=self,  # ready() and note(), for the status page
            feed=feed,
            ext_proc=ExtProcPort(),
            health_port=HealthPort(),
            metrics_port=MetricsPort(),
        )

    async def start(self) -> BoundPorts:
        """Load the pool and start serving; ``ConfigError`` when an input is invalid."""
        parts = self._parts
        started = await self._role.start(parts)
        self._tasks.spawn(started.tasks)
        await parts.feed.serving()  # the pool file: ready now (Kubernetes: at its first sync)
        self.ports = started.ports
        tls, client_ca = started.tls
        log.info(
            started.message,
            pool=self.datastore.pool.name if self.datastore.pool else None,
            endpoints=len(self.datastore.endpoints),
            ext_proc_port=self.ports.ext_proc,
            health_port=self.ports.health,
            metrics_port=self.ports.metrics,
            workers=self.settings.server.workers,
            tls=tls is not None,
            client_auth=client_ca is not None,
            metrics_auth=self.settings.server.metrics_endpoint.auth.value,
            metrics_tls=parts.metrics_port.access.tls is not None,
        )
        return self.ports

    async def stop(self, drain_timeout: float | None = None) -> None:
        """Drain: report NOT_SERVING, stop accepting, let open streams finish, then exit."""
        grace = self.settings.server.drain_timeout if drain_timeout is None else drain_timeout
        parts = self._parts
        self._draining = True
        await self.health.set_ready(False)
        await parts.feed.release()  # a standby may lead while this replica drains
        log.info("draining", grace_seconds=grace)
        # ext_proc refuses new streams and lets open ones finish (in every worker, with
        # workers); the health port keeps answering NOT_SERVING until then, so probes and
        # Envoy see the drain, not a refusal.
        await parts.ext_proc.drain(grace)
        await self._role.drain(grace)
        await parts.health_port.stop()
        if parts.routing is not None:
            parts.routing.close()  # whatever still waits in flow control gets its 503 now
        await self._tasks.cancel()
        await parts.feed.close()
        await parts.metrics_port.stop()
        log.info("stopped")

    def request_stop(self) -> None:
        self._stopping.set()

    async def wait_stopped(self) -> None:
        await self._stopping.wait()

    def kill_workers(self) -> None:
        """SIGKILL the worker processes, if this app has any (before ``os._exit``)."""
        self._role.kill()

    def ready(self) -> bool:
        """Readiness, as the gRPC health service reports it (``/readyz``, the status page)."""
        return self.health.ready

    def note(self) -> str | None:
        """Why a ready EPP serves an older state, if it does (``/healthz``, the status page)."""
        return self._parts.feed.note()

    # What tests and a worker read of the parts.

    @property
    def director(self) -> Director | None:
        routing = self._parts.routing
        return routing.director if routing is not None else None

    @property
    def flow(self) -> FlowController[RoutingDecision] | None:
        """Flow control, with the flowControl gate in a process that routes."""
        routing = self._parts.routing
        return routing.flow if routing is not None else None

    @property
    def outliers(self) -> OutlierDetector | None:
        """Outlier ejection, when on, in a process that routes (each worker judges its own)."""
        routing = self._parts.routing
        return routing.outliers if routing is not None else None

    @property
    def inflight(self) -> InFlight:
        """The EPP's own in-flight count, once a process that routes started."""
        routing = self._parts.routing
        if routing is None:
            raise AttributeError("inflight: this app routes nothing, or has not started")
        return routing.inflight

    @property
    def task_names(self) -> list[str]:
        """The background loops this app runs, by name."""
        return self._tasks.names

    @property
    def streams_accepted(self) -> int:
        """ext_proc streams this process let in since it started serving."""
        return self._parts.ext_proc.streams_accepted

    @property
    def kubernetes(self) -> KubernetesSource | None:
        """The Kubernetes source, when it feeds the pool (tests wait on its first sync)."""
        return self._parts.feed.kubernetes

    @property
    def elector(self) -> LeaderElector | None:
        """The Lease holder-or-candidate, with --ha-enable-leader-election (tests)."""
        return self._parts.feed.elector

    @property
    def _ext_server(self) -> ExtProcServer | None:  # tests read the server's connections
        return self._parts.ext_proc.server

    @property
    def _scraper(self) -> ScrapeManager | None:  # tests read its turn gate
        return self._parts.feed.scraper

    def _pool_stats(self) -> PoolStats | None:
        pool = self.datastore.pool
        if pool is None:
            return None
        states = self.datastore.endpoint_states()
        count = len(states) or 1
        return PoolStats(
            name=pool.name,
            average_kv_cache_utilization=sum(s.metrics.kv_cache_usage for s in states) / count,
            average_queue_size=sum(s.metrics.waiting_queue_size for s in states) / count,
            ready_pods=len({s.endpoint.pod_name for s in states}),
        )
