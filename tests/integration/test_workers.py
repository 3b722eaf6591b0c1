"""`epp serve --workers 2` as users run it: a real parent, real workers, real gRPC, loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tests.support.extproc import Client, body, headers, json_body, lb_metadata
from tests.support.model_servers import FakeModelServer, fake_model_servers
from tests.support.pool import model, pod, pool, pool_yaml

EPP = [sys.executable, "-m", "endpoint_picker"]
ADDRESSES = [f"127.0.8.{i}" for i in range(2, 6)]
PER_WORKER = 'inference_extension_worker_requests_total{worker="%s"}'
PROMPT = json_body({"model": "m", "prompt": "hello " * 40})


class EppProcess:
    """The parent process and its JSON log (a file, read as it grows)."""

    def __init__(self, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.proc = proc
        self.log = log

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    async def wait_for(self, matches: Callable[[dict[str, Any]], bool], limit: float) -> Any:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            found = [line for line in self.lines() if matches(line)]
            if found:
                return found[-1]
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            await asyncio.sleep(0.05)
        raise AssertionError(f"not logged within {limit} s:\n{self.log.read_text()[-3000:]}")

    async def exited(self, limit: float) -> None:
        deadline = time.monotonic() + limit
        while self.proc.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)

    def worker_pids(self) -> dict[int, int]:
        """The pid of each worker row's latest process."""
        return {
            line["worker"]: line["pid"]
            for line in self.lines()
            if line.get("event") == "worker started"
        }


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@contextlib.asynccontextmanager
async def epp_workers(
    tmp_path: Path, pool_text: str, *args: str, workers: int = 2
) -> AsyncIterator[EppProcess]:
    path = tmp_path / "pool.yaml"
    path.write_text(pool_text)
    log = tmp_path / "epp.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(  # noqa: ASYNC220  # started once; the test polls it by pid
            [*EPP, "serve", "--workers", str(workers), "--pool-file", str(path),
             "--bind-address", "127.0.0.1", "--grpc-port", "0", "--grpc-health-port", "0",
             "--metrics-port", "0", "--secure-serving", "false", "--drain-timeout", "2s",
             "--refresh-metrics-interval", "100ms", "--log-format", "json", *args],
            stderr=sink, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    epp = EppProcess(proc, log)
    try:
        yield epp
    finally:  # every process started here is stopped by its pid
        pids = [pid for pid in epp.worker_pids().values() if running(pid)]
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def every_pod(servers: Sequence[FakeModelServer]) -> str:
    """The pool file: model ``m`` on a pod per fake server."""
    pods = (pod(f"p{i}", a) for i, a in enumerate(ADDRESSES))
    return pool_yaml(pool(port=servers[0].port), model("m"), *pods)


