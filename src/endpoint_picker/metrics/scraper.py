"""Scrape every endpoint's ``/metrics``: one guarded asyncio task per endpoint.

Each task fetches ``http://<hostport>/metrics`` over one shared, kept-alive aiohttp session, parses
it with ``parse_metrics`` and hands the new immutable snapshot to ``on_snapshot``. A failed scrape
(refused, timed out, non-200, a page without the required metrics) hands over nothing, so the
endpoint keeps its last snapshot and ages into staleness; the scheduler judges that. Failures are
logged once when they start, then at most every ``_LOG_EVERY`` seconds, and once on recovery.

Tasks are spread over the interval (a random first delay) and run at a fixed rate; the interval
is stretched by ``ScrapeBudget`` when the measured cost of scraping every endpoint at
``refresh_interval`` would exceed ``cpu_budget`` of one core.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from time import thread_time

import aiohttp
import structlog

from endpoint_picker.errors import EppError
from endpoint_picker.metrics.budget import Metered, ScrapeBudget
from endpoint_picker.metrics.engines import EngineMetricNames, engine_names
from endpoint_picker.metrics.parser import parse_metrics
from endpoint_picker.settings import ScrapeSettings
from endpoint_picker.types import Endpoint, MetricsSnapshot

METRICS_PATH = "/metrics"
DEFAULT_CPU_BUDGET = 0.5  # a fraction of one core
_LOG_EVERY = 30.0  # seconds between two reports of one endpoint's ongoing failure
_MAX_BODY = 16 * 1024 * 1024  # a /metrics page bigger than this is not a model server's
# Ask for plain text: gunzipping tens of KB 20 times a second costs more CPU than it saves.
_HEADERS = {"Accept": "text/plain", "Accept-Encoding": "identity"}

OnSnapshot = Callable[[Endpoint, MetricsSnapshot], None]


class ScrapeError(EppError):
    """One scrape got no usable page (status, size); network errors stay aiohttp's own."""


@dataclass(slots=True)
class _Target:
    """The scrape state of one endpoint, owned by its task."""

    endpoint: Endpoint
    names: EngineMetricNames
    url: str
    task: asyncio.Task[None] | None = None
    failures: int = 0  # consecutive
    failures_since_log: int = 0
    last_logged: float = field(default=float("-inf"))


