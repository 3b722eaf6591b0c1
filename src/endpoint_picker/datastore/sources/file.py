"""The pool file: a multi-document YAML file of InferencePool, InferenceModel and Pod objects.

Watched by polling its identity (inode, size, mtime). The first load is immediate; a later change
is applied only once the file has stayed the same (identity and content) for ``settle_time``: a
writer caught mid-write leaves a prefix that may still parse, and serving it would route by part
of the pool. A settled change is still refused when it would take every pod from a pool that
serves some, unless its InferencePool is annotated ``endpoint-picker.io/allow-empty-pool: "true"``:
a truncated file loses pods, while a complete one may mark them all NotReady (then it applies,
and requests get 503 as they would from the reference, rather than go to pods known unready).
A refused, invalid, unreadable or missing file keeps the last good pool. Each distinct content is
handled (and logged) once, and its outcome reported to a ``ReloadObserver``.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Protocol

import structlog
import yaml

from endpoint_picker import yamlsafe
from endpoint_picker.datastore.decode import decode_documents
from endpoint_picker.datastore.objects import ClusterState
from endpoint_picker.datastore.pool import PoolState
from endpoint_picker.errors import ConfigError, clip
from endpoint_picker.types import Endpoint

log = structlog.get_logger(__name__)


# On the InferencePool: the file empties the pool on purpose (scale to zero), so apply it.
ALLOW_EMPTY_POOL_ANNOTATION = "endpoint-picker.io/allow-empty-pool"


class ReloadResult(StrEnum):
    """The outcome of one settled change of the pool file (the metric's ``result`` label)."""

    APPLIED = "applied"
    REJECTED_EMPTY = "rejected_empty"  # would have removed every pod; not marked deliberate
    INVALID = "invalid"  # missing, unreadable, not YAML, or not a valid pool


class ReloadObserver(Protocol):
    def pool_reload(self, result: ReloadResult) -> None: ...


class PoolTarget(Protocol):
    """What the source needs of the datastore: the pool in force, a dry run, and the swap."""

    @property
    def endpoints(self) -> tuple[Endpoint, ...]: ...

    def resolve(self, cluster: ClusterState) -> PoolState: ...

    def apply(self, cluster: ClusterState) -> object: ...


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read pool file: {exc.strerror}", str(path)) from exc


def load_pool_file(path: Path) -> ClusterState:
    """Read, parse and decode the file; every failure is a ``ConfigError`` naming the spot."""
    return parse_pool_bytes(_read(path), str(path))


def parse_pool_bytes(data: bytes, source: str) -> ClusterState:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text (byte {exc.start})", source) from exc
    return parse_pool_text(text, source)


def parse_pool_text(text: str, source: str) -> ClusterState:
    try:
        # libyaml's loader when present: a large pool file parses several times faster
        docs = list(yaml.load_all(text, Loader=yamlsafe.Loader))
    except RecursionError as exc:
        raise ConfigError("invalid YAML: nested too deeply", source) from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"invalid YAML: {problem}", where) from exc
    except yamlsafe.VALUE_ERRORS as exc:
        what = clip(f"{type(exc).__name__}: {exc}")
        raise ConfigError(f"invalid YAML: a value it cannot build ({what})", source) from exc
    try:
        return decode_documents(docs, source)
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError, RecursionError) as exc:
        # a shape the decoder did not foresee: still one clear line, never a traceback
        raise ConfigError(f"unexpected content: {exc}", source) from exc


_Identity = tuple[int, int, int]


def _identity(path: Path) -> _Identity | None:
    """Inode, size and mtime (None when missing): an atomic rename changes the inode."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _snapshot(path: Path) -> tuple[bytes | None, str]:
    """The file's bytes (None when unreadable) and a key naming that content or that failure."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        return None, f"cannot read pool file: {exc.strerror}"
    return data, hashlib.sha256(data).hexdigest()


@dataclass(frozen=True, slots=True)
class _Pending:
    """A change seen but not settled yet: what it looked like and since when."""

    identity: _Identity | None
    key: str
    since: float


