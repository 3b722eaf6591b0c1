"""Flow control's policies and outcomes, with an injected clock and a saturation switch."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from endpoint_picker.errors import ServiceUnavailableError, TooManyRequestsError
from endpoint_picker.flowcontrol import (
    BandConfig,
    FairnessPolicy,
    FlowControlConfig,
    FlowController,
    OrderingPolicy,
)
from endpoint_picker.flowcontrol.queues import QueuedRequest


@dataclass
class Pool:
    """The saturation signal and the clock, set by the test; ``room`` dispatches that many
    requests and then saturates again (as if each took a slot)."""

    saturated: bool = True
    room: int = 0
    now: float = 0.0
    dispatched: list[str] = field(default_factory=list)

    def is_saturated(self, priority: int) -> bool:
        return self.saturated and self.room <= 0

    def clock(self) -> float:
        return self.now

    def dispatch(self, name: str) -> Callable[[], str]:
        def run() -> str:
            self.room -= 1
            self.dispatched.append(name)
            return name

        return run


@dataclass
class Observer:
    left_log: list[tuple[int, str]] = field(default_factory=list)
    sizes: dict[int, tuple[int, int]] = field(default_factory=dict)

    def queue_changed(self, priority: int, requests: int, size: int) -> None:
        self.sizes[priority] = (requests, size)

    def left(self, priority: int, outcome: str, waited: float) -> None:
        self.left_log.append((priority, outcome))


def controller(
    pool: Pool, config: FlowControlConfig | None = None, observer: Observer | None = None
) -> FlowController[str]:
    return FlowController(
        config or FlowControlConfig(),
        pool.is_saturated,
        clock=pool.clock,
        observer=observer,
        poll_interval=0.001,
    )


@pytest.fixture
async def running() -> AsyncIterator[Callable[[FlowController[str]], None]]:
    tasks: list[asyncio.Task[None]] = []

    def start(flow: FlowController[str]) -> None:
        tasks.append(asyncio.create_task(flow.run()))

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def settle(pool: Pool, count: int) -> None:
    """Wait until ``count`` requests were dispatched (bounded)."""
    for _ in range(500):
        if len(pool.dispatched) >= count:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"only {pool.dispatched} dispatched")


async def test_admit_now_only_with_room_and_nobody_ahead() -> None:
    """A request skips the queue only when the pool has room and no one of its priority or
    higher waits; lower priorities waiting do not hold it back."""
    pool = Pool(saturated=False)
    flow = controller(pool)
    assert flow.admit_now(0)
    flow.enqueue("low", pool.dispatch("low"), priority=-1)
    assert flow.admit_now(0)  # only a lower band waits
    flow.enqueue("mid", pool.dispatch("mid"), priority=0)
    assert not flow.admit_now(0)
    assert flow.admit_now(1)
    pool.saturated = True
    assert not flow.admit_now(1)


async def test_strict_priority_between_bands(running: Callable[..., None]) -> None:
    """Higher bands leave first, whatever the arrival order."""
    pool = Pool()
    flow = controller(pool)
    futures = [
        flow.enqueue(name, pool.dispatch(name), priority=p)
        for name, p in [("s1", -1), ("std1", 0), ("c1", 1), ("s2", -1), ("c2", 1)]
    ]
    running(flow)
    pool.room = 5
    await settle(pool, 5)
    assert pool.dispatched == ["c1", "c2", "std1", "s1", "s2"]
    assert [f.result() for f in futures] == ["s1", "std1", "c1", "s2", "c2"]


async def test_room_for_critical_only_dispatches_critical_past_waiting_lower_bands(
    running: Callable[..., None],
) -> None:
    """Saturation asked per priority: while only Critical work has room, Critical requests
    leave (and skip the queue) and the lower bands keep waiting."""
    pool = Pool()
    flow: FlowController[str] = FlowController(
        FlowControlConfig(),
        lambda priority: priority <= 0,  # room for Critical only
        clock=pool.clock,
        poll_interval=0.001,
    )
    waiting = [flow.enqueue(n, pool.dispatch(n), priority=p) for n, p in [("std", 0), ("s", -1)]]
    assert flow.admit_now(1)
    assert not flow.admit_now(0)
    running(flow)
    critical = flow.enqueue("c", pool.dispatch("c"), priority=1)
    await settle(pool, 1)
    await asyncio.sleep(0.01)
    assert pool.dispatched == ["c"]
    assert critical.result() == "c"
    assert not any(f.done() for f in waiting)


@pytest.mark.parametrize("fairness", [FairnessPolicy.ROUND_ROBIN, FairnessPolicy.GLOBAL_FIFO])
@pytest.mark.parametrize("ordering", [OrderingPolicy.FCFS, OrderingPolicy.EDF])
async def test_a_request_that_cannot_go_yet_lets_other_flows_and_bands_go(
    running: Callable[..., None], fairness: FairnessPolicy, ordering: OrderingPolicy
) -> None:
    """A request whose own endpoints are busy (``ready`` false, a subset hint) waits without
    holding back anything: the requests behind it in its flow, other flows, lower bands; it
    leaves once it can; admit_now refuses such a request meanwhile."""
    pool = Pool()
    config = FlowControlConfig(default_band=BandConfig(fairness=fairness, ordering=ordering))
    flow = controller(pool, config)
    pinned_free = False
    pinned = flow.enqueue(
        "pinned", pool.dispatch("pinned"), priority=0, flow_id="a", ready=lambda: pinned_free
    )
    flow.enqueue("a2", pool.dispatch("a2"), priority=0, flow_id="a")  # behind it, in its flow
    flow.enqueue("b1", pool.dispatch("b1"), priority=0, flow_id="b")
    flow.enqueue("low", pool.dispatch("low"), priority=-1)
    running(flow)
    pool.room = 3
    await settle(pool, 3)
    assert pool.dispatched == ["a2", "b1", "low"]
    assert not pinned.done()
    pool.saturated = False
    assert not flow.admit_now(1, lambda: False)
    assert flow.admit_now(1, lambda: True)
    pinned_free = True
    flow.kick()
    await settle(pool, 4)
    assert pool.dispatched == ["a2", "b1", "low", "pinned"]


async def test_round_robin_gives_each_flow_its_turn(running: Callable[..., None]) -> None:
    """A tenant offering 3x the requests of another gets every other dispatch, not 3 of 4."""
    pool = Pool()
    flow = controller(pool)
    for i in range(9):
        flow.enqueue(f"heavy{i}", pool.dispatch("heavy"), priority=0, flow_id="heavy")
        if i % 3 == 0:
            flow.enqueue(f"light{i}", pool.dispatch("light"), priority=0, flow_id="light")
    running(flow)
    pool.room = 6
    await settle(pool, 6)
    assert pool.dispatched == ["heavy", "light"] * 3


async def test_global_fifo_serves_arrival_order_across_flows(
    running: Callable[..., None],
) -> None:
    pool = Pool()
    band = BandConfig(fairness=FairnessPolicy.GLOBAL_FIFO)
    flow = controller(pool, FlowControlConfig(default_band=band))
    for name, tenant in [("a1", "a"), ("a2", "a"), ("b1", "b"), ("a3", "a")]:
        flow.enqueue(name, pool.dispatch(name), priority=0, flow_id=tenant)
    running(flow)
    pool.room = 4
    await settle(pool, 4)
    assert pool.dispatched == ["a1", "a2", "b1", "a3"]


async def test_edf_orders_a_flow_by_deadline(running: Callable[..., None]) -> None:
    """Earliest deadline first: a request whose client waits less goes ahead of older ones."""
    pool = Pool()
    band = BandConfig(ordering=OrderingPolicy.EDF)
    flow = controller(pool, FlowControlConfig(default_ttl=30, default_band=band))
    flow.enqueue("patient", pool.dispatch("patient"), priority=0)
    pool.now = 1.0
    flow.enqueue("hurried", pool.dispatch("hurried"), priority=0, timeout=5)
    running(flow)
    pool.room = 2
    await settle(pool, 2)
    assert pool.dispatched == ["hurried", "patient"]


async def test_ttl_expiry_answers_503(running: Callable[..., None]) -> None:
    observer = Observer()
    pool = Pool()
    config = FlowControlConfig(default_ttl=10, bands={1: BandConfig(request_ttl=60)})
    flow = controller(pool, config, observer)
    stale = flow.enqueue("stale", pool.dispatch("stale"), priority=0)
    patient = flow.enqueue("critical", pool.dispatch("critical"), priority=1)
    running(flow)
    pool.now = 10.5
    with pytest.raises(ServiceUnavailableError, match="timed out in queue"):
        await asyncio.wait_for(stale, 1)
    assert not patient.done()
    assert flow.waiting == 1
    assert (0, "expired") in observer.left_log
    assert observer.sizes[0] == (0, 0)


async def test_band_capacity_rejects_with_429() -> None:
    observer = Observer()
    pool = Pool()
    config = FlowControlConfig(default_band=BandConfig(max_requests=2, max_bytes=100))
    flow = controller(pool, config, observer)
    flow.enqueue("a", pool.dispatch("a"), priority=0, size=10)
    flow.enqueue("b", pool.dispatch("b"), priority=0, size=10)
    full = flow.enqueue("c", pool.dispatch("c"), priority=0, size=10)
    with pytest.raises(TooManyRequestsError, match="priority 0 is full"):
        await full
    too_big = flow.enqueue("d", pool.dispatch("d"), priority=1, size=101)
    with pytest.raises(TooManyRequestsError):
        await too_big
    assert flow.waiting == 2
    assert observer.left_log.count((0, "rejected")) == 1


async def test_sheddable_requests_are_evicted_for_critical_ones() -> None:
    """At the global limit a Critical request pushes out the newest Sheddable one; a Standard
    request never evicts a Standard one, and nothing evicts for a Sheddable request."""
    pool = Pool()
    flow = controller(pool, FlowControlConfig(max_requests=3))
    old = flow.enqueue("shed-old", pool.dispatch("x"), priority=-1)
    new = flow.enqueue("shed-new", pool.dispatch("x"), priority=-1)
    flow.enqueue("std", pool.dispatch("x"), priority=0)
    critical = flow.enqueue("crit", pool.dispatch("x"), priority=1)
    with pytest.raises(TooManyRequestsError, match="higher-priority"):
        await new
    assert not old.done()
    assert not critical.done()
    with pytest.raises(TooManyRequestsError, match="queue is full"):
        await flow.enqueue("shed-3", pool.dispatch("x"), priority=-1)
    assert flow.waiting == 3


async def test_cancelled_waiter_leaves_the_queue_at_once() -> None:
    """A caller that stops waiting (its task cancelled) frees its place and its bytes."""
    observer = Observer()
    pool = Pool()
    flow = controller(pool, observer=observer)
    future = flow.enqueue("gone", pool.dispatch("gone"), priority=0, size=42)

    async def waiter() -> str:
        return await future

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)  # the future's done callback
    assert flow.waiting == 0
    assert observer.sizes[0] == (0, 0)
    assert observer.left_log == [(0, "cancelled")]


async def test_dispatch_errors_reach_the_caller(running: Callable[..., None]) -> None:
    pool = Pool()
    flow = controller(pool)

    def no_endpoint() -> str:
        raise ServiceUnavailableError("no endpoint passed the scheduler's filters")

    future = flow.enqueue("r", no_endpoint, priority=0)
    running(flow)
    pool.saturated = False
    with pytest.raises(ServiceUnavailableError, match="filters"):
        await asyncio.wait_for(future, 1)


async def test_close_fails_everything_waiting() -> None:
    pool = Pool()
    flow = controller(pool)
    futures = [flow.enqueue(str(i), pool.dispatch(str(i)), priority=i % 3 - 1) for i in range(5)]
    flow.close()
    for future in futures:
        with pytest.raises(ServiceUnavailableError, match="shutting down"):
            await future
    assert flow.waiting == 0


async def test_dispatcher_waits_while_saturated_and_wakes_on_kick(
    running: Callable[..., None],
) -> None:
    pool = Pool()
    flow = controller(pool)
    future = flow.enqueue("r", pool.dispatch("r"), priority=0)
    running(flow)
    await asyncio.sleep(0.02)
    assert not future.done()
    pool.saturated = False
    flow.kick()
    assert await asyncio.wait_for(future, 1) == "r"


class Payload:
    """Stands for a queued request's body: only its dispatch closure refers to it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.body = bytearray(64 * 1024)


