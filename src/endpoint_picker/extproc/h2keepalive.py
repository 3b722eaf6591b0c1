"""Keepalive and idleness of one h2 ext_proc connection, as grpc's core does them: a connection
that sent nothing for the keepalive time is PINGed, and closed when the PING goes unanswered;
one without calls for the idle time gets a GOAWAY that still lets streams in and a PING, then,
once the PING is answered (the client has seen the GOAWAY), a final GOAWAY naming the last
stream, and the close when no call is left. One timer per connection, armed for the next due.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import structlog

from endpoint_picker.settings import GrpcConnectionSettings

log = structlog.get_logger(__name__)

KEEPALIVE_PING = b"epp-live"  # PING payloads (8 bytes): keepalive, and the idle close's
IDLE_PING = b"epp-idle"


class Peer(Protocol):
    """The connection, as its keepalive sees it."""

    now: float  # the connection's clock as of its last read, which the timer moves on too

    @property
    def calls(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    @property
    def closing(self) -> bool:
        """Closed, or its transport is."""

    @property
    def drained(self) -> bool:
        """The final GOAWAY was sent: no stream after it is served."""

    def ping(self, data: bytes) -> None: ...

    def goaway(self) -> None: ...

    def last_goaway(self) -> None: ...

    def close(self, *, abort: bool = False) -> None: ...


class Keepalive:
    """The keepalive and idleness clocks of ``peer`` and its one timer."""

    def __init__(
        self, peer: Peer, limits: GrpcConnectionSettings, loop: asyncio.AbstractEventLoop
    ) -> None:
        self._peer = peer
        self._limits = limits
        self._loop = loop
        self.last_read = self.active_at = peer.now
        self._ping_sent: float | None = None  # the keepalive PING not yet answered
        self._idle_goaway_at: float | None = None  # the idle close's first GOAWAY
        self._timer: asyncio.TimerHandle | None = None

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def ping_acknowledged(self, data: bytes) -> None:
        if data == IDLE_PING:
            self._idle_acknowledged()
        self._ping_sent = None

    def schedule(self) -> None:
        """Arm the one timer of the connection for its next keepalive or idleness check."""
        limits = self._limits
        dues = []
        if self._ping_sent is not None:
            dues.append(self._ping_sent + limits.keepalive_timeout)
        elif limits.keepalive_time:
            dues.append(self.last_read + limits.keepalive_time)
        if self._idle_goaway_at is not None:
            dues.append(self._idle_goaway_at + (limits.keepalive_timeout or 1.0))
        elif limits.max_connection_idle and not self._peer.calls:
            dues.append(self.active_at + limits.max_connection_idle)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if dues:
            self._timer = self._loop.call_at(min(dues), self._tick)

    def went_idle(self) -> None:
        """The last call of an open connection ended: the idle clock starts (the timer may now
        be due sooner)."""
        peer = self._peer
        self.active_at = peer.now = self._loop.time()
        if self._limits.max_connection_idle and self._idle_goaway_at is None:
            timer = self._timer
            due = self.active_at + self._limits.max_connection_idle
            if timer is None or timer.when() > due:
                self.schedule()
        elif self._idle_goaway_at is not None and peer.drained:
            peer.close()  # the idle close's final GOAWAY was sent, its last stream is done

    def _tick(self) -> None:
        self._timer = None
        peer = self._peer
        if peer.closing:
            return
        limits = self._limits
        now = peer.now = self._loop.time()
        if self._ping_sent is not None and self.last_read > self._ping_sent:
            self._ping_sent = None  # something arrived since: alive
        if self._ping_sent is not None and now >= self._ping_sent + limits.keepalive_timeout:
            log.info(
                "ext_proc connection closed: its client answered no keepalive PING",
                calls=peer.calls,
                seconds=round(now - self.last_read, 1),
            )
            peer.close(abort=True)
            return
        if self._idle_goaway_at is not None:
            if now >= self._idle_goaway_at + (limits.keepalive_timeout or 1.0):
                self._idle_acknowledged()  # no PING answer: close anyway
                if peer.closed:
                    return
        elif (
            limits.max_connection_idle
            and not peer.calls
            and now >= self.active_at + limits.max_connection_idle
        ):
            self._close_idle()
        if (
            limits.keepalive_time
            and self._ping_sent is None
            and now >= self.last_read + limits.keepalive_time
        ):
            peer.ping(KEEPALIVE_PING)
            self._ping_sent = now
        self.schedule()

    def _close_idle(self) -> None:
        """grpc's graceful close of an idle connection: a GOAWAY that still lets streams in
        and a PING (its answer: ``_idle_acknowledged``)."""
        log.info("ext_proc connection idle: closing", idle_seconds=self._limits.max_connection_idle)
        self._idle_goaway_at = self._peer.now
        self._peer.goaway()
        self._peer.ping(IDLE_PING)

    def _idle_acknowledged(self) -> None:
        peer = self._peer
        if self._idle_goaway_at is None or peer.drained:
            return
        peer.last_goaway()
        if not peer.calls:
            peer.close()
