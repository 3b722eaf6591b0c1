"""Pool size: how a pick over ext_proc and the metrics refresh hold up from 16 to 1,024 endpoints.

Run: .venv/bin/python benchmarks/bench_pool_size.py [--sizes 16,256,1024] [--modes one,w2]
     [--duration 20] [--rate 200] [--rounds 1]

For each pool size N: N model-server endpoints on 127.0.x.y:18000, answered by one Envoy with
direct responses (the 64 KB vLLM v1 ``/metrics`` page of the unit tests: what a real server
costs to scrape and parse); a pool file with a pod per endpoint. For each mode, a fresh
``epp serve`` on that pool (default scheduler, ``--refresh-metrics-interval 50ms``):
- one: one process (``--workers 1``): scraping and routing share its event loop;
- wN:  ``--workers N``: the parent scrapes, the workers route;
- MODE@B: with ``--metrics-cpu-budget B`` (default 0.5 of a core; the refresh interval stretches
  past 50 ms to keep scraping within it).
After every endpoint has fresh metrics, a gRPC client opens ``--rate`` ext_proc streams a second
(open loop) for ``--duration`` s (headers, then the body with end of stream; the pick is the time
to the routing headers response; then the stream is closed), while ``/api/status`` is read every
0.5 s for each endpoint's metrics age. Printed per size and mode: picks/s, pick p50 and p99,
the metrics age (median over endpoints and samples, and the 99th percentile): what the
scheduler sees; and from the EPP's ``/metrics`` the scrape interval the CPU budget settled on
and the scrape steps its ``TurnGate`` deferred a second. Everything shares this machine's 2
cores (the fleet Envoy, the EPP, the client).

``--beside M`` runs, for the whole benchmark, a second load in another process: a
``ScrapeManager`` following M more endpoints (their own fleet Envoy, on 127.0.100.2 and up) at
``--beside-interval`` (``bench_scrape_budget.py --fixed``). With M = 1,024 that is the work a
1,024-endpoint pool's scraping puts on the machine; beside a 16-endpoint pool it tells what of a
large pool's pick latency is the machine's load rather than the pool's size.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from endpoint_picker.bench.fleetenvoy import (
    BIN,
    PROMPT,
    addresses,
    backend_fleet,
    default_envoy,
    free_port,
    pool_file,
    process,
)
from endpoint_picker.bench.stats import percentile

METRICS_PAGE = (
    Path(__file__).resolve().parents[1] / "tests/unit/metrics/fixtures/vllm_v1_metrics.txt"
)


def _headers() -> pb.ProcessingRequest:
    message = pb.ProcessingRequest()
    for key, value in (
        (":method", "POST"),
        (":path", "/v1/completions"),
        ("content-type", "application/json"),
        ("content-length", str(len(PROMPT))),
    ):
        message.request_headers.headers.headers.append(
            base_pb2.HeaderValue(key=key, raw_value=value.encode())
        )
    return message


HEADERS = _headers()
BODY = pb.ProcessingRequest(request_body=pb.HttpBody(body=PROMPT.encode(), end_of_stream=True))


async def pick(stub: pb_grpc.ExternalProcessorStub) -> float:
    """One routed request: seconds from its headers to the routing headers response."""
    call = stub.Process()
    started = time.perf_counter()
    await call.write(HEADERS)
    await call.write(BODY)
    first = await call.read()
    took = time.perf_counter() - started
    if first is grpc.aio.EOF or not first.request_headers.response.header_mutation.set_headers:
        raise RuntimeError(f"not routed: {first}")
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:  # the body echoed back, then the end
        pass
    return took


async def load(port: int, seconds: float, rate: float) -> tuple[list[float], int]:
    """Open loop: a pick every 1/rate s whatever the earlier ones do; their latencies, and
    how many failed (a gRPC error, or not routed)."""
    times: list[float] = []
    failed = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)

        async def one() -> None:
            nonlocal failed
            try:
                times.append(await pick(stub))
            except (grpc.aio.AioRpcError, RuntimeError):
                failed += 1

        tasks = []
        start = time.monotonic()
        for n in range(int(seconds * rate)):
            await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return times, failed


def status(metrics_port: int) -> dict[str, object]:
    url = f"http://127.0.0.1:{metrics_port}/api/status"
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def scraping(metrics_port: int) -> tuple[float, float]:
    """The EPP's scrape interval (s) and its scrape steps deferred so far, from ``/metrics``."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = value
    return (  # nan from an EPP that predates these metrics
        float(values.get("inference_extension_metrics_refresh_interval_seconds", "nan")),
        float(values.get("inference_extension_metrics_scrape_steps_deferred_total", "nan")),
    )


def ages(metrics_port: int) -> list[float]:
    """Every endpoint's metrics age now (seconds; inf when it has none yet)."""
    endpoints = status(metrics_port)["endpoints"]
    assert isinstance(endpoints, list)
    return [
        float("inf") if e["metricsAgeSeconds"] is None else float(e["metricsAgeSeconds"])
        for e in endpoints
    ]


