"""Progress: an animated bar only on a terminal; whole lines, now and then, in a pipe or a log."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator

import pytest
from tests.unit.bench.test_bench_client import SseServer, completion

from endpoint_picker.bench.client import run_requests
from endpoint_picker.bench.progress import LineProgress, report_progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def server() -> AsyncIterator[SseServer]:
    sse = await SseServer().start()
    yield sse
    await sse.stop()


async def test_client_progress_in_a_pipe_has_no_carriage_returns(
    server: SseServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """With stderr not a terminal, the client's progress is plain lines, never a redrawn bar."""
    specs = [completion(i, at=0.001 * i) for i in range(5)]
    await run_requests(server.url, specs, label="epp", progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err
    assert err.splitlines()[-1].startswith("epp: 5/5 requests (100%)")


def test_lines_are_written_at_most_once_per_interval_and_at_the_end() -> None:
    """4,000 updates over 100 s with a 30 s interval: three lines on the way, one at the end."""
    clock, out = Clock(), io.StringIO()
    lines = LineProgress("rr", 4000, out, interval=30.0, clock=clock)
    for i in range(1, 4001):
        clock.now = i / 40
        lines.update()
    lines.close()
    written = out.getvalue().splitlines()
    assert len(written) == 4
    assert written[0].startswith("rr: 1200/4000 requests (30%), 30 s")
    assert written[-1] == "rr: 4000/4000 requests (100%), 100 s"


def test_a_terminal_gets_the_animated_bar() -> None:
    """On a terminal the bar redraws in place (carriage returns), as tqdm does."""
    out = Terminal()
    with report_progress("epp", 3, stream=out) as bar:
        for _ in range(3):
            bar.update(1)
    assert "\r" in out.getvalue()
    assert "3/3" in out.getvalue()


def test_disabled_progress_writes_nothing() -> None:
    """``--no-progress``: not a byte, on a terminal or not."""
    for out in (io.StringIO(), Terminal()):
        with report_progress("epp", 3, enabled=False, stream=out) as bar:
            bar.update(1)
        assert out.getvalue() == ""
