"""The pool file: a multi-document YAML file of InferencePool, InferenceModel and Pod objects.

Watched by polling its identity (inode, size, mtime): an edit takes effect within one poll
interval, atomically; an invalid edit keeps the last good state and logs the field at fault.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import yaml

from endpoint_picker.datastore.decode import decode_documents
from endpoint_picker.datastore.objects import ClusterState
from endpoint_picker.errors import ConfigError

log = structlog.get_logger(__name__)

_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_pool_file(path: Path) -> ClusterState:
    """Read, parse and decode the file; every failure is a ``ConfigError`` naming the spot."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read pool file: {exc.strerror}", str(path)) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text (byte {exc.start})", str(path)) from exc
    return parse_pool_text(text, str(path))


def parse_pool_text(text: str, source: str) -> ClusterState:
    try:
        # libyaml's loader when present: a large pool file parses several times faster
        docs = list(yaml.load_all(text, Loader=_LOADER))
    except RecursionError as exc:
        raise ConfigError("invalid YAML: nested too deeply", source) from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"invalid YAML: {problem}", where) from exc
    try:
        return decode_documents(docs, source)
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError, RecursionError) as exc:
        # a shape the decoder did not foresee: still one clear line, never a traceback
        raise ConfigError(f"unexpected content: {exc}", source) from exc


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class PoolFileSource:
    """Loads the pool file once, then applies every valid edit through ``apply``."""

    def __init__(
        self,
        path: Path,
        apply: Callable[[ClusterState], object],
        poll_interval: float = 0.25,
    ) -> None:
        self._path = path
        self._apply = apply
        self._poll_interval = poll_interval
        self._seen: tuple[int, int, int] | None = None

    def load_initial(self) -> None:
        """The first load: failures propagate (the CLI exits 2 with the message)."""
        self._seen = _identity(self._path)
        self._apply(load_pool_file(self._path))

    async def watch(self) -> None:
        """Poll for edits forever; runs as a named app task."""
        while True:
            await asyncio.sleep(self._poll_interval)
            current = _identity(self._path)
            if current == self._seen or current is None:
                continue
            self._seen = current
            try:
                self.reload()
            except Exception:  # never let one odd edit end the watch
                log.exception("pool file reload failed; keeping the last good state")

    def reload(self) -> bool:
        """Apply the file as it is now; on failure keep the last good state and say why."""
        try:
            self._apply(load_pool_file(self._path))
        except ConfigError as exc:
            log.error("pool file edit rejected; keeping the last good state", error=str(exc))
            return False
        # os.fspath keeps the log value a plain string in JSON output
        log.info("pool file reloaded", path=os.fspath(self._path))
        return True
