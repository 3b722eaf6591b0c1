"""The parent's side of ``epp serve --workers N``: the ``Routers`` the parent ``App`` hands
routing to, and the parent's health (ready only while a worker serves).

The ext_proc port: the parent first checks that nothing holds it (a bind without SO_REUSEPORT,
released at once), then holds it itself, bound but not listening, with SO_REUSEPORT, until it
exits. A bound socket that does not listen receives no connections, but it keeps the port:
a foreign process that binds without SO_REUSEPORT fails loudly, as against a single EPP. Only
processes of the same user that also ask for SO_REUSEPORT could still join (Linux's rule).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from endpoint_picker.errors import ConfigError
from endpoint_picker.extproc.server import HealthState
from endpoint_picker.settings import Settings
from endpoint_picker.status.decisions import DEFAULT_SIZE
from endpoint_picker.workers.fanout import Publisher
from endpoint_picker.workers.merge import cumulative_only, merge_expositions, requests_counted
from endpoint_picker.workers.supervisor import Supervisor
from endpoint_picker.workers.table import InFlightTable, SlotMap, TableCounts

log = structlog.get_logger(__name__)

ASK_TIMEOUT = 2.0  # seconds a worker gets to answer for /metrics or the status page


class GatedHealth(HealthState):
    """The parent's health: its own readiness (pool loaded, synced, leading) and at least
    one worker serving. Its own readiness is also what it tells the workers."""

    def __init__(self, tell_workers: Callable[[bool], None]) -> None:
        super().__init__()
        self._tell_workers = tell_workers
        self._own = False
        self._workers = False

    async def set_ready(self, ready: bool) -> None:
        self._own = ready
        self._tell_workers(ready)
        await super().set_ready(ready and self._workers)

    async def workers_serving(self, serving: bool) -> None:
        self._workers = serving
        await super().set_ready(self._own and serving)


def hold_port(host: str, port: int) -> tuple[socket.socket, int]:
    """Refuse a port in use, then hold it for the workers (see the module docstring)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)
        port = probe.getsockname()[1]
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    finally:
        probe.close()
    holder = socket.socket(family, socket.SOCK_STREAM)
    try:
        # SO_REUSEPORT only: with SO_REUSEADDR too, another parent's probe (which sets it)
        # could bind the port while this holder is not listening
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind((address[0], port, *address[2:]))
    except OSError as exc:
        holder.close()
        raise ConfigError(f"cannot hold {host}:{port} for the workers: {exc.strerror}") from exc
    return holder, port


