"""The child processes of one bench stack: started with a log file each, awaited, stopped by pid.

``Children.wait`` polls an HTTP probe until it passes; a child that exits meanwhile, or the
stack's deadline, becomes a ``BenchError`` carrying the log tail of the child concerned.
``Children.stop`` sends SIGTERM from the last started to the first (the front goes before what
it routes to), SIGKILL after ``STOP_GRACE``, and kills whatever is left if it is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import signal
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import aiohttp
import orjson

from endpoint_picker.bench.model import BenchError

STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL, per child
_TAIL_LINES = 40
_TAIL_BYTES = 16384
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # the Rust routers colour their logs


@dataclass(frozen=True, slots=True)
class Probe:
    """What is awaited (for the error message) and a coroutine function: is it there yet?"""

    what: str
    check: Callable[[], Awaitable[bool]]


def http_probe(
    session: aiohttp.ClientSession,
    url: str,
    accept: Callable[[int, Any], bool] | None = None,
    what: str | None = None,
) -> Probe:
    """GET ``url``: passes on 200, or when ``accept(status, JSON body or None)`` says so."""

    async def check() -> bool:
        try:
            async with session.get(url) as reply:
                status, raw = reply.status, await reply.read()
        except (aiohttp.ClientError, TimeoutError):
            return False
        if accept is None:
            return status == 200
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        return accept(status, body)

    return Probe(what or url, check)


@dataclass(frozen=True, slots=True)
class Child:
    name: str
    proc: asyncio.subprocess.Process
    log_path: Path


class Children:
    """One stack's child processes (``stack`` names it in errors; logs go to ``folder``)."""

    def __init__(self, stack: str, folder: Path, deadline: float) -> None:
        self.stack = stack
        self.folder = folder
        self.deadline = deadline  # event-loop time by which every wait must have passed
        self.all: list[Child] = []

    async def start(
        self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None
    ) -> Child:
        log_path = self.folder / f"{name}.log"
        # Unbuffered, so a crash's last words reach the log; no colour codes in files.
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "NO_COLOR": "1", **(env or {})}
        try:
            with log_path.open("wb") as log:
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    env=full_env,
                )
        except OSError as exc:
            raise BenchError(f"stack {self.stack}: cannot start {name} ({argv[0]}): {exc}") from exc
        child = Child(name, proc, log_path)
        self.all.append(child)
        return child

    async def wait(self, child: Child, probe: Probe) -> None:
        """Until ``probe`` passes. ``child`` is the one to blame if the deadline passes first."""
        loop = asyncio.get_running_loop()
        while True:
            if (gone := self.exited()) is not None:
                await self.fail(gone, f"exited with status {gone.proc.returncode}")
            if await probe.check():
                return
            if loop.time() > self.deadline:
                await self.fail(child, f"not ready in time: {probe.what}")
            await asyncio.sleep(0.1)

    def exited(self) -> Child | None:
        """The first child that is no longer running, if any."""
        return next((c for c in self.all if c.proc.returncode is not None), None)

    async def fail(self, child: Child, problem: str) -> NoReturn:
        """Raise ``BenchError``: ``child``'s ``problem``, with the tail of its log."""
        tail = await asyncio.to_thread(log_tail, child.log_path)
        raise BenchError(
            f"stack {self.stack}: {child.name} {problem}; last lines of {child.log_path}:\n{tail}"
        )

    async def stop(self) -> None:
        """Last started first: SIGTERM, then SIGKILL after ``STOP_GRACE``."""
        try:
            for child in reversed(self.all):
                if child.proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        child.proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(child.proc.wait(), STOP_GRACE)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        child.proc.kill()
                    await child.proc.wait()
        finally:  # cancelled halfway (Ctrl-C): nothing may outlive the bench
            for child in self.all:
                if child.proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        child.proc.kill()


def log_tail(path: Path) -> str:
    """The last lines of a log, colour codes removed."""
    try:
        with path.open("rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - _TAIL_BYTES))
            text = log.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"(cannot read the log: {exc.strerror})"
    lines = _ANSI.sub("", text).splitlines()[-_TAIL_LINES:]
    return "\n".join(lines) if lines else "(empty)"


def fresh_folder(work_dir: Path, name: str) -> Path:
    """A new folder ``<name>-<n>`` under ``work_dir``: one per stack, never reused."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_.")[:60] or "stack"
    work_dir.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        folder = work_dir / f"{slug}-{n}"
        with contextlib.suppress(FileExistsError):
            folder.mkdir()
            return folder
    raise AssertionError("unreachable")


def free_ports(count: int, address: str) -> list[int]:
    """``count`` distinct free ports on ``address`` (each held until all are found)."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(count):
            sock = held.enter_context(socket.socket())
            sock.bind((address, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def shared_port(addresses: Sequence[str]) -> int:
    """A port free on every one of ``addresses`` (the simulated servers share one, as pods do)."""
    for _ in range(50):
        with contextlib.ExitStack() as held:
            first = held.enter_context(socket.socket())
            first.bind((addresses[0], 0))
            port = int(first.getsockname()[1])
            try:
                for address in addresses[1:]:
                    held.enter_context(socket.socket()).bind((address, port))
            except OSError:
                continue
            return port
    raise BenchError(f"no port is free on all of {addresses[0]}..{addresses[-1]}")