class ScrapeManager:
    """Owns the scrape tasks of the current endpoints and the HTTP session they share."""

    def __init__(
        self,
        settings: ScrapeSettings,
        on_snapshot: OnSnapshot,
        *,
        clock: Callable[[], float] = time.monotonic,
        cpu_budget: float = DEFAULT_CPU_BUDGET,
    ) -> None:
        self._settings = settings
        self._on_snapshot = on_snapshot
        self._clock = clock
        # Per instance, so that a manager logs through the configuration current at its birth.
        self._log = structlog.get_logger(__name__)
        self._engines = engine_names(settings)
        self._unknown_engines: set[str] = set()
        stale = settings.staleness_threshold
        self.budget = ScrapeBudget(
            settings.refresh_interval,
            cpu_budget,
            # Stretching stops well short of staleness: a missed scrape must not make it stale.
            max_interval=stale / 4 if stale > 0 else 1.0,
        )
        self._wanted: dict[str, Endpoint] = {}
        self._targets: dict[str, _Target] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None

    @property
    def interval(self) -> float:
        """The current seconds between two scrapes of one endpoint."""
        return self.budget.interval(len(self._targets))

    def endpoints(self) -> list[str]:
        """The hostports being scraped."""
        return list(self._targets)

    async def start(self) -> None:
        """Open the shared session and start scraping the endpoints set so far."""
        if self._session is not None:
            return
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            cookie_jar=aiohttp.DummyCookieJar(),
            read_bufsize=1 << 18,  # a whole page in few reads
            timeout=aiohttp.ClientTimeout(total=self._settings.timeout),
            headers=_HEADERS,
            raise_for_status=False,
        )
        self._reconcile()

    async def stop(self) -> None:
        """Cancel every task, wait for them all, close the session."""
        for target in self._targets.values():
            self._retire(target)
        self._targets.clear()
        tasks = list(self._retiring)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """Follow exactly ``endpoints`` (by hostport): start new tasks, cancel removed ones."""
        self._wanted = {endpoint.hostport: endpoint for endpoint in endpoints}
        if self._session is not None:
            self._reconcile()

    def _reconcile(self) -> None:
        for hostport, target in list(self._targets.items()):
            # A changed endpoint (new labels, so maybe another engine) gets a fresh task.
            if self._wanted.get(hostport) != target.endpoint:
                self._retire(target)
                del self._targets[hostport]
        for hostport, endpoint in self._wanted.items():
            if hostport not in self._targets:
                target = _Target(endpoint, self._names_for(endpoint), _url(endpoint))
                target.task = asyncio.get_running_loop().create_task(
                    self._run(target), name=f"scrape {hostport}"
                )
                self._targets[hostport] = target

    def _retire(self, target: _Target) -> None:
        task = target.task
        if task is not None and not task.done():
            task.cancel()
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    def _names_for(self, endpoint: Endpoint) -> EngineMetricNames:
        default = self._settings.default_engine
        engine = endpoint.label(self._settings.engine_label) or default
        names = self._engines.get(engine)
        if names is None:
            if engine not in self._unknown_engines:
                self._unknown_engines.add(engine)
                self._log.warning(
                    "unknown engine type, scraping with the default engine's names",
                    engine=engine,
                    default=default,
                    label=self._settings.engine_label,
                    endpoint=endpoint.hostport,
                )
            names = self._engines[default]
        return names

    async def _run(self, target: _Target) -> None:
        """Scrape one endpoint until cancelled; nothing but cancellation ends the loop."""
        loop = asyncio.get_running_loop()
        await asyncio.sleep(random.uniform(0, self.interval))  # spreads load only
        while True:
            started = loop.time()
            await self._scrape_once(target)
            await asyncio.sleep(max(0.0, started + self.interval - loop.time()))

    async def _scrape_once(self, target: _Target) -> None:
        metered = Metered(self._fetch(target.url))
        try:
            body = await metered
            parse_started = thread_time()
            snapshot = parse_metrics(body, target.names, self._clock())
            self.budget.record(metered.cpu + thread_time() - parse_started)
        except (aiohttp.ClientError, TimeoutError, EppError) as exc:
            self.budget.record(metered.cpu)
            self._failed(target, exc)
            return
        except Exception as exc:  # a bug: keep scraping, say so
            self._failed(target, exc, unexpected=True)
            return
        try:
            self._on_snapshot(target.endpoint, snapshot)
        except Exception as exc:
            self._failed(target, exc, unexpected=True)
            return
        if target.failures:
            self._log.info(
                "scrape recovered", endpoint=target.endpoint.hostport, failures=target.failures
            )
            target.failures = target.failures_since_log = 0
            target.last_logged = float("-inf")

    async def _fetch(self, url: str) -> bytes:
        session = self._session
        if session is None:
            raise ScrapeError("scrape manager is stopped")
        async with session.get(url, allow_redirects=False) as response:
            if response.status != 200:
                raise ScrapeError(f"HTTP {response.status}")
            if (response.content_length or 0) > _MAX_BODY:
                raise ScrapeError(f"page too large ({response.content_length} bytes)")
            return await response.read()

    def _failed(self, target: _Target, exc: Exception, *, unexpected: bool = False) -> None:
        """Count a failure; log it if it starts a run of failures or the last log is old."""
        target.failures += 1
        target.failures_since_log += 1
        now = self._clock()
        if now - target.last_logged < _LOG_EVERY:
            return
        self._log.warning(
            "scrape failed" if target.failures == 1 else "scrape still failing",
            endpoint=target.endpoint.hostport,
            pod=target.endpoint.pod_name,
            error=str(exc) or type(exc).__name__,
            error_type=type(exc).__name__,
            failures=target.failures,
            since_last_log=target.failures_since_log,
            exc_info=exc if unexpected else None,
        )
        target.failures_since_log = 0
        target.last_logged = now


def _url(endpoint: Endpoint) -> str:
    return f"http://{endpoint.hostport}{METRICS_PATH}"
