"""The queues of flow control: a band per priority, a flow per fairness id, pure and synchronous.

A ``Band`` holds the flows of one priority and picks which flow goes next (its fairness
policy); a ``Flow`` holds one fairness id's requests and picks which goes next (its ordering
policy). Removal is lazy: a request that leaves early (cancelled, expired, evicted) is marked
and skipped when reached, so every operation stays O(1) or O(log n) in the requests waiting
(the global-FIFO policy scans the band's flows, which are few).

Nothing outlives a request's stay: a request that leaves by any path drops what it carries
(``QueuedRequest.release``: the dispatch closure with the body, its context, its future), a
flow is dropped with its last waiting request, and a list whose left entries outnumber its
waiting ones is rebuilt (``compacted``), so every structure stays within twice the requests
waiting, plus a few.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from contextvars import Context
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from endpoint_picker.flowcontrol.config import BandConfig, FairnessPolicy, OrderingPolicy

T = TypeVar("T")
_E = TypeVar("_E")

# A lazily cleaned list is rebuilt once it holds more than twice its live entries plus this.
_SLACK = 16


@dataclass(eq=False, slots=True)
class QueuedRequest(Generic[T]):
    """One waiting request. ``dispatch`` runs (in ``context``) when it is admitted.

    ``dispatch``, ``context``, ``future`` and ``ready`` are None once it left the queue: the
    entries the queues still hold until they are cleaned up must not keep its body alive.
    """

    request_id: str
    flow_id: str
    priority: int
    size: int  # body bytes
    enqueued_at: float
    deadline: float  # when it leaves with a 503; EDF orders by it
    seq: int  # arrival order, the tie-breaker everywhere
    dispatch: Callable[[], T] | None
    context: Context | None
    future: Any = field(repr=False)  # asyncio.Future[T]; None once gone
    gone: bool = False  # left the queue (dispatched, cancelled, expired, evicted)
    # Whether the request could go now besides the pool having room (None: always): a
    # request limited to some endpoints (a subset hint) waits until one of them has room.
    ready: Callable[[], bool] | None = None

    def can_go(self) -> bool:
        return self.ready is None or self.ready()

    def release(self) -> None:
        """It left the queue: mark it, and let go of everything it carried."""
        self.gone = True
        self.dispatch = self.context = self.future = self.ready = None


def compacted(entries: list[_E] | deque[_E], live: int) -> bool:
    """Whether ``entries`` (a lazily cleaned list of which ``live`` are waiting) holds so many
    left ones that it is worth rebuilding: amortised O(1) per removal."""
    return len(entries) > 2 * live + _SLACK


def live_heap(
    entries: Iterable[tuple[float, int, QueuedRequest[T]]],
) -> list[tuple[float, int, QueuedRequest[T]]]:
    """A (deadline, seq, request) heap of the entries still waiting."""
    heap = [entry for entry in entries if not entry[2].gone]
    heapq.heapify(heap)
    return heap


class Flow(Generic[T]):
    """One fairness id's requests in a band, in the band's ordering."""

    __slots__ = ("_fifo", "_heap", "_ordering", "flow_id", "live")

    def __init__(self, flow_id: str, ordering: OrderingPolicy) -> None:
        self.flow_id = flow_id
        self._ordering = ordering
        self._fifo: deque[QueuedRequest[T]] = deque()
        self._heap: list[tuple[float, int, QueuedRequest[T]]] = []
        self.live = 0  # requests of this flow still waiting (its lists may hold left ones)

    def push(self, item: QueuedRequest[T]) -> None:
        self.live += 1
        if self._ordering is OrderingPolicy.EDF:
            heapq.heappush(self._heap, (item.deadline, item.seq, item))
        else:
            self._fifo.append(item)

    def left(self) -> None:
        """One of its requests left the queue (by any path): clean up when worth it."""
        self.live -= 1
        if self._ordering is OrderingPolicy.EDF:
            if compacted(self._heap, self.live):
                self._heap = live_heap(self._heap)
        elif compacted(self._fifo, self.live):
            self._fifo = deque(i for i in self._fifo if not i.gone)

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
    """The requests of one priority: counts, limits, and the fairness between its flows.

    Only flows with a waiting request exist: a flow is made by its first request and dropped
    when its last one leaves, so a client inventing fairness ids grows nothing beyond the
    requests the queue limits let wait.
    """

    __slots__ = ("_arrivals", "_flows", "bytes", "config", "count", "priority")

    def __init__(self, priority: int, config: BandConfig) -> None:
        self.priority = priority
        self.config = config
        self.count = 0
        self.bytes = 0
        # the flows with waiting requests, in round-robin turn order (next turn first)
        self._flows: OrderedDict[str, Flow[T]] = OrderedDict()
        self._arrivals: deque[QueuedRequest[T]] = deque()  # for eviction: newest last

    @property
    def flows(self) -> int:
        """How many flows (fairness ids) have a request waiting in this band."""
        return len(self._flows)

    def fits(self, size: int) -> bool:
        c = self.config
        return (not c.max_requests or self.count < c.max_requests) and (
            not c.max_bytes or self.bytes + size <= c.max_bytes
        )

    def push(self, item: QueuedRequest[T]) -> None:
        flow = self._flows.get(item.flow_id)
        if flow is None:
            flow = self._flows[item.flow_id] = Flow(item.flow_id, self.config.ordering)
        flow.push(item)
        self._arrivals.append(item)
        self.count += 1
        self.bytes += item.size

    def removed(self, item: QueuedRequest[T]) -> None:
        """Account for ``item`` leaving by any path (it is already marked ``gone``): its flow
        goes with its last request, and the lists that still hold it are cleaned up in time."""
        self.count -= 1
        self.bytes -= item.size
        flow = self._flows.get(item.flow_id)
        if flow is not None:
            flow.left()
            if flow.live <= 0:
                del self._flows[item.flow_id]
        if compacted(self._arrivals, self.count):
            self._arrivals = deque(i for i in self._arrivals if not i.gone)

    def pop(self, ready_only: bool = False) -> QueuedRequest[T] | None:
        """The next request by the band's fairness policy (``None``: nothing waits).

        ``ready_only``: pass over the requests that cannot go yet (``can_go``), in a flow's
        order: the first one that can goes; a flow none of whose requests can keeps its turn.
        The request is taken out of its flow's order; ``removed`` follows when it has left.
        """
        if self.count == 0:
            return None
        if self.config.fairness is FairnessPolicy.GLOBAL_FIFO:
            return self._pop_oldest(ready_only)
        for _ in range(len(self._flows)):
            flow_id, flow = next(iter(self._flows.items()))
            self._flows.move_to_end(flow_id)  # its turn comes again after the others'
            item = flow.first_ready() if ready_only else flow.head()
            if item is not None:
                flow.take(item)
                return item
        return None

    def _pop_oldest(self, ready_only: bool) -> QueuedRequest[T] | None:
        best: Flow[T] | None = None
        best_item: QueuedRequest[T] | None = None
        for flow in self._flows.values():
            item = flow.first_ready() if ready_only else flow.head()
            if item is not None and (best_item is None or item.seq < best_item.seq):
                best, best_item = flow, item
        if best is None or best_item is None:
            return None
        best.take(best_item)
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
