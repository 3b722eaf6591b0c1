"""Flow control: requests wait in the EPP while the pool is saturated, and leave in order.

The director asks ``admit_now(priority)`` first: with room in the pool and nobody of this
priority or higher waiting, the request is scheduled at once, and flow control costs one
saturation check. Otherwise ``enqueue`` puts it in its priority band and flow and returns a
future; the dispatcher task resolves it when the pool has room again, by running the
request's ``dispatch`` (the scheduling step) itself, so the in-flight counts the next
saturation check reads already include it.

Dispatch order: strict priority between bands (highest first), the band's fairness policy
between its flows, the flow's ordering policy within it. Before every dispatch the saturation
detector is asked again, for the priority of the band the next request comes from (a detector
may leave room to Critical requests that it refuses to lower ones); the dispatcher wakes on
every enqueue, every finished request (``kick``) and every ``poll_interval`` while requests
wait.

Outcomes, each counted by ``FlowObserver.left`` and logged with the request id:

- ``dispatched``: scheduled (its own errors, e.g. no endpoint, reach the caller as usual);
- ``rejected``: the band or the whole queue was full: 429;
- ``evicted``: a Sheddable (negative priority) request pushed out to admit a higher one: 429;
- ``expired``: waited past its TTL: 503 "request timed out in queue";
- ``cancelled``: the caller stopped waiting (the client went away): nothing is sent anywhere.

Whichever way a request leaves, the controller keeps nothing of it (its body, its future,
its flow: see ``queues.py``), so memory returns to what it was once the queue has drained.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import heapq
from collections.abc import Callable
from typing import Generic, Protocol

import structlog

from endpoint_picker.errors import ServiceUnavailableError, TooManyRequestsError
from endpoint_picker.flowcontrol.config import FlowControlConfig
from endpoint_picker.flowcontrol.queues import Band, QueuedRequest, T, compacted, live_heap

log = structlog.get_logger(__name__)

DEFAULT_FLOW = "default-flow"
DISPATCHED, REJECTED, EVICTED, EXPIRED, CANCELLED = (
    "dispatched", "rejected", "evicted", "expired", "cancelled",
)  # fmt: skip


class FlowObserver(Protocol):
    """Where flow control reports (the EPP's Prometheus metrics)."""

    def queue_changed(self, priority: int, requests: int, size: int) -> None: ...

    def left(self, priority: int, outcome: str, waited: float) -> None: ...


class FlowController(Generic[T]):
    """The queues and their dispatcher; ``run()`` is the dispatcher task's body."""

    def __init__(
        self,
        config: FlowControlConfig,
        is_saturated: Callable[[int], bool],
        *,
        clock: Callable[[], float],
        observer: FlowObserver | None = None,
        poll_interval: float = 0.01,
    ) -> None:
        self._config = config
        self._is_saturated = is_saturated
        self._clock = clock
        self._observer = observer
        self._poll = poll_interval
        self._bands: dict[int, Band[T]] = {}
        self._order: list[int] = []  # band priorities, highest first
        self._deadlines: list[tuple[float, int, QueuedRequest[T]]] = []
        self._count = 0
        self._bytes = 0
        self._seq = 0
        self._wake = asyncio.Event()

    @property
    def waiting(self) -> int:
        return self._count

    @property
    def flows(self) -> int:
        """Flows (fairness ids, per band) with a request waiting; none are kept past that."""
        return sum(band.flows for band in self._bands.values())

    def waiting_in(self, priority: int) -> int:
        band = self._bands.get(priority)
        return band.count if band else 0

    def admit_now(self, priority: int, ready: Callable[[], bool] | None = None) -> bool:
        """Whether a request of ``priority`` may skip the queue: nobody of this priority or
        higher waits, the pool has room, and the request can go (``ready``, as ``enqueue``)."""
        if self._count:
            for p in self._order:
                if p < priority:
                    break
                if self._bands[p].count:
                    return False
        return not self._is_saturated(priority) and (ready is None or ready())

    def enqueue(
        self,
        request_id: str,
        dispatch: Callable[[], T],
        *,
        priority: int,
        flow_id: str = DEFAULT_FLOW,
        size: int = 0,
        timeout: float | None = None,
        ready: Callable[[], bool] | None = None,
    ) -> asyncio.Future[T]:
        """Queue a request; the future resolves to ``dispatch()``'s result, or raises
        ``TooManyRequestsError`` (full, evicted) or ``ServiceUnavailableError`` (expired).

        ``timeout`` (seconds, e.g. the client's own) shortens the band's TTL. ``ready``: whether
        the request could go now besides the pool having room (a subset hint's endpoints); until
        it can, the dispatcher passes over its flow.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        band = self._band(priority)
        if not band.fits(size):
            self._refuse(future, request_id, priority, f"the queue for priority {priority} is full")
            return future
        if not self._fits_total(size) and not self._evict_for(priority, size):
            self._refuse(future, request_id, priority, "the flow-control queue is full")
            return future
        now = self._clock()
        ttl = self._config.ttl(priority)
        if timeout is not None and 0 < timeout < ttl:
            ttl = timeout
        self._seq += 1
        item = QueuedRequest(
            request_id, flow_id or DEFAULT_FLOW, priority, size, now, now + ttl, self._seq,
            dispatch, contextvars.copy_context(), future, ready=ready,
        )  # fmt: skip
        band.push(item)
        heapq.heappush(self._deadlines, (item.deadline, item.seq, item))
        self._count += 1
        self._bytes += size
        future.add_done_callback(lambda f: self._on_done(item, f))
        self._report(band)
        log.debug("request queued", priority=priority, flow=item.flow_id, waiting=self._count)
        self._wake.set()
        return future

    def kick(self) -> None:
        """Something freed room (a request finished): look again now rather than at the poll."""
        if self._count:
            self._wake.set()

    async def run(self) -> None:
        """Dispatch while requests wait; sleep while none do."""
        while True:
            self._expire()
            if not self._count:
                self._wake.clear()
                await self._wake.wait()
                continue
            item = self._next_ready()
            if item is None:  # saturated (for the head's priority), or nothing can go yet
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._poll)
                continue
            self._dispatch(item)
            await asyncio.sleep(0)  # let the stream it woke, and everything else, run

    def close(self) -> None:
        """Fail every waiting request (shutdown): 503, nothing is left waiting."""
        for band in self._bands.values():
            while (item := band.pop()) is not None:
                future = self._leave(item, EXPIRED)
                if not future.done():
                    future.set_exception(
                        ServiceUnavailableError("the endpoint picker is shutting down")
                    )

    # -- internals ------------------------------------------------------------------------------

    def _band(self, priority: int) -> Band[T]:
        band = self._bands.get(priority)
        if band is None:
            band = self._bands[priority] = Band(priority, self._config.band(priority))
            self._order = sorted(self._bands, reverse=True)
        return band

    def _fits_total(self, size: int) -> bool:
        c = self._config
        return (not c.max_requests or self._count < c.max_requests) and (
            not c.max_bytes or self._bytes + size <= c.max_bytes
        )

    def _evict_for(self, priority: int, size: int) -> bool:
        """Push out the newest Sheddable requests of lower priority until ``size`` fits."""
        for p in reversed(self._order):  # lowest first
            if p >= 0 or p >= priority:
                break
            band = self._bands[p]
            while not self._fits_total(size) and (victim := band.newest()) is not None:
                self._leave(victim, EVICTED).set_exception(
                    TooManyRequestsError(
                        "the pool is saturated and a higher-priority request needed the"
                        " queue space; retry later"
                    )
                )
                log.info("queued request evicted", evicted_request_id=victim.request_id,
                         priority=p, for_priority=priority)  # fmt: skip
        return self._fits_total(size)

    def _refuse(self, future: asyncio.Future[T], request_id: str, priority: int, why: str) -> None:
        future.set_exception(TooManyRequestsError(f"the pool is saturated and {why}"))
        log.info("request refused by flow control", priority=priority, reason=why)
        if self._observer is not None:
            self._observer.left(priority, REJECTED, 0.0)

    def _next_ready(self) -> QueuedRequest[T] | None:
        """The next request to dispatch: strict priority between bands, as long as the pool
        has room for the band's priority (a lower one never has more); a band whose waiting
        requests cannot go yet (``QueuedRequest.ready``) lets the next band go."""
        for p in self._order:
            band = self._bands[p]
            if not band.count:
                continue
            if self._is_saturated(p):
                return None
            item = band.pop(ready_only=True)
            band.compact()
            if item is not None:
                return item
        return None

    def _dispatch(self, item: QueuedRequest[T]) -> None:
        dispatch, context = item.dispatch, item.context
        future = self._leave(item, DISPATCHED)
        if future.done() or dispatch is None or context is None:
            return  # cancelled a moment ago; its callback has not run yet
        try:
            result = context.run(dispatch)
        except Exception as exc:  # the scheduling step's own error, for the caller to answer
            future.set_exception(exc)
        else:
            future.set_result(result)

    def _expire(self) -> None:
        now = self._clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            item = heapq.heappop(self._deadlines)[2]
            if item.gone:
                continue
            future = self._leave(item, EXPIRED)
            log.info("queued request timed out", expired_request_id=item.request_id,
                     priority=item.priority, waited=round(now - item.enqueued_at, 3))  # fmt: skip
            if not future.done():
                future.set_exception(
                    ServiceUnavailableError("request timed out in queue: the pool is saturated")
                )
        while self._deadlines and self._deadlines[0][2].gone:
            heapq.heappop(self._deadlines)

    def _on_done(self, item: QueuedRequest[T], future: asyncio.Future[T]) -> None:
        if future.cancelled() and not item.gone:
            self._leave(item, CANCELLED)
            log.debug("queued request cancelled", priority=item.priority)

    def _leave(self, item: QueuedRequest[T], outcome: str) -> asyncio.Future[T]:
        """Take ``item`` out of every count and let go of what it carried; its future (for
        the caller to resolve) is returned. Once per request: callers check ``gone``."""
        future: asyncio.Future[T] = item.future
        item.release()
        band = self._bands[item.priority]
        band.removed(item)
        self._count -= 1
        self._bytes -= item.size
        if compacted(self._deadlines, self._count):
            self._deadlines = live_heap(self._deadlines)
        self._report(band)
        if self._observer is not None:
            self._observer.left(item.priority, outcome, self._clock() - item.enqueued_at)
        return future

    def _report(self, band: Band[T]) -> None:
        if self._observer is not None:
            self._observer.queue_changed(band.priority, band.count, band.bytes)
