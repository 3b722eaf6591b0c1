"""A worker process: ``python -m endpoint_picker.workers.child CHANNEL_FD TABLE_FD``.

It reads ``Init`` from its channel, builds the ordinary ``App`` in worker mode (ext_proc on the
shared port with SO_REUSEPORT, its own director, scheduler and flow control; no pool source,
scrapers, health port or metrics port: the parent has those) and applies what the parent sends
to its datastore; it starts listening only once it has applied what the parent held when it
started (``CaughtUp``), then reports ``Serving``. It drains on SIGTERM (from the parent), on
``Drain`` (its successor serves: ``--worker-max-requests``, which it asks for with ``Retire``)
and when its channel closes (the parent is gone: a worker never outlives it), and sends its
last exposition (``Final``) as it exits. SIGINT is ignored: Ctrl-C reaches the whole process
group, and the parent turns it into the drain it orders.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import sys

import structlog

from endpoint_picker.app import App, freeze_startup_heap, return_large_blocks_to_os
from endpoint_picker.errors import ConfigError
from endpoint_picker.roles import WorkerRole
from endpoint_picker.scheduling.lifecycle import SharedInFlight
from endpoint_picker.telemetry.logs import configure_logging
from endpoint_picker.telemetry.tasks import guarded
from endpoint_picker.workers.messages import (
    Ask,
    CaughtUp,
    ChannelClosed,
    Drain,
    Final,
    Init,
    MessageTooLarge,
    MetricsUpdate,
    PoolUpdate,
    Readiness,
    Retire,
    Serving,
    Unreachable,
    encode,
    encode_answer,
    read_message,
    unpack_pool,
)
from endpoint_picker.workers.table import InFlightTable, TableRow

log = structlog.get_logger(__name__)

TURNOVER_CHECK = 1.0  # seconds between two looks at the streams served (--worker-max-requests)


class Worker:
    """Applies the parent's messages to one worker's ``App``."""

    def __init__(
        self,
        init: Init,
        table: InFlightTable,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self._row = TableRow(table, init.index)
        self.inflight = SharedInFlight(self._row)
        role = WorkerRole(
            self.inflight, tls=init.tls, client_ca=init.client_ca, before_listen=self._catch_up
        )
        self.app = App(init.settings, worker=role)
        self._reader = reader
        self._writer = writer
        self._parent_ready = False
        self._caught_up = asyncio.Event()
        self.follower: asyncio.Task[None] | None = None
        self.stop = asyncio.Event()  # SIGTERM, a Drain, or the parent gone: drain and exit
        self.drain_grace: float | None = None  # None: --drain-timeout

    async def _catch_up(self) -> None:
        """Follow the parent from now on (the director is built: it sees every frame), and
        return once what the parent held at our start is applied, or we are told to stop."""
        self.follower = asyncio.create_task(self._follow_parent(), name="worker-channel")
        caught_up = asyncio.create_task(self._caught_up.wait())
        stopped = asyncio.create_task(self.stop.wait())
        await asyncio.wait((caught_up, stopped), return_when=asyncio.FIRST_COMPLETED)
        caught_up.cancel()
        stopped.cancel()
        # Before listening: the collection this starts with must not hold a first request.
        freeze_startup_heap()

    async def _follow_parent(self) -> None:
        try:
            while True:
                message = await read_message(self._reader)
                await self.apply(message)
                if isinstance(message, MetricsUpdate):
                    # Frames that arrived together are read without a pause: let the loop
                    # look at the ext_proc sockets between two of them.
                    await asyncio.sleep(0)
        except ChannelClosed as exc:
            log.info("parent channel closed; draining", reason=str(exc))
        except Exception:  # a frame we cannot apply: never serve a frozen pool silently
            log.exception("cannot apply the parent's update; draining")
        self.stop.set()

    async def apply(self, message: object) -> None:
        datastore = self.app.datastore
        if isinstance(message, MetricsUpdate):
            for endpoint, snapshot in message.snapshots:
                datastore.update_metrics(endpoint, snapshot)
        elif isinstance(message, PoolUpdate):
            datastore.install(unpack_pool(message.state))
            self._row.remap(dict(message.slots), self.inflight.own_counts)
            await self.update_health()
        elif isinstance(message, Unreachable):
            datastore.mark_unreachable(message.hostport, message.reason)
        elif isinstance(message, Readiness):
            self._parent_ready = message.ready
            await self.update_health()
        elif isinstance(message, Ask):
            self._writer.write(encode_answer(message, self._answer(message.what)))
        elif isinstance(message, CaughtUp):
            self._caught_up.set()
        elif isinstance(message, Drain):
            log.info("successor serving; draining", grace_seconds=message.grace)
            self.drain_grace = message.grace
            self.stop.set()

    def _answer(self, what: str) -> object:
        if what == "metrics":
            return self.app.metrics.render()
        if what == "decisions":
            return self.app.decisions.recent()
        return None

    async def update_health(self) -> None:
        """ext_proc-port health: the parent is ready and this worker holds the pool."""
        await self.app.health.set_ready(self._parent_ready and self.app.datastore.loaded)

    def serving(self) -> None:
        """Tell the parent this worker serves: it has applied the pool and snapshots the
        parent held when it started, and then its ext_proc server started listening."""
        self._writer.write(encode(Serving(True)))

    async def turnover(self, limit: int) -> None:
        """Ask once to be replaced after ``limit`` streams (plus up to a tenth, so that the
        workers of one parent do not all turn over together); the parent then starts the
        replacement and, once it serves, drains this one."""
        limit += random.randint(0, limit // 10)  # spread, not security
        while self.app.streams_accepted < limit:  # noqa: ASYNC110  # no hook on the hot path
            await asyncio.sleep(TURNOVER_CHECK)
        streams = self.app.streams_accepted
        log.info("worker reached its request limit; asking to be replaced", streams=streams)
        self._writer.write(encode(Retire(streams)))


async def _run(channel_fd: int, table_fd: int) -> int:
    sock = socket.socket(fileno=channel_fd)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    try:
        init = await read_message(reader)
    except ChannelClosed:
        return 1
    if not isinstance(init, Init):
        raise TypeError(f"expected Init, got {type(init).__name__}")
    configure_logging(init.settings.logging.format, init.settings.logging.level)
    structlog.contextvars.bind_contextvars(worker=init.index)
    table = InFlightTable(table_fd, init.table_rows, init.table_capacity)
    worker = Worker(init, table, reader, writer)
    stop = worker.stop
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    tasks: list[asyncio.Task[None]] = []
    try:
        # listens only once the parent's pool and snapshots are applied (``_catch_up``)
        await worker.app.start()
        if not stop.is_set():
            worker.serving()
        limit = init.settings.server.worker_max_requests
        if limit > 0:
            turnover = guarded("worker-turnover", worker.turnover(limit))
            tasks.append(asyncio.create_task(turnover, name="worker-turnover"))
        await stop.wait()
    finally:
        await worker.app.stop(worker.drain_grace)
        if worker.follower is not None:
            tasks.append(worker.follower)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if not writer.is_closing():  # counted since the parent last asked: keep it in the sum
            try:
                writer.write(encode(Final(worker.app.metrics.render())))
            except MessageTooLarge as exc:
                log.error("last exposition too large for the parent's channel", size=exc.size)
            with contextlib.suppress(ConnectionError):
                await writer.drain()
        writer.close()
        table.close()
    return 0


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channel_fd, table_fd = int(argv[0]), int(argv[1])
    return_large_blocks_to_os()
    try:
        return asyncio.run(_run(channel_fd, table_fd))
    except ConfigError as exc:  # a start-up failure: one line, like `epp serve`
        print(f"epp: worker {os.getpid()}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