class _NoObserver:
    def pool_reload(self, result: ReloadResult) -> None:
        pass


class PoolFileSource:
    """Loads the pool file once, then applies every settled, acceptable change to ``target``."""

    def __init__(
        self,
        path: Path,
        target: PoolTarget,
        *,
        observer: ReloadObserver | None = None,
        poll_interval: float = 0.25,
        settle_time: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._path = path
        self._source = os.fspath(path)  # a plain string in logs and error paths
        self._target = target
        self._observer = observer or _NoObserver()
        self._poll_interval = poll_interval
        self._settle_time = settle_time
        self._clock = clock
        self._sleep = sleep
        self._handled: _Identity | None = None  # the version last handled, applied or not
        self._handled_key = ""
        self._pending: _Pending | None = None
        self.healthy = True  # False while the file's current content is refused

    def load_initial(self) -> None:
        """The first load, immediate: failures propagate (the CLI exits 2 with the message)."""
        identity = _identity(self._path)  # before the read: a change during it shows next poll
        data = _read(self._path)
        self._target.apply(parse_pool_bytes(data, self._source))
        self._handled, self._handled_key = identity, hashlib.sha256(data).hexdigest()
        self._observer.pool_reload(ReloadResult.APPLIED)

    async def watch(self) -> None:
        """Poll for changes forever; runs as a named app task."""
        while True:
            await self._sleep(self._poll_interval)
            try:
                self.poll()
            except Exception:  # never let one odd edit end the watch
                log.exception("pool file check failed; keeping the last good pool")

    def poll(self) -> None:
        """One check: note a change, or handle it once it has stayed the same long enough."""
        identity = _identity(self._path)
        if identity == self._handled:
            self._pending = None
            return
        now = self._clock()
        pending = self._pending
        if pending is None or pending.identity != identity:
            # a new change (or the writer is still at it): the settle time starts again
            self._pending = pending = _Pending(identity, _snapshot(self._path)[1], now)
        if now - pending.since < self._settle_time:
            return
        data, key = _snapshot(self._path)
        if key != pending.key:  # rewritten in place within one mtime tick: wait again
            self._pending = _Pending(identity, key, now)
            return
        self._pending = None
        self._handled = identity
        if key != self._handled_key:  # else touched, or rewritten with the same bytes
            self._handled_key = key
            self._handle(data, key)

    def _handle(self, data: bytes | None, key: str) -> None:
        try:
            if data is None:  # the key says why
                raise ConfigError(key, self._source)
            cluster = parse_pool_bytes(data, self._source)
            new = self._target.resolve(cluster)
        except ConfigError as exc:
            self._refuse(ReloadResult.INVALID, error=str(exc))
            return
        allowed = (new.pool.annotation(ALLOW_EMPTY_POOL_ANNOTATION) or "").lower() == "true"
        if not new.pod_count and self._target.endpoints and not allowed:
            self._refuse(
                ReloadResult.REJECTED_EMPTY,
                error="the change would remove every pod of the pool",
                endpoints_in_force=len(self._target.endpoints),
                hint=f"to empty the pool on purpose, annotate the InferencePool "
                f'{ALLOW_EMPTY_POOL_ANNOTATION}: "true"',
            )
            return
        self._target.apply(cluster)
        log.info(
            "pool file reloaded",
            path=self._source,
            endpoints=len(new.endpoints),
            pods=new.pod_count,
        )
        self.healthy = True
        self._observer.pool_reload(ReloadResult.APPLIED)

    def _refuse(self, result: ReloadResult, **details: object) -> None:
        # a refused empty pool is a warning: the file parsed, but applying it would serve 503s
        emit = log.warning if result is ReloadResult.REJECTED_EMPTY else log.error
        emit(
            "pool file change refused; keeping the last good pool",
            path=self._source,
            result=result.value,
            **details,
        )
        self.healthy = False
        self._observer.pool_reload(result)
