"""Scrape every endpoint's ``/metrics``: one guarded asyncio task per endpoint.

Each task fetches ``http://<hostport>/metrics`` over its own kept-alive connection (``HttpClient``,
a lean HTTP/1.1 client on httptools), parses it with ``parse_metrics`` and hands the new immutable
snapshot to ``on_snapshot``. A failed scrape (refused, timed out, non-200, a page without the
required metrics) hands over nothing, so the endpoint keeps its last snapshot and ages into
staleness; the scheduler judges that. A scrape whose connection is refused or reset, or whose
host is unreachable, is more than a failure: nothing listens there any more (a killed pod), and
``on_unreachable`` is told at once so that routing stops before the metrics turn stale. A merely
slow scrape (a timeout) says nothing of the kind. Failures are logged once when they start,
then at most every ``_LOG_EVERY`` seconds, and once on recovery. A task closes its connection
when it ends.

With ``name_filter`` (the default) a scrape asks only for the metrics the engine's fields read,
``/metrics?name[]=vllm%3Anum_requests_waiting&...``: servers built on prometheus_client (vLLM,
SGLang) then render and send about 2 KB instead of about 64, which spares their API process
as much as the EPP. A server that ignores the query sends the whole page, which parses the
same. One whose filtered page lacks a required metric, or which refuses the query with a 4xx,
is asked for the whole page in the same scrape; if that one is good, the endpoint gets whole
pages from then on (logged once).

Tasks are spread over the interval (a random first delay) and run at a fixed rate; the interval
is stretched by ``ScrapeBudget`` when the measured cost of scraping every endpoint at
``refresh_interval`` would exceed ``cpu_budget`` of one core. Scrapes that come due or are
answered together pass a ``TurnGate`` before they send and before they parse: steps run until
0.3 ms has passed in an event-loop iteration, then 4 per following iteration, so that a burst
is cut into slices a pick can slip between. Where no pick shares the loop (the parent of
``--workers``, ``sliced=False``) they run as they come: slicing there only delayed the scrapes
and made the parent's frames to the workers smaller and more frequent.
"""

from __future__ import annotations

import asyncio
import errno
import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from time import thread_time
from urllib.parse import quote

import structlog

from endpoint_picker.errors import EppError
from endpoint_picker.metrics.budget import Metered, ScrapeBudget
from endpoint_picker.metrics.engines import EngineMetricNames, engine_names
from endpoint_picker.metrics.http import HttpClient, HttpStatusError, ScrapeError
from endpoint_picker.metrics.parser import Hints, MetricsParseError, parse_metrics
from endpoint_picker.metrics.turns import TurnGate
from endpoint_picker.settings import ScrapeSettings
from endpoint_picker.types import Endpoint, MetricsSnapshot

METRICS_PATH = "/metrics"
DEFAULT_CPU_BUDGET = 0.5  # a fraction of one core
_LOG_EVERY = 30.0  # seconds between two reports of one endpoint's ongoing failure
_METER_EVERY = 16  # one scrape in this many measures its CPU for the budget

OnSnapshot = Callable[[Endpoint, MetricsSnapshot], None]
OnUnreachable = Callable[[str, str], None]  # (hostport, reason)

# errno values that mean "no route to the endpoint at all" (a pod IP that is gone)
_UNREACHABLE_ERRNOS = frozenset({errno.EHOSTUNREACH, errno.ENETUNREACH})


def is_unreachable(exc: BaseException) -> bool:
    """Whether a scrape failure means nothing listens at the endpoint (not merely slow)."""
    for error in (exc, exc.__cause__):
        if isinstance(error, ConnectionError):  # refused, reset, aborted, broken pipe
            return True
        if isinstance(error, OSError) and error.errno in _UNREACHABLE_ERRNOS:
            return True
    return False


def filtered_path(names: EngineMetricNames) -> str:
    """``/metrics`` asking for only the metrics ``names`` reads (prometheus_client's
    ``name[]`` query parameter, repeated), or plain ``/metrics`` when it reads none."""
    query = "&".join(f"name%5B%5D={quote(name, safe='')}" for name in names.metric_names())
    return f"{METRICS_PATH}?{query}" if query else METRICS_PATH


def _blames_filter(exc: BaseException) -> bool:
    """Whether a failed filtered scrape may be the filter's doing: the page lacked a required
    metric (a server whose prometheus_client filters too much) or the query was refused."""
    if isinstance(exc, MetricsParseError):
        return True
    return isinstance(exc, HttpStatusError) and 400 <= exc.status < 500


__all__ = [
    "DEFAULT_CPU_BUDGET",
    "METRICS_PATH",
    "OnSnapshot",
    "OnUnreachable",
    "ScrapeError",
    "ScrapeManager",
    "filtered_path",
    "is_unreachable",
]


@dataclass(slots=True)
class _Target:
    """The scrape state of one endpoint, owned by its task."""

    endpoint: Endpoint
    names: EngineMetricNames
    client: HttpClient
    filtered: bool  # asking for the engine's metrics only (``filtered_path``)
    task: asyncio.Task[None] | None = None
    hints: Hints = field(default_factory=dict)  # where each family sat on the last page
    failures: int = 0  # consecutive
    failures_since_log: int = 0
    last_logged: float = field(default=float("-inf"))


