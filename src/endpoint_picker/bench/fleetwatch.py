"""Watches the model servers during a run: where the requests went, cache hits, queues, clocks.

``start()`` scrapes every server once (the baseline; with a warm-up, the baseline is taken
again when the warm-up ends), then every ``interval`` seconds records the queue, running and
KV gauges; ``stop()`` scrapes once more and returns the counters' deltas
(requests served, prefix-cache queries and hits, the simulator's clock keeping) with the gauges
over time. Counters are read from the servers rather than inferred from the client because the
router under test decides the placement, and only the servers know it.

The pages are parsed by a small line filter, not a full Prometheus parser: a vLLM page is mostly
histogram buckets, and this runs on the two cores the fleet and the router share. Series of one
family with different labels (data-parallel engines, ``finished_reason``) are summed; KV usage
is averaged.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Sequence
from urllib.parse import urlsplit

import aiohttp
import structlog

from endpoint_picker.bench.model import FleetObservation, ServerObservation, ServerSample

log = structlog.get_logger(__name__)

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
SUCCESS = "vllm:request_success_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
STEP_PLANNED = "sim:step_planned_seconds_total"
STEP_LATE = "sim:step_late_seconds_total"
STEP_BEHIND = "sim:step_behind_seconds_total"
ORACLE_HITS = "sim:prefix_cache_oracle_hits_total"
_COUNTERS = (SUCCESS, PREFIX_QUERIES, PREFIX_HITS, STEP_PLANNED, STEP_LATE, STEP_BEHIND,
             ORACLE_HITS)  # fmt: skip
_WANTED = frozenset((WAITING, RUNNING, KV_USAGE, *_COUNTERS))
_PREFIXES = ("vllm:num_requests_", "vllm:kv_cache_usage_perc", "vllm:request_success_total",
             "vllm:prefix_cache_", "sim:step_", "sim:prefix_cache_")  # fmt: skip

Page = dict[str, list[float]]  # family name -> the values of its series


def parse_page(text: str) -> Page:
    """The wanted families' sample values out of Prometheus text; other lines are skipped.

    A sample line is ``name{labels} value [timestamp]``; label values may hold spaces and braces,
    so the value is read after the last ``}``. Non-finite values are dropped.
    """
    page: Page = {}
    for line in text.splitlines():
        if not line.startswith(_PREFIXES):  # also skips # HELP / # TYPE
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name, rest = line[:brace], line[line.rfind("}") + 1 :]
        else:
            name, rest = line[:space], line[space:]
        if name not in _WANTED:
            continue
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if math.isfinite(value):
            page.setdefault(name, []).append(value)
    return page


class FleetWatch:
    """Scrapes ``server_urls`` (``http://host:port``) around and during one run."""

    def __init__(
        self,
        server_urls: Sequence[str],
        interval: float = 0.5,
        timeout: float = 2.0,
        warmup: float = 0.0,
    ) -> None:
        self._urls = [url.rstrip("/") for url in server_urls]
        self._names = [urlsplit(url).netloc for url in self._urls]
        self._interval = interval
        self._warmup = warmup  # seconds after start() when the counters' baseline is retaken
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._baseline: list[Page | None] = [None] * len(self._urls)
        self._latest: list[Page | None] = [None] * len(self._urls)
        self._samples: list[list[ServerSample]] = [[] for _ in self._urls]
        self._failed: set[int] = set()  # servers whose scrape failure was already logged
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._rebase: asyncio.Task[None] | None = None
        self._start = 0.0

    async def start(self) -> None:
        """Take the baseline and start sampling every ``interval``."""
        loop = asyncio.get_running_loop()
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self._start = loop.time()
        self._baseline = await self._scrape_all()
        self._latest = list(self._baseline)
        self._task = asyncio.create_task(self._run(), name="bench-fleetwatch")
        if self._warmup > 0:
            self._rebase = asyncio.create_task(self._rebase_after_warmup(), name="bench-warmup")

    async def stop(self) -> FleetObservation:
        """Stop sampling, scrape once more, and return what the fleet did since ``start``."""
        try:
            for task in (self._task, self._rebase):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task  # re-raises a bug in the sampling loop
            await self._scrape_all()
        finally:
            if self._session is not None:
                await self._session.close()
        return FleetObservation(tuple(self._observe(i) for i in range(len(self._urls))))

    async def _rebase_after_warmup(self) -> None:
        """Retake the baseline when the warm-up ends: the counters then cover the measured part.

        Prefix-cache queries and hits are counted when a request is admitted, so they cover the
        requests sent after the warm-up; a warm-up request finishing later still counts as served.
        """
        await asyncio.sleep(self._warmup)
        baseline = await self._scrape_all()
        # A server that did not answer keeps its first baseline rather than losing its counters.
        self._baseline = [
            b if b is not None else a for a, b in zip(self._baseline, baseline, strict=True)
        ]

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        tick = loop.time()
        while True:
            # Fixed cadence; ticks missed while a slow scrape ran are skipped, not bunched.
            tick += self._interval * max(1, math.ceil((loop.time() - tick) / self._interval))
            await asyncio.sleep(tick - loop.time())
            await self._scrape_all()

    async def _scrape_all(self) -> list[Page | None]:
        return await asyncio.gather(*(self._scrape(i) for i in range(len(self._urls))))

    async def _scrape(self, i: int) -> Page | None:
        assert self._session is not None
        loop = asyncio.get_running_loop()
        try:
            async with self._session.get(
                self._urls[i] + "/metrics", timeout=self._timeout
            ) as response:
                response.raise_for_status()
                text = await response.text()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            if i not in self._failed:
                self._failed.add(i)
                log.warning("bench scrape failed", server=self._names[i], error=repr(exc))
            return None
        page = parse_page(text)
        self._latest[i] = page
        self._samples[i].append(
            ServerSample(
                t=loop.time() - self._start,
                waiting=sum(page.get(WAITING, ())),
                running=sum(page.get(RUNNING, ())),
                kv_usage=_mean(page.get(KV_USAGE, ())),
            )
        )
        return page

    def _observe(self, i: int) -> ServerObservation:
        before, after = self._baseline[i] or {}, self._latest[i] or {}

        def delta(name: str) -> float | None:
            if name not in after:
                return None
            # A counter that went down means the server restarted: count from zero then.
            end, start = sum(after[name]), sum(before.get(name, ()))
            return end - start if end >= start else end

        return ServerObservation(
            name=self._names[i],
            requests=round(delta(SUCCESS) or 0.0),
            prefix_cache_queries=delta(PREFIX_QUERIES) or 0.0,
            prefix_cache_hits=delta(PREFIX_HITS) or 0.0,
            samples=tuple(self._samples[i]),
            step_planned_seconds=delta(STEP_PLANNED),
            step_late_seconds=delta(STEP_LATE),
            step_behind_seconds=delta(STEP_BEHIND),
            oracle_hits=delta(ORACLE_HITS),
        )


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
