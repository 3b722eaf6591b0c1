"""What the parent and its workers say to each other, and how it is framed on the wire.

One Unix socketpair per worker carries pickles of the frozen dataclasses below and of the ones
they hold (``Endpoint``, ``MetricsSnapshot``, the pool objects). Pickle is safe here: both ends
are our own processes and the socketpair is reachable from nowhere else. Each message is pickled
once by the parent and the same bytes are written to every worker.

A message travels as one or more frames: a 4-byte big-endian header (its top bit set when more
frames of the same message follow, the rest the frame's length, at most ``MAX_FRAME``), then
that many bytes of the pickle. A pickle longer than a frame is split, as HTTP/2 splits a message
into DATA frames, so no size of answer (a worker's exposition with a thousand model labels, its
decisions) can break the channel; a message is refused only past ``MAX_MESSAGE``, where
``encode`` raises ``MessageTooLarge`` for the sender to trim what it says (never a reason to
close the channel). A reader that meets a frame over the limit, or a message over
``MAX_MESSAGE``, is talking to something that is not our sender: ``ChannelClosed``, with why.

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

import structlog

from endpoint_picker.datastore import PoolState
from endpoint_picker.errors import EppError
from endpoint_picker.settings import Settings
from endpoint_picker.types import Endpoint, MetricsSnapshot

log = structlog.get_logger(__name__)

_HEADER = struct.Struct(">I")
_MORE = 1 << 31  # the header's flag: another frame of this message follows
MAX_FRAME = 4 * 1024 * 1024  # bytes of one frame: a pool of thousands of endpoints fits in one
MAX_MESSAGE = 256 * 1024 * 1024  # bytes of one message, all its frames together


class ChannelClosed(EppError):
    """The other end of a worker channel is gone (EOF) or sent what cannot be read; ``eof``:
    it closed at a message boundary, as a worker that exits does."""

    def __init__(self, reason: str, *, eof: bool = False) -> None:
        super().__init__(reason)
        self.eof = eof


class MessageTooLarge(ValueError):
    """A message whose pickle is over ``MAX_MESSAGE`` bytes: the sender must say less."""

    def __init__(self, size: int) -> None:
        super().__init__(f"a message of {size} bytes (at most {MAX_MESSAGE})")
        self.size = size


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
    """The message's frames, ready to write: its pickle, split past ``MAX_FRAME`` bytes;
    ``MessageTooLarge`` past ``MAX_MESSAGE``."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    size = len(data)
    if size <= MAX_FRAME:  # nearly every message: one frame, one copy
        return _HEADER.pack(size) + data
    if size > MAX_MESSAGE:
        raise MessageTooLarge(size)
    view = memoryview(data)
    parts: list[bytes | memoryview] = []
    for start in range(0, size, MAX_FRAME):
        chunk = view[start : start + MAX_FRAME]
        last = start + MAX_FRAME >= size
        parts += (_HEADER.pack(len(chunk) | (0 if last else _MORE)), chunk)
    return b"".join(parts)


def encode_answer(ask: Ask, payload: object) -> bytes:
    """The answer to ``ask``, framed. One too large for the channel is trimmed, logged: a list
    (the decisions, newest first) to its newest half, again until it fits; anything else (an
    exposition) to no answer, so the parent keeps the previous one. Never a reason to close
    the channel, which would restart the worker."""
    while True:
        try:
            return encode(Answer(ask.ask_id, payload))
        except MessageTooLarge as exc:
            log.error("answer too large for the parent's channel; trimmed",
                      question=ask.what, size=exc.size)  # fmt: skip
            payload = payload[: len(payload) // 2] if isinstance(payload, list) else None


async def read_message(reader: asyncio.StreamReader) -> object:
    """The next message; ``ChannelClosed`` at EOF or on frames that cannot be read."""
    chunks: list[bytes] = []
    total = 0
    try:
        while True:
            try:
                header = await reader.readexactly(_HEADER.size)
            except asyncio.IncompleteReadError as exc:
                if not exc.partial and not chunks:
                    raise ChannelClosed("end of channel", eof=True) from exc
                raise
            (word,) = _HEADER.unpack(header)
            size = word & ~_MORE
            if size > MAX_FRAME:
                raise ChannelClosed(f"a frame of {size} bytes (at most {MAX_FRAME})")
            total += size
            if total > MAX_MESSAGE:
                raise ChannelClosed(f"a message of over {total} bytes (at most {MAX_MESSAGE})")
            chunks.append(await reader.readexactly(size))
            if not word & _MORE:
                break
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise ChannelClosed(f"cut off mid-message: {exc}") from exc
    data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    try:
        return pickle.loads(data)  # our own processes, a private socketpair
    except Exception as exc:
        raise ChannelClosed(f"undecodable message of {len(data)} bytes: {exc}") from exc


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
