"""The pool file watch: settle time, the empty-pool guard, atomic renames, lost files."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from structlog.testing import capture_logs
from tests.support.pool import pod, pool, pool_yaml

from endpoint_picker.datastore import Datastore
from endpoint_picker.datastore.sources.file import ALLOW_EMPTY_POOL_ANNOTATION, PoolFileSource
from endpoint_picker.telemetry.metrics import EppMetrics

pytestmark = pytest.mark.timeout(5)

POLL = 0.25
SETTLE = 0.5


class FakeTime:
    """A clock that moves only when the watch loop's sleep is ended by ``poll``."""

    def __init__(self) -> None:
        self.now = 0.0
        self._sleeps: asyncio.Queue[tuple[float, asyncio.Future[None]]] = asyncio.Queue()
        self._asleep: tuple[float, asyncio.Future[None]] | None = None

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        wake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sleeps.put_nowait((seconds, wake))
        await wake

    async def poll(self, times: int = 1) -> None:
        """End the loop's sleep (time moves by its length); return once its check has run."""
        for _ in range(times):
            seconds, wake = self._asleep or await self._sleeps.get()
            self.now += seconds
            wake.set_result(None)
            self._asleep = await self._sleeps.get()  # asleep again: the check is done


class Watched:
    """A real pool file, datastore and metrics, with the real watch loop on fake time."""

    def __init__(self, path: Path, time: FakeTime) -> None:
        self.path = path
        self.time = time
        self.store = Datastore()
        self.metrics = EppMetrics()
        self.applied: list[list[str]] = []  # every endpoint set ever swapped in
        self.store.on_endpoints_changed(lambda eps: self.applied.append([e.pod_name for e in eps]))
        self.source = PoolFileSource(
            path,
            self.store,
            observer=self.metrics,
            poll_interval=POLL,
            settle_time=SETTLE,
            clock=time.clock,
            sleep=time.sleep,
        )

    @property
    def pods(self) -> list[str]:
        return [e.pod_name for e in self.store.endpoints]

    def reloads(self, result: str) -> float | None:
        return self.metrics.registry.get_sample_value(
            "inference_extension_pool_reload_total", {"result": result}
        )

    @property
    def healthy_gauge(self) -> float | None:
        return self.metrics.registry.get_sample_value("inference_extension_pool_source_healthy")


def two_pods(*names: str, annotations: dict[str, object] | None = None) -> str:
    doc = pool()
    if annotations:
        doc["metadata"]["annotations"] = annotations
    return pool_yaml(doc, *(pod(n, f"127.0.0.{i + 2}") for i, n in enumerate(names)))


@contextlib.asynccontextmanager
async def watching(tmp_path: Path, text: str) -> AsyncIterator[Watched]:
    path = tmp_path / "pool.yaml"
    path.write_text(text)
    watched = Watched(path, FakeTime())
    watched.source.load_initial()
    task = asyncio.create_task(watched.source.watch())
    try:
        yield watched
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_truncated_rewrite_waits_for_the_settle_time(tmp_path: Path) -> None:
    """A cut-off rewrite that parses is not applied within the settle time; the full one is."""
    async with watching(tmp_path, two_pods("a", "b")) as w:
        full = two_pods("c", "d", "e")
        w.path.write_text(full[: full.index("---", full.index("name: d"))])  # ends after pod d
        await w.time.poll()  # the change is seen: the settle time starts
        await w.time.poll()  # 0.25 s later: still within it
        assert w.pods == ["a", "b"]
        w.path.write_text(full)  # the writer finishes: the settle time starts again
        await w.time.poll(2)
        assert w.pods == ["a", "b"]
        await w.time.poll()  # unchanged for 0.5 s: applied
        assert w.pods == ["c", "d", "e"]
        assert w.applied == [["a", "b"], ["c", "d", "e"]]  # the cut-off version never was
        assert w.reloads("applied") == 2  # the first load and the full rewrite