class ScrapeManager:
    """Owns the scrape tasks of the current endpoints, each with its own kept-alive connection."""

    def __init__(
        self,
        settings: ScrapeSettings,
        on_snapshot: OnSnapshot,
        *,
        clock: Callable[[], float] = time.monotonic,
        cpu_budget: float = DEFAULT_CPU_BUDGET,
        on_unreachable: OnUnreachable | None = None,
        sliced: bool = True,
    ) -> None:
        self._settings = settings
        self._on_snapshot = on_snapshot
        self._on_unreachable = on_unreachable
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
        self._meter_in = 0  # scrapes until the next metered one (the first is)
        self.gate = TurnGate() if sliced else TurnGate(seconds=math.inf)  # admits every step
        self._started = False

    @property
    def interval(self) -> float:
        """The current seconds between two scrapes of one endpoint."""
        return self.budget.interval(len(self._targets))

    @property
    def cpu_share(self) -> float:
        """The estimated fraction of one core scraping uses now."""
        return self.budget.cpu_share(len(self._targets))

    def endpoints(self) -> list[str]:
        """The hostports being scraped."""
        return list(self._targets)

    async def start(self) -> None:
        """Start scraping the endpoints set so far (and those set later)."""
        if self._started:
            return
        self._started = True
        self._reconcile()

    async def stop(self) -> None:
        """Cancel every task, wait for them all; every connection is closed."""
        self._started = False
        targets = list(self._targets.values())
        for target in targets:
            self._retire(target)
        self._targets.clear()
        tasks = list(self._retiring)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for target in targets:  # a task cancelled before its first step never ran its finally
            target.client.close()

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """Follow exactly ``endpoints`` (by hostport): start new tasks, cancel removed ones."""
        self._wanted = {endpoint.hostport: endpoint for endpoint in endpoints}
        if self._started:
            self._reconcile()

    def _reconcile(self) -> None:
        for hostport, target in list(self._targets.items()):
            # A changed endpoint (new labels, so maybe another engine) gets a fresh task.
            if self._wanted.get(hostport) != target.endpoint:
                self._retire(target)
                del self._targets[hostport]
        for hostport, endpoint in self._wanted.items():
            if hostport not in self._targets:
                names = self._names_for(endpoint)
                path = filtered_path(names) if self._settings.name_filter else METRICS_PATH
                client = HttpClient(
                    endpoint.address, endpoint.port, path, timeout=self._settings.timeout
                )
                target = _Target(endpoint, names, client, filtered=path != METRICS_PATH)
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
        try:
            await asyncio.sleep(random.uniform(0, self.interval))  # spreads load only
            gate = self.gate
            while True:
                started = loop.time()
                if not gate.admit():
                    await gate.wait()
                await self._scrape_once(target)
                await asyncio.sleep(max(0.0, started + self.interval - loop.time()))
        finally:
            target.client.close()

    async def _scrape_once(self, target: _Target) -> None:
        try:
            try:
                snapshot = await self._fetch(target)
            except EppError as exc:
                if not (target.filtered and _blames_filter(exc)):
                    raise
                snapshot = await self._fetch_whole_page(target, exc)
        except (OSError, TimeoutError, EppError) as exc:  # refused/reset, timeout, bad page
            self._failed(target, exc)
            if self._on_unreachable is not None and is_unreachable(exc):
                self._on_unreachable(target.endpoint.hostport, f"scrape: {type(exc).__name__}")
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

    async def _fetch(self, target: _Target) -> MetricsSnapshot:
        """One GET and parse. One in ``_METER_EVERY`` records its CPU in the budget, whatever
        the outcome: reading the thread's CPU clock is a system call, several a scrape."""
        self._meter_in -= 1
        metered: Metered[bytes] | None = None
        if self._meter_in > 0:
            body = await target.client.get()
        else:
            self._meter_in = _METER_EVERY
            metered = Metered(target.client.get())
            try:
                body = await metered
            except BaseException:
                self.budget.record(metered.cpu)
                raise
        received = self._clock()  # the page's age starts now, not after a wait at the gate
        if not self.gate.admit():
            await self.gate.wait()
        if metered is None:
            return parse_metrics(body, target.names, received, target.hints)
        parse_started = thread_time()
        try:
            return parse_metrics(body, target.names, received, target.hints)
        finally:
            self.budget.record(metered.cpu + thread_time() - parse_started)

    async def _fetch_whole_page(self, target: _Target, filtered_error: EppError) -> MetricsSnapshot:
        """The filtered page failed in a way the filter may cause: try the whole page. If it
        is good, keep asking for whole pages; if not, the filter was not at fault."""
        target.client.set_path(METRICS_PATH)
        try:
            snapshot = await self._fetch(target)
        except BaseException:
            target.client.set_path(filtered_path(target.names))
            raise
        target.filtered = False
        target.hints.clear()  # the offsets of the filtered page
        self._log.info(
            "filtered metrics page unusable, scraping the whole page from now on",
            endpoint=target.endpoint.hostport,
            error=str(filtered_error),
        )
        return snapshot

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
