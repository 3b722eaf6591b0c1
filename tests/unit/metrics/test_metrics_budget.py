"""The CPU budget: interval arithmetic, cost averaging, and the step meter."""

from __future__ import annotations

import asyncio
import time

import pytest

from endpoint_picker.metrics.budget import Metered, ScrapeBudget


def budget(
    cost: float, cpu_budget: float = 0.5, base: float = 0.05, cap: float = 0.5
) -> ScrapeBudget:
    meter = ScrapeBudget(base, cpu_budget, cap, overhead=1.0)
    meter.record(cost)
    return meter


@pytest.mark.parametrize(
    ("endpoints", "cost", "cpu_budget", "expected"),
    [
        (10, 0.0005, 0.5, 0.05),  # 10 * 0.5 ms / 0.5 = 10 ms: the base interval holds
        (50, 0.0005, 0.5, 0.05),  # exactly at the budget
        (100, 0.0005, 0.5, 0.1),  # twice the budget: twice the interval
        (300, 0.0005, 0.5, 0.3),
        (100, 0.0005, 0.25, 0.2),  # a smaller budget stretches more
        (10_000, 0.0005, 0.5, 0.5),  # capped short of staleness
        (100, 0.0005, 0.0, 0.05),  # budget 0: never stretched
        (0, 0.0005, 0.5, 0.05),
    ],
)
def test_interval(endpoints: int, cost: float, cpu_budget: float, expected: float) -> None:
    """interval = clamp(endpoints * cost / budget, refresh_interval, max_interval)."""
    assert budget(cost, cpu_budget).interval(endpoints) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("endpoints", "expected_share"), [(10, 0.1), (100, 0.5), (10_000, 10_000 * 0.0005 / 0.5)]
)
def test_cpu_share_stays_within_budget_until_the_cap(endpoints: int, expected_share: float) -> None:
    """The estimated share is n*c/interval: at most the budget unless the interval is capped."""
    assert budget(0.0005).cpu_share(endpoints) == pytest.approx(expected_share)


def test_cost_is_a_moving_average() -> None:
    """The first sample sets the cost; later ones move it by the smoothing weight."""
    meter = ScrapeBudget(0.05, 0.5, 0.5, smoothing=0.5, overhead=1.0)
    meter.record(0.002)
    assert meter.cost_per_scrape == pytest.approx(0.002)
    meter.record(0.004)
    assert meter.cost_per_scrape == pytest.approx(0.003)
    for _ in range(50):
        meter.record(0.001)
    assert meter.cost_per_scrape == pytest.approx(0.001)
    assert meter.samples == 52


def test_samples_are_scaled_by_the_unseen_overhead() -> None:
    """Metered samples are scaled up to the CPU the event loop spends around them."""
    meter = ScrapeBudget(0.05, 0.5, 0.5, overhead=2.0)
    meter.record(0.001)
    assert meter.cost_per_scrape == pytest.approx(0.002)
    assert meter.interval(100) == pytest.approx(0.4)


def test_max_interval_never_below_refresh_interval() -> None:
    """A cap below the base interval is raised to it."""
    assert budget(1.0, cap=0.01).interval(100) == pytest.approx(0.05)


def busy(cpu_seconds: float) -> None:
    end = time.thread_time() + cpu_seconds
    while time.thread_time() < end:
        pass


async def test_metered_counts_steps_not_waits() -> None:
    """The meter adds the time spent running the coroutine, not the time it awaits."""

    async def work() -> str:
        busy(0.01)
        await asyncio.sleep(0.3)
        busy(0.01)
        return "done"

    metered = Metered(work())
    assert await metered == "done"
    # thread_time ticks coarsely on a loaded machine: allow a little under the 20 ms spent
    assert 0.015 <= metered.cpu < 0.25


async def test_metered_propagates_errors_and_cancellation() -> None:
    """Exceptions and cancellation pass through the meter unchanged."""

    async def fail() -> None:
        await asyncio.sleep(0)
        raise KeyError("x")

    with pytest.raises(KeyError):
        await Metered(fail())

    cleaned_up = asyncio.Event()

    async def wait_forever() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            cleaned_up.set()

    async def run() -> None:
        await Metered(wait_forever())

    task = asyncio.create_task(run())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned_up.is_set()
