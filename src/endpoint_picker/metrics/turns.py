"""Scrapes that come due together are run a few per event-loop iteration, not all in one.

With a thousand endpoints the scrapes of many come due in the same millisecond (their phases
were drawn before the CPU budget stretched the interval, and responses that arrive together
are read together). asyncio runs every ready callback of an iteration before it looks at its
sockets again, so fifty scrapes ready at once (about 60 µs each: a send, or a parse and a
snapshot) hold every ext_proc message that arrives meanwhile for 3 ms; a hundred for 6. The
gate lets scrape steps run until ``seconds`` have passed in one iteration; the rest wait, in
order, and ``batch`` of them go on in each following iteration, after the loop has read its
sockets (woken steps run without looking at the clock, so while some wait an iteration runs
``batch`` steps: 0.25-0.5 ms at 60-140 µs a step). Bursts keep their batching (one wake-up for
many responses), which is what makes them cheap; they are only cut into slices a pick can slip
between. A pick takes several iterations (its headers, its body, the answer), so the slice is
short: 0.3 ms and 4 steps halved a pick's added p50 at 1,024 endpoints against 1 ms and 16
(``benchmarks/bench_pool_size.py``); 0.15 ms and 2 gained nothing more.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

DEFAULT_SECONDS = 0.0003  # scrape work one iteration may do before the rest waits
DEFAULT_BATCH = 4  # waiting scrape steps let go per iteration


class TurnGate:
    """Admits steps while the current iteration's share lasts; the rest wait their turn."""

    def __init__(
        self,
        seconds: float = DEFAULT_SECONDS,
        batch: int = DEFAULT_BATCH,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._seconds = seconds
        self._batch = batch
        self._clock = clock
        self._opened: float | None = None  # when this iteration's first step was admitted
        self._closing = False  # a ``_close`` is scheduled
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.deferred = 0  # steps that had to wait, since start (for tests and benchmarks)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def admit(self) -> bool:
        """Whether a step may run now; if not, ``await wait()`` before running it."""
        now = self._clock()
        if self._opened is None:
            if self._waiters:  # those first
                return False
            self._open(now)
            return True
        return now - self._opened < self._seconds

    async def wait(self) -> None:
        """Return in a later iteration, in order of arrival (``batch`` an iteration)."""
        self.deferred += 1
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._schedule_close()
        await waiter  # cancelled, it stays queued, done: ``_close`` skips it
        if self._opened is None:  # the woken open their iteration's share
            self._open(self._clock())

    def _open(self, now: float) -> None:
        self._opened = now
        self._schedule_close()

    def _schedule_close(self) -> None:
        if not self._closing:
            self._closing = True
            asyncio.get_running_loop().call_soon(self._close)

    def _close(self) -> None:
        """Runs in the iteration after the share opened: a new share, and the next waiters go
        on (they run in the iteration after this one, which closes in turn)."""
        self._closing = False
        self._opened = None
        woken = 0
        while self._waiters and woken < self._batch:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                woken += 1
        if self._waiters or woken:
            self._schedule_close()
