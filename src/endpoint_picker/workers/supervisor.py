"""Worker processes: start them, restart the ones that die (with a backoff), drain them all.

Each worker is ``python -m endpoint_picker.workers.child`` with two inherited descriptors: its
end of a socketpair (the channel) and the in-flight table's memfd. A supervising task per
worker (``worker-<i>``) starts it, sends ``Init``, the present state and ``CaughtUp``, and
watches its channel. A worker that exits (the kernel closes its end) has its row of the
in-flight table zeroed and, after the backoff, a replacement in the same row; its open ext_proc
streams die with it (Envoy sees their connections reset). A worker that asks to retire
(``--worker-max-requests``) gets a successor in its other row first, and is drained only once
the successor serves: nothing is refused while workers turn over.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import structlog

from endpoint_picker.errors import ConfigError
from endpoint_picker.settings import Settings
from endpoint_picker.telemetry.tasks import guarded
from endpoint_picker.workers.fanout import Publisher
from endpoint_picker.workers.link import WorkerLink
from endpoint_picker.workers.messages import CaughtUp, Drain, Init, encode
from endpoint_picker.workers.table import InFlightTable

log = structlog.get_logger(__name__)

BACKOFF_FIRST = 0.5  # seconds before the first restart of a worker
BACKOFF_MAX = 10.0
STABLE_AFTER = 30.0  # a worker that lived this long restarts after BACKOFF_FIRST again
EXIT_WAIT = 5.0  # seconds from a closed channel to a reaped process (SIGKILL past it)
START_LIMIT = 60.0  # seconds a worker gets to start serving at start-up
# Seconds a worker replaced at --worker-max-requests gives its open streams (at least
# --drain-timeout): long generations finish; nothing waits on it but that worker's next
# turnover, which takes its row back only once it has gone.
TURNOVER_GRACE = 600.0


@dataclass(eq=False)
class _Running:
    """One worker process in one row of the in-flight table, and the task that sees it end."""

    row: int
    proc: subprocess.Popen[bytes]
    link: WorkerLink
    ended: asyncio.Task[int | None]  # its exit code, once reaped and its row cleared


class Supervisor:
    """``count`` workers sharing ``settings`` (their ext_proc port already resolved).

    Worker ``i`` runs in row ``i`` of the in-flight table; with ``--worker-max-requests`` the
    table has a second row per worker (``i + count``), where a worker's successor counts while
    its predecessor drains, and successive processes of worker ``i`` alternate between the two.
    """

    def __init__(
        self,
        settings: Settings,
        count: int,
        table: InFlightTable,
        publisher: Publisher,
        on_serving: Callable[[int, bool], None],
    ) -> None:
        self._settings = settings
        self._count = count
        self._table = table
        self._publisher = publisher
        self._on_serving = on_serving
        self._tls: tuple[bytes, bytes] | None = None
        self._client_ca: bytes | None = None
        self._links: dict[int, WorkerLink] = {}  # by row
        self._procs: dict[int, subprocess.Popen[bytes]] = {}  # by row
        self._tasks: list[asyncio.Task[Any]] = []
        self._started: dict[int, asyncio.Future[bool]] = {}  # by row: served, or died first
        self._row_ended: dict[int, asyncio.Task[int | None]] = {}  # by row: its last process
        self._stopping = False
        self.restarts = [0] * count  # by worker: processes that died and were replaced
        self.recycles = [0] * count  # by worker: processes replaced at their request limit
        self.generations = [0] * table.rows  # by row: processes that ended there
        # (row, generation): the last exposition of a process that exited after a drain
        self.finals: dict[tuple[int, int], bytes] = {}

    @property
    def links(self) -> list[WorkerLink]:
        return list(self._links.values())

    @property
    def pids(self) -> dict[int, int]:
        """The live process of each row."""
        return {row: proc.pid for row, proc in self._procs.items()}

    def send_all(self, frame: bytes) -> None:
        for row, link in list(self._links.items()):
            if not link.send(frame):
                log.error("worker too far behind its channel; replacing it", worker=row)
                self._kill(row)

    async def start(self, tls: tuple[bytes, bytes] | None, client_ca: bytes | None) -> None:
        """Start every worker; ``ConfigError`` when one exits before it serves."""
        self._tls, self._client_ca = tls, client_ca
        loop = asyncio.get_running_loop()
        for index in range(self._count):
            self._started[index] = loop.create_future()
            self._spawn_task(f"worker-{index}", self._supervise(index))
        for index in range(self._count):
            try:
                serving = await asyncio.wait_for(asyncio.shield(self._started[index]), START_LIMIT)
            except TimeoutError:
                raise ConfigError(
                    f"worker {index} did not serve within {START_LIMIT:.0f} s"
                ) from None
            if not serving:
                raise ConfigError(f"worker {index} exited before serving (see its log above)")

    def _spawn_task(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        self._tasks.append(asyncio.create_task(guarded(name, coro), name=name))

    async def _supervise(self, index: int) -> None:
        backoff = BACKOFF_FIRST
        began = time.monotonic()
        current = await self._launch(index)
        if not await self._serves(current):  # a start-up error: `start` fails, no restarts
            return
        while not self._stopping:
            retiring = asyncio.create_task(current.link.retiring.wait())
            await asyncio.wait((current.ended, retiring), return_when=asyncio.FIRST_COMPLETED)
            retiring.cancel()
            if self._stopping:
                return
            if not current.ended.done():  # it reached --worker-max-requests
                current = await self._replace(index, current)
                continue
            code = current.ended.result()
            backoff = BACKOFF_FIRST if time.monotonic() - began > STABLE_AFTER else backoff
            self.restarts[index] += 1
            log.warning("worker exited; restarting", worker=current.row, code=code,
                        backoff=backoff)  # fmt: skip
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)
            if self._stopping:
                return
            began = time.monotonic()
            current = await self._launch(current.row)

    async def _replace(self, index: int, old: _Running) -> _Running:
        """Start ``old``'s successor in the other row; once it serves, drain ``old`` (``Drain``:
        it stops taking streams and gives its open ones ``TURNOVER_GRACE`` while the successor
        takes the new connections). The successor not serving leaves ``old`` serving."""
        row = old.row + self._count if old.row < self._count else old.row - self._count
        successor = await self._launch(row)
        if not await self._serves(successor):
            log.error("replacement worker did not serve; the old one keeps serving",
                      worker=old.row)  # fmt: skip
            old.link.retiring.clear()  # it asks once: keep watching it for its exit only
            return old
        self.recycles[index] += 1
        log.info("worker replaced at its request limit; draining the old one",
                 worker=old.row, successor=row)  # fmt: skip
        grace = max(self._settings.server.drain_timeout, TURNOVER_GRACE)
        if old.proc.poll() is None and not old.link.send(encode(Drain(grace))):
            old.proc.send_signal(signal.SIGTERM)  # too far behind to read it: drain now
        return successor

    async def _serves(self, running: _Running) -> bool:
        """Whether the process reports serving (False: it exited first, or took too long)."""
        started = self._started[running.row]
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(asyncio.shield(started), START_LIMIT)
        log.error("worker did not serve in time; killing it", worker=running.row)
        self._kill(running.row)
        return False

    async def _launch(self, row: int) -> _Running:
        """Start one worker process in ``row`` and send it what it must know."""
        previous = self._row_ended.get(row)
        if previous is not None and not previous.done():  # still draining from a turnover
            await asyncio.wait((previous,))
        started = self._started.get(row)
        if started is None or started.done():
            self._started[row] = asyncio.get_running_loop().create_future()
        ours, theirs = socket.socketpair()
        try:
            # Popen, watched through a pidfd: asyncio's own child watcher on Python 3.11
            # starts a thread per child
            proc = subprocess.Popen(  # noqa: ASYNC220
                [sys.executable, "-m", "endpoint_picker.workers.child",
                 str(theirs.fileno()), str(self._table.fd)],
                pass_fds=(theirs.fileno(), self._table.fd),
            )  # fmt: skip
        finally:
            theirs.close()
        self._procs[row] = proc
        log.info("worker started", worker=row, pid=proc.pid)
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        link = WorkerLink(row, reader, writer, self._serving)
        self._links[row] = link
        table = self._table
        init = Init(self._settings, row, table.rows, table.capacity, self._tls, self._client_ca)
        for frame in (encode(init), *self._publisher.catch_up(), encode(CaughtUp())):
            link.send(frame)
        ended = asyncio.create_task(self._ended(row, proc, link), name=f"worker-{row}-process")
        self._row_ended[row] = ended
        self._tasks = [task for task in self._tasks if not task.done()]
        self._tasks.append(ended)  # drain() ends it with the rest
        return _Running(row, proc, link, ended)

    async def _ended(self, row: int, proc: subprocess.Popen[bytes], link: WorkerLink) -> int | None:
        """Read the worker's channel until it exits; then reap it and free its row."""
        try:
            await link.run()
        finally:
            if self._links.get(row) is link:
                del self._links[row]
            await link.close()
        code = await self._reap(row, proc)
        started = self._started.get(row)
        if started is not None and not started.done():
            started.set_result(False)
        self._table.clear_row(row)
        if link.final is not None:
            self.finals[(row, self.generations[row])] = link.final
        self.generations[row] += 1
        return code

    def _serving(self, row: int, serving: bool) -> None:
        started = self._started.get(row)
        if serving and started is not None and not started.done():
            started.set_result(True)
        self._on_serving(row, serving)

    async def _reap(self, row: int, proc: subprocess.Popen[bytes]) -> int | None:
        if not await exited(proc, EXIT_WAIT):
            log.error("worker closed its channel but lives on; killing it", worker=row)
            proc.kill()
            await exited(proc, EXIT_WAIT)
        if self._procs.get(row) is proc:
            del self._procs[row]
        return proc.returncode

    def _kill(self, row: int) -> None:
        proc = self._procs.get(row)
        if proc is not None and proc.poll() is None:
            proc.kill()

    async def drain(self, grace: float) -> None:
        """SIGTERM every worker (each drains as a single EPP does), wait, SIGKILL past grace."""
        self._stopping = True
        procs = list(self._procs.values())
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        await asyncio.gather(*(exited(proc, grace + EXIT_WAIT) for proc in procs))
        for proc in procs:
            if proc.poll() is None:
                log.error("worker still running after the drain; killing it", pid=proc.pid)
                proc.kill()
                await exited(proc, EXIT_WAIT)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self._procs.clear()


async def exited(proc: subprocess.Popen[bytes], within: float) -> bool:
    """Wait up to ``within`` seconds for ``proc`` to exit (its pidfd turns readable); reaps it."""
    if proc.poll() is not None:
        return True
    loop = asyncio.get_running_loop()
    fd = os.pidfd_open(proc.pid)
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(fd, readable)
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done, within)
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return proc.poll() is not None
