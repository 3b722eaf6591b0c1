"""What the parent and its workers say to each other, and how it is framed on the wire.

One Unix socketpair per worker carries length-prefixed pickles (a 4-byte big-endian length,
then the pickle) of the frozen dataclasses below and of the ones they hold (``Endpoint``,
``MetricsSnapshot``, the pool objects). Pickle is safe here: both ends are our own processes
and the socketpair is reachable from nowhere else. Each frame is pickled once by the parent and
the same bytes are written to every worker.

Parent to worker: ``Init`` (first, once), ``PoolUpdate``, ``MetricsUpdate``, ``Unreachable``,
``Readiness``, ``Ask``. Worker to parent: ``Serving``, ``Answer``.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from endpoint_picker.datastore import PoolState
from endpoint_picker.settings import Settings
from endpoint_picker.types import Endpoint, MetricsSnapshot

_HEADER = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024  # a pool of many thousand endpoints fits far below this


class ChannelClosed(Exception):
    """The other end of a worker channel is gone (EOF or a broken frame)."""


@dataclass(frozen=True, slots=True)
class Init:
    """The worker's whole configuration: its row in the in-flight table and the TLS material
    (loaded or generated once by the parent, so every worker presents the same certificate)."""

    settings: Settings
    index: int  # the worker's row in the in-flight table (a recycled worker's successor
    # takes the worker's other row, so that both can count while the old one drains)
    table_rows: int
    table_capacity: int
    tls: tuple[bytes, bytes] | None  # (key, chain) PEM
    client_ca: bytes | None


@dataclass(frozen=True, slots=True)
class PoolUpdate:
    """The pool as the parent resolved it, and the in-flight table slot of each endpoint."""

    state: tuple[Any, ...]  # ``pack_pool``: PoolState without its (unpicklable) mapping proxies
    slots: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class MetricsUpdate:
    """Fresh snapshots, batched: every scrape that finished since the last frame."""

    snapshots: tuple[tuple[Endpoint, MetricsSnapshot], ...]


@dataclass(frozen=True, slots=True)
class Unreachable:
    hostport: str
    reason: str


@dataclass(frozen=True, slots=True)
class Readiness:
    """The parent's readiness (its source loaded, synced and, with HA, leading)."""

    ready: bool


@dataclass(frozen=True, slots=True)
class Ask:
    """A question the worker answers with an ``Answer`` of the same ``ask_id``."""

    ask_id: int
    what: str  # "metrics": its exposition (bytes); "decisions": DecisionLog.recent()


@dataclass(frozen=True, slots=True)
class Answer:
    ask_id: int
    payload: Any


@dataclass(frozen=True, slots=True)
class Serving:
    """The worker's ext_proc server is up and it holds a pool (or no longer, when False)."""

    serving: bool


@dataclass(frozen=True, slots=True)
class CaughtUp:
    """Everything the parent held when the worker started has been sent: once it has applied
    this far, the worker reports ``Serving``."""


@dataclass(frozen=True, slots=True)
class Retire:
    """The worker has served its ``--worker-max-requests``: start its replacement, then drain
    it (it keeps serving until told)."""

    streams: int


@dataclass(frozen=True, slots=True)
class Drain:
    """Parent to a retiring worker, once its successor serves: stop taking streams and give the
    open ones up to ``grace`` seconds (a turnover is in no hurry, unlike a shutdown)."""

    grace: float


@dataclass(frozen=True, slots=True)
class Final:
    """The worker's last exposition, sent as it exits after a drain: what it counted since the
    parent last asked stays in the merged /metrics."""

    metrics: bytes


def encode(message: object) -> bytes:
    """One frame: length prefix and pickle."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


async def read_message(reader: asyncio.StreamReader) -> object:
    """The next message; ``ChannelClosed`` at EOF or on a frame that cannot be read."""
    try:
        header = await reader.readexactly(_HEADER.size)
        (size,) = _HEADER.unpack(header)
        if size > MAX_FRAME:
            raise ChannelClosed(f"frame of {size} bytes")
        data = await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise ChannelClosed(str(exc)) from exc
    try:
        return pickle.loads(data)  # our own processes, a private socketpair
    except Exception as exc:
        raise ChannelClosed(f"undecodable frame: {exc}") from exc


def pack_pool(state: PoolState) -> tuple[Any, ...]:
    """``PoolState`` as plain picklable values (``MappingProxyType`` does not pickle)."""
    return (
        state.pool,
        tuple(state.models.items()),
        state.endpoints,
        state.configured_names,
        tuple(state.objectives.items()),
        state.pod_count,
        state.duplicates,
    )


def unpack_pool(packed: tuple[Any, ...]) -> PoolState:
    pool, models, endpoints, configured, objectives, pod_count, duplicates = packed
    return PoolState(
        pool=pool,
        models=MappingProxyType(dict(models)),
        endpoints=endpoints,
        configured_names=configured,
        objectives=MappingProxyType(dict(objectives)),
        pod_count=pod_count,
        duplicates=duplicates,
    )