async def sample_ages(metrics_port: int, seconds: float) -> list[float]:
    out: list[float] = []
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        out += await asyncio.to_thread(ages, metrics_port)
        await asyncio.sleep(0.5)
    return out


def wait_fresh(metrics_port: int, count: int, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            seen = ages(metrics_port)
            if len(seen) == count and max(seen) < 1.0:
                return
        time.sleep(0.5)
    raise RuntimeError(f"not every one of {count} endpoints got metrics within {within} s")


def ms(values: list[float], q: float) -> float:
    """The ``q``-th percentile (``bench.stats.percentile``) in milliseconds, NaN of nothing."""
    value = percentile(values, q)
    return math.nan if value is None else value * 1e3


def measure(mode: str, endpoints: list[str], args: argparse.Namespace, tmp: Path) -> str:
    pool_file(endpoints, tmp / "pool.yaml")
    grpc_port, metrics_port = free_port(), free_port()
    kind, _, budget = mode.partition("@")
    workers = "1" if kind == "one" else kind.removeprefix("w")
    argv = [
        str(BIN / "epp"), "serve", "--pool-file", str(tmp / "pool.yaml"),
        "--bind-address", "127.0.0.1", "--grpc-port", str(grpc_port),
        "--grpc-health-port", str(free_port()), "--metrics-port", str(metrics_port),
        "--secure-serving", "false", "--workers", workers, "--log-level", "warning",
        "--refresh-metrics-interval", "50ms", "--drain-timeout", "1s",
        *(["--metrics-cpu-budget", budget] if budget else []),
    ]  # fmt: skip
    with process(argv, tmp / f"epp-{kind}-{len(endpoints)}.log"):
        wait_fresh(metrics_port, len(endpoints))
        asyncio.run(load(grpc_port, 3, args.rate))  # warm-up

        async def both() -> tuple[tuple[list[float], int], list[float]]:
            return await asyncio.gather(
                load(grpc_port, args.duration, args.rate),
                sample_ages(metrics_port, args.duration),
            )

        _, deferred_before = scraping(metrics_port)
        (times, failed), seen = asyncio.run(both())
        interval, deferred = scraping(metrics_port)
        deferred = (deferred - deferred_before) / args.duration
    if not times:
        return f"{len(endpoints):6d} {mode:7s} every pick failed ({failed})"
    p50, p99 = ms(times, 50), ms(times, 99)
    age50, age99 = ms(seen, 50), ms(seen, 99)
    return (
        f"{len(endpoints):6d} {mode:7s} {len(times) / args.duration:8.0f} picks/s   "
        f"pick p50 {p50:6.2f} ms  p99 {p99:7.2f} ms   metrics age p50 {age50:5.0f} ms  "
        f"p99 {age99:5.0f} ms   interval {interval * 1e3:4.0f} ms, "
        f"{deferred:5.0f} steps deferred/s" + (f"   FAILED {failed}" if failed else "")
    )


@contextlib.contextmanager
def scraping_beside(count: int, interval: float, envoy: str) -> Iterator[None]:
    """``bench_scrape_budget.py`` over ``count`` endpoints of its own, in its own process group,
    running until the block ends (then interrupted, so that it stops its fleet Envoy)."""
    if count <= 0:
        yield
        return
    argv = [sys.executable, str(Path(__file__).with_name("bench_scrape_budget.py")),
            "--sizes", str(count), "--fixed", str(interval), "--seconds", "86400",
            "--warmup", "3", "--first-subnet", "100", "--envoy", envoy, "--announce"]  # fmt: skip
    background = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        assert background.stdout is not None
        # its fleet up (within its own 120 s) and every endpoint scraped for 3 s
        line = background.stdout.readline()
        if not line.startswith("scraping"):
            raise RuntimeError(f"the scraper beside exited ({background.wait()})")
        print(f"beside: {count} endpoints scraped every {interval * 1e3:.0f} ms", flush=True)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(background.pid, signal.SIGINT)
        try:
            background.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(background.pid, signal.SIGKILL)
            background.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16,256,1024")
    parser.add_argument("--modes", default="one,w2", help="one, or wN: --workers N")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--rate", type=float, default=200.0, help="picks per second")
    parser.add_argument("--rounds", type=int, default=1, help="alternate the modes N times")
    parser.add_argument("--envoy", default=default_envoy())
    parser.add_argument("--beside", type=int, default=0, help="endpoints scraped beside")
    parser.add_argument("--beside-interval", type=float, default=0.22, help="seconds")
    args = parser.parse_args()
    with scraping_beside(args.beside, args.beside_interval, args.envoy):
        for size in (int(s) for s in args.sizes.split(",")):
            endpoints = addresses(size)
            with tempfile.TemporaryDirectory(prefix="bench-pool-size-") as tmp_name:
                tmp = Path(tmp_name)
                with backend_fleet(
                    args.envoy, endpoints, tmp, METRICS_PAGE.read_text(), within=120
                ):
                    for _ in range(args.rounds):
                        for mode in args.modes.split(","):
                            print(measure(mode, endpoints, args, tmp), flush=True)


if __name__ == "__main__":
    main()
