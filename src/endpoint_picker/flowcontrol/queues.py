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
    # Whether the request could go now besides the pool having room (None: always): a
    # request limited to some endpoints (a subset hint) waits until one of them has room.
    ready: Callable[[], bool] | None = None

    def can_go(self) -> bool:
        return self.ready is None or self.ready()


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

    def first_ready(self) -> QueuedRequest[T] | None:
        """The first live request in this flow's order that can go (``can_go``). The head
        is checked first; the rest are scanned only when it cannot go (rare: subset hints)."""
        head = self.head()
        if head is None or head.can_go():
            return head
        items = (
            [entry[2] for entry in sorted(self._heap)]
            if self._ordering is OrderingPolicy.EDF
            else list(self._fifo)
        )
        return next((i for i in items if not i.gone and i.can_go()), None)

    def take(self, item: QueuedRequest[T]) -> None:
        """Remove ``item`` (the head, or a ``first_ready`` answer) from the order: O(log n)
        for the head, a scan for any other."""
        if self.head() is item:
            self.pop()
        elif self._ordering is OrderingPolicy.EDF:
            self._heap = [entry for entry in self._heap if entry[2] is not item]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(item)


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

    def pop(self, ready_only: bool = False) -> QueuedRequest[T] | None:
        """The next request by the band's fairness policy (``None``: nothing waits).

        ``ready_only``: pass over the requests that cannot go yet (``can_go``), in a flow's
        order: the first one that can goes; a flow none of whose requests can keeps its turn.
        """
        if self.count == 0:
            return None
        if self.config.fairness is FairnessPolicy.GLOBAL_FIFO:
            return self._pop_oldest(ready_only)
        for _ in range(len(self._active)):
            flow_id = self._active.popleft()
            flow = self._flows[flow_id]
            if flow.head() is None:  # its requests all left early
                del self._flows[flow_id]
                continue
            item = flow.first_ready() if ready_only else flow.head()
            if item is None:  # none of its requests can go yet: it keeps its turn
                self._active.append(flow_id)
                continue
            flow.take(item)
            if flow.head() is None:
                del self._flows[flow_id]
            else:
                self._active.append(flow_id)  # its turn comes again after the others'
            return item
        return None

    def _pop_oldest(self, ready_only: bool) -> QueuedRequest[T] | None:
        best: Flow[T] | None = None
        best_item: QueuedRequest[T] | None = None
        for flow_id in list(self._active):
            flow = self._flows[flow_id]
            if flow.head() is None:
                del self._flows[flow_id]
                self._active.remove(flow_id)
                continue
            item = flow.first_ready() if ready_only else flow.head()
            if item is not None and (best_item is None or item.seq < best_item.seq):
                best, best_item = flow, item
        if best is None or best_item is None:
            return None
        best.take(best_item)
        if best.head() is None:
            del self._flows[best.flow_id]
            self._active.remove(best.flow_id)
        return best_item

    def newest(self) -> QueuedRequest[T] | None:
        """The live request that arrived last (the one to evict: it has waited least)."""
        while self._arrivals and self._arrivals[-1].gone:
            self._arrivals.pop()
        return self._arrivals[-1] if self._arrivals else None

    def compact(self) -> None:
        """Drop the oldest entries of the eviction list that already left."""
        while self._arrivals and self._arrivals[0].gone:
            self._arrivals.popleft()
