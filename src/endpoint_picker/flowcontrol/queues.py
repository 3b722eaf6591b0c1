"""The queues of flow control: a band per priority, a flow per fairness id, pure and synchronous.

A ``Band`` holds the flows of one priority and picks which flow goes next (its fairness
policy); a ``Flow`` holds one fairness id's requests and picks which goes next (its ordering
policy). Removal is lazy: a request that leaves early (cancelled, expired, evicted) is marked
and skipped when reached, so every operation stays O(1) or O(log n) in the requests waiting
(the global-FIFO policy scans the band's flows, which are few).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from contextvars import Context
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from endpoint_picker.flowcontrol.config import BandConfig, FairnessPolicy, OrderingPolicy

T = TypeVar("T")


@dataclass(eq=False, slots=True)
class QueuedRequest(Generic[T]):
    """One waiting request. ``dispatch`` runs (in ``context``) when it is admitted."""

    request_id: str
    flow_id: str
    priority: int
    size: int  # body bytes
    enqueued_at: float
    deadline: float  # when it leaves with a 503; EDF orders by it
    seq: int  # arrival order, the tie-breaker everywhere
    dispatch: Callable[[], T]
    context: Context
    future: Any = field(repr=False)  # asyncio.Future[T]
    gone: bool = False  # left the queue (dispatched, cancelled, expired, evicted)


class Flow(Generic[T]):
    """One fairness id's requests in a band, in the band's ordering."""

    __slots__ = ("_fifo", "_heap", "_ordering", "flow_id")

    def __init__(self, flow_id: str, ordering: OrderingPolicy) -> None:
        self.flow_id = flow_id
        self._ordering = ordering
        self._fifo: deque[QueuedRequest[T]] = deque()
        self._heap: list[tuple[float, int, QueuedRequest[T]]] = []

    def push(self, item: QueuedRequest[T]) -> None:
        if self._ordering is OrderingPolicy.EDF:
            heapq.heappush(self._heap, (item.deadline, item.seq, item))
        else:
            self._fifo.append(item)

    def head(self) -> QueuedRequest[T] | None:
        """The next live request, dropping the ones that left meanwhile."""
        if self._ordering is OrderingPolicy.EDF:
            while self._heap and self._heap[0][2].gone:
                heapq.heappop(self._heap)
            return self._heap[0][2] if self._heap else None
        while self._fifo and self._fifo[0].gone:
            self._fifo.popleft()
        return self._fifo[0] if self._fifo else None

    def pop(self) -> QueuedRequest[T] | None:
        item = self.head()
        if item is not None:
            if self._ordering is OrderingPolicy.EDF:
                heapq.heappop(self._heap)
            else:
                self._fifo.popleft()
        return item


class Band(Generic[T]):
    """The requests of one priority: counts, limits, and the fairness between its flows."""

    __slots__ = ("_active", "_arrivals", "_flows", "bytes", "config", "count", "priority")

    def __init__(self, priority: int, config: BandConfig) -> None:
        self.priority = priority
        self.config = config
        self.count = 0
        self.bytes = 0
        self._flows: dict[str, Flow[T]] = {}
        self._active: deque[str] = deque()  # flows that may hold requests, in turn order
        self._arrivals: deque[QueuedRequest[T]] = deque()  # for eviction: newest last

    def fits(self, size: int) -> bool:
        c = self.config
        return (not c.max_requests or self.count < c.max_requests) and (
            not c.max_bytes or self.bytes + size <= c.max_bytes
        )

    def push(self, item: QueuedRequest[T]) -> None:
        flow = self._flows.get(item.flow_id)
        if flow is None:
            flow = self._flows[item.flow_id] = Flow(item.flow_id, self.config.ordering)
            self._active.append(item.flow_id)
        flow.push(item)
        self._arrivals.append(item)
        self.count += 1
        self.bytes += item.size

    def removed(self, item: QueuedRequest[T]) -> None:
        """Account for ``item`` leaving (it is already marked ``gone``)."""
        self.count -= 1
        self.bytes -= item.size

    def pop(self) -> QueuedRequest[T] | None:
        """The next request by the band's fairness policy (``None``: nothing waits)."""
        if self.count == 0:
            return None
        if self.config.fairness is FairnessPolicy.GLOBAL_FIFO:
            return self._pop_oldest()
        while self._active:
            flow_id = self._active.popleft()
            flow = self._flows[flow_id]
            item = flow.pop()
            if item is None:  # its requests all left early
                del self._flows[flow_id]
                continue
            if flow.head() is None:
                del self._flows[flow_id]
            else:
                self._active.append(flow_id)  # its turn comes again after the others'
            return item
        return None

    def _pop_oldest(self) -> QueuedRequest[T] | None:
        best: Flow[T] | None = None
        best_seq = 0
        for flow_id in list(self._active):
            head = self._flows[flow_id].head()
            if head is None:
                del self._flows[flow_id]
                self._active.remove(flow_id)
            elif best is None or head.seq < best_seq:
                best, best_seq = self._flows[flow_id], head.seq
        if best is None:
            return None
        item = best.pop()
        if best.head() is None:
            del self._flows[best.flow_id]
            self._active.remove(best.flow_id)
        return item

    def newest(self) -> QueuedRequest[T] | None:
        """The live request that arrived last (the one to evict: it has waited least)."""
        while self._arrivals and self._arrivals[-1].gone:
            self._arrivals.pop()
        return self._arrivals[-1] if self._arrivals else None

    def compact(self) -> None:
        """Drop the oldest entries of the eviction list that already left."""
        while self._arrivals and self._arrivals[0].gone:
            self._arrivals.popleft()