@pytest.mark.parametrize("fairness", [FairnessPolicy.ROUND_ROBIN, FairnessPolicy.GLOBAL_FIFO])
@pytest.mark.parametrize("ordering", [OrderingPolicy.FCFS, OrderingPolicy.EDF])
async def test_requests_that_left_leave_nothing_behind(
    running: Callable[..., None], fairness: FairnessPolicy, ordering: OrderingPolicy
) -> None:
    """However a request leaves (expired, cancelled, evicted, dispatched), the controller keeps
    no reference to what it carried (its payload dies) and its flow is dropped."""
    pool = Pool()
    band = BandConfig(fairness=fairness, ordering=ordering)
    flow = controller(pool, FlowControlConfig(max_requests=30, default_ttl=10, default_band=band))
    payloads: list[weakref.ref[Payload]] = []
    futures: list[asyncio.Future[str]] = []

    def queue(name: str, priority: int, timeout: float | None = None) -> None:
        payload = Payload(name)
        payloads.append(weakref.ref(payload))

        def run() -> str:
            pool.room -= 1
            pool.dispatched.append(payload.name)
            return payload.name

        futures.append(
            flow.enqueue(
                name, run, priority=priority, flow_id=f"tenant-{name}", size=1, timeout=timeout
            )
        )

    for i in range(10):
        queue(f"expires-{i}", 0, timeout=1)
    for i in range(10):
        queue(f"cancelled-{i}", 0)
    for i in range(10):
        queue(f"sheddable-{i}", -1)
    for i in range(10):  # each evicts a Sheddable request: the queue holds 30
        queue(f"critical-{i}", 1)
    assert flow.waiting == 30
    for future in futures[10:20]:
        future.cancel()
    await asyncio.sleep(0)  # the cancelled futures' callbacks
    running(flow)
    pool.now = 2.0  # the first ten expire
    pool.room = 10  # the critical ones go
    await settle(pool, 10)
    for _ in range(100):
        if flow.waiting == 0:
            break
        await asyncio.sleep(0.001)
    assert flow.waiting == 0
    assert all(future.done() for future in futures)
    futures.clear()
    gc.collect()
    alive = [name for ref in payloads if (name := getattr(ref(), "name", None))]
    assert alive == []
    assert flow.flows == 0


async def test_requests_coming_and_going_behind_a_waiting_one_grow_nothing() -> None:
    """While one request waits, a thousand others queued and cancelled behind it (each with a
    fairness id of its own) leave at most a few bookkeeping entries, not one each."""
    pool = Pool()
    flow = controller(pool)
    flow.enqueue("patient", pool.dispatch("patient"), priority=0, flow_id="patient")
    for i in range(1000):
        future = flow.enqueue(str(i), pool.dispatch(str(i)), priority=0, flow_id=f"t{i}")
        future.cancel()
        await asyncio.sleep(0)  # its done callback
    assert flow.waiting == 1
    gc.collect()
    kept = sum(1 for o in gc.get_objects() if isinstance(o, QueuedRequest))
    assert kept < 50
    assert flow.flows == 1
