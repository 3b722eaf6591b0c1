"""The ext_proc server on h2 alone: gRPC's two methods served straight from HTTP/2 events.

The EPP serves two gRPC methods on this port, ext_proc's ``Process`` and health's ``Check``,
and answers each ext_proc message synchronously (``RequestStream.handle``) but for a request
that waits in flow control. So this server needs no general gRPC framework: it runs h2's state
machine in the event loop's ``data_received``, decodes each length-prefixed message as its
last byte arrives and answers in the same call, without a task, a queue or a wake-up per
message; a task exists only while a request waits in flow control. Measured through Envoy
(docs/results/2026-11-23-performance.md): the EPP needs 40% less CPU a request than on
grpclib, the stack before this one, and half of what it needs on grpcio.

What it serves, as the grpcio server does: ``Process`` and ``grpc.health.v1.Health/Check`` (from
``HealthState``; any other method is UNIMPLEMENTED, a method but POST is 405, a content-type but
``application/grpc[+proto]`` 415), TLS and mutual TLS through an ``ssl.SSLContext`` with ALPN
``h2``, ``--grpc-max-streams-per-connection`` streams per connection (announced; ``--max-
concurrent-streams`` caps the process with a JSON 429), a message past ``wire.MAX_MESSAGE_BYTES``
refused with RESOURCE_EXHAUSTED before it is buffered, ``grpc-timeout`` (DEADLINE_EXCEEDED),
SO_REUSEPORT for ``--workers``, and the drain of ``stop(grace)``: the listener closes, each
connection gets a GOAWAY naming the largest stream id (RFC 9113, 6.8: the open streams go on,
no new ones; written beside h2, whose state machine refuses every frame after a GOAWAY of its
own), open calls get ``grace``, then a second GOAWAY names the last stream received and the
streams the client opened meanwhile are refused with REFUSED_STREAM for
``_LAST_GOAWAY_SECONDS`` (a gRPC client retries those on another connection; closed at once,
they were lost in a connection reset), then the connections close.

Flow control: a window large enough for a long prompt is announced up front; what arrives is
acknowledged once it is consumed: decoded, or part of the message being assembled (which may
grow to the message limit). Every byte a call holds undecoded counts toward ``--max-buffered-
bytes`` (past it: the JSON 429 of a full buffer); a call waiting in flow control acknowledges
nothing until its wait ends. What is sent waits for the client's window, per stream, in order,
the trailers last, and for the socket: while the transport's buffer is above its high-water
mark nothing more is written and the connection is not read (a client that does not read
cannot make the EPP queue its answers).

Abuse and dead peers, as grpc's core handles them (``h2policy``, flags in
``GrpcConnectionSettings``): too many client PINGs with no data between them, or too many
streams reset right after opening (rapid reset), end the connection with GOAWAY
ENHANCE_YOUR_CALM; a connection that sent nothing for the keepalive time is PINGed and closed
when the PING goes unanswered (its streams end: their in-flight counts and held bytes are
released); one without streams for the idle time gets a GOAWAY, then a final one once the
client has seen it.

The modules: this one (the server: listen, drain), ``h2connection`` (a connection's reading
half: events, calls, sessions), ``h2writer`` (its writing half: answers, statuses, the ends of
calls), ``h2calls`` (one call's state, gRPC's framing and status codes), ``h2keepalive`` and
``h2policy`` (what the server checks of its clients); the sessions come from ``session``, which
the grpcio server (``grpcio_server``) shares.
"""

from __future__ import annotations

import asyncio
import ssl
import time
import weakref

import structlog

from endpoint_picker.extproc.h2calls import (
    CLIENT_REST_SECONDS,
    HEALTH_CHECK_PATH,
    MAX_UNREAD_BYTES,
    PROCESS_PATH,
    ConnectionLike,
    Health,
)
from endpoint_picker.extproc.h2connection import Connection
from endpoint_picker.extproc.limits import BodyBudget
from endpoint_picker.extproc.session import ExternalProcessor
from endpoint_picker.settings import GrpcConnectionSettings

__all__ = ["CLIENT_REST_SECONDS", "HEALTH_CHECK_PATH", "PROCESS_PATH", "H2GrpcServer"]

log = structlog.get_logger(__name__)

_CLOSE_SECONDS = 5.0  # how long stop() waits for cancelled flow-control waits to end
# After the drain's final GOAWAY (naming the last stream served), how long the connections stay
# open so that streams the client opened meanwhile are refused with REFUSED_STREAM (which a
# gRPC client retries elsewhere) rather than lost in a connection reset.
_LAST_GOAWAY_SECONDS = 0.1
# What a call may hold unread (``h2calls``); read when a server is built, so a test may lower it.
_MAX_UNREAD_BYTES = MAX_UNREAD_BYTES


class H2GrpcServer:
    """The h2 ext_proc server: ``start`` binds and listens, ``stop(grace)`` drains."""

    def __init__(
        self,
        processor: ExternalProcessor,
        health: Health,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None = None,
        *,
        reuse_port: bool = False,
        budget: BodyBudget | None = None,
        limits: GrpcConnectionSettings | None = None,
    ) -> None:
        self.processor = processor
        self.health = health
        # the process's body budget: calls count their undecoded bytes toward it
        self.budget = budget or BodyBudget(0)
        self.limits = (limits or GrpcConnectionSettings()).resolved(0)
        self.max_unread_bytes = _MAX_UNREAD_BYTES
        self.connections: weakref.WeakSet[ConnectionLike] = weakref.WeakSet()
        self.cancelled: set[asyncio.Task[None]] = set()  # flow-control waits being cancelled
        self.stopping = False
        self._host = host
        self._port = port
        self._ssl = ssl_context
        self._reuse_port = reuse_port
        self._listener: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        """Bind and listen; raises ``OSError`` when the address cannot be bound."""
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(
            lambda: Connection(self),
            self._host or None,
            self._port,
            ssl=self._ssl,
            reuse_address=True,
            # A port in use fails loudly unless this is a worker of one parent (which holds it).
            reuse_port=self._reuse_port,
        )
        self.port = int(self._listener.sockets[0].getsockname()[1])

    async def stop(self, grace: float | None) -> None:
        """Refuse new connections and streams, let open calls finish within ``grace`` seconds
        (None: wait for them), then reset what is left and close every connection."""
        listener, self._listener = self._listener, None
        if listener is None:
            return
        self.stopping = True
        listener.close()
        for connection in list(self.connections):
            connection.goaway()
        deadline = None if grace is None else time.monotonic() + grace
        while any(connection.busy for connection in list(self.connections)):
            if deadline is not None and time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.02)
        if self.connections:
            for connection in list(self.connections):
                connection.last_goaway()
            await asyncio.sleep(_LAST_GOAWAY_SECONDS)
        for connection in list(self.connections):
            connection.cancel()
        lost = [connection.lost for connection in self.connections]
        if lost:  # each socket closes on the loop's next turn
            await asyncio.wait(lost, timeout=_CLOSE_SECONDS)
        if self.cancelled:
            _, pending = await asyncio.wait(self.cancelled, timeout=_CLOSE_SECONDS)
            if pending:
                log.warning("ext_proc calls still waiting after stop", calls=len(pending))
