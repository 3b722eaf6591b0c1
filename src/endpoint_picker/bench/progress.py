"""A run's progress on stderr: an animated bar on a terminal, a plain line now and then elsewhere.

tqdm redraws its bar with a carriage return up to ten times a second. A terminal overwrites
each redraw; a pipe, a file or a CI log keeps them all (thousands of updates for one run). So
the bar animates only when the stream is a terminal (``isatty``); anywhere else a line such as
``epp: 1200/4000 requests (30%), 31 s`` is written at most every ``LINE_INTERVAL`` seconds,
and once at the end.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Protocol, TextIO

from tqdm import tqdm

LINE_INTERVAL = 30.0  # seconds between two lines when stderr is not a terminal


class Progress(Protocol):
    """What the client reports to: one call per finished request."""

    def update(self, n: int = 1) -> object: ...


class _Silent:
    def update(self, n: int = 1) -> None:
        pass


class LineProgress:
    """Progress as whole lines, at most one every ``interval`` seconds, and one at the end."""

    def __init__(
        self,
        label: str,
        total: int,
        stream: TextIO,
        interval: float = LINE_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self.total = total
        self.stream = stream
        self.interval = interval
        self.clock = clock
        self.done = 0
        self.start = self.last = clock()

    def update(self, n: int = 1) -> None:
        self.done += n
        now = self.clock()
        if now - self.last >= self.interval:
            self.last = now
            self._line(now)

    def close(self) -> None:
        self._line(self.clock())

    def _line(self, now: float) -> None:
        share = f" ({100 * self.done // self.total}%)" if self.total else ""
        elapsed = now - self.start
        print(
            f"{self.label}: {self.done}/{self.total} requests{share}, {elapsed:.0f} s",
            file=self.stream,
            flush=True,
        )


@contextlib.contextmanager
def report_progress(
    label: str,
    total: int,
    *,
    enabled: bool = True,
    stream: TextIO | None = None,
    interval: float = LINE_INTERVAL,
) -> Iterator[Progress]:
    """Report ``total`` steps named ``label`` to ``stream`` (default: stderr at call time)."""
    out = sys.stderr if stream is None else stream
    if not enabled:
        yield _Silent()
    elif out.isatty():
        with tqdm(total=total, desc=label, unit="req", file=out) as bar:
            yield bar
    else:
        lines = LineProgress(label, total, out, interval)
        try:
            yield lines
        finally:
            lines.close()
