"""Keep scraping within a CPU budget: measure what each scrape costs, stretch the interval.

One scrape (HTTP round trip on a kept-alive connection, then the parse) costs a roughly fixed
amount of CPU, ``c`` seconds. ``n`` endpoints scraped every ``interval`` use ``n * c / interval``
of a core, so to stay within ``cpu_budget`` (a fraction of one core) the interval must be at least
``n * c / cpu_budget``. ``ScrapeBudget`` keeps ``c`` as an exponentially weighted moving average of
measured costs and returns::

    interval(n) = clamp(n * c / cpu_budget, refresh_interval, max_interval)

``max_interval`` wins over the budget: past it snapshots would age towards staleness, which
costs the scheduler more than the extra CPU. A ``cpu_budget`` of 0 disables stretching.

A scrape's cost is measured by ``Metered``: it drives the scrape coroutine step by step and adds
up the thread CPU time (``time.thread_time``, immune to preemption) of each step, the code
between two awaits: with ``HttpClient`` that is sending the request (the send system call
included) and the parse. The rest of a scrape runs outside those steps and is not seen: the
event loop's selector wake-ups and timers, the ``recv`` of the page and the protocol callback
feeding httptools. How much that is depends on the rate: at a few hundred scrapes a second
every scrape has a wake-up of its own and the meter sees about half the process CPU
(``benchmarks/bench_metrics.py``); at the thousands a second where the budget binds (hundreds of
endpoints), wake-ups serve several scrapes and the meter sees 70-110% of it
(``benchmarks/bench_scrape_budget.py``). Each sample is multiplied by ``UNSEEN_OVERHEAD`` (1.2),
calibrated where the budget binds: with 256 and 1,024 endpoints the estimate came out at
0.93-1.49x the measured cost per scrape and scraping used 42-49% of a core under the default
budget of 50%. The scraper meters one scrape in 16 (reading the thread's CPU clock is a system
call, several a scrape), so the average remembers about 200 samples (``smoothing`` 0.005).
"""

from __future__ import annotations

from collections.abc import Coroutine, Generator
from time import thread_time
from typing import Any, Generic, TypeVar

T = TypeVar("T")

# The meter sees the scrape coroutine's steps: 70-110% of the process CPU a scrape really costs
# at the rates where the budget binds (benchmarks/bench_scrape_budget.py, 256 and 1,024
# endpoints); 1.2 errs towards scraping less.
UNSEEN_OVERHEAD = 1.2


class ScrapeBudget:
    """The scrape interval for ``n`` endpoints, from measured per-scrape CPU costs."""

    def __init__(
        self,
        refresh_interval: float,
        cpu_budget: float,
        max_interval: float,
        *,
        smoothing: float = 0.005,
        overhead: float = UNSEEN_OVERHEAD,
    ) -> None:
        self.refresh_interval = refresh_interval
        self.cpu_budget = cpu_budget
        self.max_interval = max(max_interval, refresh_interval)
        self._smoothing = smoothing  # weight of each new sample: ~1/smoothing samples remembered
        self._overhead = overhead
        self.cost_per_scrape = 0.0  # seconds of CPU, EWMA; 0 until the first sample
        self.samples = 0

    def record(self, cpu_seconds: float) -> None:
        """Fold one scrape's metered CPU seconds (times the unseen overhead) into the average."""
        cpu_seconds *= self._overhead
        if self.samples == 0:
            self.cost_per_scrape = cpu_seconds
        else:
            self.cost_per_scrape += self._smoothing * (cpu_seconds - self.cost_per_scrape)
        self.samples += 1

    def interval(self, endpoints: int) -> float:
        """Seconds between two scrapes of one endpoint when ``endpoints`` are followed."""
        if self.cpu_budget <= 0:
            return self.refresh_interval
        needed = endpoints * self.cost_per_scrape / self.cpu_budget
        return min(max(needed, self.refresh_interval), self.max_interval)

    def cpu_share(self, endpoints: int) -> float:
        """The estimated fraction of one core scraping uses at ``interval(endpoints)``."""
        return endpoints * self.cost_per_scrape / self.interval(endpoints)


class Metered(Generic[T]):
    """Await a coroutine while adding up the time spent running its steps (``.cpu``)."""

    __slots__ = ("_coro", "cpu")

    def __init__(self, coro: Coroutine[Any, Any, T]) -> None:
        self._coro = coro
        self.cpu = 0.0

    def __await__(self) -> Generator[Any, Any, T]:
        coro = self._coro
        value: Any = None
        error: BaseException | None = None
        while True:
            started = thread_time()
            try:
                yielded = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]  # the coroutine's T
            finally:
                self.cpu += thread_time() - started
            # Hand the awaited future to the task as ``yield from`` would, and pass back what
            # the task sends or throws (results, CancelledError) on resumption.
            try:
                value, error = (yield yielded), None
            except BaseException as exc:
                value, error = None, exc