async def test_rewrite_dropping_every_endpoint_is_refused_and_counted(tmp_path: Path) -> None:
    """A settled rewrite with no endpoints keeps the pool, logs once, counts, and says unhealthy."""
    async with watching(tmp_path, two_pods("a", "b")) as w:
        with capture_logs() as logs:
            w.path.write_text(two_pods())
            await w.time.poll(3)
            w.path.write_text(two_pods())  # the same content again: already refused
            await w.time.poll(3)
        assert w.pods == ["a", "b"]
        refusals = [e for e in logs if e.get("result") == "rejected_empty"]
        assert len(refusals) == 1
        assert refusals[0]["log_level"] == "warning"
        assert ALLOW_EMPTY_POOL_ANNOTATION in refusals[0]["hint"]
        assert w.reloads("rejected_empty") == 1
        assert w.healthy_gauge == 0
        assert not w.source.healthy
        w.path.write_text(two_pods("a", "b", "c"))  # a good edit heals the source
        await w.time.poll(3)
        assert w.pods == ["a", "b", "c"]
        assert w.healthy_gauge == 1
        assert w.source.healthy


async def test_rewrite_marking_every_pod_not_ready_is_applied(tmp_path: Path) -> None:
    """A complete file whose pods are all NotReady applies (no endpoint: 503s), while one that
    drops every pod is still refused; the guard is for truncated files, not for readiness."""
    async with watching(tmp_path, two_pods("a", "b")) as w:
        unready = pool_yaml(
            pool(), pod("a", "127.0.0.2", ready=False), pod("b", "127.0.0.3", ready=False)
        )
        w.path.write_text(unready)
        await w.time.poll(3)
        assert w.pods == []
        assert w.reloads("applied") == 2
        assert w.reloads("rejected_empty") == 0
        assert w.source.healthy
        w.path.write_text(two_pods("a"))  # ready again
        await w.time.poll(3)
        assert w.pods == ["a"]
        w.path.write_text(two_pods())  # every pod dropped: refused, as before
        await w.time.poll(3)
        assert w.pods == ["a"]
        assert w.reloads("rejected_empty") == 1


@pytest.mark.parametrize("marker", ["true", True])  # quoted as Kubernetes wants, or a YAML bool
async def test_empty_pool_marked_deliberate_is_applied(tmp_path: Path, marker: object) -> None:
    """With the allow-empty annotation on the InferencePool, emptying the pool is applied."""
    async with watching(tmp_path, two_pods("a", "b")) as w:
        w.path.write_text(two_pods(annotations={ALLOW_EMPTY_POOL_ANNOTATION: marker}))
        await w.time.poll(3)
        assert w.pods == []
        assert w.reloads("rejected_empty") == 0
        assert w.healthy_gauge == 1


async def test_atomic_rename_is_picked_up(tmp_path: Path) -> None:
    """A file written beside the pool file and renamed over it is applied after the settle time."""
    async with watching(tmp_path, two_pods("a")) as w:
        temp = tmp_path / ".pool.yaml.tmp"
        temp.write_text(two_pods("b"))
        os.replace(temp, w.path)
        await w.time.poll(2)
        assert w.pods == ["a"]
        await w.time.poll()
        assert w.pods == ["b"]


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda p: p.write_bytes(b""), id="truncated-to-zero"),
        pytest.param(lambda p: p.unlink(), id="deleted"),
        pytest.param(lambda p: p.write_bytes(b"kind: [Pool\n"), id="unparsable"),
    ],
)
async def test_lost_or_broken_file_keeps_the_last_good_pool(
    tmp_path: Path, damage: Callable[[Path], object]
) -> None:
    """A zero-byte, deleted or unparsable file keeps the pool, counts invalid, until fixed."""
    async with watching(tmp_path, two_pods("a", "b")) as w:
        damage(w.path)
        await w.time.poll(3)
        assert w.pods == ["a", "b"]
        assert w.reloads("invalid") == 1
        assert w.healthy_gauge == 0
        assert not w.source.healthy
        w.path.write_text(two_pods("c"))
        await w.time.poll(3)
        assert w.pods == ["c"]
        assert w.healthy_gauge == 1
