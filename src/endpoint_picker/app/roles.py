"""The three roles an ``App`` takes, each a small builder whose ``start`` returns its ports and
its named background tasks (the root spawns them guarded; ``endpoint_picker.roles`` defines the
two roles of ``--workers N``):

- ``Single``: one EPP reads the pool, scrapes, routes, and serves all three ports;
- ``Parent``: a workers' parent reads the pool, scrapes, and serves health and metrics for all
  its workers, which route (``Routers``);
- ``Worker``: a worker routes only; its parent feeds its datastore.

Each builder starts its parts in the order that matters: TLS material and the configs first (a
bad file fails the start before anything runs or logs), then the pool, then the ports.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from endpoint_picker.app.grpc_ports import ExtProcPort, HealthPort, Tls, load_tls
from endpoint_picker.app.metrics_port import MetricsPort, build_access
from endpoint_picker.app.pool import FedByParent, Feed, PoolFeed
from endpoint_picker.app.routing import Routing, build_routing, scheduling_config
from endpoint_picker.datastore import Datastore
from endpoint_picker.extproc.server import HealthState
from endpoint_picker.roles import Routers, WorkerRole
from endpoint_picker.scheduling.lifecycle import InFlight
from endpoint_picker.settings import Settings
from endpoint_picker.status import DecisionLog
from endpoint_picker.status.view import Health, InFlightCounts, RecentDecisions, StatusView
from endpoint_picker.telemetry.metrics import EppMetrics
from endpoint_picker.telemetry.tasks import NamedTask


@dataclass(frozen=True, slots=True)
class BoundPorts:
    ext_proc: int
    health: int
    metrics: int


@dataclass(eq=False)
class Parts:
    """Everything one process may run, built by the root. A role starts some of them; the
    root stops them all, each a no-op where it never started."""

    settings: Settings
    clock: Callable[[], float]
    rng: random.Random
    datastore: Datastore
    metrics: EppMetrics
    health: HealthState
    decisions: DecisionLog  # the status page's recent decisions and refusals
    status: Health  # readiness and its note, as the status page shows them (the app)
    feed: Feed
    ext_proc: ExtProcPort
    health_port: HealthPort
    metrics_port: MetricsPort
    routing: Routing | None = None  # once built, in a process that routes


@dataclass(frozen=True, slots=True)
class Started:
    """A role, serving: its ports and the background loops the root is to run."""

    ports: BoundPorts
    tasks: list[NamedTask]
    tls: Tls
    message: str = "endpoint picker serving"


class Role(Protocol):
    """How one process serves: which feed its datastore has, which parts it starts, and what
    it drains beside them."""

    def feed(self, parts: FeedParts) -> Feed: ...

    async def start(self, parts: Parts) -> Started: ...

    async def drain(self, grace: float) -> None:
        """After its ext_proc port drained: what else still routes (a parent's workers)."""

    def kill(self) -> None:
        """SIGKILL the worker processes, if this role has any."""


@dataclass(frozen=True, slots=True)
class FeedParts:
    """What a role's feed is built from (before ``Parts``, which holds it)."""

    settings: Settings
    datastore: Datastore
    metrics: EppMetrics
    health: HealthState
    clock: Callable[[], float]
    draining: Callable[[], bool]  # never ready again once the drain began


@dataclass(frozen=True, slots=True)
class Single:
    """One EPP: it reads the pool, scrapes, routes, and serves all three ports."""

    before_listen: Callable[[], None] | None = None  # the pool is in; ext_proc not listening

    def feed(self, parts: FeedParts) -> Feed:
        return _pool_feed(parts, sliced=True)  # a pick shares this loop: scraping yields

    async def start(self, parts: Parts) -> Started:
        settings = parts.settings
        tls = load_tls(settings.server)
        _authorize_metrics(parts)
        routing = _build_routing(parts, None)
        await _load_pool(parts)
        if self.before_listen is not None:
            self.before_listen()
        ext_proc_port = await _start_ext_proc(parts, routing, tls, reuse_port=False)
        health_port = await parts.health_port.start(parts.health, settings.server)
        view = _status_view(parts, routing.inflight, parts.decisions, routing)
        metrics_port = await parts.metrics_port.start(settings.server, view, parts.metrics.render)
        tasks = [*parts.metrics_port.tasks(), *routing.tasks(), *parts.feed.tasks()]
        return Started(BoundPorts(ext_proc_port, health_port, metrics_port), tasks, tls)

    async def drain(self, grace: float) -> None:
        pass

    def kill(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class Parent:
    """A workers' parent: it reads the pool, scrapes, and serves health and metrics for all
    its workers, which route."""

    routers: Routers

    def feed(self, parts: FeedParts) -> Feed:
        return _pool_feed(parts, sliced=False)  # it routes nothing: no pick to let by

    async def start(self, parts: Parts) -> Started:
        settings, routers = parts.settings, self.routers
        tls = load_tls(settings.server)
        _authorize_metrics(parts)
        scheduling_config(settings)  # a bad config fails here, before any worker starts
        await _load_pool(parts)
        ext_proc_port = await routers.start(*tls)
        health_port = await parts.health_port.start(parts.health, settings.server)
        view = _status_view(parts, routers.inflight, routers.decisions, None)
        own = parts.metrics.render

        def render() -> bytes:  # one view: the parent's families with the workers' summed in
            return routers.render(own())

        metrics_port = await parts.metrics_port.start(
            settings.server, view, render, routers.refresh
        )
        tasks = [*parts.metrics_port.tasks(), *parts.feed.tasks()]
        return Started(BoundPorts(ext_proc_port, health_port, metrics_port), tasks, tls)

    async def drain(self, grace: float) -> None:
        await self.routers.drain(grace)  # closes what construction opened, started or not

    def kill(self) -> None:
        self.routers.kill()


@dataclass(frozen=True, slots=True)
class Worker:
    """A worker: it routes only; its parent feeds its datastore and serves health and metrics."""

    role: WorkerRole
    before_listen: Callable[[], None] | None = None

    def feed(self, parts: FeedParts) -> Feed:
        return FedByParent(parts.settings)

    async def start(self, parts: Parts) -> Started:
        worker = self.role
        tls = (worker.tls, worker.client_ca)  # the parent's: one certificate for all
        routing = _build_routing(parts, worker.inflight)
        await parts.health.start()
        if worker.before_listen is not None:  # the parent's pool and snapshots, applied
            await worker.before_listen()
        if self.before_listen is not None:
            self.before_listen()
        ext_proc_port = await _start_ext_proc(parts, routing, tls, reuse_port=True)
        return Started(BoundPorts(ext_proc_port, 0, 0), routing.tasks(), tls, "worker serving")

    async def drain(self, grace: float) -> None:
        pass

    def kill(self) -> None:
        pass


def _pool_feed(parts: FeedParts, *, sliced: bool) -> Feed:
    return PoolFeed(
        parts.settings,
        parts.datastore,
        parts.metrics,
        parts.health,
        parts.clock,
        sliced=sliced,
        draining=parts.draining,
    )


def _authorize_metrics(parts: Parts) -> None:
    reviewer = parts.feed.reviewer
    review = reviewer.review if reviewer is not None else None
    endpoint = parts.settings.server.metrics_endpoint
    parts.metrics_port.access = build_access(endpoint, review, parts.clock)


def _build_routing(parts: Parts, inflight: InFlight | None) -> Routing:
    parts.routing = build_routing(
        parts.settings,
        parts.datastore,
        parts.metrics,
        parts.decisions,
        clock=parts.clock,
        rng=parts.rng,
        inflight=inflight,
    )
    return parts.routing


async def _load_pool(parts: Parts) -> None:
    parts.feed.load()
    await parts.health.start()
    await parts.feed.start()


async def _start_ext_proc(parts: Parts, routing: Routing, tls: Tls, *, reuse_port: bool) -> int:
    return await parts.ext_proc.start(
        parts.settings.server,
        routing.director,
        parts.metrics,
        parts.decisions,
        parts.health,
        parts.clock,
        tls,
        reuse_port=reuse_port,
    )


def _status_view(
    parts: Parts,
    inflight: InFlightCounts,
    decisions: RecentDecisions,
    routing: Routing | None,  # None in a workers' parent: each worker has its own
) -> StatusView:
    scrape = parts.settings.scrape
    return StatusView(
        parts.datastore,
        inflight=inflight,
        decisions=decisions,
        health=parts.status,
        staleness_threshold=scrape.staleness_threshold,
        engine_label=scrape.engine_label,
        flow=routing.flow if routing is not None else None,
        outliers=routing.outliers if routing is not None else None,
        predictor=routing.components.latency_predictor if routing is not None else None,
        kv_events=routing.components.kv_events if routing is not None else None,
        refresh_interval=parts.feed.refresh_interval,
        clock=parts.clock,
    )