class MergedDecisions:
    """The workers' last decisions, newest first, each marked with its worker."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def recent(self) -> list[dict[str, Any]]:
        return self.items


class WorkerPool(Collector):
    """``Routers`` over worker processes, and a collector of per-worker facts for /metrics."""

    def __init__(self, settings: Settings, count: int) -> None:
        self._settings = settings
        self._count = count
        # a second row per worker for its successor while it drains (--worker-max-requests)
        rows = count * 2 if settings.server.worker_max_requests > 0 else count
        self._table = InFlightTable.create(rows)
        self._slots = SlotMap(self._table.capacity)
        self.publisher = Publisher(self._slots, self._send)
        self.health = GatedHealth(self.publisher.readiness)
        self._inflight = TableCounts(self._table, self._slots)
        self._decisions = MergedDecisions()
        # per row: (its process generation when collected, that process's last exposition)
        self._last: dict[int, tuple[int, bytes]] = {}
        self._retired = b""  # dead workers' last counters and histograms, summed
        self._supervisor: Supervisor | None = None
        self._holder: socket.socket | None = None
        self._serving: set[int] = set()
        self._health_changed = asyncio.Event()
        self._health_task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def inflight(self) -> TableCounts:
        return self._inflight

    @property
    def decisions(self) -> MergedDecisions:
        return self._decisions

    @property
    def supervisor(self) -> Supervisor | None:
        return self._supervisor

    async def start(self, tls: tuple[bytes, bytes] | None, client_ca: bytes | None) -> int:
        server = self._settings.server
        self._holder, port = hold_port(server.bind_address, server.grpc_port)
        settings = replace(self._settings, server=replace(server, grpc_port=port))
        self._health_task = asyncio.create_task(self._follow_health(), name="workers-health")
        self._supervisor = Supervisor(
            settings, self._count, self._table, self.publisher, self._worker_serving
        )
        await self._supervisor.start(tls, client_ca)
        return port

    def _send(self, frame: bytes) -> None:
        if self._supervisor is not None:
            self._supervisor.send_all(frame)

    def _worker_serving(self, index: int, serving: bool) -> None:
        (self._serving.add if serving else self._serving.discard)(index)
        self._health_changed.set()

    async def _follow_health(self) -> None:
        """Health goes NOT_SERVING only while no worker serves (a guarded, owned loop)."""
        while True:
            await self._health_changed.wait()
            self._health_changed.clear()
            try:
                await self.health.workers_serving(bool(self._serving))
            except Exception:
                log.exception("background task failed", task="workers-health")

    async def refresh(self) -> None:
        links = self._supervisor.links if self._supervisor is not None else []
        answers = await asyncio.gather(
            *(link.ask("metrics", ASK_TIMEOUT) for link in links),
            *(link.ask("decisions", ASK_TIMEOUT) for link in links),
        )
        metrics, decisions = answers[: len(links)], answers[len(links) :]
        supervisor = self._supervisor
        generations = supervisor.generations if supervisor is not None else []
        finals = supervisor.finals if supervisor is not None else {}
        ended = []
        for row, (generation, text) in list(self._last.items()):
            if generations[row] != generation:  # that process has ended: its final word counts
                ended.append(finals.pop((row, generation), text))
                del self._last[row]
        ended.extend(finals.values())  # ended before this parent ever asked them
        finals.clear()
        if ended:
            self._retired = merge_expositions(self._retired, [cumulative_only(t) for t in ended])
        for link, answer in zip(links, metrics, strict=True):
            if answer:  # no answer in time: its previous one stands
                self._last[link.index] = (generations[link.index], answer)
        merged = [
            {**item, "worker": link.index}
            for link, items in zip(links, decisions, strict=True)
            for item in items or ()
        ]
        merged.sort(key=lambda item: item["time"], reverse=True)
        self._decisions.items = merged[:DEFAULT_SIZE]

    def render(self, own: bytes) -> bytes:
        live = [text for _, (_, text) in sorted(self._last.items())]
        return merge_expositions(own, [*live, self._retired])

    def collect(self) -> Iterator[Metric]:
        serving = GaugeMetricFamily(
            "inference_extension_workers_serving", "Worker processes serving ext_proc now."
        )
        serving.add_metric([], float(len(self._serving)))
        yield serving
        restarts = CounterMetricFamily(
            "inference_extension_worker_restarts",
            "Worker processes restarted after they died, by worker.",
            labels=["worker"],
        )
        recycles = CounterMetricFamily(
            "inference_extension_worker_recycles",
            "Worker processes replaced at --worker-max-requests, by worker.",
            labels=["worker"],
        )
        requests = CounterMetricFamily(
            "inference_extension_worker_requests",
            "inference_model_request_total as counted by each worker's process (how the kernel "
            "spread the ext_proc connections), by row: a worker's successor at "
            "--worker-max-requests counts in its other row; restarts from 0 with its process.",
            labels=["worker"],
        )
        supervisor = self._supervisor
        for index in range(self._count):
            restarts.add_metric(
                [str(index)], float(supervisor.restarts[index] if supervisor else 0)
            )
            recycles.add_metric(
                [str(index)], float(supervisor.recycles[index] if supervisor else 0)
            )
        for row, (_, text) in sorted(self._last.items()):
            requests.add_metric([str(row)], requests_counted(text))
        yield restarts
        yield recycles
        yield requests

    def kill(self) -> None:
        if self._supervisor is not None:
            for pid in self._supervisor.pids.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    async def drain(self, grace: float) -> None:
        if self._supervisor is not None:
            await self._supervisor.drain(grace)
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
            self._health_task = None
        if self._holder is not None:
            self._holder.close()
            self._holder = None
        if not self._closed:
            self._closed = True
            self._table.close()
