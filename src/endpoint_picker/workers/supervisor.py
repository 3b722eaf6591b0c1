"""Worker processes: start them, restart the ones that die (with a backoff), drain them all.

Each worker is ``python -m endpoint_picker.workers.child`` with two inherited descriptors: its
end of a socketpair (the channel) and the in-flight table's memfd. A supervising task per
worker (``worker-<i>``) starts it, sends ``Init`` and the present state, reads its channel until
the worker exits (the kernel closes its end), then, unless the parent is stopping, zeroes the
worker's row of the in-flight table, waits the backoff and starts a replacement in the same row.
The worker's open ext_proc streams die with it: Envoy sees their connections reset.
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
from typing import Any

import structlog

from endpoint_picker.errors import ConfigError
from endpoint_picker.settings import Settings
from endpoint_picker.telemetry.tasks import guarded
from endpoint_picker.workers.fanout import Publisher
from endpoint_picker.workers.link import WorkerLink
from endpoint_picker.workers.messages import Init, encode
from endpoint_picker.workers.table import InFlightTable

log = structlog.get_logger(__name__)

BACKOFF_FIRST = 0.5  # seconds before the first restart of a worker
BACKOFF_MAX = 10.0
STABLE_AFTER = 30.0  # a worker that lived this long restarts after BACKOFF_FIRST again
EXIT_WAIT = 5.0  # seconds from a closed channel to a reaped process (SIGKILL past it)
START_LIMIT = 60.0  # seconds a worker gets to start serving at start-up


class Supervisor:
    """``count`` workers sharing ``settings`` (their ext_proc port already resolved)."""

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
        self._links: dict[int, WorkerLink] = {}
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._started: dict[int, asyncio.Future[bool]] = {}
        self._stopping = False
        self.restarts = [0] * count

    @property
    def links(self) -> list[WorkerLink]:
        return list(self._links.values())

    @property
    def pids(self) -> dict[int, int]:
        return {index: proc.pid for index, proc in self._procs.items()}

    def send_all(self, frame: bytes) -> None:
        for index, link in list(self._links.items()):
            if not link.send(frame):
                log.error("worker too far behind its channel; replacing it", worker=index)
                self._kill(index)

    async def start(self, tls: tuple[bytes, bytes] | None, client_ca: bytes | None) -> None:
        """Start every worker; ``ConfigError`` when one exits before it serves."""
        self._tls, self._client_ca = tls, client_ca
        loop = asyncio.get_running_loop()
        for index in range(self._count):
            self._started[index] = loop.create_future()
            self._spawn_task(f"worker-{index}", self._supervise(index))
        for index, started in self._started.items():
            try:
                serving = await asyncio.wait_for(asyncio.shield(started), START_LIMIT)
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
        while not self._stopping:
            began = time.monotonic()
            code = await self._run_once(index)
            first = self._started[index]
            if not first.done():  # died before it ever served: a start-up error, no restarts
                first.set_result(False)
                return
            if self._stopping:
                return
            self._table.clear_row(index)
            backoff = BACKOFF_FIRST if time.monotonic() - began > STABLE_AFTER else backoff
            self.restarts[index] += 1
            log.warning("worker exited; restarting", worker=index, code=code, backoff=backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)

    async def _run_once(self, index: int) -> int | None:
        """Run one worker process in row ``index`` until it exits; returns its exit code."""
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
        self._procs[index] = proc
        log.info("worker started", worker=index, pid=proc.pid)
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        link = WorkerLink(index, reader, writer, self._serving)
        self._links[index] = link
        table = self._table
        init = Init(self._settings, index, table.rows, table.capacity, self._tls, self._client_ca)
        for frame in (encode(init), *self._publisher.catch_up()):
            link.send(frame)
        try:
            await link.run()
        finally:
            del self._links[index]
            await link.close()
        return await self._reap(index, proc)

    def _serving(self, index: int, serving: bool) -> None:
        started = self._started.get(index)
        if serving and started is not None and not started.done():
            started.set_result(True)
        self._on_serving(index, serving)

    async def _reap(self, index: int, proc: subprocess.Popen[bytes]) -> int | None:
        if not await exited(proc, EXIT_WAIT):
            log.error("worker closed its channel but lives on; killing it", worker=index)
            proc.kill()
            await exited(proc, EXIT_WAIT)
        self._procs.pop(index, None)
        return proc.returncode

    def _kill(self, index: int) -> None:
        proc = self._procs.get(index)
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