async def route(port: int, requests: int) -> list[str]:
    """``requests`` streams over a channel of its own (a new connection for the kernel to
    place on a worker); the endpoint each was routed to."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        client = Client(channel)
        return [
            lb_metadata((await client.exchange([headers(), body(PROMPT)]))[0])
            for _ in range(requests)
        ]


async def metrics(session: aiohttp.ClientSession, port: int) -> dict[str, float]:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
        text = await response.text()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def health(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        return int(reply.status)


async def test_two_workers_share_the_port_survive_a_kill_and_drain_on_sigterm(
    tmp_path: Path,
) -> None:
    """Both workers route on one port, /metrics counts every request once, a SIGKILLed
    worker is replaced while the other keeps routing, and SIGTERM ends every process."""
    async with (
        fake_model_servers(ADDRESSES) as servers,
        epp_workers(
            tmp_path,
            every_pod(servers),
        ) as epp,
        aiohttp.ClientSession() as session,
    ):
        serving = await epp.wait_for(lambda e: e.get("event") == "endpoint picker serving", 30)
        ext_port, metrics_port = serving["ext_proc_port"], serving["metrics_port"]
        first_pids = epp.worker_pids()
        assert sorted(first_pids) == [0, 1]
        assert await health(serving["health_port"]) == health_pb2.HealthCheckResponse.SERVING
        hostports = {s.hostport for s in servers}
        sent, by_worker = 0, {}
        for _ in range(40):  # new connections until the kernel has given each worker some
            assert set(await route(ext_port, 2)) <= hostports
            sent += 2
            seen = await metrics(session, metrics_port)
            by_worker = {w: seen.get(PER_WORKER % w, 0) for w in "01"}
            if all(by_worker.values()):
                break
        assert all(by_worker.values()), by_worker
        labels = '{model_name="m",target_model_name="m"}'
        assert seen[f"inference_model_request_total{labels}"] == sent
        assert seen["inference_extension_workers_serving"] == 2
        # scraping is the parent's: its interval, not a sum with the workers' unset gauges
        assert seen["inference_extension_metrics_refresh_interval_seconds"] == 0.1
        async with session.get(f"http://127.0.0.1:{metrics_port}/api/status") as response:
            status = await response.json()
        assert {d["worker"] for d in status["decisions"]} == {0, 1}  # collected from both
        assert status["inFlight"] == 0  # the shared table, every stream finished
        assert [e["inFlight"] for e in status["endpoints"]] == [0] * len(ADDRESSES)
        assert all(not e["stale"] for e in status["endpoints"])  # scraped by the parent
        assert status["refreshIntervalSeconds"] == 0.1

        os.kill(first_pids[0], signal.SIGKILL)
        await epp.wait_for(
            lambda e: (
                e.get("event") == "worker started"
                and e["worker"] == 0
                and e["pid"] != first_pids[0]
            ),
            20,
        )
        deadline = time.monotonic() + 20
        while (await metrics(session, metrics_port))["inference_extension_workers_serving"] < 2:
            assert time.monotonic() < deadline, "the replacement never served"
            # new connections all through the restart: the replacement listens only with
            # the pool applied, so none of them may meet a worker without it (a 503)
            assert set(await route(ext_port, 1)) <= hostports
        for _ in range(4):
            assert set(await route(ext_port, 2)) <= hostports
        seen = await metrics(session, metrics_port)
        assert seen['inference_extension_worker_restarts_total{worker="0"}'] == 1
        assert seen['inference_extension_worker_restarts_total{worker="1"}'] == 0

        all_pids = [first_pids[0], *epp.worker_pids().values()]
        epp.proc.send_signal(signal.SIGTERM)
        await epp.exited(20)
        assert epp.proc.returncode == 0, epp.log.read_text()[-3000:]
        assert not [pid for pid in all_pids if running(pid)]
        assert sum(1 for line in epp.lines() if line.get("event") == "stopped") == 3


async def test_a_second_signal_ends_the_parent_and_every_worker_at_once(tmp_path: Path) -> None:
    """SIGTERM twice: the parent exits 1 without draining, and kills its workers first (left
    alone they would drain for --drain-timeout, holding the port)."""
    async with (
        fake_model_servers(ADDRESSES) as servers,
        epp_workers(
            tmp_path,
            pool_yaml(pool(port=servers[0].port), model("m"), pod("p0", ADDRESSES[0])),
        ) as epp,
    ):
        serving = await epp.wait_for(lambda e: e.get("event") == "endpoint picker serving", 30)
        pids = list(epp.worker_pids().values())
        assert len(pids) == 2
        address = f"127.0.0.1:{serving['ext_proc_port']}"
        async with grpc.aio.insecure_channel(address) as channel:
            open_stream = pb_grpc.ExternalProcessorStub(channel).Process()
            await open_stream.write(headers())  # a request still open: a drain would wait on it
            epp.proc.send_signal(signal.SIGTERM)
            await epp.wait_for(lambda e: e.get("event") == "draining", 10)
            epp.proc.send_signal(signal.SIGTERM)  # two at once would merge into one
            await epp.exited(10)
            assert epp.proc.returncode == 1
            deadline = time.monotonic() + 1.0  # SIGKILL is immediate; the drain would take 2 s
            while any(running(pid) for pid in pids):
                assert time.monotonic() < deadline, "a worker outlived the parent"
                await asyncio.sleep(0.05)
            open_stream.cancel()


async def test_a_worker_at_its_request_limit_is_replaced_without_refusing_a_request(
    tmp_path: Path,
) -> None:
    """`--workers 1 --worker-max-requests 15`: while a client keeps routing over one channel
    (as Envoy keeps one connection), the worker turns over: its successor serves before it
    drains, the old process exits, no request fails, and /metrics counts every request."""
    async with (
        fake_model_servers(ADDRESSES) as servers,
        epp_workers(
            tmp_path,
            every_pod(servers),
            "--worker-max-requests",
            "15",
            workers=1,
        ) as epp,
        aiohttp.ClientSession() as session,
    ):
        serving = await epp.wait_for(lambda e: e.get("event") == "endpoint picker serving", 30)
        ext_port, metrics_port = serving["ext_proc_port"], serving["metrics_port"]
        (first_pid,) = epp.worker_pids().values()
        hostports = {s.hostport for s in servers}
        sent, after = 0, 0
        deadline = time.monotonic() + 60
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ext_port}") as channel:
            client = Client(channel)
            while after < 20:  # until the first process is gone, and 20 requests more
                assert time.monotonic() < deadline, epp.log.read_text()[-3000:]
                replies = await client.exchange([headers(), body(PROMPT)])
                assert lb_metadata(replies[0]) in hostports  # routed: never refused
                sent += 1
                if not running(first_pid):
                    after += 1
                await asyncio.sleep(0.01)
        pids = epp.worker_pids()  # the successor took the worker's other row
        assert pids == {0: first_pid, 1: pids[1]}, pids
        assert running(pids[1])
        assert any(line.get("event") == "worker replaced at its request limit; draining the old one"
                   for line in epp.lines())  # fmt: skip
        labels = '{model_name="m",target_model_name="m"}'
        deadline = time.monotonic() + 10
        while (seen := await metrics(session, metrics_port))[
            f"inference_model_request_total{labels}"
        ] != sent:  # the old process's counts stay in the sum once it has gone
            assert time.monotonic() < deadline, (
                seen.get(f"inference_model_request_total{labels}"),
                sent,
            )
            await asyncio.sleep(0.2)
        assert seen['inference_extension_worker_recycles_total{worker="0"}'] >= 1
        assert seen['inference_extension_worker_restarts_total{worker="0"}'] == 0
        assert seen["inference_extension_workers_serving"] == 1


async def test_a_turnover_lets_open_streams_finish_and_a_second_waits_for_the_row(
    tmp_path: Path,
) -> None:
    """`--worker-max-requests 5`, a stream held open on the first process: after the turnover
    that process drains past --drain-timeout (2 s; a turnover is no shutdown) until the held
    stream ends normally; its successor, at the limit too, gets a third process in row 0 only
    once the first has stopped; the shared in-flight counts end at 0."""
    async with (
        fake_model_servers(ADDRESSES) as servers,
        epp_workers(tmp_path, every_pod(servers), "--worker-max-requests", "5", workers=1) as epp,
        aiohttp.ClientSession() as session,
    ):
        serving = await epp.wait_for(lambda e: e.get("event") == "endpoint picker serving", 30)
        ext_port, metrics_port = serving["ext_proc_port"], serving["metrics_port"]
        (first_pid,) = epp.worker_pids().values()
        started = lambda: [e for e in epp.lines() if e.get("event") == "worker started"]  # noqa: E731
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ext_port}") as held_channel:
            held = pb_grpc.ExternalProcessorStub(held_channel).Process()
            await held.write(headers())
            await held.write(body(PROMPT))
            assert lb_metadata(await held.read())  # routed, and left open
            deadline = time.monotonic() + 60
            while len(started()) < 2:  # new channels: Envoy reconnects after each GOAWAY too
                assert time.monotonic() < deadline, epp.log.read_text()[-3000:]
                await route(ext_port, 1)
                await asyncio.sleep(0.05)
            await epp.wait_for(lambda e: e.get("event") == "successor serving; draining", 30)
            await asyncio.sleep(3)  # past --drain-timeout
            assert running(first_pid)  # still draining: the held stream is open
            await held.done_writing()  # the held request ends as a client's would
            while await held.read() is not grpc.aio.EOF:
                pass
            assert await held.code() == grpc.StatusCode.OK
        while len(started()) < 3:
            assert time.monotonic() < deadline, epp.log.read_text()[-3000:]
            await route(ext_port, 1)
            await asyncio.sleep(0.05)
        lines = epp.lines()
        stops = [
            i for i, e in enumerate(lines) if e.get("event") == "stopped" and e.get("worker") == 0
        ]
        third_started = [i for i, e in enumerate(lines) if e.get("event") == "worker started"][2]
        assert lines[third_started]["worker"] == 0
        assert stops, "the first process never stopped"
        assert stops[0] < third_started, [e.get("event") for e in lines]
        deadline = time.monotonic() + 10
        while True:
            async with session.get(f"http://127.0.0.1:{metrics_port}/api/status") as response:
                status = await response.json()
            assert status["inFlight"] >= 0
            if status["inFlight"] == 0:
                break
            assert time.monotonic() < deadline, status["inFlight"]
            await asyncio.sleep(0.2)


async def test_multi_megabyte_model_names_while_scraped_never_restart_a_worker(
    tmp_path: Path,
) -> None:
    """40 requests with distinct 2 MB model names over one connection (one worker refuses them
    all: unknown models) while /metrics and /api/status are read: no worker restarts, both keep
    serving, the decisions arrive cut, and the health port stays SERVING."""
    async with (
        fake_model_servers(ADDRESSES) as servers,
        epp_workers(tmp_path, every_pod(servers)) as epp,
        aiohttp.ClientSession() as session,
    ):
        serving = await epp.wait_for(lambda e: e.get("event") == "endpoint picker serving", 30)
        ext_port, metrics_port = serving["ext_proc_port"], serving["metrics_port"]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ext_port}") as channel:
            client = Client(channel)
            for i in range(40):
                name = f"{i:02d}" + "m" * (2 * 1024 * 1024)
                request = json_body({"model": name, "prompt": "hi"})
                await client.exchange([headers(), body(request)])
                if i % 10 == 9:
                    await metrics(session, metrics_port)
        for _ in range(3):
            seen = await metrics(session, metrics_port)
            async with session.get(f"http://127.0.0.1:{metrics_port}/api/status") as response:
                raw = await response.read()
                status = json.loads(raw)
            await asyncio.sleep(0.2)
        assert not [e for e in epp.lines() if e.get("event") == "worker exited; restarting"]
        assert seen['inference_extension_worker_restarts_total{worker="0"}'] == 0
        assert seen['inference_extension_worker_restarts_total{worker="1"}'] == 0
        assert seen["inference_extension_workers_serving"] == 2
        assert await health(serving["health_port"]) == health_pb2.HealthCheckResponse.SERVING
        assert len(raw) < 200_000
        assert len(status["decisions"]) == 40
        assert status["decisions"][0]["model"].startswith("39mmm")
