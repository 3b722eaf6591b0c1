"""The two roles an ``App`` takes with ``epp serve --workers N`` (N > 1), besides doing it all.

A *parent* app hands routing to ``Routers`` (the worker processes; ``workers.WorkerPool``) and
keeps the pool source, the scrapers, the health port and the metrics port. A *worker* app
(``WorkerRole``) only routes: its parent feeds its datastore, and its ext_proc port is shared
with its siblings by SO_REUSEPORT.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from endpoint_picker.scheduling.lifecycle import InFlight
from endpoint_picker.status.view import InFlightCounts, RecentDecisions


@dataclass(frozen=True, slots=True)
class WorkerRole:
    """This app is one worker of several: it routes, and its parent feeds its datastore."""

    inflight: InFlight  # a SharedInFlight over the machine-wide table
    tls: tuple[bytes, bytes] | None  # the parent's (key, chain): one certificate for all
    client_ca: bytes | None
    # Awaited once the director is built and before the ext_proc port listens: the worker
    # applies its parent's pool and snapshots there, so that no stream finds it without them.
    before_listen: Callable[[], Awaitable[None]] | None = None


class Routers(Protocol):
    """The worker processes a parent app hands routing to (``workers.WorkerPool``)."""

    @property
    def inflight(self) -> InFlightCounts: ...

    @property
    def decisions(self) -> RecentDecisions: ...

    async def start(self, tls: tuple[bytes, bytes] | None, client_ca: bytes | None) -> int:
        """Start the workers; the ext_proc port they share. ``ConfigError`` on failure."""
        ...

    async def refresh(self) -> None:
        """Collect the workers' metrics and decisions (before /metrics or the status page)."""
        ...

    def render(self, own: bytes) -> bytes:
        """``own`` exposition merged with the workers' last collected ones."""
        ...

    async def drain(self, grace: float) -> None: ...

    def kill(self) -> None:
        """SIGKILL every worker now (a second signal: the operator wants out without a drain)."""
        ...
