"""TurnGate: a burst of scrape steps is cut into slices, one slice per event-loop iteration."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine

import pytest

from endpoint_picker.metrics.turns import TurnGate


class Iterations:
    """Counts event-loop iterations: a callback that puts itself back each iteration."""

    def __init__(self) -> None:
        self.count = 0
        self._handle: asyncio.Handle | None = None

    def start(self) -> None:
        self._handle = asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        self.count += 1
        self._handle = asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()


class StepClock:
    """Each admitted step costs ``step`` seconds of this clock."""

    def __init__(self, step: float) -> None:
        self.now = 0.0
        self.step = step

    def __call__(self) -> float:
        return self.now


def named_step(
    gate: TurnGate, clock: StepClock, order: list[str]
) -> Callable[[str], Coroutine[None, None, None]]:
    """A step that passes the gate, then records its name and costs ``clock.step``."""

    async def step(name: str) -> None:
        if not gate.admit():
            await gate.wait()
        order.append(name)
        clock.now += clock.step

    return step


async def run_burst(gate: TurnGate, clock: StepClock, steps: int) -> list[tuple[int, int]]:
    """``steps`` tasks ready in one iteration; returns (step, iteration it ran in), in run order."""
    iterations = Iterations()
    ran: list[tuple[int, int]] = []

    async def step(n: int) -> None:
        if not gate.admit():
            await gate.wait()
        ran.append((n, iterations.count))
        clock.now += clock.step

    iterations.start()
    try:
        await asyncio.gather(*(step(n) for n in range(steps)))
    finally:
        iterations.stop()
    return ran


async def test_a_burst_runs_a_slice_per_iteration_in_order() -> None:
    clock = StepClock(step=0.0001)  # 100 µs a step: 10 fit in a 1 ms share
    gate = TurnGate(seconds=0.001, batch=4, clock=clock)
    ran = await run_burst(gate, clock, 30)
    assert sorted(n for n, _ in ran) == list(range(30))  # every step ran once
    per_iteration: dict[int, list[int]] = {}
    for n, iteration in ran:
        per_iteration.setdefault(iteration, []).append(n)
    slices = list(per_iteration.values())
    # the share (1 ms of 100 µs steps), then ``batch`` an iteration
    assert [len(s) for s in slices] == [10, 4, 4, 4, 4, 4]
    assert [n for n, _ in ran] == list(range(30))  # waiters keep their order
    assert gate.deferred == 20
    assert gate.waiting == 0


async def test_steps_that_fit_never_wait() -> None:
    clock = StepClock(step=0.0001)
    gate = TurnGate(seconds=0.001, batch=4, clock=clock)
    for _ in range(5):  # five iterations of five steps: each iteration's share suffices
        ran = await run_burst(gate, clock, 5)
        assert len({iteration for _, iteration in ran}) == 1
    assert gate.deferred == 0


async def test_new_steps_queue_behind_the_waiting_ones() -> None:
    """A step that arrives while others wait does not jump the queue, even in a fresh share."""
    clock = StepClock(step=0.001)  # one step fills a share
    gate = TurnGate(seconds=0.001, batch=1, clock=clock)
    order: list[str] = []
    step = named_step(gate, clock, order)

    first = [asyncio.create_task(step(f"a{n}")) for n in range(3)]
    await asyncio.sleep(0)  # a0 ran, a1 and a2 wait
    late = asyncio.create_task(step("late"))
    await asyncio.gather(*first, late)
    assert order == ["a0", "a1", "a2", "late"]


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    clock = StepClock(step=0.001)
    gate = TurnGate(seconds=0.001, batch=1, clock=clock)
    order: list[str] = []
    step = named_step(gate, clock, order)

    tasks = {name: asyncio.create_task(step(name)) for name in ("a", "b", "c")}
    await asyncio.sleep(0)
    assert gate.waiting == 2
    tasks["b"].cancel()
    with pytest.raises(asyncio.CancelledError):
        await tasks["b"]
    await asyncio.gather(tasks["a"], tasks["c"])
    assert order == ["a", "c"]
    assert gate.waiting == 0
