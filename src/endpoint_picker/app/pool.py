"""What feeds a process's datastore: its source and the scrapers of its endpoints, or, in a
worker, its parent (which sends both over the worker's channel)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from endpoint_picker.app.sources import Source, build_source
from endpoint_picker.datastore import Datastore
from endpoint_picker.extproc.server import HealthState
from endpoint_picker.metrics.scraper import ScrapeManager
from endpoint_picker.settings import Settings
from endpoint_picker.telemetry.metrics import EppMetrics
from endpoint_picker.telemetry.tasks import NamedTask

if TYPE_CHECKING:
    from endpoint_picker.datastore.sources.kubernetes import (
        KubernetesAccessReviewer,
        KubernetesSource,
        LeaderElector,
    )


class Feed(Source, Protocol):
    """The root's view of what feeds its datastore: a source (the pool file or Kubernetes; in a
    worker, its parent) and the scraping of the endpoints that source brings."""

    @property
    def scraper(self) -> ScrapeManager | None: ...

    async def start(self) -> None:
        """Start scraping what was loaded (and what comes later)."""

    def refresh_interval(self) -> float:
        """Seconds between two scrapes of one endpoint now (the status page)."""


class PoolFeed:
    """One EPP's or a workers' parent's: the pool file or Kubernetes, and the scrapers."""

    def __init__(
        self,
        settings: Settings,
        datastore: Datastore,
        metrics: EppMetrics,
        health: HealthState,
        clock: Callable[[], float],
        *,
        sliced: bool,  # a pick shares this loop: scraping yields to it (one EPP, not a parent)
        draining: Callable[[], bool],
    ) -> None:
        self._datastore = datastore
        self._source: Source = build_source(settings, datastore, metrics, health, draining)
        scraper = ScrapeManager(
            settings.scrape,
            datastore.update_metrics,
            clock=clock,
            cpu_budget=settings.scrape.cpu_budget,
            on_unreachable=datastore.mark_unreachable,
            sliced=sliced,
        )
        self.scraper: ScrapeManager | None = scraper
        self._scraper = scraper
        metrics.track_scraping(
            lambda: scraper.interval, lambda: scraper.cpu_share, lambda: scraper.gate.deferred
        )

    @property
    def kubernetes(self) -> KubernetesSource | None:
        return self._source.kubernetes

    @property
    def elector(self) -> LeaderElector | None:
        return self._source.elector

    @property
    def reviewer(self) -> KubernetesAccessReviewer | None:
        return self._source.reviewer

    def load(self) -> None:
        self._datastore.on_endpoints_changed(self._scraper.set_endpoints)
        self._source.load()

    async def start(self) -> None:
        await self._scraper.start()
        self._scraper.set_endpoints(self._datastore.endpoints)

    def tasks(self) -> list[NamedTask]:
        return self._source.tasks()

    async def serving(self) -> None:
        await self._source.serving()

    def refresh_interval(self) -> float:
        return self._scraper.interval

    def note(self) -> str | None:
        return self._source.note()

    async def release(self) -> None:
        await self._source.release()

    async def close(self) -> None:
        await self._source.close()
        await self._scraper.stop()


class FedByParent:
    """A worker's: its parent reads the pool and scrapes, and sends both (``workers.child``)."""

    scraper = None
    kubernetes = None
    elector = None
    reviewer = None

    def __init__(self, settings: Settings) -> None:
        self._interval = settings.scrape.refresh_interval

    def load(self) -> None:
        pass

    async def start(self) -> None:
        pass

    def tasks(self) -> list[NamedTask]:
        return []

    async def serving(self) -> None:
        pass  # the worker says it (``workers.child``): its parent's readiness and its pool

    def refresh_interval(self) -> float:
        return self._interval  # not served (the parent's status page is), but say the setting

    def note(self) -> str | None:
        return None

    async def release(self) -> None:
        pass

    async def close(self) -> None:
        pass
