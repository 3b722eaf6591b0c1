"""List, then watch, one kind of object in one namespace, keeping the decoded objects by name.

The loop a Kubernetes informer runs, written out:

1. **List** the objects (``request_timeout`` bounds it) and replace the whole store with them:
   an object deleted while nobody watched disappears here. The list's ``resourceVersion`` is
   where the watch starts.
2. **Watch** from that version. Each event updates the store and calls ``on_change``. The API
   server ends the watch after ``watch_timeout`` seconds; the client then watches again from
   the last version seen. A watch silent for ``inactivity_timeout`` (a quiet kind, or a
   half-open connection: they look alike) is reopened at once from the last version.
3. **410 Gone** (the version is older than the server keeps, as an ERROR event or an HTTP
   status): list again at once, step 1.
4. **Any other failure** (connection refused or dropped, a 5xx, a timeout): wait with
   exponential backoff and jitter, then watch again from the last version seen (or list, when
   none was seen yet).
5. **404** on the list (the CRD is not installed): the kind counts as synced and empty, and is
   looked for again every ``missing_resource_retry`` seconds.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Generic, TypeVar, cast

import httpx2
import structlog
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError

from endpoint_picker.errors import ConfigError
from endpoint_picker.settings import KubernetesSettings

log = structlog.get_logger(__name__)

T = TypeVar("T")


class _Gone(Exception):
    """The watch's resourceVersion is too old: list again."""


class _Silent(Exception):
    """No event for ``inactivity_timeout``: reopen the watch (not a failure in itself)."""


def status_code(exc: BaseException) -> int | None:
    """The HTTP status of a client error: an API ``Status`` or the plain response."""
    if isinstance(exc, ApiError) and exc.status is not None and exc.status.code:
        return int(exc.status.code)
    if isinstance(exc, httpx2.HTTPStatusError):
        response = getattr(exc, "response", None)
        if response is not None:
            return int(response.status_code)
    return None


class Reflector(Generic[T]):
    """Keeps ``objects`` equal to the API server's view of one kind (see the module doc)."""

    def __init__(
        self,
        kind: str,
        client: AsyncClient,
        resource: type[Any],
        namespace: str,
        decode: Callable[[Any], T],
        on_change: Callable[[], None],
        settings: KubernetesSettings,
        *,
        fields: dict[str, Any] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.kind = kind
        self._client = client
        self._resource = resource
        self._namespace = namespace
        self._decode = decode
        self._on_change = on_change
        self._settings = settings
        self._fields = fields
        self._sleep = sleep
        self._rng = rng or random.Random()
        self.objects: dict[str, T] = {}
        self.synced = False  # the first list has completed (or the kind is not installed)
        self.connected = False  # a watch is open now
        self._version: str | None = None  # the last resourceVersion seen
        self._progressed = False  # a list or an event since the last failure

    async def run(self) -> None:
        """The loop, forever; runs inside a named app task."""
        backoff = self._settings.backoff_initial
        while True:
            try:
                if self._version is None:
                    await self._list()
                await self._watch()
            except _Gone:
                log.info("watch expired (410 Gone), listing again", kind=self.kind)
                self._version = None
                continue
            except _Silent:
                # A quiet kind is normal; a half-open connection looks the same. Reopen at
                # once from the last version: a dead server then fails the reconnect instead.
                log.debug("kubernetes watch silent; reopening", kind=self.kind)
                continue
            except Exception as exc:  # HTTP, connection, timeout, or a line that is not JSON
                self.connected = False
                if self._progressed:  # it worked for a while: start the backoff over
                    backoff = self._settings.backoff_initial
                    self._progressed = False
                code = status_code(exc)
                if code == 404:  # the CRD is not installed (or was just removed)
                    self._version = None
                    await self._missing()
                    continue
                if code == 410:
                    log.info("watch expired (410 Gone), listing again", kind=self.kind)
                    self._version = None
                    continue
                delay = backoff * self._rng.uniform(0.5, 1.0)
                log.warning(
                    "kubernetes watch failed; reconnecting",
                    kind=self.kind,
                    error=f"{type(exc).__name__}: {exc}",
                    status=code,
                    retry_in_seconds=round(delay, 2),
                )
                await self._sleep(delay)
                backoff = min(backoff * 2, self._settings.backoff_max)

    async def _missing(self) -> None:
        """The kind is not served (its CRD is not installed): synced and empty, look again."""
        log.warning(
            "kubernetes kind not served (CRD not installed?); treating it as empty",
            kind=self.kind,
            retry_in_seconds=self._settings.missing_resource_retry,
        )
        if self.objects or not self.synced:
            self.objects = {}
            self.synced = True
            self._on_change()
        await self._sleep(self._settings.missing_resource_retry)

    async def _list(self) -> None:
        listing = self._client.list(self._resource, namespace=self._namespace, fields=self._fields)
        items: list[Any] = []
        async with asyncio.timeout(self._settings.request_timeout):
            async for item in listing:
                items.append(item)
        objects: dict[str, T] = {}
        for item in items:
            decoded = self._decode_or_none(item)
            if decoded is not None:
                objects[item.metadata.name] = decoded
        self._progressed = True
        self.objects = objects
        self._version = listing.resourceVersion
        self.synced = True
        log.info("kubernetes list", kind=self.kind, objects=len(objects), version=self._version)
        self._on_change()

    async def _watch(self) -> None:
        stream = self._client.watch(
            self._resource,
            namespace=self._namespace,
            fields=self._fields,
            resource_version=self._version,
            server_timeout=max(1, int(self._settings.watch_timeout)),
        )
        events = cast(AsyncGenerator[tuple[str, Any], None], aiter(stream))
        self.connected = True
        try:
            while True:
                try:
                    async with asyncio.timeout(self._settings.inactivity_timeout):
                        event_type, obj = await anext(events)
                except TimeoutError as exc:
                    raise _Silent from exc
                except ApiError as exc:
                    if status_code(exc) == 410:
                        raise _Gone from exc
                    raise
                self._apply(event_type, obj)
        finally:
            self.connected = False
            await events.aclose()

    def _apply(self, event_type: str, obj: Any) -> None:
        meta = obj.metadata
        if meta is not None and meta.resourceVersion:
            self._version = meta.resourceVersion
        self._progressed = True
        if event_type == "BOOKMARK" or meta is None or not meta.name:
            return
        if event_type == "DELETED":
            if self.objects.pop(meta.name, None) is None:
                return
        else:  # ADDED, MODIFIED
            decoded = self._decode_or_none(obj)
            if decoded is None:
                if self.objects.pop(meta.name, None) is None:
                    return
            else:
                self.objects[meta.name] = decoded
        self._on_change()

    def _decode_or_none(self, obj: Any) -> T | None:
        try:
            return self._decode(obj)
        except ConfigError as exc:
            log.warning("kubernetes object refused; leaving it out", kind=self.kind, error=str(exc))
            return None
