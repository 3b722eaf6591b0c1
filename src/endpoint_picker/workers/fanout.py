"""The parent's pool and metrics, fanned out to every worker as they change.

The parent's sources and scrapers write to a ``PublishingDatastore``: the ordinary datastore
(the status page and the pool gauges read it) that also hands each change to the
``Publisher``. The publisher keeps the latest of everything, so a restarted worker starts from
the present, and sends each change once per worker: the pool (with the in-flight table's
slots) at once, metrics snapshots gathered for up to ``FLUSH_DELAY`` (the scrapes that
finished meanwhile share a frame, up to ``FRAME_SNAPSHOTS`` a frame; a full frame goes at once),
pickled once for all workers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from endpoint_picker.datastore import Datastore, PoolState
from endpoint_picker.types import Endpoint, MetricsSnapshot
from endpoint_picker.workers.messages import (
    MetricsUpdate,
    PoolUpdate,
    Readiness,
    Unreachable,
    encode,
    pack_pool,
)
from endpoint_picker.workers.table import SlotMap

Send = Callable[[bytes], None]  # the same frame to every live worker

# A worker applies a frame in one go (about 8 µs a snapshot to unpickle and swap in) and looks
# at its ext_proc sockets between frames: scrapes that finish together (hundreds in one turn
# with a thousand endpoints) go out in frames of this many, so no frame holds a pick for more
# than a quarter of a millisecond.
FRAME_SNAPSHOTS = 32
# Each frame wakes every worker (a context switch, a read, an unpickle) on the cores the routing
# shares. Sent every loop turn, a 1,024-endpoint pool's 5,000 snapshots a second went out in
# 600-2,500 frames a second, as many as the scraper's turns; gathered for 5 ms, at most 200 plus
# the full ones. A snapshot's age counts from its page's arrival, so the delay shows in it.
FLUSH_DELAY = 0.005


class Publisher:
    """The latest pool, snapshots, unreachable marks and readiness; sends each change."""

    def __init__(self, slot_map: SlotMap, send: Send) -> None:
        self._slots = slot_map
        self._send = send
        self._pool: bytes | None = None
        self._snapshots: dict[str, tuple[Endpoint, MetricsSnapshot]] = {}
        self._unreachable: dict[str, str] = {}
        self._ready = False
        self._pending: dict[str, tuple[Endpoint, MetricsSnapshot]] = {}  # newest per endpoint
        self._timer: asyncio.TimerHandle | None = None

    def pool(self, state: PoolState) -> None:
        live = {e.hostport for e in state.endpoints}
        slots = self._slots.update(e.hostport for e in state.endpoints)
        self._snapshots = {k: v for k, v in self._snapshots.items() if k in live}
        self._pending = {k: v for k, v in self._pending.items() if k in live}
        self._unreachable = {k: v for k, v in self._unreachable.items() if k in live}
        self._pool = encode(PoolUpdate(pack_pool(state), tuple(slots.items())))
        self._send(self._pool)

    def metrics(self, endpoint: Endpoint, snapshot: MetricsSnapshot) -> None:
        item = (endpoint, snapshot)
        self._snapshots[endpoint.hostport] = item
        self._unreachable.pop(endpoint.hostport, None)
        self._pending[endpoint.hostport] = item
        if len(self._pending) >= FRAME_SNAPSHOTS:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(FLUSH_DELAY, self.flush)

    def flush(self) -> None:
        """Send the snapshots gathered since the last flush, ``FRAME_SNAPSHOTS`` a frame."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._pending:
            items, self._pending = tuple(self._pending.values()), {}
            for start in range(0, len(items), FRAME_SNAPSHOTS):
                self._send(encode(MetricsUpdate(items[start : start + FRAME_SNAPSHOTS])))

    def unreachable(self, hostport: str, reason: str) -> None:
        self.flush()  # a snapshot gathered before the mark must not reach a worker after it
        self._unreachable[hostport] = reason
        self._send(encode(Unreachable(hostport, reason)))

    def readiness(self, ready: bool) -> None:
        self._ready = ready
        self._send(encode(Readiness(ready)))

    def catch_up(self) -> Iterable[bytes]:
        """Everything a newly started worker needs, as frames, in order."""
        if self._pool is not None:
            yield self._pool
        if self._snapshots:
            yield encode(MetricsUpdate(tuple(self._snapshots.values())))
        for hostport, reason in self._unreachable.items():
            yield encode(Unreachable(hostport, reason))
        yield encode(Readiness(self._ready))


class PublishingDatastore(Datastore):
    """A ``Datastore`` that also publishes each change to the workers (the parent's)."""

    def __init__(self, pool_name: str | None, publisher: Publisher) -> None:
        super().__init__(pool_name)
        self._publisher = publisher

    def install(self, new: PoolState) -> PoolState:
        state = super().install(new)
        self._publisher.pool(state)
        return state

    def update_metrics(self, endpoint: Endpoint, snapshot: MetricsSnapshot) -> None:
        super().update_metrics(endpoint, snapshot)
        if self.metrics_of(endpoint.hostport) is snapshot:  # not a late one for a removed pod
            self._publisher.metrics(endpoint, snapshot)

    def mark_unreachable(self, hostport: str, reason: str) -> None:
        before = hostport in self._unreachable
        super().mark_unreachable(hostport, reason)
        if not before and hostport in self._unreachable:
            self._publisher.unreachable(hostport, reason)
